#include "common/core/crc32.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace zeroplus::checksum {
namespace {

constexpr uint32_t kPoly = 0xEDB88320u;

// tables[k][b]: the CRC of byte b followed by k zero bytes (slicing-by-8).
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
    }
  }
};

const Tables& tables() {
  static const Tables instance;  // built once; C++11 static initialisation is thread-safe
  return instance;
}

// On the inverted running state (zlib's internal form).
uint32_t portableState(uint32_t c, const unsigned char* p, size_t n) {
  const auto& t = tables().t;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);  // little-endian loads (x86-64, aarch64 Linux)
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return c;
}

#if defined(__x86_64__)
#define ZEROPLUS_CLMUL __attribute__((target("pclmul,sse4.1")))

ZEROPLUS_CLMUL inline __m128i load(const unsigned char* q) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
}

// acc carried 128 bits forward (k = x^(128+64), x^128 mod P) and added to the next block.
ZEROPLUS_CLMUL inline __m128i fold128(__m128i acc, __m128i next, __m128i k3k4) {
  const __m128i lo = _mm_clmulepi64_si128(acc, k3k4, 0x00);
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, k3k4, 0x11), next), lo);
}

// Folds n bytes (n >= 64, a multiple of 16) into the inverted state c. The constants are
// x^(k) mod P for the fold distances (512+64 / 512, 128+64 / 128, 64, 32 bits) and the Barrett
// pair (P' = floor(x^64 / P), P), all bit-reflected, from the Intel paper's CRC-32 example.
ZEROPLUS_CLMUL uint32_t foldState(uint32_t c, const unsigned char* p, size_t n) {
  const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
  const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
  const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124LL);
  const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);

  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  p += 64;
  n -= 64;
  // Four lanes folded 512 bits forward per round: independent multiplies keep the unit busy.
  while (n >= 64) {
    const __m128i x5 = _mm_clmulepi64_si128(x1, k1k2, 0x00), x6 = _mm_clmulepi64_si128(x2, k1k2, 0x00);
    const __m128i x7 = _mm_clmulepi64_si128(x3, k1k2, 0x00), x8 = _mm_clmulepi64_si128(x4, k1k2, 0x00);
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k1k2, 0x11), x5), load(p));
    x2 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x2, k1k2, 0x11), x6), load(p + 16));
    x3 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x3, k1k2, 0x11), x7), load(p + 32));
    x4 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x4, k1k2, 0x11), x8), load(p + 48));
    p += 64;
    n -= 64;
  }
  // The four lanes into one (128 bits forward each), then the remaining 16-byte blocks.
  x1 = fold128(fold128(fold128(x1, x2, k3k4), x3, k3k4), x4, k3k4);
  for (; n >= 16; p += 16, n -= 16) x1 = fold128(x1, load(p), k3k4);

  // 128 -> 64 -> 32 bits, then Barrett reduction modulo P.
  const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
  x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
  x2 = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5k0, 0x00), x2);
  x2 = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10), mask32);
  x1 = _mm_xor_si128(x1, _mm_clmulepi64_si128(x2, poly, 0x00));
  return static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
}

bool detectAcceleration() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}
#endif

}  // namespace

bool crc32Accelerated() {
#if defined(__x86_64__)
  static const bool accelerated = detectAcceleration();
  return accelerated;
#else
  return false;
#endif
}

uint32_t crc32Portable(uint32_t crc, const void* data, size_t n) {
  return ~portableState(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32(uint32_t crc, const void* data, size_t n) {
  auto p = static_cast<const unsigned char*>(data);
  uint32_t state = ~crc;
#if defined(__x86_64__)
  if (n >= 64 && crc32Accelerated()) {
    const size_t body = n & ~static_cast<size_t>(15);
    state = foldState(state, p, body);
    p += body;
    n -= body;
  }
#endif
  return ~portableState(state, p, n);
}

}  // namespace zeroplus::checksum
