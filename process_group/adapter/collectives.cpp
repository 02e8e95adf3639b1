// The collective wrappers of ZeroPlusBackend: validate on the caller's thread, then hand one
// closure to collective(). Closures capture tensors by value (refcounted), never references
// to caller-owned vectors, because they run later on the worker thread.
#include <cstring>

#include <ATen/ops/empty.h>

#include "process_group/adapter/backend.hpp"
#include "process_group/adapter/tensor_checks.hpp"

namespace zeroplus::pg {
namespace {

size_t bytesOf(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

}  // namespace

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
  return collective(c10d::OpType::BROADCAST, kOp, {tensor}, opts.timeout, [this, tensor, root](Deadline deadline) {
    comm_->broadcast(tensor.data_ptr(), bytesOf(tensor), root, deadline);
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  static constexpr const char* kOp = "allreduce";
  checkSingleTensor(kOp, "tensors", tensors.size());
  TORCH_CHECK(!opts.sparseIndices.has_value(), "zeroplus allreduce: does not support sparse tensors");
  at::Tensor tensor = tensors[0];
  checkCpuDense(kOp, "tensor", tensor);
  const DataType type = toDataType(kOp, "tensor", tensor.scalar_type());
  const ReduceOp op = toCoreReduceOp(kOp, opts.reduceOp, tensor.scalar_type());
  const bool average = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
  const int worldSize = size_;
  return collective(c10d::OpType::ALLREDUCE, kOp, {tensor}, opts.timeout,
                    [this, tensor, type, op, average, worldSize](Deadline deadline) mutable {
                      comm_->allreduce(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, op, deadline);
                      if (average) tensor.div_(worldSize);
                    });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "allgather";
  checkSingleTensor(kOp, "input_tensors", inputs.size());
  checkSingleTensor(kOp, "output_tensors", outputs.size());
  at::Tensor input = inputs[0];
  checkCpuDense(kOp, "input tensor", input);
  toDataType(kOp, "input tensor", input.scalar_type());
  std::vector<at::Tensor> outs = outputs[0];
  TORCH_CHECK(static_cast<int>(outs.size()) == size_, "zeroplus allgather: output tensor list has ", outs.size(),
              " tensors, expected one per rank (", size_, ")");
  for (const auto& out : outs) {
    checkCpuDense(kOp, "output tensor", out);
    checkSameTypeAndNumel(kOp, "output tensor", out, input);
  }
  return collective(c10d::OpType::ALLGATHER, kOp, outs, opts.timeout, [this, input, outs](Deadline deadline) {
    const size_t bytes = bytesOf(input);
    // Gather into one flat buffer, then scatter to the caller's tensors (which may live anywhere).
    at::Tensor flat = at::empty({static_cast<int64_t>(bytes * outs.size())}, at::kByte);
    auto* base = static_cast<uint8_t*>(flat.data_ptr());
    comm_->allgather(input.data_ptr(), bytes, base, deadline);
    for (size_t r = 0; r < outs.size(); ++r) {
      if (bytes) std::memcpy(outs[r].data_ptr(), base + r * bytes, bytes);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "_allgather_base";
  checkCpuDense(kOp, "input tensor", input);
  checkCpuDense(kOp, "output tensor", output);
  toDataType(kOp, "input tensor", input.scalar_type());
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "zeroplus _allgather_base: output tensor has dtype ",
              output.scalar_type(), ", expected ", input.scalar_type());
  TORCH_CHECK(output.numel() == input.numel() * size_, "zeroplus _allgather_base: output tensor has ",
              output.numel(), " elements, expected world size (", size_, ") x input (", input.numel(), ")");
  at::Tensor in = input;
  at::Tensor out = output;
  return collective(c10d::OpType::_ALLGATHER_BASE, kOp, {out}, opts.timeout, [this, in, out](Deadline deadline) {
    comm_->allgather(in.data_ptr(), bytesOf(in), out.data_ptr(), deadline);
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::barrier(const c10d::BarrierOptions& opts) {
  return collective(c10d::OpType::BARRIER, "barrier", {}, opts.timeout,
                    [this](Deadline deadline) { comm_->barrier(deadline); });
}

}  // namespace zeroplus::pg
