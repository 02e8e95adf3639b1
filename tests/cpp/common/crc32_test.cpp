// crc32 against a bit-at-a-time reference of the same polynomial: every length 0..300 (the
// folding path's thresholds at 64 and each 16), odd alignments, running checksums split at every
// point, the standard check value, and large buffers through both paths.
#include "common/core/crc32.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace zeroplus::checksum {
namespace {

uint32_t reference(uint32_t crc, const unsigned char* p, size_t n) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

std::vector<unsigned char> randomBytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(gen());
  return v;
}

TEST(Crc32, CheckValue) {
  const char* text = "123456789";
  EXPECT_EQ(crc32(0, text, 9), 0xCBF43926u);
  EXPECT_EQ(crc32Portable(0, text, 9), 0xCBF43926u);
  EXPECT_EQ(crc32(0, nullptr, 0), 0u);
}

TEST(Crc32, EveryLengthAndAlignmentMatchesTheReference) {
  const auto data = randomBytes(300 + 16, 7);
  for (size_t offset = 0; offset < 16; offset += 3) {
    for (size_t n = 0; n <= 300; ++n) {
      const unsigned char* p = data.data() + offset;
      const uint32_t want = reference(0x1234567u, p, n);
      ASSERT_EQ(crc32(0x1234567u, p, n), want) << "n " << n << " offset " << offset;
      ASSERT_EQ(crc32Portable(0x1234567u, p, n), want) << "n " << n << " offset " << offset;
    }
  }
}

TEST(Crc32, RunningChecksumSplitAnywhere) {
  const auto data = randomBytes(1000, 11);
  const uint32_t whole = reference(0, data.data(), data.size());
  for (size_t cut = 0; cut <= data.size(); cut += 7) {
    EXPECT_EQ(crc32(crc32(0, data.data(), cut), data.data() + cut, data.size() - cut), whole) << cut;
  }
}

TEST(Crc32, LargeBuffersBothPaths) {
  const auto data = randomBytes((4u << 20) + 13, 3);  // a checkpoint block and a ragged tail
  const uint32_t want = reference(0, data.data(), data.size());
  EXPECT_EQ(crc32(0, data.data(), data.size()), want);
  EXPECT_EQ(crc32Portable(0, data.data(), data.size()), want);
  std::vector<unsigned char> zeros(1 << 20, 0);
  EXPECT_EQ(crc32(0, zeros.data(), zeros.size()), reference(0, zeros.data(), zeros.size()));
}

TEST(Crc32, ReportsWhichPathRuns) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  EXPECT_EQ(crc32Accelerated(), __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"));
  if (!crc32Accelerated()) GTEST_SKIP() << "CPU lacks PCLMULQDQ/SSE4.1: only the portable path was checked";
#else
  EXPECT_FALSE(crc32Accelerated());
#endif
}

}  // namespace
}  // namespace zeroplus::checksum
