// Selection and construction of the CUDA-side transport. The NCCL part compiles only in builds
// against a CUDA torch (ZEROPLUS_WITH_CUDA); the host-staging part needs no CUDA headers.
#include "process_group/adapter/cuda_transport.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "process_group/adapter/host_staging_backend.hpp"

#ifdef ZEROPLUS_WITH_CUDA
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
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

c10::intrusive_ptr<c10d::Backend> createCudaTransport(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const c10::intrusive_ptr<ZeroPlusBackend>& cpu) {
  const std::string choice = selectedCudaTransport(cpu->tuning().cudaTransport);
#ifdef ZEROPLUS_WITH_CUDA
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
