// Internal: the two Engine implementations. Both take requests from Engine::queue_ and report
// through detail::Job, so they differ only in how a request reaches the kernel.
#pragma once

#include <liburing.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "aio/core/engine.hpp"

namespace zeroplus::aio::detail {

class UringEngine final : public Engine {
 public:
  // Sets up all rings first; returns a negative errno (and no engine) if any setup fails, so
  // Engine::create() can fall back before a thread was started.
  static int create(const EngineOptions& options, std::unique_ptr<Engine>* out);
  ~UringEngine() override;

  bool registerBuffer(void* base, size_t length) override;
  void unregisterBuffer(void* base) override;

 private:
  struct Region {
    uintptr_t begin = 0;
    uintptr_t end = 0;  // begin == end: free slot
  };
  static constexpr unsigned kMaxRegions = 64;

  explicit UringEngine(const EngineOptions& options);
  void worker(unsigned index);

  std::vector<io_uring> rings_;
  std::vector<std::thread> threads_;
  bool fixed_buffers_ = false;  // sparse buffer tables exist in every ring
  std::mutex regions_mu_;       // serialises (un)registration and guards regions_
  std::vector<Region> regions_;
  std::atomic<uint64_t> regions_gen_{0};
};

class ThreadPoolEngine final : public Engine {
 public:
  explicit ThreadPoolEngine(const EngineOptions& options);
  ~ThreadPoolEngine() override;

 private:
  void worker();
  std::vector<std::thread> threads_;
};

}  // namespace zeroplus::aio::detail
