#include "process_group/adapter/device_router.hpp"

#include "process_group/adapter/cuda_transport.hpp"

namespace zeroplus::pg {
namespace {

c10::DeviceType deviceOf(const std::vector<at::Tensor>& tensors) {
  return tensors.empty() || !tensors[0].defined() ? c10::DeviceType::CPU : tensors[0].device().type();
}

// Bytes of one tensor's elements (a sparse COO tensor: its indices and values).
uint64_t bytesOf(const at::Tensor& t) {
  if (!t.defined()) return 0;
  if (t.layout() == at::kSparse) return bytesOf(t._indices()) + bytesOf(t._values());
  return static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size());
}

uint64_t bytesOf(const std::vector<at::Tensor>& tensors) {
  uint64_t sum = 0;
  for (const auto& t : tensors) sum += bytesOf(t);
  return sum;
}

uint64_t firstBytes(const std::vector<at::Tensor>& tensors) {
  return tensors.empty() ? 0 : bytesOf(tensors[0]);
}

}  // namespace

DeviceRouter::DeviceRouter(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<ZeroPlusBackend> cpu)
    : c10d::Backend(cpu->getRank(), cpu->getSize()), store_(std::move(store)), cpu_(std::move(cpu)) {}

c10d::Backend& DeviceRouter::backendFor(c10::DeviceType device) {
  if (device == c10::DeviceType::CPU) return *cpu_;
  TORCH_CHECK(device == c10::DeviceType::CUDA, "zeroplus: does not support tensors on device type ", device,
              "; supported: cpu, cuda");
  std::lock_guard<std::mutex> lock(cudaMutex_);
  if (!cuda_) cuda_ = createCudaTransport(store_, cpu_);
  return *cuda_;
}

void DeviceRouter::setTimeout(std::chrono::milliseconds timeout) {
  cpu_->setTimeout(timeout);
  std::lock_guard<std::mutex> lock(cudaMutex_);
  if (cuda_) cuda_->setTimeout(timeout);
}

void DeviceRouter::shutdown() {
  {
    std::lock_guard<std::mutex> lock(cudaMutex_);
    if (cuda_) cuda_->shutdown();
  }
  cpu_->shutdown();
}

void DeviceRouter::abort() {
  {
    std::lock_guard<std::mutex> lock(cudaMutex_);
    if (cuda_) cuda_->abort();
  }
  cpu_->abort();
}

// Message sizes (core/comm_stats.hpp): S of each op, computed from its arguments before it is
// issued (the op may modify its outputs' metadata, never their sizes). Undefined tensors count
// 0 bytes; the backend rejects them anyway, and rejected ops are not counted.
template <class Call>
c10::intrusive_ptr<c10d::Work> DeviceRouter::route(CommOp op, uint64_t bytes, c10::DeviceType device, Call&& call) {
  c10::intrusive_ptr<c10d::Work> work = call(backendFor(device));
  stats_.record(op, bytes);
  return work;
}

