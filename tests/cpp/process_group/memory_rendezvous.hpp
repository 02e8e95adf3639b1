// An in-process rendezvous for ranks that are threads of one process. No GoogleTest dependency,
// so the fuzz targets (tests/fuzz) share it with the GoogleTest helpers (test_group.hpp).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "process_group/core/rendezvous.hpp"

namespace zeroplus::pg::testing {

class InMemoryRendezvous : public Rendezvous {
 public:
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      kv_[key] = value;
    }
    cv_.notify_all();
  }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return kv_.count(key) > 0; })) {
      throw std::runtime_error("rendezvous: timed out waiting for key " + key);
    }
    return kv_[key];
  }
  bool check(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return kv_.count(key) > 0;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<uint8_t>> kv_;
};

}  // namespace zeroplus::pg::testing
