// AVX-512 (F, BW, VL) instances of the Adam/SGD loops. Compiled with per-file flags
// (optimizers/CMakeLists.txt); only reached after cpuSupports(Isa::kAvx512) said yes.
#include <immintrin.h>

#include "optimizers/core/detail/kernel_table.hpp"

namespace zeroplus::optim::detail {
namespace {  // internal linkage: see kernel_table.hpp

struct Vec {
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static Reg sqrt(Reg a) { return _mm512_sqrt_ps(a); }
  static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }  // a*b+c, one rounding
  static Reg loadF(const float* p) { return _mm512_loadu_ps(p); }
  static void storeF(float* p, Reg r) { _mm512_storeu_ps(p, r); }

  template <DType DT>
  static Reg load(const void* base, int64_t i) {
    if constexpr (DT == DType::kFloat32) {
      return loadF(static_cast<const float*>(base) + i);
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
      if constexpr (DT == DType::kBFloat16) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        return _mm512_cvtph_ps(h);
      }
    }
  }

  template <DType DT>
  static void store(void* base, int64_t i, Reg r) {
    if constexpr (DT == DType::kFloat32) {
      storeF(static_cast<float*>(base) + i, r);
    } else {
      __m256i h;
      if constexpr (DT == DType::kBFloat16) {
        // Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate; NaN
        // inputs keep their top bits with the quiet bit forced (as c10::BFloat16 does).
        const __m512i u = _mm512_castps_si512(r);
        const __m512i hi = _mm512_srli_epi32(u, 16);
        const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
        __m512i out = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q);
        out = _mm512_mask_mov_epi32(out, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
        h = _mm512_cvtepi32_epi16(out);
      } else {
        h = _mm512_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i), h);
    }
  }
};

#include "optimizers/core/detail/optim_body.inl"

}  // namespace

AdamChunkFn adamKernelAvx512(DType dtype, bool amsgrad, bool l2) { return selectAdam(dtype, amsgrad, l2); }
SgdChunkFn sgdKernelAvx512(DType dtype, SgdMode mode, bool nesterov, bool l2) {
  return selectSgd(dtype, mode, nesterov, l2);
}

}  // namespace zeroplus::optim::detail
