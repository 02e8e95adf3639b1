// Shared helpers for the optimizer kernel tests: typed buffers, deterministic data and an
// ulp-aware comparison (SIMD paths may differ from the scalar reference by a few ulp because
// they multiply by 1/sqrt(bc2) and may contract mul+add into FMA).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "optimizers/core/cpu_isa.hpp"
#include "optimizers/core/dtype.hpp"

namespace zeroplus::optim::test {

// Storage for one tensor of a given DType (bytes), with float accessors.
struct Typed {
  DType dt = DType::kFloat32;
  std::vector<uint32_t> raw;  // 4-byte units so fp32 is aligned; 16-bit types use half of it
  Typed() = default;
  Typed(DType t, int64_t n) : dt(t), raw(static_cast<size_t>(n) + 1, 0) {}
  void* data() { return raw.data(); }
  float get(int64_t i) const { return loadElement(raw.data(), dt, i); }
  void set(int64_t i, float v) { storeElement(raw.data(), dt, i, v); }
};

inline std::vector<float> randomFloats(int64_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

inline Typed makeTyped(DType dt, const std::vector<float>& v) {
  Typed t(dt, static_cast<int64_t>(v.size()));
  for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), v[i]);
  return t;
}

// Relative precision of one unit in the last place of a type.
inline float ulpOf(DType dt) {
  switch (dt) {
    case DType::kFloat32: return 0x1.0p-23f;
    case DType::kBFloat16: return 0x1.0p-7f;
    case DType::kFloat16: return 0x1.0p-10f;
  }
  return 0.0f;
}

inline ::testing::AssertionResult closeUlps(float got, float want, float ulp, float ulps, float abs_floor) {
  const float tol = ulps * ulp * std::max(std::fabs(got), std::fabs(want)) + abs_floor;
  if (std::fabs(got - want) <= tol || (std::isnan(got) && std::isnan(want))) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << got << " want " << want << " (tol " << tol << ")";
}

inline std::vector<Isa> simdIsas() { return {Isa::kAvx2, Isa::kAvx512}; }

#define ZEROPLUS_SKIP_IF_UNSUPPORTED(isa)                                       \
  do {                                                                          \
    if (!::zeroplus::optim::cpuSupports(isa))                                   \
      GTEST_SKIP() << "CPU lacks " << ::zeroplus::optim::isaName(isa);          \
  } while (0)

}  // namespace zeroplus::optim::test
