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
#include "process_group/adapter/process_group.hpp"

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

// Communication accounting through the LibTorch API (pg::commStats): ops issued through
// c10d::ProcessGroup reach the router's funnel once each, with comm_stats.hpp's message sizes.
TEST(DeviceRouter, CountsEveryOpOfTheGroup) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        zeroplus::pg::BackendConfig config;
        config.timeout = std::chrono::seconds(20);
        auto group = zeroplus::pg::makeProcessGroup(store, rank, 2, config);
        using zeroplus::pg::CommOp;
        std::vector<at::Tensor> t{at::ones({1024})};
        group->allreduce(t)->wait();
        at::Tensor in = at::ones({3});
        at::Tensor out = at::empty({6});
        group->getBackend(c10::DeviceType::CPU)->_allgather_base(out, in)->wait();  // all_gather_into_tensor
        std::vector<at::Tensor> p{at::ones({5}, at::kDouble)};
        if (rank == 0) {
          group->send(p, 1, 0)->wait();
        } else {
          group->recv(p, 0, 0)->wait();
        }
        group->barrier()->wait();
        const auto s = zeroplus::pg::commStats(group).snapshot();
        EXPECT_EQ(s[CommOp::kAllReduce].calls, 1u);
        EXPECT_EQ(s[CommOp::kAllReduce].bytes, 4096u);
        EXPECT_EQ(s[CommOp::kAllGatherIntoTensor].bytes, 24u);  // the whole output
        EXPECT_EQ(s[rank == 0 ? CommOp::kSend : CommOp::kRecv].bytes, 40u);
        EXPECT_EQ(s[rank == 0 ? CommOp::kRecv : CommOp::kSend].calls, 0u);
        EXPECT_EQ(s[CommOp::kBarrier].calls, 1u);
        EXPECT_EQ(s.total().calls, 4u);
        EXPECT_EQ(s.total().bytes, 4096u + 24u + 40u);
        zeroplus::pg::commStats(group).reset();
        EXPECT_EQ(zeroplus::pg::commStats(group).snapshot().total().calls, 0u);
        group->shutdown();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int rank = 0; rank < 2; ++rank) EXPECT_TRUE(errors[rank].empty()) << "rank " << rank << ": " << errors[rank];
  auto bare = c10::make_intrusive<c10d::ProcessGroup>(store, 0, 1);
  EXPECT_THROW(zeroplus::pg::commStats(bare), c10::Error);
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
