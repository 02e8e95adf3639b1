// All-to-all (flat with split sizes, and list form) and point-to-point send/recv of
// ZeroPlusBackend.
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "process_group/adapter/backend.hpp"
#include "process_group/adapter/tensor_checks.hpp"
#include "process_group/core/point_to_point.hpp"

namespace zeroplus::pg {
namespace {

c10::DistBackendError backendError(const std::string& message) {
  return c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
}

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
  return pointToPoint(c10d::OpType::SEND, kOp, tensors[0], dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  static constexpr const char* kOp = "recv";
  checkSingleTensor(kOp, "tensors", tensors.size());
  checkCpuDense(kOp, "tensor", tensors[0]);
  checkRank(kOp, "source rank", srcRank, size_);
  TORCH_CHECK(srcRank != rank_, "zeroplus recv: source rank ", srcRank, " is this rank");
  TORCH_CHECK(tag >= 0, "zeroplus recv: tag must be non-negative, got ", tag);
  return pointToPoint(c10d::OpType::RECV, kOp, tensors[0], srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  static constexpr const char* kOp = "recvAnysource";
  checkSingleTensor(kOp, "tensors", tensors.size());
  checkCpuDense(kOp, "tensor", tensors[0]);
  TORCH_CHECK(size_ > 1, "zeroplus recvAnysource: no other rank to receive from in a group of size 1");
  TORCH_CHECK(tag >= 0, "zeroplus recvAnysource: tag must be non-negative, got ", tag);
  return pointToPoint(c10d::OpType::RECVANYSOURCE, kOp, tensors[0], kAnySource, tag);
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::pointToPoint(c10d::OpType opType, const char* opName,
                                                             const at::Tensor& tensor, int peer, int tag) {
  const uint64_t seq = ++sequenceNumber_;
  auto work = c10::make_intrusive<ZeroPlusWork>(rank_, opType, opName, seq, std::vector<at::Tensor>{tensor});
  std::string broken;
  std::chrono::milliseconds timeout;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "zeroplus ", opName, ": process group has been shut down");
    broken = brokenReason_;
    timeout = config_.timeout;
    if (coalescing_ && broken.empty()) coalescedP2p_.push_back(work);
  }
  if (!broken.empty()) {
    work->markFailed(std::make_exception_ptr(backendError(
        std::string("zeroplus ") + opName + ": process group is unusable after an earlier failure: " + broken)));
    return work;
  }
  // The Work and the tensor (held by the Work) stay alive until the engine calls back.
  auto done = [this, work](const P2pResult& result) {
    if (!result.error) {
      work->setSourceRank(result.source);
      work->markSucceeded();
      return;
    }
    std::string what;
    try {
      std::rethrow_exception(result.error);
    } catch (const CommError& e) {
      what = failureText(e);
    } catch (const std::exception& e) {
      what = e.what();
    }
    markBroken(what);
    work->markFailed(std::make_exception_ptr(backendError(what)));
  };
  // The deadline counts from the post: a point-to-point op waits for nothing else of this group.
  const Deadline deadline = Clock::now() + timeout;
  try {
    if (opType == c10d::OpType::SEND) {
      p2p_->send(tensor.data_ptr(), tensor.nbytes(), peer, static_cast<uint32_t>(tag), deadline, std::move(done));
    } else {
      p2p_->recv(tensor.data_ptr(), tensor.nbytes(), peer, static_cast<uint32_t>(tag), deadline, std::move(done));
    }
  } catch (const CommError& e) {  // an argument the engine refuses (checked above already)
    TORCH_CHECK(false, e.what());
  }
  return work;
}

}  // namespace zeroplus::pg
