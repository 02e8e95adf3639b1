// Element types of parameters and gradients, and exact scalar conversions for the 16-bit ones.
//
// Optimizer state (exp_avg, exp_avg_sq, momentum buffers) is always fp32; parameters and their
// gradients share one of these storage types and are widened to fp32 for the math. Narrowing
// rounds to nearest even and keeps NaN a (quiet) NaN, the same as c10::BFloat16 / c10::Half,
// so a step on 16-bit parameters stores what torch would store for the same fp32 result.
#pragma once

#include <cstdint>
#include <cstring>

namespace zeroplus::optim {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline const char* dtypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "unknown";
}

inline int dtypeSize(DType t) { return t == DType::kFloat32 ? 4 : 2; }

namespace detail {
inline uint32_t floatBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bitsFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
}  // namespace detail

inline float bf16ToFloat(uint16_t h) { return detail::bitsFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t floatToBf16(float f) {
  const uint32_t u = detail::floatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// IEEE binary16 conversions without F16C (the scalar reference must run everywhere). These are
// the branch-light formulations used by c10/util/Half.h (from the FP16 library): they rely on
// fp32 arithmetic doing the rounding, so they need IEEE semantics (no -ffast-math, no FTZ).
inline float halfToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = detail::bitsFloat((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = detail::bitsFloat((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result =
      sign | (two_w < (1u << 27) ? detail::floatBits(denormalized) : detail::floatBits(normalized));
  return detail::bitsFloat(result);
}

inline uint16_t floatToHalf(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = detail::floatBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = detail::bitsFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = detail::floatBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// Generic element access used by the scalar reference and the tests.
inline float loadElement(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16: return halfToFloat(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

inline void storeElement(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kFloat32: static_cast<float*>(base)[i] = v; break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = floatToBf16(v); break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = floatToHalf(v); break;
  }
}

}  // namespace zeroplus::optim
