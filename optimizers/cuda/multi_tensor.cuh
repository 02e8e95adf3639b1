// Shared pieces of the multi-tensor CUDA kernels (torch-free): element conversion, the chunk
// table passed by value, and the batching loop that fills it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cerrno>
#include <cstdint>

#include "optimizers/cuda/fused_optim_cuda.h"

namespace zeroplus::optim::cuda {

template <typename T>
__device__ __forceinline__ float toFloat(T x);
template <>
__device__ __forceinline__ float toFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ float toFloat<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float toFloat<__half>(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T fromFloat(float x);
template <>
__device__ __forceinline__ float fromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half fromFloat<__half>(float x) { return __float2half_rn(x); }

// Four consecutive elements in one memory transaction (16 bytes of float, 8 of a 16-bit type):
// a memory-bound kernel keeps four times the bytes in flight per thread, which a chunk of
// 65536 elements per block needs to approach the GPU's bandwidth. Arithmetic stays per element,
// so results are bitwise those of the scalar loop.
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T x[4];
};

__device__ __forceinline__ bool alignedTo(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

template <typename T>
__device__ __forceinline__ bool packable(const T* p) {
  return alignedTo(p, 4 * sizeof(T));
}

template <typename T>
__device__ __forceinline__ void load4(const T* __restrict__ p, float out[4]) {
  const Pack4<T> v = *reinterpret_cast<const Pack4<T>*>(p);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = toFloat(v.x[k]);
}

template <typename T>
__device__ __forceinline__ void store4(T* __restrict__ p, const float in[4]) {
  Pack4<T> v;
#pragma unroll
  for (int k = 0; k < 4; ++k) v.x[k] = fromFloat<T>(in[k]);
  *reinterpret_cast<Pack4<T>*>(p) = v;
}

// Which (tensor, chunk) each block of one launch handles. Kernel arguments are limited to 4 KiB
// on older toolkits; the per-kernel argument structs stay under that.
struct BlockTable {
  unsigned char tensor[ZP_CUDA_MAX_BLOCKS];
  int chunk[ZP_CUDA_MAX_BLOCKS];
};

// Walks `count` tensor descriptors (anything with a `numel` field), packing them into `args`
// (add(args, slot, i) copies tensor i into slot) and calling launch(args, table, blocks) whenever
// the block table or the tensor slots fill up. A tensor whose chunks span two launches is
// re-added in slot 0 of the next one. Returns 0 or the first failing launch's code.
template <typename Tensor, typename Args, typename Add, typename Launch>
int forEachLaunch(const Tensor* tensors, int64_t count, Args& args, Add add, Launch launch) {
  BlockTable table{};
  int slots = 0, blocks = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = tensors[i].numel;
    if (n == 0) continue;
    const int64_t chunks = (n + ZP_CUDA_CHUNK_ELEMS - 1) / ZP_CUDA_CHUNK_ELEMS;
    int slot = slots++;
    add(args, slot, i);
    for (int64_t c = 0; c < chunks; ++c) {
      table.tensor[blocks] = static_cast<unsigned char>(slot);
      table.chunk[blocks] = static_cast<int>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      if (blocks == ZP_CUDA_MAX_BLOCKS || (last_chunk && slots == ZP_CUDA_MAX_TENSORS)) {
        if (const int rc = launch(args, table, blocks); rc != 0) return rc;
        blocks = 0;
        slots = 0;
        if (!last_chunk) {
          slot = slots++;
          add(args, slot, i);
        }
      }
    }
  }
  return blocks > 0 ? launch(args, table, blocks) : 0;
}

int recordLaunchError(cudaError_t err);

}  // namespace zeroplus::optim::cuda
