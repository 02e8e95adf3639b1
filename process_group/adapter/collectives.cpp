// Reductions and one-to-all collectives of ZeroPlusBackend: broadcast, allreduce (dense, several
// tensors per process, strided, sparse COO), allreduce_coalesced, reduce, barrier and the
// coalescing window. The common case (one contiguous tensor) takes the fast paths unchanged. Each wrapper validates on the
// caller's thread, then hands one closure to collective(). Closures capture tensors by value
// (refcounted), never references to caller-owned vectors: they run later on the worker.
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/sparse_coo_tensor.h>

#include <cstring>

#include "process_group/adapter/backend.hpp"
#include "process_group/adapter/tensor_checks.hpp"

namespace zeroplus::pg {

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  static constexpr const char* kOp = "broadcast";
  checkRank(kOp, "root rank", opts.rootRank, size_);
  TORCH_CHECK(opts.rootTensor >= 0 && opts.rootTensor < static_cast<int64_t>(tensors.size()),
              "zeroplus broadcast: invalid root tensor ", opts.rootTensor, " for ", tensors.size(), " tensors");
  for (const auto& t : tensors) checkCpuStrided(kOp, "tensor", t);
  checkSameTypeAndSizes(kOp, tensors);
  toDataType(kOp, "tensor", tensors[0].scalar_type());
  const int root = static_cast<int>(opts.rootRank);
  if (tensors.size() == 1 && tensors[0].is_contiguous()) {
    at::Tensor tensor = tensors[0];
    return collective(
        c10d::OpType::BROADCAST, kOp, {tensor}, opts.timeout,
        [this, tensor, root](Deadline deadline) { comm_->broadcast(tensor.data_ptr(), tensor.nbytes(), root, deadline); },
        opts.asyncOp);
  }
  // Several tensors per process (as Gloo): the root's tensors[rootTensor] lands in every tensor
  // of every rank. Strided tensors move through a contiguous copy.
  std::vector<at::Tensor> all = tensors;
  const size_t rootTensor = static_cast<size_t>(opts.rootTensor);
  return collective(
      c10d::OpType::BROADCAST, kOp, all, opts.timeout,
      [this, all, root, rootTensor](Deadline deadline) {
        const at::Tensor& source = rank_ == root ? all[rootTensor] : all[0];
        at::Tensor buffer = contiguousStage(source);
        comm_->broadcast(buffer.data_ptr(), buffer.nbytes(), root, deadline);
        for (const auto& t : all) unstage(buffer, t);
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  static constexpr const char* kOp = "allreduce";
  TORCH_CHECK(!tensors.empty(), "zeroplus allreduce: requires non-empty tensor list");
  TORCH_CHECK(!opts.sparseIndices.has_value(), "zeroplus allreduce: does not support sparseIndices");
  for (const auto& t : tensors) {
    TORCH_CHECK(t.layout() == tensors[0].layout(), "zeroplus allreduce: invalid tensor layout ", t.layout(),
                ", expected ", tensors[0].layout(), " (every tensor of the list)");
  }
  if (tensors[0].layout() == at::kSparse) {
    for (const auto& t : tensors) {
      TORCH_CHECK(t.device().is_cpu(), "zeroplus allreduce: sparse tensor is on ", t.device(), ", expected CPU");
    }
    checkSameTypeAndSizes(kOp, tensors);
    TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM,
                "zeroplus allreduce: unsupported reduction operation for sparse tensors: ", opts.reduceOp.op_,
                " (only SUM, as Gloo)");
    std::vector<at::Tensor> all = tensors;
    return collective(
        c10d::OpType::ALLREDUCE, kOp, all, opts.timeout,
        [this, all](Deadline deadline) { sparseAllreduce(all, deadline); }, opts.asyncOp);
  }
  for (const auto& t : tensors) checkCpuStrided(kOp, "tensor", t);
  checkSameTypeAndSizes(kOp, tensors);
  at::Tensor tensor = tensors[0];
  const DataType type = toDataType(kOp, "tensor", tensor.scalar_type());
  const Reduction reduction = toReduction(kOp, opts.reduceOp, tensor.scalar_type());
  if (tensors.size() > 1 || !tensor.is_contiguous()) {
    std::vector<at::Tensor> all = tensors;
    return collective(
        c10d::OpType::ALLREDUCE, kOp, all, opts.timeout,
        [this, all, type, reduction](Deadline deadline) { stagedAllreduce(all, type, reduction, deadline); },
        opts.asyncOp);
  }
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

void ZeroPlusBackend::stagedAllreduce(const std::vector<at::Tensor>& tensors, DataType type,
                                      const Reduction& reduction, Deadline deadline) {
  // Local combination first (in list order), then one allreduce of the combined buffer. AVG
  // divides the sum of every tensor of every rank by the world size, as Gloo (whose result is
  // that in tensors[0]; Gloo leaves the other tensors undivided, zeroplus writes it into all).
  at::Tensor acc = tensors.size() == 1 ? tensors[0].contiguous() : tensors[0].clone(at::MemoryFormat::Contiguous);
  applyPremultiply(reduction, acc);
  for (size_t i = 1; i < tensors.size(); ++i) {
    at::Tensor x = tensors[i];
    if (reduction.premultiply) {
      x = x.clone();
      applyPremultiply(reduction, x);
    }
    switch (reduction.op) {
      case ReduceOp::kSum: acc.add_(x); break;
      case ReduceOp::kProduct: acc.mul_(x); break;
      case ReduceOp::kMin: acc.copy_(at::minimum(acc, x)); break;
      case ReduceOp::kMax: acc.copy_(at::maximum(acc, x)); break;
      case ReduceOp::kBand: acc.bitwise_and_(x); break;
      case ReduceOp::kBor: acc.bitwise_or_(x); break;
      case ReduceOp::kBxor: acc.bitwise_xor_(x); break;
    }
  }
  comm_->allreduce(acc.data_ptr(), acc.numel(), type, reduction.op, deadline);
  applyAverage(reduction, acc, size_);
  for (const auto& t : tensors) unstage(acc, t);
}

void ZeroPlusBackend::sparseAllreduce(const std::vector<at::Tensor>& tensors, Deadline deadline) {
  at::Tensor local = tensors[0];
  for (size_t i = 1; i < tensors.size(); ++i) local = local.add(tensors[i]);
  local = local.coalesce();
  const int64_t sparseDim = local.sparse_dim();
  const at::Tensor indices = local._indices().contiguous();  // [sparseDim, nnz] int64
  const at::Tensor values = local._values().contiguous();    // [nnz, dense sizes...]
  const int64_t nnz = local._nnz();
  // Round 1: every rank's nnz. Rounds 2 and 3: indices and values, variable sizes.
  std::vector<int64_t> counts(size_);
  comm_->allgather(&nnz, sizeof(int64_t), counts.data(), deadline);
  int64_t rowElems = 1;
  for (int64_t d = sparseDim; d < local.dim(); ++d) rowElems *= local.size(d);
  const size_t rowBytes = static_cast<size_t>(values.element_size() * rowElems);
  std::vector<size_t> idxCounts(size_), idxDispls(size_), valCounts(size_), valDispls(size_);
  size_t idxTotal = 0, valTotal = 0;
  for (int r = 0; r < size_; ++r) {
    idxCounts[r] = static_cast<size_t>(counts[r] * sparseDim) * sizeof(int64_t);
    valCounts[r] = static_cast<size_t>(counts[r]) * rowBytes;
    idxDispls[r] = idxTotal;
    valDispls[r] = valTotal;
    idxTotal += idxCounts[r];
    valTotal += valCounts[r];
  }
  at::Tensor allIdx = at::empty({static_cast<int64_t>(idxTotal)}, at::kByte);
  at::Tensor allVal = at::empty({static_cast<int64_t>(valTotal)}, at::kByte);
  comm_->allgatherv(indices.data_ptr(), allIdx.data_ptr(), idxCounts, idxDispls, deadline);
  comm_->allgatherv(values.data_ptr(), allVal.data_ptr(), valCounts, valDispls, deadline);
  // Sum in rank order (every rank computes the identical result).
  std::vector<int64_t> valueShape = {0};
  for (int64_t d = sparseDim; d < local.dim(); ++d) valueShape.push_back(local.size(d));
  at::Tensor sum;
  for (int r = 0; r < size_; ++r) {
    at::Tensor idx = at::empty({sparseDim, counts[r]}, at::kLong);
    if (idxCounts[r]) std::memcpy(idx.data_ptr(), allIdx.data_ptr<uint8_t>() + idxDispls[r], idxCounts[r]);
    valueShape[0] = counts[r];
    at::Tensor val = at::empty(valueShape, values.options());
    if (valCounts[r]) std::memcpy(val.data_ptr(), allVal.data_ptr<uint8_t>() + valDispls[r], valCounts[r]);
    at::Tensor part = at::sparse_coo_tensor(idx, val, local.sizes());
    sum = sum.defined() ? sum.add(part) : part;
  }
  sum = sum.coalesce();
  for (const auto& t : tensors) t.copy_(sum);
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
  checkCpuStrided(kOp, "tensor", tensor);
  const DataType type = toDataType(kOp, "tensor", tensor.scalar_type());
  const Reduction reduction = toReduction(kOp, opts.reduceOp, tensor.scalar_type());
  const int root = static_cast<int>(opts.rootRank);
  return collective(c10d::OpType::REDUCE, kOp, {tensor}, opts.timeout,
                    [this, tensor, type, reduction, root](Deadline deadline) mutable {
                      // Non-root inputs stay unchanged, so a pre-scaled op works on a copy there.
                      const bool scratch = reduction.premultiply && rank_ != root;
                      at::Tensor work = scratch ? tensor.clone(at::MemoryFormat::Contiguous) : contiguousStage(tensor);
                      applyPremultiply(reduction, work);
                      comm_->reduce(work.data_ptr(), work.numel(), type, reduction.op, root, deadline);
                      if (rank_ == root) {
                        applyAverage(reduction, work, size_);
                        unstage(work, tensor);
                      }
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
  coalescedP2p_.clear();
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::endCoalescing() {
  std::vector<c10::intrusive_ptr<ZeroPlusWork>> works;
  std::vector<c10::intrusive_ptr<ZeroPlusWork>> p2p;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(coalescing_, "zeroplus endCoalescing: startCoalescing was not called");
    coalescing_ = false;
    works.swap(coalescedWorks_);
    p2p.swap(coalescedP2p_);
  }
  std::vector<at::Tensor> outputs;
  for (const auto& w : works) {
    auto r = w->result();
    outputs.insert(outputs.end(), r.begin(), r.end());
  }
  // The queue is FIFO, so this marker runs after every op of the window; it fails with the
  // first failure among them so one wait() reports the whole window.
  auto marker = collective(c10d::OpType::COALESCED, "coalesced", outputs, std::chrono::milliseconds(-1),
                           [works](Deadline) {
                             for (const auto& w : works) {
                               if (auto error = w->exception()) std::rethrow_exception(error);
                             }
                           });
  if (p2p.empty()) return marker;
  // Point-to-point ops of the window complete outside the queue (point_to_point.hpp), so the
  // marker cannot stand for them without blocking the queue: the returned Work completes once
  // the marker and each of them has, failing with the first failure.
  for (const auto& w : p2p) {
    auto r = w->result();
    outputs.insert(outputs.end(), r.begin(), r.end());
  }
  auto all = c10::make_intrusive<ZeroPlusWork>(rank_, c10d::OpType::COALESCED, "coalesced", ++sequenceNumber_, outputs);
  struct Join {
    std::mutex mutex;
    size_t left;
    std::exception_ptr first;
  };
  auto join = std::make_shared<Join>();
  join->left = 1 + p2p.size();
  auto arrive = [join, all](c10::ivalue::Future& future) {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(join->mutex);
      if (future.hasError() && !join->first) join->first = future.exception_ptr();
      if (--join->left > 0) return;
      error = join->first;
    }
    if (error) {
      all->markFailed(error);
    } else {
      all->markSucceeded();
    }
  };
  marker->getFuture()->addCallback(arrive);
  for (const auto& w : p2p) w->getFuture()->addCallback(arrive);
  return all;
}

}  // namespace zeroplus::pg
