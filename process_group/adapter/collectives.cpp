// Reductions and one-to-all collectives of ZeroPlusBackend: broadcast, allreduce,
// allreduce_coalesced, reduce, barrier and the coalescing window. Each wrapper validates on the
// caller's thread, then hands one closure to collective(). Closures capture tensors by value
// (refcounted), never references to caller-owned vectors: they run later on the worker.
#include "process_group/adapter/backend.hpp"
#include "process_group/adapter/tensor_checks.hpp"

namespace zeroplus::pg {

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  static constexpr const char* kOp = "broadcast";
  checkSingleTensor(kOp, "tensors", tensors.size());
  checkCpuDense(kOp, "tensor", tensors[0]);
  checkRank(kOp, "root rank", opts.rootRank, size_);
  TORCH_CHECK(opts.rootTensor == 0, "zeroplus broadcast: invalid root tensor ", opts.rootTensor, ", expected 0");
  toDataType(kOp, "tensor", tensors[0].scalar_type());
  at::Tensor tensor = tensors[0];
  const int root = static_cast<int>(opts.rootRank);
  return collective(
      c10d::OpType::BROADCAST, kOp, {tensor}, opts.timeout,
      [this, tensor, root](Deadline deadline) { comm_->broadcast(tensor.data_ptr(), tensor.nbytes(), root, deadline); },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  static constexpr const char* kOp = "allreduce";
  checkSingleTensor(kOp, "tensors", tensors.size());
  TORCH_CHECK(!opts.sparseIndices.has_value(), "zeroplus allreduce: does not support sparse tensors");
  at::Tensor tensor = tensors[0];
  checkCpuDense(kOp, "tensor", tensor);
  const DataType type = toDataType(kOp, "tensor", tensor.scalar_type());
  const Reduction reduction = toReduction(kOp, opts.reduceOp, tensor.scalar_type());
  if (fusion_ && !reduction.premultiply && tensor.nbytes() <= config_.tuning.bucketBytes) {
    return fusibleAllreduce(tensor, type, reduction, opts.timeout, opts.asyncOp);
  }
  return collective(
      c10d::OpType::ALLREDUCE, kOp, {tensor}, opts.timeout,
      [this, tensor, type, reduction](Deadline deadline) mutable {
        applyPremultiply(reduction, tensor);
        comm_->allreduce(tensor.data_ptr(), tensor.numel(), type, reduction.op, deadline);
        applyAverage(reduction, tensor, size_);
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                    const c10d::AllreduceCoalescedOptions& opts) {
  static constexpr const char* kOp = "allreduce_coalesced";
  TORCH_CHECK(!tensors.empty(), "zeroplus allreduce_coalesced: tensors must not be empty");
  for (const auto& t : tensors) checkCpuDense(kOp, "tensors[i]", t);
  checkSameDtype(kOp, "tensors", tensors, tensors[0].scalar_type());
  const DataType type = toDataType(kOp, "tensors", tensors[0].scalar_type());
  const Reduction reduction = toReduction(kOp, opts.reduceOp, tensors[0].scalar_type());
  std::vector<at::Tensor> outs = tensors;
  // Buckets of tuning.bucketBytes; tensors that are consecutive views of one buffer move
  // without a copy (allreducev), the shared-memory transport packs straight into its segment.
  return collective(
      c10d::OpType::ALLREDUCE_COALESCED, kOp, outs, opts.timeout,
      [this, outs, type, reduction](Deadline deadline) { bucketedAllreduce(outs, type, reduction, deadline); },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  static constexpr const char* kOp = "reduce";
  checkSingleTensor(kOp, "tensors", tensors.size());
  checkRank(kOp, "root rank", opts.rootRank, size_);
  TORCH_CHECK(opts.rootTensor == 0, "zeroplus reduce: invalid root tensor ", opts.rootTensor, ", expected 0");
  at::Tensor tensor = tensors[0];
  checkCpuDense(kOp, "tensor", tensor);
  const DataType type = toDataType(kOp, "tensor", tensor.scalar_type());
  const Reduction reduction = toReduction(kOp, opts.reduceOp, tensor.scalar_type());
  const int root = static_cast<int>(opts.rootRank);
  return collective(c10d::OpType::REDUCE, kOp, {tensor}, opts.timeout,
                    [this, tensor, type, reduction, root](Deadline deadline) mutable {
                      // Non-root inputs stay unchanged, so a pre-scaled op works on a copy there.
                      const bool scratch = reduction.premultiply && rank_ != root;
                      at::Tensor work = scratch ? tensor.clone() : tensor;
                      applyPremultiply(reduction, work);
                      comm_->reduce(work.data_ptr(), work.numel(), type, reduction.op, root, deadline);
                      if (rank_ == root) applyAverage(reduction, work, size_);
                    });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::barrier(const c10d::BarrierOptions& opts) {
  return collective(
      c10d::OpType::BARRIER, "barrier", {}, opts.timeout, [this](Deadline deadline) { comm_->barrier(deadline); },
      opts.asyncOp);
}

void ZeroPlusBackend::startCoalescing() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!coalescing_, "zeroplus startCoalescing: already coalescing; call endCoalescing first");
  coalescing_ = true;
  coalescedWorks_.clear();
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::endCoalescing() {
  std::vector<c10::intrusive_ptr<ZeroPlusWork>> works;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(coalescing_, "zeroplus endCoalescing: startCoalescing was not called");
    coalescing_ = false;
    works.swap(coalescedWorks_);
  }
  std::vector<at::Tensor> outputs;
  for (const auto& w : works) {
    auto r = w->result();
    outputs.insert(outputs.end(), r.begin(), r.end());
  }
  // The queue is FIFO, so this marker runs after every op of the window; it fails with the
  // first failure among them so one wait() reports the whole window.
  return collective(c10d::OpType::COALESCED, "coalesced", outputs, std::chrono::milliseconds(-1),
                    [works](Deadline) {
                      for (const auto& w : works) {
                        if (auto error = w->exception()) std::rethrow_exception(error);
                      }
                    });
}

}  // namespace zeroplus::pg
