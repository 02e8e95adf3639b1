// Adam/AdamW: argument checks, per-tensor coefficients, the scalar reference and the
// ISA/thread dispatcher. The SIMD loops live in simd_kernels_{avx2,avx512}.cpp.
#include "optimizers/core/adam_kernels.hpp"

#include <cerrno>
#include <cmath>

#include "optimizers/core/detail/kernel_table.hpp"
#include "optimizers/core/detail/parallel.hpp"

namespace zeroplus::optim {
namespace {

using detail::AdamChunkArgs;

int validate(const AdamOptions& o, std::span<const AdamSpan> spans) {
  // Same ranges torch.optim.Adam's constructor accepts; NaN fails every comparison.
  if (!(o.lr >= 0.0) || !(o.eps >= 0.0) || !(o.weight_decay >= 0.0)) return -EINVAL;
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0) || !(o.beta2 >= 0.0 && o.beta2 < 1.0)) return -EINVAL;
  for (const AdamSpan& s : spans) {
    if (s.numel < 0 || s.step < 1) return -EINVAL;
    if (s.numel == 0) continue;
    if (!s.param || !s.grad || !s.exp_avg || !s.exp_avg_sq) return -EINVAL;
    if (o.amsgrad && !s.max_exp_avg_sq) return -EINVAL;
  }
  return 0;
}

// Coefficients exactly as _single_tensor_adam computes them: in double (Python floats), then
// rounded to fp32 once when they meet an fp32 tensor.
AdamChunkArgs makeArgs(const AdamOptions& o, const AdamSpan& s, DType dt, int64_t off, int64_t len) {
  const double step = static_cast<double>(s.step);
  const double bc1 = 1.0 - std::pow(o.beta1, step);
  const double bc2 = 1.0 - std::pow(o.beta2, step);
  const double bc2_sqrt = std::sqrt(bc2);
  const bool l2 = o.weight_decay != 0.0 && !o.decoupled_weight_decay;
  const bool decoupled = o.weight_decay != 0.0 && o.decoupled_weight_decay;
  AdamChunkArgs a{};
  a.param = static_cast<char*>(s.param) + off * dtypeSize(dt);
  a.grad = static_cast<const char*>(s.grad) + off * dtypeSize(dt);
  a.exp_avg = s.exp_avg + off;
  a.exp_avg_sq = s.exp_avg_sq + off;
  a.max_exp_avg_sq = s.max_exp_avg_sq ? s.max_exp_avg_sq + off : nullptr;
  a.n = len;
  a.sign = o.maximize ? -1.0f : 1.0f;
  a.weight_decay = l2 ? static_cast<float>(o.weight_decay) : 0.0f;
  a.decay = decoupled ? static_cast<float>(1.0 - o.lr * o.weight_decay) : 1.0f;
  a.w1 = static_cast<float>(1.0 - o.beta1);
  a.lerp_high = !(std::fabs(1.0 - o.beta1) < 0.5);
  a.beta2 = static_cast<float>(o.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  a.inv_bc2_sqrt = static_cast<float>(1.0 / bc2_sqrt);
  a.bc2_sqrt = static_cast<float>(bc2_sqrt);
  a.eps = static_cast<float>(o.eps);
  a.neg_step_size = static_cast<float>(-(o.lr / bc1));
  return a;
}

// The reference: one element at a time, each torch op rounded to fp32 in torch's order.
template <bool kL2, bool kAmsgrad>
void scalarChunk(const AdamChunkArgs& a, DType dt) {
  for (int64_t i = 0; i < a.n; ++i) {
    float g = loadElement(a.grad, dt, i) * a.sign;
    float p = loadElement(a.param, dt, i);
    // std::fma where ATen's vectorised kernels use one (add with alpha, lerp, addcmul).
    if (kL2) g = std::fma(p, a.weight_decay, g);
    p = p * a.decay;
    float m = a.exp_avg[i];
    const float d = g - m;
    m = a.lerp_high ? std::fma(a.w1 - 1.0f, d, g) : std::fma(a.w1, d, m);  // torch's two-sided lerp
    float v = a.exp_avg_sq[i] * a.beta2;
    v = std::fma(a.one_minus_beta2 * g, g, v);
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    if (kAmsgrad) {
      v = std::fmax(a.max_exp_avg_sq[i], v);
      a.max_exp_avg_sq[i] = v;
    }
    const float denom = std::sqrt(v) / a.bc2_sqrt + a.eps;
    p = p + a.neg_step_size * m / denom;
    storeElement(a.param, dt, i, p);
  }
}

void scalarAdam(const AdamChunkArgs& a, DType dt, bool l2, bool amsgrad) {
  if (l2) {
    amsgrad ? scalarChunk<true, true>(a, dt) : scalarChunk<true, false>(a, dt);
  } else {
    amsgrad ? scalarChunk<false, true>(a, dt) : scalarChunk<false, false>(a, dt);
  }
}

}  // namespace

int adamStep(const AdamOptions& opt, DType dtype, std::span<const AdamSpan> spans, const KernelConfig& cfg) {
  if (const int rc = validate(opt, spans); rc != 0) return rc;
  const bool l2 = opt.weight_decay != 0.0 && !opt.decoupled_weight_decay;
  detail::AdamChunkFn fn = nullptr;
  switch (resolveIsa(cfg.isa)) {
#ifdef ZEROPLUS_OPTIM_X86
    case Isa::kAvx512: fn = detail::adamKernelAvx512(dtype, opt.amsgrad, l2); break;
    case Isa::kAvx2: fn = detail::adamKernelAvx2(dtype, opt.amsgrad, l2); break;
#else
    case Isa::kAvx512:
    case Isa::kAvx2:
#endif
    case Isa::kScalar: break;
  }
  int64_t total = 0;
  for (const AdamSpan& s : spans) total += s.numel;
  const auto numel = [&](int64_t i) { return spans[static_cast<size_t>(i)].numel; };
  detail::parallelRange(total, cfg.threads, cfg.grain, cfg.runner, [&](int64_t b, int64_t e) {
    detail::forEachPiece(static_cast<int64_t>(spans.size()), numel, b, e, [&](int64_t i, int64_t off, int64_t len) {
      const AdamChunkArgs a = makeArgs(opt, spans[static_cast<size_t>(i)], dtype, off, len);
      if (fn) fn(a);
      else scalarAdam(a, dtype, l2, opt.amsgrad);
    });
  });
  return 0;
}

int adamStepReference(const AdamOptions& opt, DType dtype, std::span<const AdamSpan> spans) {
  KernelConfig cfg;
  cfg.isa = Isa::kScalar;
  cfg.threads = 1;
  return adamStep(opt, dtype, spans, cfg);
}

}  // namespace zeroplus::optim
