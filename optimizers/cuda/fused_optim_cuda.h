/* Fused multi-tensor Adam/AdamW and SGD kernels for CUDA: a torch-free, C-callable launcher API.
 *
 * Math: the same as the CPU kernels (optimizers/core/adam_kernels.hpp, sgd_kernels.hpp), which
 * follow torch.optim's single-tensor loops op by op: fp32 arithmetic, fused multiply-adds where
 * ATen uses them, per-tensor coefficients (bias corrections from that tensor's step) computed in
 * double on the host and rounded to fp32 once. Params and grads are fp32, bf16 or fp16 (one type
 * per call); optimizer state is always fp32; 16-bit params are updated in fp32 and rounded to
 * nearest even on store.
 *
 * Launch model (torch's MultiTensorApply): tensors are cut into chunks of
 * ZP_CUDA_CHUNK_ELEMS elements; one thread block per chunk; descriptors for up to
 * ZP_CUDA_MAX_TENSORS tensors and ZP_CUDA_MAX_BLOCKS chunks travel as kernel arguments, so a
 * call issues ceil(chunks / ZP_CUDA_MAX_BLOCKS) launches and no host-to-device copies.
 *
 * Contract: every pointer is device memory on the current device, the tensors' buffers do not
 * overlap, numel >= 0. `step` is the per-tensor count after the increment (1 on the first
 * update); the caller owns the counters (torch keeps them on the host). The call is
 * asynchronous on `stream` (a cudaStream_t; NULL = legacy default stream) and returns once the
 * kernels are enqueued. Thread-safe as long as callers use different buffers.
 *
 * Errors: 0, -EINVAL (bad arguments, nothing launched) or -EIO (a launch failed; the CUDA error
 * string is available from zp_cuda_last_error()).
 */
#ifndef ZEROPLUS_OPTIMIZERS_CUDA_FUSED_OPTIM_CUDA_H_
#define ZEROPLUS_OPTIMIZERS_CUDA_FUSED_OPTIM_CUDA_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZP_CUDA_CHUNK_ELEMS 65536
#define ZP_CUDA_MAX_TENSORS 24
#define ZP_CUDA_MAX_BLOCKS 320

typedef enum { ZP_CUDA_F32 = 0, ZP_CUDA_BF16 = 1, ZP_CUDA_F16 = 2 } zp_cuda_dtype;

typedef struct {
  double lr, beta1, beta2, eps, weight_decay;
  int decoupled_weight_decay; /* 1 = AdamW */
  int amsgrad;
  int maximize;
} zp_cuda_adam_options;

typedef struct {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq; /* required iff amsgrad */
  int64_t numel;
  int64_t step;
} zp_cuda_adam_tensor;

typedef struct {
  double lr, momentum, dampening, weight_decay;
  int nesterov;
  int maximize;
} zp_cuda_sgd_options;

typedef struct {
  void* param;
  const void* grad;
  float* momentum_buffer; /* required iff momentum != 0 */
  int64_t numel;
  int init_momentum;      /* 1: buffer is new this step, set it to the gradient (torch's clone) */
} zp_cuda_sgd_tensor;

int zp_cuda_adam_step(const zp_cuda_adam_options* opt, zp_cuda_dtype dtype, const zp_cuda_adam_tensor* tensors,
                      int64_t count, void* stream);

int zp_cuda_sgd_step(const zp_cuda_sgd_options* opt, zp_cuda_dtype dtype, const zp_cuda_sgd_tensor* tensors,
                     int64_t count, void* stream);

/* The last CUDA error string seen by a launcher on this thread ("" if none). */
const char* zp_cuda_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* ZEROPLUS_OPTIMIZERS_CUDA_FUSED_OPTIM_CUDA_H_ */
