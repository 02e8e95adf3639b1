// Internal: the per-ISA inner loops and the arguments they take (one contiguous piece of one
// tensor, with every scalar coefficient already folded to fp32 by the dispatcher).
// Each ISA translation unit exports only these selector functions; everything else in those
// TUs has internal linkage so code compiled with -mavx512f can never be picked by the linker
// for a call made on a CPU without it (the classic inline-ODR hazard of per-file ISA flags).
#pragma once

#include <cstdint>

#include "optimizers/core/dtype.hpp"

namespace zeroplus::optim::detail {

struct AdamChunkArgs {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  int64_t n;
  float sign;          // -1 when maximize (exact negation), else 1
  float weight_decay;  // L2 coefficient (Adam only; the kernel variant decides whether it applies)
  float decay;         // AdamW: 1 - lr*wd, else 1 (multiplying by 1 is exact)
  float w1;            // lerp weight 1 - beta1
  bool lerp_high;      // torch's lerp switches formula at |weight| >= 0.5
  float beta2;
  float one_minus_beta2;
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float bc2_sqrt;      // sqrt(1 - beta2^step) (scalar reference divides, like torch)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

struct SgdChunkArgs {
  void* param;
  const void* grad;
  float* momentum_buffer;
  int64_t n;
  float sign;
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  float neg_lr;
};

// Momentum handling, fixed per kernel instance so the hot loop has no data-dependent branch.
enum class SgdMode : int { kPlain = 0, kMomentumInit = 1, kMomentumUpdate = 2 };

using AdamChunkFn = void (*)(const AdamChunkArgs&);
using SgdChunkFn = void (*)(const SgdChunkArgs&);

// nullptr when the ISA was not compiled into this build (non-x86 hosts).
AdamChunkFn adamKernelAvx2(DType dtype, bool amsgrad, bool l2);
AdamChunkFn adamKernelAvx512(DType dtype, bool amsgrad, bool l2);
SgdChunkFn sgdKernelAvx2(DType dtype, SgdMode mode, bool nesterov, bool l2);
SgdChunkFn sgdKernelAvx512(DType dtype, SgdMode mode, bool nesterov, bool l2);

}  // namespace zeroplus::optim::detail
