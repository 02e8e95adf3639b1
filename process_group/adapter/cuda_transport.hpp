// CUDA-side transports of a zeroplus group (see device_router.hpp for when they are created).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

#include "process_group/adapter/backend.hpp"

namespace zeroplus::pg {

// "nccl" when this build has CUDA and NCCL, else "host"; ZEROPLUS_CUDA_TRANSPORT overrides.
// Raises naming the variable when it holds anything else, or "nccl" in a build without CUDA.
std::string selectedCudaTransport();

// Builds the transport named by selectedCudaTransport() for the group of `cpu`.
// Collective: every rank of the group must call it (the first CUDA op does).
c10::intrusive_ptr<c10d::Backend> createCudaTransport(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const c10::intrusive_ptr<ZeroPlusBackend>& cpu);

}  // namespace zeroplus::pg
