// ZeroPlusWork: the c10d::Work returned by every zeroplus collective.
//
// Lifetime: created on the caller's thread by ZeroPlusBackend::collective(), completed exactly
// once by markSucceeded()/markFailed() on the thread that ran the op (the backend's worker, the
// caller of an inline sync op, or the relief thread of a callback phase, callback_phase.cpp);
// the future's callbacks run there. The output tensors are kept alive by the Work until it is
// destroyed (c10d callers rely on result() and futures).
//
// Blocking: wait() blocks the calling thread until the worker completes the op (CPU tensors:
// completion means the data is in place). Errors raised on the worker are rethrown by wait()
// and delivered through the future (DDP comm hooks call getFuture()).
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

namespace zeroplus::pg {

class ZeroPlusWork : public c10d::Work {
 public:
  ZeroPlusWork(int rank, c10d::OpType opType, const char* profilingTitle, uint64_t sequenceNumber,
               std::vector<at::Tensor> outputs);

  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override { return sequenceNumber_; }
  // recv from any source: the rank the message came from (c10d's Work::sourceRank, Python
  // work._source_rank()); set before markSucceeded. Other ops: c10d's "not supported" error.
  int sourceRank() const override;
  void setSourceRank(int rank) { sourceRank_ = rank; }

  // Output lists of an op with several tensors per process (allgather): the future's value
  // becomes List[List[Tensor]] when there is more than one list, as Gloo's. Before submission.
  void setNestedOutputs(std::vector<std::vector<at::Tensor>> lists);

  // Worker side. Exactly one of these is called, once.
  void markSucceeded();
  void markFailed(std::exception_ptr error);

 private:
  const uint64_t sequenceNumber_;
  int sourceRank_ = -1;
  std::vector<at::Tensor> outputs_;
  std::vector<std::vector<at::Tensor>> nested_;  // set by setNestedOutputs (more than one list)
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace zeroplus::pg
