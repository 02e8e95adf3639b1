// Torch adapter for the CUDA fused optimizer kernels (optimizers/cuda/fused_optim_cuda.h).
// Compiled only when ZEROPLUS_WITH_CUDA is defined (CMake: ZEROPLUS_CUDA_ENABLED).
//
// Contract: the same argument lists and AdamArgs/SgdArgs as the CPU ops
// (fused_optimizer_ops.hpp); params, grads and state are contiguous tensors on ONE CUDA device
// (params[0]'s), state fp32; state_steps stay one-element CPU tensors (torch's default for
// non-capturable Adam) and are incremented on the host. Kernels are enqueued on the current
// CUDA stream of that device; the call returns without synchronising. All checks run before
// anything is launched or incremented. `threads` is ignored.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "optimizers/adapter/fused_optimizer_ops.hpp"

namespace zeroplus::optim::adapter {

void adamStepCuda(const char* op, bool decoupled, const std::vector<at::Tensor>& params,
                  const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                  const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& max_exp_avg_sqs,
                  const std::vector<at::Tensor>& state_steps, const AdamArgs& args);

void sgdStepCuda(const char* op, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& momentum_buffers, const std::vector<bool>& init_momentum,
                 const SgdArgs& args);

}  // namespace zeroplus::optim::adapter