c10::intrusive_ptr<c10d::Work> DeviceRouter::broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) {
  return route(CommOp::kBroadcast, firstBytes(t), deviceOf(t), [&](c10d::Backend& b) { return b.broadcast(t, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) {
  // Several tensors per process (Gloo style) combine into one result of one tensor's size.
  return route(CommOp::kAllReduce, firstBytes(t), deviceOf(t), [&](c10d::Backend& b) { return b.allreduce(t, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::allreduce_coalesced(std::vector<at::Tensor>& t,
                                                                 const c10d::AllreduceCoalescedOptions& o) {
  return route(CommOp::kAllReduceCoalesced, bytesOf(t), deviceOf(t),
               [&](c10d::Backend& b) { return b.allreduce_coalesced(t, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) {
  return route(CommOp::kReduce, firstBytes(t), deviceOf(t), [&](c10d::Backend& b) { return b.reduce(t, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::allgather(std::vector<std::vector<at::Tensor>>& out,
                                                       std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o) {
  // out[0]: the n gathered pieces of the (single) input.
  const uint64_t bytes = out.empty() ? 0 : bytesOf(out[0]);
  return route(CommOp::kAllGather, bytes, deviceOf(in), [&](c10d::Backend& b) { return b.allgather(out, in, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::_allgather_base(at::Tensor& out, at::Tensor& in,
                                                             const c10d::AllgatherOptions& o) {
  return route(CommOp::kAllGatherIntoTensor, bytesOf(out), in.device().type(),
               [&](c10d::Backend& b) { return b._allgather_base(out, in, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                             std::vector<at::Tensor>& in,
                                                                             const c10d::AllgatherOptions& o) {
  return route(CommOp::kAllGatherIntoTensorCoalesced, bytesOf(out), deviceOf(in),
               [&](c10d::Backend& b) { return b.allgather_into_tensor_coalesced(out, in, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::AllgatherOptions& o) {
  // out[r]: rank r's input list; S is all of it.
  uint64_t bytes = 0;
  for (const auto& list : out) bytes += bytesOf(list);
  return route(CommOp::kAllGatherCoalesced, bytes, deviceOf(in),
               [&](c10d::Backend& b) { return b.allgather_coalesced(out, in, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::gather(std::vector<std::vector<at::Tensor>>& out,
                                                    std::vector<at::Tensor>& in, const c10d::GatherOptions& o) {
  // Only the root has outputs; every rank counts the same S = n x its input.
  const uint64_t bytes = firstBytes(in) * static_cast<uint64_t>(getSize());
  return route(CommOp::kGather, bytes, deviceOf(in), [&](c10d::Backend& b) { return b.gather(out, in, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::scatter(std::vector<at::Tensor>& out,
                                                     std::vector<std::vector<at::Tensor>>& in,
                                                     const c10d::ScatterOptions& o) {
  const uint64_t bytes = firstBytes(out) * static_cast<uint64_t>(getSize());
  return route(CommOp::kScatter, bytes, deviceOf(out), [&](c10d::Backend& b) { return b.scatter(out, in, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::reduce_scatter(std::vector<at::Tensor>& out,
                                                            std::vector<std::vector<at::Tensor>>& in,
                                                            const c10d::ReduceScatterOptions& o) {
  // in[0]: the n pieces this rank contributes, one per destination rank.
  const uint64_t bytes = in.empty() ? 0 : bytesOf(in[0]);
  return route(CommOp::kReduceScatter, bytes, deviceOf(out),
               [&](c10d::Backend& b) { return b.reduce_scatter(out, in, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::_reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                                  const c10d::ReduceScatterOptions& o) {
  return route(CommOp::kReduceScatterTensor, bytesOf(in), in.device().type(),
               [&](c10d::Backend& b) { return b._reduce_scatter_base(out, in, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                             std::vector<at::Tensor>& in,
                                                                             const c10d::ReduceScatterOptions& o) {
  return route(CommOp::kReduceScatterTensorCoalesced, bytesOf(in), deviceOf(in),
               [&](c10d::Backend& b) { return b.reduce_scatter_tensor_coalesced(out, in, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::alltoall_base(at::Tensor& out, at::Tensor& in,
                                                           std::vector<int64_t>& outSplits,
                                                           std::vector<int64_t>& inSplits,
                                                           const c10d::AllToAllOptions& o) {
  return route(CommOp::kAllToAllSingle, bytesOf(in), in.device().type(),
               [&](c10d::Backend& b) { return b.alltoall_base(out, in, outSplits, inSplits, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                      const c10d::AllToAllOptions& o) {
  return route(CommOp::kAllToAll, bytesOf(in), deviceOf(in), [&](c10d::Backend& b) { return b.alltoall(out, in, o); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::send(std::vector<at::Tensor>& t, int dst, int tag) {
  return route(CommOp::kSend, bytesOf(t), deviceOf(t), [&](c10d::Backend& b) { return b.send(t, dst, tag); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::recv(std::vector<at::Tensor>& t, int src, int tag) {
  return route(CommOp::kRecv, bytesOf(t), deviceOf(t), [&](c10d::Backend& b) { return b.recv(t, src, tag); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::recvAnysource(std::vector<at::Tensor>& t, int tag) {
  return route(CommOp::kRecv, bytesOf(t), deviceOf(t), [&](c10d::Backend& b) { return b.recvAnysource(t, tag); });
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::barrier(const c10d::BarrierOptions& o) {
  // c10d allocates the barrier's token on opts.device; a CUDA barrier must order CUDA work too.
  const bool cuda = o.device.has_value() && o.device->is_cuda();
  return route(CommOp::kBarrier, 0, cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU,
               [&](c10d::Backend& b) { return b.barrier(o); });
}

void DeviceRouter::startCoalescing() {
  cpu_->startCoalescing();
}

c10::intrusive_ptr<c10d::Work> DeviceRouter::endCoalescing() {
  return cpu_->endCoalescing();
}

}  // namespace zeroplus::pg
