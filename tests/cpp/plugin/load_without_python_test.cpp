// Description: libzeroplus.so loads into, and works from, a C++ program without Python.
// The executable links LibTorch and libzeroplus only; a ProcessGroup with the zeroplus backend
// is built through the public C++ headers and runs collectives with ranks as threads.
#include <dlfcn.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <ATen/ATen.h>

#include <thread>

#include "process_group/adapter/backend.hpp"

namespace {

TEST(LoadWithoutPython, DlopenSucceedsAndNoPythonIsPresent) {
  void* handle = dlopen(ZEROPLUS_LIBRARY_PATH, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(handle, nullptr) << dlerror();
  // The load-time Python hook must have found no interpreter and done nothing.
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "Py_IsInitialized"), nullptr);
  EXPECT_NE(dlsym(handle, "_ZN8zeroplus2pg15ZeroPlusBackendD0Ev"), nullptr);
  dlclose(handle);
}

TEST(LoadWithoutPython, BackendRunsCollectivesFromCpp) {
  constexpr int kWorld = 2;
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<at::Tensor> results(kWorld);
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        zeroplus::pg::BackendConfig config;
        config.timeout = std::chrono::seconds(30);
        auto backend = c10::make_intrusive<zeroplus::pg::ZeroPlusBackend>(store, rank, kWorld, config);
        auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, kWorld);
        pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
        std::vector<at::Tensor> tensors{at::full({5}, static_cast<float>(rank + 1))};
        pg->getBackend(c10::DeviceType::CPU)->allreduce(tensors)->wait();
        backend->barrier()->wait();
        results[rank] = tensors[0];
        backend->shutdown();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int rank = 0; rank < kWorld; ++rank) {
    ASSERT_TRUE(errors[rank].empty()) << "rank " << rank << ": " << errors[rank];
    EXPECT_TRUE(at::equal(results[rank], at::full({5}, 3.0f)));
  }
}

}  // namespace
