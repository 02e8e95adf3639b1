// Internal: IEEE binary16 and bfloat16 <-> float conversions used by the reduction kernels.
//
// All functions are branch-free integer/float arithmetic so the compiler can vectorise the
// element loops that call them. float -> half rounds to nearest-even (the only rounding the
// core performs; see reduceInto), NaN stays NaN (quiet), overflow goes to +-inf.
// The binary16 versions follow Maratyszcza's FP16 library (MIT), which relies on the default
// rounding mode of float arithmetic; the core never changes the rounding mode.
#pragma once

#include <bit>
#include <cstdint>

namespace zeroplus::pg::detail {

inline float halfToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t twoW = w + w;
  // Normal numbers: shift the exponent/mantissa into place and rescale by 2^-112 so the
  // exponent bias (15 -> 127) is fixed up by one multiply; inf/NaN survive because the
  // scaled exponent saturates.
  const float normalized = std::bit_cast<float>((twoW >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // Subnormals: place the mantissa under a magic exponent and subtract the implicit one.
  const float denormalized = std::bit_cast<float>((twoW >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result =
      sign | (twoW < (1u << 27) ? std::bit_cast<uint32_t>(denormalized) : std::bit_cast<uint32_t>(normalized));
  return std::bit_cast<float>(result);
}

inline uint16_t floatToHalf(float f) {
  // Scaling up then down by powers of two makes the FPU do the round-to-nearest-even of the
  // mantissa for us (and flushes overflow to inf); the bias trick then extracts the bits.
  float base = ((f < 0 ? -f : f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = std::bit_cast<uint32_t>(f);
  const uint32_t shl1W = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1W & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = std::bit_cast<float>((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = std::bit_cast<uint32_t>(base);
  const uint32_t expBits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissaBits = bits & 0x00000FFFu;
  const uint32_t nonsign = expBits + mantissaBits;
  return static_cast<uint16_t>((sign >> 16) | (shl1W > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bf16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

inline uint16_t floatToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  // Round to nearest-even on the 16 dropped bits; a NaN must not round into inf, so it is
  // truncated and forced quiet instead.
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool isNan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(isNan ? ((u >> 16) | 0x0040u) : rounded);
}

}  // namespace zeroplus::pg::detail
