#include "process_group/adapter/work.hpp"

#include <ATen/core/jit_type.h>

namespace zeroplus::pg {

ZeroPlusWork::ZeroPlusWork(int rank, c10d::OpType opType, const char* profilingTitle,
                           uint64_t sequenceNumber, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, opType, profilingTitle),
      sequenceNumber_(sequenceNumber),
      outputs_(std::move(outputs)),
      // The value is a List[Tensor]: the DDP reducer and Python comm hooks read it as such.
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

std::vector<at::Tensor> ZeroPlusWork::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> ZeroPlusWork::getFuture() {
  return future_;
}

int ZeroPlusWork::sourceRank() const {
  if (sourceRank_ < 0) return c10d::Work::sourceRank();  // throws as the base does
  return sourceRank_;
}

void ZeroPlusWork::setNestedOutputs(std::vector<std::vector<at::Tensor>> lists) {
  if (lists.size() <= 1) return;
  nested_ = std::move(lists);
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::ListType::create(c10::TensorType::get())));
}

void ZeroPlusWork::markSucceeded() {
  // Complete the future before finish(): a thread woken by wait() may immediately read it.
  future_->markCompleted(nested_.empty() ? c10::IValue(outputs_) : c10::IValue(nested_));
  finish();
}

void ZeroPlusWork::markFailed(std::exception_ptr error) {
  future_->setError(error);
  finish(error);
}

}  // namespace zeroplus::pg
