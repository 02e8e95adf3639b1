// AVX2 + FMA + F16C instances of the Adam/SGD loops. Compiled with per-file flags
// (optimizers/CMakeLists.txt); only reached after cpuSupports(Isa::kAvx2) said yes.
// This is also the path valgrind/callgrind can run (it does not decode AVX-512).
#include <immintrin.h>

#include "optimizers/core/detail/kernel_table.hpp"

namespace zeroplus::optim::detail {
namespace {  // internal linkage: see kernel_table.hpp

struct Vec {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static Reg sqrt(Reg a) { return _mm256_sqrt_ps(a); }
  static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }  // a*b+c, one rounding
  static Reg loadF(const float* p) { return _mm256_loadu_ps(p); }
  static void storeF(float* p, Reg r) { _mm256_storeu_ps(p, r); }

  template <DType DT>
  static Reg load(const void* base, int64_t i) {
    if constexpr (DT == DType::kFloat32) {
      return loadF(static_cast<const float*>(base) + i);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
      if constexpr (DT == DType::kBFloat16) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        return _mm256_cvtph_ps(h);
      }
    }
  }

  template <DType DT>
  static void store(void* base, int64_t i, Reg r) {
    if constexpr (DT == DType::kFloat32) {
      storeF(static_cast<float*>(base) + i, r);
    } else {
      __m128i h;
      if constexpr (DT == DType::kBFloat16) {
        // Round to nearest even, NaN kept quiet (see the AVX-512 variant).
        const __m256i u = _mm256_castps_si256(r);
        const __m256i hi = _mm256_srli_epi32(u, 16);
        const __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
        __m256i out = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(r, r, _CMP_UNORD_Q));
        out = _mm256_blendv_epi8(out, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
        // packus works per 128-bit lane: [o0..o3 o0..o3 | o4..o7 o4..o7]; keep qwords 0 and 2.
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08);
        h = _mm256_castsi256_si128(packed);
      } else {
        h = _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), h);
    }
  }
};

#include "optimizers/core/detail/optim_body.inl"

}  // namespace

AdamChunkFn adamKernelAvx2(DType dtype, bool amsgrad, bool l2) { return selectAdam(dtype, amsgrad, l2); }
SgdChunkFn sgdKernelAvx2(DType dtype, SgdMode mode, bool nesterov, bool l2) {
  return selectSgd(dtype, mode, nesterov, l2);
}

}  // namespace zeroplus::optim::detail
