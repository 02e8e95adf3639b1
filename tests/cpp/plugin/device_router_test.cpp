// Description: DeviceRouter picks the transport by device; HostStagingBackend runs ops through
// the CPU backend and copies results back (exercised here with CPU tensors, the only kind this
// machine has: the staging copies become no-ops, the op plumbing is what is checked).
#include <gtest/gtest.h>
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <cstdlib>
#include <functional>
#include <thread>

#include "process_group/adapter/cuda_transport.hpp"
#include "process_group/adapter/device_router.hpp"
#include "process_group/adapter/host_staging_backend.hpp"

namespace {

using zeroplus::pg::ZeroPlusBackend;

void runRanks(int world, const std::function<void(int, c10::intrusive_ptr<ZeroPlusBackend>, c10::intrusive_ptr<c10d::Store>)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        zeroplus::pg::BackendConfig config;
        config.timeout = std::chrono::seconds(20);
        auto cpu = c10::make_intrusive<ZeroPlusBackend>(store, rank, world, config);
        fn(rank, cpu, store);
        cpu->shutdown();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < world; ++rank) ASSERT_TRUE(errors[rank].empty()) << "rank " << rank << ": " << errors[rank];
}

TEST(HostStagingBackend, RunsCollectivesThroughTheCpuBackend) {
  runRanks(2, [](int rank, c10::intrusive_ptr<ZeroPlusBackend> cpu, c10::intrusive_ptr<c10d::Store>) {
    zeroplus::pg::HostStagingBackend staged(cpu);
    std::vector<at::Tensor> t{at::full({6}, static_cast<float>(rank + 1))};
    auto work = staged.allreduce(t);
    EXPECT_TRUE(work->isCompleted());  // host staging completes before returning
    EXPECT_TRUE(at::equal(t[0], at::full({6}, 3.0f)));
    EXPECT_TRUE(at::equal(work->result()[0], t[0]));

    at::Tensor in = at::full({3}, static_cast<float>(rank));
    at::Tensor out = at::empty({6});
    staged._allgather_base(out, in)->wait();
    EXPECT_TRUE(at::equal(out, at::cat({at::zeros({3}), at::ones({3})})));

    std::vector<at::Tensor> b{at::full({2}, static_cast<float>(rank + 10))};
    c10d::BroadcastOptions opts;
    opts.rootRank = 1;
    staged.broadcast(b, opts)->wait();
    EXPECT_TRUE(at::equal(b[0], at::full({2}, 11.0f)));
    staged.barrier()->wait();
  });
}

TEST(DeviceRouter, RoutesCpuAndRejectsUnknownDevices) {
  runRanks(1, [](int, c10::intrusive_ptr<ZeroPlusBackend> cpu, c10::intrusive_ptr<c10d::Store> store) {
    zeroplus::pg::DeviceRouter router(store, cpu);
    EXPECT_EQ(&router.backendFor(c10::DeviceType::CPU), cpu.get());
    try {
      router.backendFor(c10::DeviceType::XLA);
      ADD_FAILURE() << "XLA accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("does not support tensors on device type"), std::string::npos) << e.what();
    }
    std::vector<at::Tensor> t{at::ones({4})};
    router.allreduce(t)->wait();
    EXPECT_TRUE(at::equal(t[0], at::ones({4})));
    EXPECT_EQ(router.getBackendName(), "zeroplus");
  });
}

#ifndef ZEROPLUS_WITH_CUDA
TEST(CudaTransport, SelectionWithoutCuda) {
  using zeroplus::pg::CudaTransport;
  EXPECT_EQ(zeroplus::pg::selectedCudaTransport(CudaTransport::kAuto), "host");
  EXPECT_EQ(zeroplus::pg::selectedCudaTransport(CudaTransport::kHost), "host");
  try {
    zeroplus::pg::selectedCudaTransport(CudaTransport::kNccl);
    ADD_FAILURE() << "nccl accepted without CUDA";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no CUDA"), std::string::npos) << e.what();
  }
  setenv("ZEROPLUS_CUDA_TRANSPORT", "carrier-pigeon", 1);
  try {
    zeroplus::pg::configFromEnvironment();
    ADD_FAILURE() << "bad value accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ZEROPLUS_CUDA_TRANSPORT='carrier-pigeon' is invalid"), std::string::npos)
        << e.what();
  }
  unsetenv("ZEROPLUS_CUDA_TRANSPORT");
}
#endif

}  // namespace
