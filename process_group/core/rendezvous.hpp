// Key-value rendezvous used to bootstrap transports; the adapter implements it over a
// c10d::Store, tests implement it in memory. Torch-free.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace zeroplus::pg {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until `key` exists or `timeout` passes; throws std::runtime_error on timeout.
  virtual std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Whether `key` exists now, without waiting. The default probes with a 1 ms get(); the store
  // adapter asks the store directly.
  virtual bool check(const std::string& key) {
    try {
      get(key, std::chrono::milliseconds(1));
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }
};

}  // namespace zeroplus::pg
