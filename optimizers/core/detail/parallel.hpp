// Internal: split a multi-tensor step into contiguous element ranges and run them.
// Spans are laid end to end in a virtual index space; each worker gets one range, cut at
// multiples of 64 elements so two threads never write the same cache line of fp32 state
// (16-bit params share a line only if a tensor is not 128-byte aligned, which is benign
// for correctness because each element is written by exactly one thread).
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "optimizers/core/adam_kernels.hpp"  // ParallelRunner

namespace zeroplus::optim::detail {

// fn(span_index, offset_in_span, length) for every piece of [begin, end).
template <class Numel, class Fn>
void forEachPiece(int64_t count, Numel numel, int64_t begin, int64_t end, Fn&& fn) {
  int64_t base = 0;
  for (int64_t i = 0; i < count && base < end; ++i) {
    const int64_t n = numel(i);
    const int64_t lo = std::max(begin, base), hi = std::min(end, base + n);
    if (lo < hi) fn(i, lo - base, hi - lo);
    base += n;
  }
}

// Runs fn(begin, end) over [0, total) in at most `threads` pieces of >= `grain` elements: on
// `runner` when given (in units of 64 elements, so pieces stay cache-line aligned), else on
// std::threads with the caller as one of them. One piece runs inline either way.
template <class Fn>
void parallelRange(int64_t total, int threads, int64_t grain, const ParallelRunner& runner, Fn&& fn) {
  constexpr int64_t kAlign = 64;
  int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, total / std::max<int64_t>(grain, 1)));
  if (workers <= 1) {
    fn(int64_t{0}, total);
    return;
  }
  const int64_t blocks = (total + kAlign - 1) / kAlign;
  const int64_t per_blocks = (blocks + workers - 1) / workers;
  if (runner) {
    // A grain of per_blocks caps the pool at `workers` pieces whatever its size.
    runner(blocks, per_blocks, [&fn, total](int64_t b, int64_t e) {
      const int64_t lo = std::min(total, b * kAlign), hi = std::min(total, e * kAlign);
      if (lo < hi) fn(lo, hi);
    });
    return;
  }
  const int64_t per = per_blocks * kAlign;
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(workers - 1));
  for (int64_t w = 1; w < workers; ++w) {
    const int64_t b = std::min(total, w * per), e = std::min(total, (w + 1) * per);
    if (b < e) pool.emplace_back([&fn, b, e] { fn(b, e); });
  }
  fn(int64_t{0}, std::min(total, per));
  for (auto& t : pool) t.join();
}

}  // namespace zeroplus::optim::detail
