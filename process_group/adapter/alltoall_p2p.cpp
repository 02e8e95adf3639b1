// All-to-all (flat with split sizes, and list form) and point-to-point send/recv of
// ZeroPlusBackend.
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "process_group/adapter/backend.hpp"
#include "process_group/adapter/tensor_checks.hpp"

namespace zeroplus::pg {
namespace {

// Byte counts and displacements along dim 0 for alltoall_base; empty splits mean equal parts.
struct Splits {
  std::vector<size_t> counts;
  std::vector<size_t> displs;
};

Splits computeSplits(const char* arg, const at::Tensor& tensor, const std::vector<int64_t>& splitSizes, int size) {
  const int64_t rows = tensor.dim() == 0 ? 1 : tensor.size(0);
  const size_t rowBytes = rows == 0 ? 0 : tensor.nbytes() / static_cast<size_t>(rows);
  std::vector<int64_t> split = splitSizes;
  if (split.empty()) {
    TORCH_CHECK(rows % size == 0, "zeroplus alltoall_base: ", arg, " has ", rows,
                " rows, not divisible by world size ", size, "; pass explicit split sizes");
    split.assign(size, rows / size);
  }
  TORCH_CHECK(static_cast<int>(split.size()) == size, "zeroplus alltoall_base: ", arg, " split sizes have ",
              split.size(), " entries, expected world size ", size);
  int64_t total = 0;
  for (int64_t s : split) {
    TORCH_CHECK(s >= 0, "zeroplus alltoall_base: ", arg, " split sizes must be non-negative, got ", s);
    total += s;
  }
  TORCH_CHECK(total == rows, "zeroplus alltoall_base: ", arg, " split sizes sum to ", total, " but the tensor has ",
              rows, " rows");
  Splits out;
  size_t offset = 0;
  for (int64_t s : split) {
    out.counts.push_back(static_cast<size_t>(s) * rowBytes);
    out.displs.push_back(offset);
    offset += static_cast<size_t>(s) * rowBytes;
  }
  return out;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& outputSplitSizes,
                                                              std::vector<int64_t>& inputSplitSizes,
                                                              const c10d::AllToAllOptions& opts) {
  static constexpr const char* kOp = "alltoall_base";
  checkCpuStrided(kOp, "input tensor", input);
  checkCpuStrided(kOp, "output tensor", output);
  checkContiguousValue(kOp, "input tensor", input);
  checkContiguousValue(kOp, "output tensor", output);
  toDataType(kOp, "input tensor", input.scalar_type());
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "zeroplus alltoall_base: output tensor has dtype ",
              output.scalar_type(), ", expected ", input.scalar_type());
  if (input.dim() > 1 || output.dim() > 1) {
    TORCH_CHECK(input.numel() / std::max<int64_t>(1, input.size(0)) ==
                    output.numel() / std::max<int64_t>(1, output.size(0)),
                "zeroplus alltoall_base: input and output rows differ in size (", input.sizes(), " vs ",
                output.sizes(), ")");
  }
  Splits send = computeSplits("input", input, inputSplitSizes, size_);
  Splits recv = computeSplits("output", output, outputSplitSizes, size_);
  at::Tensor in = input;
  at::Tensor out = output;
  return collective(c10d::OpType::ALLTOALL_BASE, kOp, {out}, opts.timeout, [this, in, out, send, recv](Deadline d) {
    comm_->alltoallv(in.data_ptr(), send.counts, send.displs, out.data_ptr(), recv.counts, recv.displs, d);
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  static constexpr const char* kOp = "alltoall";
  TORCH_CHECK(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
              "zeroplus alltoall: expected one input and one output tensor per rank (", size_, "), got ",
              inputs.size(), " inputs and ", outputs.size(), " outputs");
  Splits send, recv;
  for (int r = 0; r < size_; ++r) {
    checkCpuDense(kOp, "input_tensor_list[i]", inputs[r]);
    checkCpuDense(kOp, "output_tensor_list[i]", outputs[r]);
    TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                    outputs[r].scalar_type() == inputs[0].scalar_type(),
                "zeroplus alltoall: every tensor must have dtype ", inputs[0].scalar_type());
    send.counts.push_back(inputs[r].nbytes());
    recv.counts.push_back(outputs[r].nbytes());
  }
  toDataType(kOp, "input_tensor_list", inputs[0].scalar_type());
  send.displs.assign(size_, 0);
  recv.displs.assign(size_, 0);
  for (int r = 1; r < size_; ++r) {
    send.displs[r] = send.displs[r - 1] + send.counts[r - 1];
    recv.displs[r] = recv.displs[r - 1] + recv.counts[r - 1];
  }
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  return collective(c10d::OpType::ALLTOALL, kOp, outs, opts.timeout, [this, ins, outs, send, recv](Deadline d) {
    std::vector<at::Tensor> flatIns;
    for (const auto& t : ins) flatIns.push_back(t.reshape(-1));
    at::Tensor packed = at::cat(flatIns);
    const size_t total = recv.displs.back() + recv.counts.back();
    at::Tensor received = at::empty({static_cast<int64_t>(total)}, at::kByte);
    comm_->alltoallv(packed.data_ptr(), send.counts, send.displs, received.data_ptr(), recv.counts, recv.displs, d);
    for (size_t r = 0; r < outs.size(); ++r) {
      if (recv.counts[r]) std::memcpy(outs[r].data_ptr(), received.data_ptr<uint8_t>() + recv.displs[r], recv.counts[r]);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  static constexpr const char* kOp = "send";
  checkSingleTensor(kOp, "tensors", tensors.size());
  checkCpuDense(kOp, "tensor", tensors[0]);
  checkRank(kOp, "destination rank", dstRank, size_);
  TORCH_CHECK(dstRank != rank_, "zeroplus send: destination rank ", dstRank, " is this rank");
  TORCH_CHECK(tag >= 0, "zeroplus send: tag must be non-negative, got ", tag);
  at::Tensor tensor = tensors[0];
  return collective(c10d::OpType::SEND, kOp, {tensor}, std::chrono::milliseconds(-1),
                    [this, tensor, dstRank, tag](Deadline d) {
                      comm_->send(tensor.data_ptr(), tensor.nbytes(), dstRank, static_cast<uint32_t>(tag), d);
                    });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  static constexpr const char* kOp = "recv";
  checkSingleTensor(kOp, "tensors", tensors.size());
  checkCpuDense(kOp, "tensor", tensors[0]);
  checkRank(kOp, "source rank", srcRank, size_);
  TORCH_CHECK(srcRank != rank_, "zeroplus recv: source rank ", srcRank, " is this rank");
  TORCH_CHECK(tag >= 0, "zeroplus recv: tag must be non-negative, got ", tag);
  at::Tensor tensor = tensors[0];
  return collective(c10d::OpType::RECV, kOp, {tensor}, std::chrono::milliseconds(-1),
                    [this, tensor, srcRank, tag](Deadline d) {
                      comm_->recv(tensor.data_ptr(), tensor.nbytes(), srcRank, static_cast<uint32_t>(tag), d);
                    });
}

}  // namespace zeroplus::pg
