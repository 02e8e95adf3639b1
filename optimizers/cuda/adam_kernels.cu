// Fused multi-tensor Adam/AdamW for CUDA (torch-free). See fused_optim_cuda.h for the contract.
// Every arithmetic step is written with an explicitly rounded intrinsic (__fmul_rn, __fadd_rn,
// __fdiv_rn) or fmaf where torch's ATen kernels fuse, so nvcc's default FMA contraction cannot
// make results drift from the CPU reference (optimizers/core/adam_kernels.cpp, scalarChunk).
#include <cmath>
#include <cstring>

#include "optimizers/cuda/multi_tensor.cuh"

namespace zeroplus::optim::cuda {
namespace {

constexpr int kThreads = 512;

struct AdamTensors {
  void* param[ZP_CUDA_MAX_TENSORS];
  const void* grad[ZP_CUDA_MAX_TENSORS];
  float* exp_avg[ZP_CUDA_MAX_TENSORS];
  float* exp_avg_sq[ZP_CUDA_MAX_TENSORS];
  float* max_exp_avg_sq[ZP_CUDA_MAX_TENSORS];
  int64_t numel[ZP_CUDA_MAX_TENSORS];
  float neg_step_size[ZP_CUDA_MAX_TENSORS];  // -(lr / (1 - beta1^step))
  float bc2_sqrt[ZP_CUDA_MAX_TENSORS];       // sqrt(1 - beta2^step)
};

struct AdamScalars {
  float sign, weight_decay, decay, w1, beta2, one_minus_beta2, eps;
  int l2, lerp_high, amsgrad;
};

static_assert(sizeof(AdamTensors) + sizeof(BlockTable) + sizeof(AdamScalars) <= 4096,
              "kernel arguments must fit the 4 KiB limit");

// One element's update; every kernel path calls this, so the packed and the scalar loop agree
// bit for bit. v is updated in place; with amsgrad vmax too, and the update uses max(vmax, v).
__device__ __forceinline__ float adamElement(float pi, float graw, float& mi, float& vi, float& vmaxi,
                                             const AdamScalars& s, float neg_step_size, float bc2_sqrt) {
  float gi = __fmul_rn(graw, s.sign);
  if (s.l2) gi = fmaf(pi, s.weight_decay, gi);       // grad.add(param, alpha=wd)
  pi = __fmul_rn(pi, s.decay);                       // AdamW: param.mul_(1 - lr * wd)
  const float d = __fsub_rn(gi, mi);                 // torch's two-sided lerp
  mi = s.lerp_high ? fmaf(__fsub_rn(s.w1, 1.0f), d, gi) : fmaf(s.w1, d, mi);
  vi = fmaf(__fmul_rn(s.one_minus_beta2, gi), gi, __fmul_rn(vi, s.beta2));
  float vu = vi;
  if (s.amsgrad) {
    vmaxi = fmaxf(vmaxi, vi);
    vu = vmaxi;
  }
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vu), bc2_sqrt), s.eps);
  return __fadd_rn(pi, __fdiv_rn(__fmul_rn(neg_step_size, mi), denom));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) adamKernel(AdamTensors t, BlockTable table, AdamScalars s) {
  const int slot = table.tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(table.chunk[blockIdx.x]) * ZP_CUDA_CHUNK_ELEMS;
  const int64_t end = min(begin + ZP_CUDA_CHUNK_ELEMS, t.numel[slot]);
  T* __restrict__ p = static_cast<T*>(t.param[slot]);
  const T* __restrict__ g = static_cast<const T*>(t.grad[slot]);
  float* __restrict__ m = t.exp_avg[slot];
  float* __restrict__ v = t.exp_avg_sq[slot];
  float* __restrict__ vmax = t.max_exp_avg_sq[slot];
  const float neg_step_size = t.neg_step_size[slot];
  const float bc2_sqrt = t.bc2_sqrt[slot];
  // Packed loop over the chunk's multiple of four when every array allows 4-element loads
  // there (torch's allocations do; views at odd offsets take the scalar loop), then the rest.
  int64_t packed_end = begin;
  if (packable(p + begin) && packable(g + begin) && packable(m + begin) && packable(v + begin) &&
      (!s.amsgrad || packable(vmax + begin))) {
    packed_end = begin + ((end - begin) & ~static_cast<int64_t>(3));
    for (int64_t i = begin + 4 * static_cast<int64_t>(threadIdx.x); i < packed_end; i += 4 * kThreads) {
      float pv[4], gv[4], mv[4], vv[4], xv[4] = {0.f, 0.f, 0.f, 0.f};
      load4(p + i, pv);
      load4(g + i, gv);
      load4(m + i, mv);
      load4(v + i, vv);
      if (s.amsgrad) load4(vmax + i, xv);
#pragma unroll
      for (int k = 0; k < 4; ++k) pv[k] = adamElement(pv[k], gv[k], mv[k], vv[k], xv[k], s, neg_step_size, bc2_sqrt);
      store4(m + i, mv);
      store4(v + i, vv);
      if (s.amsgrad) store4(vmax + i, xv);
      store4(p + i, pv);
    }
  }
  for (int64_t i = packed_end + threadIdx.x; i < end; i += kThreads) {
    float mi = m[i], vi = v[i], xi = s.amsgrad ? vmax[i] : 0.f;
    const float pi = adamElement(toFloat(p[i]), toFloat(g[i]), mi, vi, xi, s, neg_step_size, bc2_sqrt);
    m[i] = mi;
    v[i] = vi;
    if (s.amsgrad) vmax[i] = xi;
    p[i] = fromFloat<T>(pi);
  }
}

