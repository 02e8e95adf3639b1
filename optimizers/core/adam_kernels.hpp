// Fused Adam / AdamW step over many tensors in one call (torch-free).
//
// Math (identical op order to torch.optim.adam._single_tensor_adam, fp32 arithmetic with the
// scalar coefficients computed in double and rounded once, as torch does):
//   g   = maximize ? -grad : grad
//   Adam  with weight_decay: g = g + wd * p                       (L2 added to the gradient)
//   AdamW with weight_decay: p = p * (1 - lr * wd)                (decoupled, before the update)
//   m   = lerp(m, g, 1 - beta1)
//   v   = v * beta2 + (1 - beta2) * g * g
//   amsgrad: vmax = max(vmax, v), and vmax replaces v below
//   p   = p - (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// `step` is the count AFTER the increment (1 on the first update), per tensor, like torch's
// state["step"]. The SIMD paths multiply by 1/sqrt(bc2) where torch divides, so results agree
// with the scalar reference to a few ulp, not bit for bit.
//
// Types: params and grads are fp32, bf16 or fp16 (the same type within one call); exp_avg,
// exp_avg_sq and max_exp_avg_sq are always fp32. 16-bit params are widened, updated in fp32
// and rounded to nearest even on store (fp32 state, low-precision weights).
//
// Ownership and threading: the caller owns every buffer; spans must not overlap each other
// within a call. The call blocks until all spans are updated. With threads > 1 the element
// range is split into at most `threads` contiguous pieces, cut at multiples of 64 elements, and
// run on KernelConfig::runner when one is given (the torch adapter passes torch's intra-op
// OpenMP pool), otherwise on short-lived std::threads. The default is 1 thread.
//
// Errors: returns 0, or -EINVAL (nothing written) for a null pointer with numel > 0, numel < 0,
// step < 1, amsgrad without max_exp_avg_sq, or non-finite / out-of-range hyperparameters.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <utility>

#include "optimizers/core/cpu_isa.hpp"
#include "optimizers/core/dtype.hpp"

namespace zeroplus::optim {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = false;  // true = AdamW
  bool amsgrad = false;
  bool maximize = false;
};

// One tensor: contiguous `numel` elements of param/grad (of the call's DType) and fp32 state.
struct AdamSpan {
  void* param = nullptr;
  const void* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // required iff amsgrad
  int64_t numel = 0;
  int64_t step = 1;  // already incremented
};

// body(begin, end) for one piece of a range of work units.
using RangeBody = std::function<void(int64_t begin, int64_t end)>;

// A thread pool the kernels borrow instead of starting their own threads. Contract: calls
// body(b, e) for pieces that cover [0, count) exactly once, with pieces no smaller than
// `grain` units (the last one may be), possibly concurrently, and returns only after every
// piece returned; body never throws. Running on the caller's thread alone is a valid runner.
// Why it exists: a process with torch already has an OpenMP pool whose idle workers spin for a
// while after each parallel region; private threads started next to it share the cores with
// those spinning workers (measured: 0.73x of torch's fused Adam when interleaved with it, 1.05x
// with OMP_WAIT_POLICY=PASSIVE). Running the pieces on that same pool avoids the fight.
using ParallelRunner = std::function<void(int64_t count, int64_t grain, const RangeBody& body)>;

struct KernelConfig {
  // A constructor rather than member initialisers so KernelConfig{isa, threads, grain} stays
  // valid without naming the runner.
  KernelConfig(Isa isa_ = activeIsa(), int threads_ = 1, int64_t grain_ = 1 << 15, ParallelRunner runner_ = {})
      : isa(isa_), threads(threads_), grain(grain_), runner(std::move(runner_)) {}

  Isa isa;                // clamped to what the CPU supports
  int threads;            // <= 1: run on the calling thread
  int64_t grain;          // minimum elements per thread
  ParallelRunner runner;  // empty: std::threads
};

int adamStep(const AdamOptions& opt, DType dtype, std::span<const AdamSpan> spans,
             const KernelConfig& cfg = {});

// The scalar reference, element by element in torch's op order; the oracle for the SIMD tests.
int adamStepReference(const AdamOptions& opt, DType dtype, std::span<const AdamSpan> spans);

}  // namespace zeroplus::optim
