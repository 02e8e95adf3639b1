// Test helpers for the LibTorch-facing suites: ranks as threads of this process, each with its
// own zeroplus process group over one c10d::HashStore, and random values from private
// generators (ranks are threads: torch's global generator is shared).
//
// runRanks(world, fn) runs fn(rank, pg) on `world` threads, shuts every group down, and reports
// each rank's exception (EXPECT, so every rank's message shows, not only the first).
#pragma once

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "process_group/adapter/process_group.hpp"

namespace zeroplus::testing {

inline void runRanks(int world, const std::function<void(int, c10::intrusive_ptr<c10d::ProcessGroup>)>& fn,
                     std::chrono::seconds timeout = std::chrono::seconds(60)) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        zeroplus::pg::BackendConfig config;
        config.timeout = timeout;
        auto pg = zeroplus::pg::makeProcessGroup(store, rank, world, config);
        fn(rank, pg);
        pg->shutdown();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < world; ++rank) EXPECT_TRUE(errors[rank].empty()) << "rank " << rank << ": " << errors[rank];
}

inline at::Tensor randomTensor(at::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::detail::createCPUGenerator(seed), at::kFloat);
}

}  // namespace zeroplus::testing
