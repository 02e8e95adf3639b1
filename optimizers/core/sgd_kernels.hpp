// Fused SGD step (momentum, dampening, nesterov, weight decay, maximize) over many tensors
// (torch-free). Same op order as torch.optim.sgd._single_tensor_sgd:
//   g = maximize ? -grad : grad
//   weight_decay: g = g + wd * p
//   momentum != 0:
//     first step (span.init_momentum): buf = g           (a copy, not dampened, as torch does)
//     later:                           buf = buf * momentum + (1 - dampening) * g
//     g = nesterov ? g + momentum * buf : buf
//   p = p - lr * g
// Types, ownership, threading and errors as in adam_kernels.hpp: params/grads fp32, bf16 or
// fp16, momentum buffers fp32; -EINVAL for bad pointers or options (nesterov requires
// momentum > 0 and dampening == 0, like torch's constructor).
#pragma once

#include <cstdint>
#include <span>

#include "optimizers/core/adam_kernels.hpp"  // KernelConfig, DType, Isa

namespace zeroplus::optim {

struct SgdOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

struct SgdSpan {
  void* param = nullptr;
  const void* grad = nullptr;
  float* momentum_buffer = nullptr;  // required iff momentum != 0
  int64_t numel = 0;
  bool init_momentum = false;  // true on the step that creates the buffer (torch: buf is None)
};

int sgdStep(const SgdOptions& opt, DType dtype, std::span<const SgdSpan> spans,
            const KernelConfig& cfg = {});

int sgdStepReference(const SgdOptions& opt, DType dtype, std::span<const SgdSpan> spans);

}  // namespace zeroplus::optim
