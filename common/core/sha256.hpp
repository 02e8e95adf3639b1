// SHA-256 (FIPS 180-4) of byte strings: the checkpoint manifest's own seal (format.py,
// "manifest_sha256"). Torch-free and dependency-free on purpose: one short, well-tested
// function is cheaper than linking OpenSSL's libcrypto into libzeroplus.so (a new Debian
// package in scripts/setup.sh, and one more shared object every LibTorch program and wheel
// would have to find at load time). The manifest is a few KiB to a few MiB, so speed is moot.
// Checked against the FIPS 180-2 vectors in tests/cpp/common/sha256_test.cpp. Thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace zeroplus::checksum {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  // The digest; the object must not be updated afterwards.
  std::array<uint8_t, 32> finish();

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t fill_ = 0;
  uint64_t total_ = 0;
};

// The digest of `data` as 64 lowercase hex digits (hashlib.sha256(data).hexdigest()).
std::string sha256Hex(std::string_view data);

}  // namespace zeroplus::checksum
