// SGD: argument checks, coefficients, the scalar reference and the ISA/thread dispatcher.
#include "optimizers/core/sgd_kernels.hpp"

#include <cerrno>
#include <cmath>

#include "optimizers/core/detail/kernel_table.hpp"
#include "optimizers/core/detail/parallel.hpp"

namespace zeroplus::optim {
namespace {

using detail::SgdChunkArgs;
using detail::SgdMode;

int validate(const SgdOptions& o, std::span<const SgdSpan> spans) {
  if (!(o.lr >= 0.0) || !(o.momentum >= 0.0) || !(o.weight_decay >= 0.0)) return -EINVAL;
  if (!(o.dampening == o.dampening)) return -EINVAL;  // NaN
  if (o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0)) return -EINVAL;
  for (const SgdSpan& s : spans) {
    if (s.numel < 0) return -EINVAL;
    if (s.numel == 0) continue;
    if (!s.param || !s.grad) return -EINVAL;
    if (o.momentum != 0.0 && !s.momentum_buffer) return -EINVAL;
  }
  return 0;
}

SgdMode modeOf(const SgdOptions& o, const SgdSpan& s) {
  if (o.momentum == 0.0) return SgdMode::kPlain;
  return s.init_momentum ? SgdMode::kMomentumInit : SgdMode::kMomentumUpdate;
}

SgdChunkArgs makeArgs(const SgdOptions& o, const SgdSpan& s, DType dt, int64_t off, int64_t len) {
  SgdChunkArgs a{};
  a.param = static_cast<char*>(s.param) + off * dtypeSize(dt);
  a.grad = static_cast<const char*>(s.grad) + off * dtypeSize(dt);
  a.momentum_buffer = s.momentum_buffer ? s.momentum_buffer + off : nullptr;
  a.n = len;
  a.sign = o.maximize ? -1.0f : 1.0f;
  a.weight_decay = static_cast<float>(o.weight_decay);
  a.momentum = static_cast<float>(o.momentum);
  a.one_minus_dampening = static_cast<float>(1.0 - o.dampening);  // torch: alpha=1 - dampening
  a.neg_lr = static_cast<float>(-o.lr);
  return a;
}

// The reference, element by element in _single_tensor_sgd's order.
void scalarSgd(const SgdChunkArgs& a, DType dt, SgdMode mode, bool nesterov, bool l2) {
  for (int64_t i = 0; i < a.n; ++i) {
    float g = loadElement(a.grad, dt, i) * a.sign;
    float p = loadElement(a.param, dt, i);
    // std::fma wherever torch calls add(x, alpha=a): ATen implements it as fmadd(x, a, self).
    if (l2) g = std::fma(p, a.weight_decay, g);
    if (mode != SgdMode::kPlain) {
      float b = g;
      if (mode == SgdMode::kMomentumUpdate) b = std::fma(g, a.one_minus_dampening, a.momentum_buffer[i] * a.momentum);
      a.momentum_buffer[i] = b;
      g = nesterov ? std::fma(b, a.momentum, g) : b;
    }
    p = std::fma(g, a.neg_lr, p);
    storeElement(a.param, dt, i, p);
  }
}

}  // namespace

int sgdStep(const SgdOptions& opt, DType dtype, std::span<const SgdSpan> spans, const KernelConfig& cfg) {
  if (const int rc = validate(opt, spans); rc != 0) return rc;
  const bool l2 = opt.weight_decay != 0.0;
  const Isa isa = resolveIsa(cfg.isa);
  int64_t total = 0;
  for (const SgdSpan& s : spans) total += s.numel;
  const auto numel = [&](int64_t i) { return spans[static_cast<size_t>(i)].numel; };
  detail::parallelRange(total, cfg.threads, cfg.grain, cfg.runner, [&](int64_t b, int64_t e) {
    detail::forEachPiece(static_cast<int64_t>(spans.size()), numel, b, e, [&](int64_t i, int64_t off, int64_t len) {
      const SgdSpan& s = spans[static_cast<size_t>(i)];
      const SgdMode mode = modeOf(opt, s);
      const SgdChunkArgs a = makeArgs(opt, s, dtype, off, len);
      detail::SgdChunkFn fn = nullptr;
#ifdef ZEROPLUS_OPTIM_X86
      if (isa == Isa::kAvx512) fn = detail::sgdKernelAvx512(dtype, mode, opt.nesterov, l2);
      else if (isa == Isa::kAvx2) fn = detail::sgdKernelAvx2(dtype, mode, opt.nesterov, l2);
#else
      (void)isa;
#endif
      if (fn) fn(a);
      else scalarSgd(a, dtype, mode, opt.nesterov, l2);
    });
  });
  return 0;
}

int sgdStepReference(const SgdOptions& opt, DType dtype, std::span<const SgdSpan> spans) {
  KernelConfig cfg;
  cfg.isa = Isa::kScalar;
  cfg.threads = 1;
  return sgdStep(opt, dtype, spans, cfg);
}

}  // namespace zeroplus::optim
