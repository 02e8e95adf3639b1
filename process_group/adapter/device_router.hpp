// DeviceRouter: the c10d::Backend object c10d actually holds for a "zeroplus" group.
//
// c10d registers one backend object for every device type of the group ("cpu" and "cuda"),
// so routing by tensor device has to happen inside it. The router forwards CPU tensors to
// ZeroPlusBackend and CUDA tensors to a CUDA transport created lazily on the first CUDA op
// (every rank issues that op, so creation is itself collective):
//   * "nccl" (default when built with CUDA): an inner c10d::ProcessGroupNCCL on a prefixed store;
//   * "host": HostStagingBackend, which copies through host memory and reuses the CPU transport
//     (needed when NCCL cannot run, e.g. several ranks sharing one GPU).
// ZEROPLUS_CUDA_TRANSPORT=nccl|host selects it (process_group/adapter/cuda_transport.hpp).
// Ops with no tensors (barrier) go to the device named in BarrierOptions, else to CPU.
//
// Communication accounting: every op c10d issues on the group passes this object exactly once,
// whatever its device, so the router is the funnel that counts them (route() in the .cpp):
// after the serving backend accepted the op (argument errors are not counted), one call and the
// op's message size go into commStats() (core/comm_stats.hpp has the byte definitions). Two
// relaxed atomic adds per op; always on. startCoalescing/endCoalescing are not ops of their own:
// the ops inside the window are counted one by one.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <mutex>

#include "process_group/adapter/backend.hpp"
#include "process_group/core/comm_stats.hpp"

namespace zeroplus::pg {

class DeviceRouter final : public c10d::Backend {
 public:
  DeviceRouter(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<ZeroPlusBackend> cpu);

  const std::string getBackendName() const override { return "zeroplus"; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return cpu_->getSequenceNumberForGroup(); }
  void shutdown() override;
  void abort() override;
  bool supportsCoalescing() const override { return false; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // The backend serving `device` (creates the CUDA transport on first use). Public for tests.
  c10d::Backend& backendFor(c10::DeviceType device);
  // The CPU backend (topology and transport queries of registration/library.cpp).
  const ZeroPlusBackend& cpuBackend() const { return *cpu_; }
  // Calls and bytes per collective type issued on this group by this rank (any thread).
  CommStats& commStats() { return stats_; }
  const CommStats& commStats() const { return stats_; }

 private:
  // The funnel: runs call(backendFor(device)) and, once it returned a Work, counts the op.
  template <class Call>
  c10::intrusive_ptr<c10d::Work> route(CommOp op, uint64_t bytes, c10::DeviceType device, Call&& call);

  CommStats stats_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<ZeroPlusBackend> cpu_;
  std::mutex cudaMutex_;
  c10::intrusive_ptr<c10d::Backend> cuda_;  // guarded by cudaMutex_ until set
  c10::DeviceType coalescingDevice_ = c10::DeviceType::CPU;
};

}  // namespace zeroplus::pg
