#include "process_group/adapter/device_router.hpp"

#include "process_group/adapter/cuda_transport.hpp"

namespace zeroplus::pg {
namespace {

c10::DeviceType deviceOf(const std::vector<at::Tensor>& tensors) {
  return tensors.empty() || !tensors[0].defined() ? c10::DeviceType::CPU : tensors[0].device().type();
}

c10::DeviceType deviceOf(const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& l : lists) {
    if (!l.empty()) return deviceOf(l);
  }
  return c10::DeviceType::CPU;
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

c10::intrusive_ptr<c10d::Work> DeviceRouter::broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) {
  return backendFor(deviceOf(t)).broadcast(t, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) {
  return backendFor(deviceOf(t)).allreduce(t, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::allreduce_coalesced(std::vector<at::Tensor>& t,
                                                                 const c10d::AllreduceCoalescedOptions& o) {
  return backendFor(deviceOf(t)).allreduce_coalesced(t, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) {
  return backendFor(deviceOf(t)).reduce(t, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::allgather(std::vector<std::vector<at::Tensor>>& out,
                                                       std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o) {
  return backendFor(deviceOf(in)).allgather(out, in, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::_allgather_base(at::Tensor& out, at::Tensor& in,
                                                             const c10d::AllgatherOptions& o) {
  return backendFor(in.device().type())._allgather_base(out, in, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                             std::vector<at::Tensor>& in,
                                                                             const c10d::AllgatherOptions& o) {
  return backendFor(deviceOf(in)).allgather_into_tensor_coalesced(out, in, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::AllgatherOptions& o) {
  return backendFor(deviceOf(in)).allgather_coalesced(out, in, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::gather(std::vector<std::vector<at::Tensor>>& out,
                                                    std::vector<at::Tensor>& in, const c10d::GatherOptions& o) {
  return backendFor(deviceOf(in)).gather(out, in, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::scatter(std::vector<at::Tensor>& out,
                                                     std::vector<std::vector<at::Tensor>>& in,
                                                     const c10d::ScatterOptions& o) {
  return backendFor(deviceOf(out)).scatter(out, in, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::reduce_scatter(std::vector<at::Tensor>& out,
                                                            std::vector<std::vector<at::Tensor>>& in,
                                                            const c10d::ReduceScatterOptions& o) {
  return backendFor(deviceOf(out)).reduce_scatter(out, in, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::_reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                                  const c10d::ReduceScatterOptions& o) {
  return backendFor(in.device().type())._reduce_scatter_base(out, in, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                             std::vector<at::Tensor>& in,
                                                                             const c10d::ReduceScatterOptions& o) {
  return backendFor(deviceOf(in)).reduce_scatter_tensor_coalesced(out, in, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::alltoall_base(at::Tensor& out, at::Tensor& in,
                                                           std::vector<int64_t>& outSplits,
                                                           std::vector<int64_t>& inSplits,
                                                           const c10d::AllToAllOptions& o) {
  return backendFor(in.device().type()).alltoall_base(out, in, outSplits, inSplits, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                      const c10d::AllToAllOptions& o) {
  return backendFor(deviceOf(in)).alltoall(out, in, o);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::send(std::vector<at::Tensor>& t, int dst, int tag) {
  return backendFor(deviceOf(t)).send(t, dst, tag);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::recv(std::vector<at::Tensor>& t, int src, int tag) {
  return backendFor(deviceOf(t)).recv(t, src, tag);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::recvAnysource(std::vector<at::Tensor>& t, int tag) {
  return backendFor(deviceOf(t)).recvAnysource(t, tag);
}
c10::intrusive_ptr<c10d::Work> DeviceRouter::barrier(const c10d::BarrierOptions& o) {
  // c10d allocates the barrier's token on opts.device; a CUDA barrier must order CUDA work too.
  const bool cuda = o.device.has_value() && o.device->is_cuda();
  return backendFor(cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU).barrier(o);
}

void DeviceRouter::startCoalescing() {
  cpu_->startCoalescing();
}

c10::intrusive_ptr<c10d::Work> DeviceRouter::endCoalescing() {
  return cpu_->endCoalescing();
}

}  // namespace zeroplus::pg
