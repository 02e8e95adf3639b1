#include "process_group/adapter/host_staging_backend.hpp"

namespace zeroplus::pg {
namespace {

using Tensors = std::vector<at::Tensor>;

at::Tensor toHost(const at::Tensor& t) {
  return t.is_cpu() ? t : t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/false).contiguous();
}

Tensors toHost(const Tensors& ts) {
  Tensors out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(toHost(t));
  return out;
}

void copyBack(const Tensors& device, const Tensors& host) {
  for (size_t i = 0; i < device.size(); ++i) {
    if (!device[i].is_same(host[i])) device[i].copy_(host[i]);
  }
}

// Waits for the host op (rethrowing its error), copies results back, returns a completed Work.
c10::intrusive_ptr<c10d::Work> finish(int rank, c10d::OpType type, const c10::intrusive_ptr<c10d::Work>& hostWork,
                                      const Tensors& deviceOut, const Tensors& hostOut) {
  hostWork->wait();
  copyBack(deviceOut, hostOut);
  auto work = c10::make_intrusive<ZeroPlusWork>(rank, type, "zeroplus:host_staged", 0, deviceOut);
  work->markSucceeded();
  return work;
}

}  // namespace

HostStagingBackend::HostStagingBackend(c10::intrusive_ptr<ZeroPlusBackend> cpu)
    : c10d::Backend(cpu->getRank(), cpu->getSize()), cpu_(std::move(cpu)) {}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) {
  Tensors host = toHost(tensors);
  return finish(rank_, c10d::OpType::BROADCAST, cpu_->broadcast(host, opts), tensors, host);
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  Tensors host = toHost(tensors);
  return finish(rank_, c10d::OpType::ALLREDUCE, cpu_->allreduce(host, opts), tensors, host);
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::allreduce_coalesced(Tensors& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
  Tensors host = toHost(tensors);
  return finish(rank_, c10d::OpType::ALLREDUCE_COALESCED, cpu_->allreduce_coalesced(host, opts), tensors, host);
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::reduce(Tensors& tensors, const c10d::ReduceOptions& opts) {
  Tensors host = toHost(tensors);
  return finish(rank_, c10d::OpType::REDUCE, cpu_->reduce(host, opts), tensors, host);
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::allgather(std::vector<Tensors>& outputs, Tensors& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  Tensors in = toHost(inputs);
  std::vector<Tensors> out;
  for (const auto& o : outputs) out.push_back(toHost(o));
  auto hostWork = cpu_->allgather(out, in, opts);
  hostWork->wait();
  for (size_t i = 0; i < outputs.size(); ++i) copyBack(outputs[i], out[i]);
  Tensors flat;
  for (const auto& o : outputs) flat.insert(flat.end(), o.begin(), o.end());
  auto work = c10::make_intrusive<ZeroPlusWork>(rank_, c10d::OpType::ALLGATHER, "zeroplus:host_staged", 0, flat);
  work->markSucceeded();
  return work;
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  at::Tensor in = toHost(input);
  at::Tensor out = toHost(output);
  return finish(rank_, c10d::OpType::_ALLGATHER_BASE, cpu_->_allgather_base(out, in, opts), {output}, {out});
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                                                   const c10d::AllgatherOptions& opts) {
  Tensors in = toHost(inputs);
  Tensors out = toHost(outputs);
  return finish(rank_, c10d::OpType::COALESCED, cpu_->allgather_into_tensor_coalesced(out, in, opts), outputs, out);
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::gather(std::vector<Tensors>& outputs, Tensors& inputs,
                                                          const c10d::GatherOptions& opts) {
  Tensors in = toHost(inputs);
  std::vector<Tensors> out;
  for (const auto& o : outputs) out.push_back(toHost(o));
  auto hostWork = cpu_->gather(out, in, opts);
  hostWork->wait();
  Tensors flat;
  for (size_t i = 0; i < outputs.size(); ++i) {
    copyBack(outputs[i], out[i]);
    flat.insert(flat.end(), outputs[i].begin(), outputs[i].end());
  }
  auto work = c10::make_intrusive<ZeroPlusWork>(rank_, c10d::OpType::GATHER, "zeroplus:host_staged", 0, flat);
  work->markSucceeded();
  return work;
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                                           const c10d::ScatterOptions& opts) {
  Tensors out = toHost(outputs);
  std::vector<Tensors> in;
  for (const auto& i : inputs) in.push_back(toHost(i));
  return finish(rank_, c10d::OpType::SCATTER, cpu_->scatter(out, in, opts), outputs, out);
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::reduce_scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  Tensors out = toHost(outputs);
  std::vector<Tensors> in;
  for (const auto& i : inputs) in.push_back(toHost(i));
  return finish(rank_, c10d::OpType::REDUCE_SCATTER, cpu_->reduce_scatter(out, in, opts), outputs, out);
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  at::Tensor in = toHost(input);
  at::Tensor out = toHost(output);
  return finish(rank_, c10d::OpType::_REDUCE_SCATTER_BASE, cpu_->_reduce_scatter_base(out, in, opts), {output}, {out});
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::reduce_scatter_tensor_coalesced(
    Tensors& outputs, Tensors& inputs, const c10d::ReduceScatterOptions& opts) {
  Tensors in = toHost(inputs);
  Tensors out = toHost(outputs);
  return finish(rank_, c10d::OpType::COALESCED, cpu_->reduce_scatter_tensor_coalesced(out, in, opts), outputs, out);
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                 std::vector<int64_t>& outputSplitSizes,
                                                                 std::vector<int64_t>& inputSplitSizes,
                                                                 const c10d::AllToAllOptions& opts) {
  at::Tensor in = toHost(input);
  at::Tensor out = toHost(output);
  auto hostWork = cpu_->alltoall_base(out, in, outputSplitSizes, inputSplitSizes, opts);
  return finish(rank_, c10d::OpType::ALLTOALL_BASE, hostWork, {output}, {out});
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::alltoall(Tensors& outputs, Tensors& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  Tensors in = toHost(inputs);
  Tensors out = toHost(outputs);
  return finish(rank_, c10d::OpType::ALLTOALL, cpu_->alltoall(out, in, opts), outputs, out);
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::send(Tensors& tensors, int dstRank, int tag) {
  Tensors host = toHost(tensors);
  return finish(rank_, c10d::OpType::SEND, cpu_->send(host, dstRank, tag), {}, {});
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::recv(Tensors& tensors, int srcRank, int tag) {
  Tensors host = toHost(tensors);
  return finish(rank_, c10d::OpType::RECV, cpu_->recv(host, srcRank, tag), tensors, host);
}

c10::intrusive_ptr<c10d::Work> HostStagingBackend::barrier(const c10d::BarrierOptions& opts) {
  return finish(rank_, c10d::OpType::BARRIER, cpu_->barrier(opts), {}, {});
}

}  // namespace zeroplus::pg
