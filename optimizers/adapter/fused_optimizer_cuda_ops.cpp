// CUDA tensors to zp_cuda_* descriptors: check everything, bump the host step counters, then
// enqueue the multi-tensor kernels on the current stream. Compiled only with ZEROPLUS_WITH_CUDA.
#ifdef ZEROPLUS_WITH_CUDA

#include "optimizers/adapter/fused_optimizer_cuda_ops.hpp"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "optimizers/cuda/fused_optim_cuda.h"

namespace zeroplus::optim::adapter {
namespace {

zp_cuda_dtype cudaDType(const char* op, size_t i, const at::Tensor& p) {
  switch (p.scalar_type()) {
    case at::kFloat: return ZP_CUDA_F32;
    case at::kBFloat16: return ZP_CUDA_BF16;
    case at::kHalf: return ZP_CUDA_F16;
    default:
      TORCH_CHECK(false, op, ": params[", i, "] is ", c10::toString(p.scalar_type()),
                  ", expected float32/bfloat16/float16");
  }
  return ZP_CUDA_F32;
}

void checkOnDevice(const char* op, const char* arg, size_t i, const at::Tensor& t, const c10::Device& device,
                   at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK(t.defined() && t.layout() == at::kStrided, op, ": ", arg, "[", i, "] must be a dense tensor");
  TORCH_CHECK(t.device() == device, op, ": ", arg, "[", i, "] is on ", t.device(), ", expected ", device);
  TORCH_CHECK(t.is_contiguous(), op, ": ", arg, "[", i, "] is not contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", arg, "[", i, "] is ", c10::toString(t.scalar_type()), ", expected ",
              c10::toString(dtype));
  TORCH_CHECK(t.numel() == numel, op, ": ", arg, "[", i, "] has ", t.numel(), " elements, expected ", numel);
}

void raiseOnError(const char* op, int rc) {
  TORCH_CHECK(rc != -EINVAL, op, ": kernel rejected the arguments (", std::strerror(-rc), ")");
  TORCH_CHECK(rc == 0, op, ": CUDA launch failed: ", zp_cuda_last_error());
}

}  // namespace

void adamStepCuda(const char* op, bool decoupled, const std::vector<at::Tensor>& params,
                  const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                  const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& max_exp_avg_sqs,
                  const std::vector<at::Tensor>& state_steps, const AdamArgs& a) {
  const size_t n = params.size();
  checkAdamListLengths(op, n, grads.size(), exp_avgs.size(), exp_avg_sqs.size(), max_exp_avg_sqs.size(),
                       state_steps.size(), a.amsgrad);
  checkAdamArgs(op, a);  // before the step counters move
  if (n == 0) return;
  const c10::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), op, ": params[0] is on ", device, ", expected a CUDA device");
  const zp_cuda_dtype dtype = cudaDType(op, 0, params[0]);
  std::vector<zp_cuda_adam_tensor> desc(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const int64_t numel = p.numel();
    checkOnDevice(op, "params", i, p, device, params[0].scalar_type(), numel);
    checkOnDevice(op, "grads", i, grads[i], device, p.scalar_type(), numel);
    checkOnDevice(op, "exp_avgs", i, exp_avgs[i], device, at::kFloat, numel);
    checkOnDevice(op, "exp_avg_sqs", i, exp_avg_sqs[i], device, at::kFloat, numel);
    if (a.amsgrad) checkOnDevice(op, "max_exp_avg_sqs", i, max_exp_avg_sqs[i], device, at::kFloat, numel);
    const at::Tensor& s = state_steps[i];
    TORCH_CHECK(s.defined() && s.device().is_cpu() && s.numel() == 1 &&
                    (s.scalar_type() == at::kFloat || s.scalar_type() == at::kDouble),
                op, ": state_steps[", i, "] must be a one-element float32/float64 CPU tensor");
    zp_cuda_adam_tensor& d = desc[i];
    d.param = p.data_ptr();
    d.grad = grads[i].data_ptr();
    d.exp_avg = exp_avgs[i].data_ptr<float>();
    d.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    d.max_exp_avg_sq = a.amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr;
    d.numel = numel;
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& s = state_steps[i];
    desc[i].step = s.scalar_type() == at::kDouble ? static_cast<int64_t>(++*s.data_ptr<double>())
                                                  : static_cast<int64_t>(++*s.data_ptr<float>());
  }
  zp_cuda_adam_options o{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, decoupled ? 1 : 0, a.amsgrad ? 1 : 0,
                         a.maximize ? 1 : 0};
  const c10::cuda::CUDAGuard guard(device);
  raiseOnError(op, zp_cuda_adam_step(&o, dtype, desc.data(), static_cast<int64_t>(n),
                                     c10::cuda::getCurrentCUDAStream(device.index()).stream()));
}

void sgdStepCuda(const char* op, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& momentum_buffers, const std::vector<bool>& init_momentum,
                 const SgdArgs& a) {
  const size_t n = params.size();
  const bool has_momentum = a.momentum != 0.0;
  checkSgdListLengths(op, n, grads.size(), momentum_buffers.size(), init_momentum.size(), has_momentum);
  checkSgdArgs(op, a);
  if (n == 0) return;
  const c10::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), op, ": params[0] is on ", device, ", expected a CUDA device");
  const zp_cuda_dtype dtype = cudaDType(op, 0, params[0]);
  std::vector<zp_cuda_sgd_tensor> desc(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    checkOnDevice(op, "params", i, p, device, params[0].scalar_type(), p.numel());
    checkOnDevice(op, "grads", i, grads[i], device, p.scalar_type(), p.numel());
    zp_cuda_sgd_tensor& d = desc[i];
    d.param = p.data_ptr();
    d.grad = grads[i].data_ptr();
    d.numel = p.numel();
    if (has_momentum) {
      checkOnDevice(op, "momentum_buffers", i, momentum_buffers[i], device, at::kFloat, p.numel());
      d.momentum_buffer = momentum_buffers[i].data_ptr<float>();
      d.init_momentum = init_momentum[i] ? 1 : 0;
    }
  }
  zp_cuda_sgd_options o{a.lr, a.momentum, a.dampening, a.weight_decay, a.nesterov ? 1 : 0, a.maximize ? 1 : 0};
  const c10::cuda::CUDAGuard guard(device);
  raiseOnError(op, zp_cuda_sgd_step(&o, dtype, desc.data(), static_cast<int64_t>(n),
                                    c10::cuda::getCurrentCUDAStream(device.index()).stream()));
}

}  // namespace zeroplus::optim::adapter

#endif  // ZEROPLUS_WITH_CUDA
