// Test helpers for the process-group core: rendezvous implementations and a runner that
// executes one function per rank on its own thread.
//
// InMemoryRendezvous serves ranks that are threads of this process; FileRendezvous serves
// ranks that are forked processes (keys are files in a directory, written atomically by
// rename so a reader never sees half a value).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "process_group/core/communicator.hpp"
#include "tests/cpp/process_group/memory_rendezvous.hpp"

namespace zeroplus::pg::testing {

class FileRendezvous : public Rendezvous {
 public:
  explicit FileRendezvous(std::filesystem::path dir) : dir_(std::move(dir)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    const auto path = file(key);
    const auto tmp = path.string() + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::binary);
      out.write(reinterpret_cast<const char*>(value.data()), static_cast<std::streamsize>(value.size()));
    }
    std::filesystem::rename(tmp, path);
  }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    const auto until = std::chrono::steady_clock::now() + timeout;
    const auto path = file(key);
    while (!std::filesystem::exists(path)) {
      if (std::chrono::steady_clock::now() >= until) throw std::runtime_error("rendezvous: timed out on " + key);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

 private:
  std::filesystem::path file(const std::string& key) const {
    std::string name = key;
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    return dir_ / name;
  }
  std::filesystem::path dir_;
};

// Runs fn(rank) on `n` threads and rethrows the first exception after all have joined.
inline void runRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// n connected communicators living in one process.
struct Group {
  std::vector<std::unique_ptr<Communicator>> comms;

  explicit Group(int n, std::chrono::milliseconds timeout = std::chrono::seconds(20), ShmMode shm = ShmMode::kOff,
                 size_t shmChunkBytes = 1u << 20)
      : comms(static_cast<size_t>(n)) {
    InMemoryRendezvous rdv;
    runRanks(n, [&](int r) {
      CommunicatorOptions o;
      o.rank = r;
      o.size = n;
      o.connectTimeout = timeout;
      o.shm = shm;
      o.shmChunkBytes = shmChunkBytes;
      comms[static_cast<size_t>(r)] = Communicator::connect(rdv, o);
    });
  }
  int size() const { return static_cast<int>(comms.size()); }
  Communicator& operator[](int r) { return *comms[static_cast<size_t>(r)]; }
  void run(const std::function<void(Communicator&, int)>& fn) {
    runRanks(size(), [&](int r) { fn(*comms[static_cast<size_t>(r)], r); });
  }
};

inline Deadline in(std::chrono::milliseconds d) { return Clock::now() + d; }
inline Deadline soon() { return in(std::chrono::seconds(30)); }

}  // namespace zeroplus::pg::testing
