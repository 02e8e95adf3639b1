// Selection and construction of the CUDA-side transport. The NCCL part compiles only in builds
// against a CUDA torch (ZEROPLUS_WITH_CUDA); the host-staging part needs no CUDA headers.
#include "process_group/adapter/cuda_transport.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "process_group/adapter/host_staging_backend.hpp"

#ifdef ZEROPLUS_WITH_CUDA
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <cstdio>
#include <set>
#endif

namespace zeroplus::pg {

std::string selectedCudaTransport(CudaTransport requested) {
#ifdef ZEROPLUS_WITH_CUDA
  std::string choice = "nccl";
#else
  std::string choice = "host";
#endif
  if (requested != CudaTransport::kAuto) choice = std::string(toString(requested));
#ifndef ZEROPLUS_WITH_CUDA
  TORCH_CHECK(choice == "host", "zeroplus: ZEROPLUS_CUDA_TRANSPORT=nccl but this build of zeroplus has no CUDA; ",
              "rebuild against a CUDA torch or use ZEROPLUS_CUDA_TRANSPORT=host");
#endif
  return choice;
}

#ifdef ZEROPLUS_WITH_CUDA
namespace {

// This rank's GPU as "host index/PCI bus id" (the PCI id, not the device index: with
// CUDA_VISIBLE_DEVICES two ranks' device 0 can be different GPUs).
std::string gpuIdentity(const ZeroPlusBackend& cpu) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  char bus[64] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the identity falls back to the index
    std::snprintf(bus, sizeof(bus), "index %d", static_cast<int>(device));
  }
  return std::to_string(cpu.topology().host()) + "/" + bus;
}

// Whether two ranks of the group drive the same GPU: NCCL refuses such a communicator
// ("Duplicate GPU detected"), the host-staging transport serves it. Collective: every rank
// publishes its GPU under a key of this group's store and reads everyone's.
bool ranksShareAGpu(const c10::intrusive_ptr<c10d::Store>& store, const ZeroPlusBackend& cpu) {
  auto keys = c10::make_intrusive<c10d::PrefixStore>("zeroplus-cuda-gpu/", store);
  const std::string mine = gpuIdentity(cpu);
  keys->set(std::to_string(cpu.getRank()), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::set<std::string> seen;
  for (int r = 0; r < cpu.getSize(); ++r) {
    const std::vector<uint8_t> theirs = keys->get(std::to_string(r));
    if (!seen.emplace(theirs.begin(), theirs.end()).second) return true;
  }
  return false;
}

}  // namespace
#endif

c10::intrusive_ptr<c10d::Backend> createCudaTransport(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const c10::intrusive_ptr<ZeroPlusBackend>& cpu) {
  std::string choice = selectedCudaTransport(cpu->tuning().cudaTransport);
#ifdef ZEROPLUS_WITH_CUDA
  // "auto" with several ranks on one GPU (a zeroplus feature NCCL lacks): host staging.
  if (choice == "nccl" && cpu->tuning().cudaTransport == CudaTransport::kAuto && cpu->getSize() > 1 &&
      ranksShareAGpu(store, *cpu)) {
    choice = "host";
  }
  if (choice == "nccl") {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = cpu->timeout();
    // A private key prefix: NCCL's unique-id exchange must not collide with our own keys.
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("zeroplus-nccl/", store);
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, cpu->getRank(), cpu->getSize(), options);
  }
#else
  (void)store;
#endif
  return c10::make_intrusive<HostStagingBackend>(cpu);
}

}  // namespace zeroplus::pg
