// CUDA-side transports of a zeroplus group (see device_router.hpp for when they are created).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

#include "process_group/adapter/backend.hpp"
#include "process_group/core/config.hpp"

namespace zeroplus::pg {

// Resolves the group's cuda_transport knob (ZEROPLUS_CUDA_TRANSPORT / BackendOptions, parsed in
// process_group/core/config.cpp): "auto" is "nccl" in builds with CUDA and "host" otherwise.
// Raises for "nccl" in a build without CUDA.
std::string selectedCudaTransport(CudaTransport requested);

// Builds the transport named by selectedCudaTransport() for the group of `cpu`, except that
// "auto" in a CUDA build takes host staging when two ranks of the group drive the same GPU
// (NCCL refuses that). Collective: every rank of the group must call it (the first CUDA op does).
c10::intrusive_ptr<c10d::Backend> createCudaTransport(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const c10::intrusive_ptr<ZeroPlusBackend>& cpu);

}  // namespace zeroplus::pg
