// Fused multi-tensor SGD (momentum, dampening, nesterov, weight decay, maximize) for CUDA,
// torch-free. Op order mirrors optimizers/core/sgd_kernels.cpp (scalarSgd), which mirrors
// torch.optim.sgd._single_tensor_sgd; fmaf exactly where ATen's add(x, alpha=a) fuses.
#include <cstring>

#include "optimizers/cuda/multi_tensor.cuh"

namespace zeroplus::optim::cuda {
namespace {

constexpr int kThreads = 512;

struct SgdTensors {
  void* param[ZP_CUDA_MAX_TENSORS];
  const void* grad[ZP_CUDA_MAX_TENSORS];
  float* momentum_buffer[ZP_CUDA_MAX_TENSORS];
  int64_t numel[ZP_CUDA_MAX_TENSORS];
  int init[ZP_CUDA_MAX_TENSORS];
};

struct SgdScalars {
  float sign, weight_decay, momentum, one_minus_dampening, neg_lr;
  int l2, has_momentum, nesterov;
};

static_assert(sizeof(SgdTensors) + sizeof(BlockTable) + sizeof(SgdScalars) <= 4096,
              "kernel arguments must fit the 4 KiB limit");

// One element's update (the packed and the scalar loop both call it: same bits).
__device__ __forceinline__ float sgdElement(float pi, float graw, float& b, bool init, const SgdScalars& s) {
  float gi = __fmul_rn(graw, s.sign);
  if (s.l2) gi = fmaf(pi, s.weight_decay, gi);
  if (s.has_momentum) {
    b = init ? gi : fmaf(gi, s.one_minus_dampening, __fmul_rn(b, s.momentum));  // first step: buf = clone(grad)
    gi = s.nesterov ? fmaf(b, s.momentum, gi) : b;
  }
  return fmaf(gi, s.neg_lr, pi);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sgdKernel(SgdTensors t, BlockTable table, SgdScalars s) {
  const int slot = table.tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(table.chunk[blockIdx.x]) * ZP_CUDA_CHUNK_ELEMS;
  const int64_t end = min(begin + ZP_CUDA_CHUNK_ELEMS, t.numel[slot]);
  T* __restrict__ p = static_cast<T*>(t.param[slot]);
  const T* __restrict__ g = static_cast<const T*>(t.grad[slot]);
  float* __restrict__ buf = t.momentum_buffer[slot];
  const bool init = t.init[slot] != 0;
  int64_t packed_end = begin;  // packed loop where every array allows 4-element loads (multi_tensor.cuh)
  if (packable(p + begin) && packable(g + begin) && (!s.has_momentum || packable(buf + begin))) {
    packed_end = begin + ((end - begin) & ~static_cast<int64_t>(3));
    for (int64_t i = begin + 4 * static_cast<int64_t>(threadIdx.x); i < packed_end; i += 4 * kThreads) {
      float pv[4], gv[4], bv[4] = {0.f, 0.f, 0.f, 0.f};
      load4(p + i, pv);
      load4(g + i, gv);
      if (s.has_momentum && !init) load4(buf + i, bv);
#pragma unroll
      for (int k = 0; k < 4; ++k) pv[k] = sgdElement(pv[k], gv[k], bv[k], init, s);
      if (s.has_momentum) store4(buf + i, bv);
      store4(p + i, pv);
    }
  }
  for (int64_t i = packed_end + threadIdx.x; i < end; i += kThreads) {
    float b = (s.has_momentum && !init) ? buf[i] : 0.f;
    const float pi = sgdElement(toFloat(p[i]), toFloat(g[i]), b, init, s);
    if (s.has_momentum) buf[i] = b;
    p[i] = fromFloat<T>(pi);
  }
}

template <typename T>
int launchAll(const zp_cuda_sgd_options& o, const zp_cuda_sgd_tensor* tensors, int64_t count, cudaStream_t stream) {
  SgdScalars s{};
  s.sign = o.maximize ? -1.0f : 1.0f;
  s.l2 = o.weight_decay != 0.0;
  s.weight_decay = static_cast<float>(o.weight_decay);
  s.has_momentum = o.momentum != 0.0;
  s.momentum = static_cast<float>(o.momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - o.dampening);
  s.neg_lr = static_cast<float>(-o.lr);
  s.nesterov = o.nesterov != 0;
  SgdTensors args{};
  auto add = [&](SgdTensors& a, int slot, int64_t i) {
    const zp_cuda_sgd_tensor& x = tensors[i];
    a.param[slot] = x.param;
    a.grad[slot] = x.grad;
    a.momentum_buffer[slot] = x.momentum_buffer;
    a.numel[slot] = x.numel;
    a.init[slot] = x.init_momentum;
  };
  auto launch = [&](const SgdTensors& a, const BlockTable& table, int blocks) {
    sgdKernel<T><<<blocks, kThreads, 0, stream>>>(a, table, s);
    return recordLaunchError(cudaGetLastError());
  };
  return forEachLaunch(tensors, count, args, add, launch);
}

}  // namespace

// One definition for both kernel files: the thread's last CUDA error, for zp_cuda_last_error().
namespace {
thread_local char g_last_error[256] = "";
}

int recordLaunchError(cudaError_t err) {
  if (err == cudaSuccess) return 0;
  std::strncpy(g_last_error, cudaGetErrorString(err), sizeof(g_last_error) - 1);
  return -EIO;
}

}  // namespace zeroplus::optim::cuda

extern "C" int zp_cuda_sgd_step(const zp_cuda_sgd_options* opt, zp_cuda_dtype dtype,
                                const zp_cuda_sgd_tensor* tensors, int64_t count, void* stream) {
  using namespace zeroplus::optim::cuda;
  if (opt == nullptr || count < 0 || (count > 0 && tensors == nullptr)) return -EINVAL;
  if (!(opt->lr >= 0.0) || !(opt->momentum >= 0.0) || !(opt->weight_decay >= 0.0)) return -EINVAL;
  if (opt->nesterov && (opt->momentum <= 0.0 || opt->dampening != 0.0)) return -EINVAL;
  for (int64_t i = 0; i < count; ++i) {
    const zp_cuda_sgd_tensor& t = tensors[i];
    if (t.numel < 0) return -EINVAL;
    if (t.numel > 0 && (!t.param || !t.grad || (opt->momentum != 0.0 && !t.momentum_buffer))) return -EINVAL;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case ZP_CUDA_F32: return launchAll<float>(*opt, tensors, count, s);
    case ZP_CUDA_BF16: return launchAll<__nv_bfloat16>(*opt, tensors, count, s);
    case ZP_CUDA_F16: return launchAll<__half>(*opt, tensors, count, s);
  }
  return -EINVAL;
}

extern "C" const char* zp_cuda_last_error(void) { return zeroplus::optim::cuda::g_last_error; }
