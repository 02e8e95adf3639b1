// Key-value rendezvous used to bootstrap transports; the adapter implements it over a
// c10d::Store, tests implement it in memory. Torch-free.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace zeroplus::pg {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until `key` exists or `timeout` passes; throws std::runtime_error on timeout.
  virtual std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

}  // namespace zeroplus::pg