bool validOptions(const zp_cuda_adam_options& o) {
  if (!(o.lr >= 0.0) || !(o.eps >= 0.0) || !(o.weight_decay >= 0.0)) return false;
  return o.beta1 >= 0.0 && o.beta1 < 1.0 && o.beta2 >= 0.0 && o.beta2 < 1.0;
}

template <typename T>
int launchAll(const zp_cuda_adam_options& o, const zp_cuda_adam_tensor* tensors, int64_t count, cudaStream_t stream) {
  const bool l2 = o.weight_decay != 0.0 && !o.decoupled_weight_decay;
  const bool decoupled = o.weight_decay != 0.0 && o.decoupled_weight_decay;
  AdamScalars s{};
  s.sign = o.maximize ? -1.0f : 1.0f;
  s.weight_decay = l2 ? static_cast<float>(o.weight_decay) : 0.0f;
  s.decay = decoupled ? static_cast<float>(1.0 - o.lr * o.weight_decay) : 1.0f;
  s.w1 = static_cast<float>(1.0 - o.beta1);
  s.lerp_high = !(std::fabs(1.0 - o.beta1) < 0.5);
  s.beta2 = static_cast<float>(o.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  s.eps = static_cast<float>(o.eps);
  s.l2 = l2;
  s.amsgrad = o.amsgrad != 0;
  AdamTensors args{};
  auto add = [&](AdamTensors& a, int slot, int64_t i) {
    const zp_cuda_adam_tensor& x = tensors[i];
    const double step = static_cast<double>(x.step);
    a.param[slot] = x.param;
    a.grad[slot] = x.grad;
    a.exp_avg[slot] = x.exp_avg;
    a.exp_avg_sq[slot] = x.exp_avg_sq;
    a.max_exp_avg_sq[slot] = x.max_exp_avg_sq;
    a.numel[slot] = x.numel;
    a.neg_step_size[slot] = static_cast<float>(-(o.lr / (1.0 - std::pow(o.beta1, step))));
    a.bc2_sqrt[slot] = static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, step)));
  };
  auto launch = [&](const AdamTensors& a, const BlockTable& table, int blocks) {
    adamKernel<T><<<blocks, kThreads, 0, stream>>>(a, table, s);
    return recordLaunchError(cudaGetLastError());
  };
  return forEachLaunch(tensors, count, args, add, launch);
}

}  // namespace
}  // namespace zeroplus::optim::cuda

extern "C" int zp_cuda_adam_step(const zp_cuda_adam_options* opt, zp_cuda_dtype dtype,
                                 const zp_cuda_adam_tensor* tensors, int64_t count, void* stream) {
  using namespace zeroplus::optim::cuda;
  if (opt == nullptr || count < 0 || (count > 0 && tensors == nullptr) || !validOptions(*opt)) return -EINVAL;
  for (int64_t i = 0; i < count; ++i) {
    const zp_cuda_adam_tensor& t = tensors[i];
    if (t.numel < 0 || t.step < 1) return -EINVAL;
    if (t.numel > 0 && (!t.param || !t.grad || !t.exp_avg || !t.exp_avg_sq || (opt->amsgrad && !t.max_exp_avg_sq)))
      return -EINVAL;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case ZP_CUDA_F32: return launchAll<float>(*opt, tensors, count, s);
    case ZP_CUDA_BF16: return launchAll<__nv_bfloat16>(*opt, tensors, count, s);
    case ZP_CUDA_F16: return launchAll<__half>(*opt, tensors, count, s);
  }
  return -EINVAL;
}
