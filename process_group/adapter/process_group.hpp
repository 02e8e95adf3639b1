// zeroplus::pg::makeProcessGroup: a c10d::ProcessGroup whose backend is zeroplus, for LibTorch
// programs without Python (Python gets the same through init_process_group(backend="zeroplus")).
//
// Contract:
//  * Collective: every rank of the group calls it with the same store, its own rank, the same
//    size and agreeing BackendConfig tuning; it blocks until all ranks joined (config.timeout).
//  * The returned group serves CPU tensors, and CUDA tensors in CUDA builds (the DeviceRouter
//    picks NCCL or host staging as in Python). Use it with c10d's ProcessGroup API
//    (pg->allreduce(...)->wait()) or hand it to zeroplus::optim::ZeroAdamW.
//  * Ownership: the group owns the backend; shut it down with pg->shutdown() (or let the last
//    reference go) after the last collective.
//  * A group spanning hosts runs the flat TCP algorithms here: the hierarchical path's Gloo
//    groups are created by the Python registration hook (docs/multihost.md).
//  * commStats(group) is the group's communication accounting (core/comm_stats.hpp): calls and
//    bytes per collective type, snapshot() and reset(); it throws c10::Error for a group whose
//    backend is not zeroplus.
//  * Errors: as ZeroPlusBackend's constructor (c10::Error / c10::DistBackendError naming the
//    rank and the failed step).
// Header-only on purpose: it adds no translation unit to libzeroplus.so.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "process_group/adapter/backend.hpp"
#include "process_group/adapter/device_router.hpp"

namespace zeroplus::pg {

inline c10::intrusive_ptr<c10d::ProcessGroup> makeProcessGroup(const c10::intrusive_ptr<c10d::Store>& store,
                                                               int rank, int size, BackendConfig config = {}) {
  auto cpu = c10::make_intrusive<ZeroPlusBackend>(store, rank, size, std::move(config));
  cpu->noteNoInterHostChannel();  // across hosts: flat TCP (Gloo needs the Python hook)
  auto router = c10::make_intrusive<DeviceRouter>(cpu->sessionStore(), cpu);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  using Type = c10d::ProcessGroup::BackendType;
  group->setBackend(c10::DeviceType::CPU, Type::CUSTOM, router);
  group->setBackend(c10::DeviceType::CUDA, Type::CUSTOM, router);
  group->setDefaultBackend(Type::CUSTOM);
  return group;
}

inline CommStats& commStats(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  TORCH_CHECK(group, "zeroplus commStats: group is null");
  auto* router = dynamic_cast<DeviceRouter*>(group->getBackend(c10::DeviceType::CPU).get());
  TORCH_CHECK(router != nullptr, "zeroplus commStats: group is not a zeroplus group");
  return router->commStats();
}

}  // namespace zeroplus::pg
