// GlooChannel: see gloo_channel.hpp.
#include "process_group/adapter/gloo_channel.hpp"

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <stdexcept>

namespace zeroplus::pg {
namespace {

at::ScalarType scalarType(DataType type) {
  switch (type) {
    case DataType::kFloat32: return at::kFloat;
    case DataType::kFloat64: return at::kDouble;
    case DataType::kFloat16: return at::kHalf;
    case DataType::kBFloat16: return at::kBFloat16;
    case DataType::kInt8: return at::kChar;
    case DataType::kUInt8: return at::kByte;
    case DataType::kInt16: return at::kShort;
    case DataType::kInt32: return at::kInt;
    case DataType::kInt64: return at::kLong;
    case DataType::kBool: return at::kBool;
  }
  return at::kByte;
}

c10d::ReduceOp c10dOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return c10d::ReduceOp::SUM;
    case ReduceOp::kProduct: return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kBand: return c10d::ReduceOp::BAND;
    case ReduceOp::kBor: return c10d::ReduceOp::BOR;
    case ReduceOp::kBxor: return c10d::ReduceOp::BXOR;
  }
  return c10d::ReduceOp::SUM;
}

at::Tensor wrap(const void* data, size_t count, at::ScalarType type) {
  return at::from_blob(const_cast<void*>(data), {static_cast<int64_t>(count)}, at::TensorOptions().dtype(type));
}

std::chrono::milliseconds left(Deadline deadline) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                  std::chrono::milliseconds(1));
}

}  // namespace

GlooChannel::GlooChannel(c10::intrusive_ptr<c10d::Backend> backend, int hostIndex, int hostCount)
    : backend_(std::move(backend)), rank_(hostIndex), size_(hostCount) {}

bool GlooChannel::supports(DataType type, ReduceOp op) const {
  // The element types Gloo reduces on CPU in every torch this builds against; bfloat16, int16
  // and bool take the flat path. Bitwise ops: integers only (as c10d's Gloo checks).
  switch (type) {
    case DataType::kFloat32:
    case DataType::kFloat64:
    case DataType::kFloat16:
      return op == ReduceOp::kSum || op == ReduceOp::kProduct || op == ReduceOp::kMin || op == ReduceOp::kMax;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kInt32:
    case DataType::kInt64:
      return true;
    default:
      return false;
  }
}

void GlooChannel::wait(const c10::intrusive_ptr<c10d::Work>& work, Deadline deadline) const {
  for (;;) {
    if (aborted_.load(std::memory_order_acquire)) throw std::runtime_error("aborted while waiting for the Gloo op");
    const auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (remaining.count() <= 0 && !work->isCompleted()) {
      throw std::runtime_error("the Gloo op did not complete by the op deadline (peer host unreachable or stalled?)");
    }
    try {
      // Work::wait(timeout) throws both for the op's own error and when the slice ran out:
      // only a completed Work's exception is the op's.
      work->wait(std::clamp(remaining, std::chrono::milliseconds(1), std::chrono::milliseconds(100)));
      return;
    } catch (const std::exception&) {
      if (work->isCompleted()) throw;
    }
  }
}

void GlooChannel::allreduce(void* data, size_t count, DataType type, ReduceOp op, Deadline deadline) {
  std::vector<at::Tensor> tensors{wrap(data, count, scalarType(type))};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10dOp(op);
  opts.timeout = left(deadline);
  wait(backend_->allreduce(tensors, opts), deadline);
}

void GlooChannel::allgather(const void* in, size_t bytes, void* out, Deadline deadline) {
  std::vector<at::Tensor> inputs{wrap(in, bytes, at::kByte)};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int h = 0; h < size_; ++h) outputs[0].push_back(wrap(static_cast<uint8_t*>(out) + h * bytes, bytes, at::kByte));
  c10d::AllgatherOptions opts;
  opts.timeout = left(deadline);
  wait(backend_->allgather(outputs, inputs, opts), deadline);
}

void GlooChannel::broadcast(void* data, size_t bytes, int root, Deadline deadline) {
  std::vector<at::Tensor> tensors{wrap(data, bytes, at::kByte)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.rootTensor = 0;
  opts.timeout = left(deadline);
  wait(backend_->broadcast(tensors, opts), deadline);
}

void GlooChannel::reduceScatter(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                                Deadline deadline) {
  const at::ScalarType st = scalarType(type);
  const size_t block = count * elementSize(type);
  std::vector<at::Tensor> outputs{wrap(out, count, st)};
  std::vector<std::vector<at::Tensor>> inputs(1);
  for (int h = 0; h < size_; ++h) inputs[0].push_back(wrap(static_cast<const uint8_t*>(in) + h * block, count, st));
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10dOp(op);
  opts.timeout = left(deadline);
  wait(backend_->reduce_scatter(outputs, inputs, opts), deadline);
}

}  // namespace zeroplus::pg
