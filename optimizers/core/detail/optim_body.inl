// Internal: the vectorised Adam and SGD loops, written once against a `Vec` policy type.
// Included by each ISA translation unit INSIDE an anonymous namespace, after it defines
// `Vec` (register type, width, arithmetic, and typed loads/stores for fp32/bf16/fp16).
// Everything here therefore has internal linkage per ISA (see kernel_table.hpp).
//
// Op order and rounding follow torch's CPU for-loop path op by op: torch's vectorised ATen
// kernels use one fused multiply-add for lerp and for add(other, alpha=...) (and its compiler
// contracts addcmul's self + value*t1*t2 the same way), so we write fmadd exactly there and
// plain ops elsewhere (sqrt(v) / sqrt(bc2) stays a division, as in torch). This keeps fused
// results within a few ulp of torch.optim over many steps instead of drifting.
//
// Tails: the last n % kWidth elements are copied into zero-padded stack buffers, run through
// the same vector body, and copied back, so there is exactly one code path for the math.
// Zero padding is harmless (sqrt(0) = 0, denominators become eps).

template <class Body>
inline void runWithTail(int64_t n, Body&& body) {
  int64_t i = 0;
  for (; i + Vec::kWidth <= n; i += Vec::kWidth) body(i, false, int64_t{0});
  if (i < n) body(i, true, n - i);
}

// Copies `count` elements of `bytes` each from src+offset into a zeroed stack buffer.
inline void stage(void* dst, const void* src, int64_t offset, int64_t count, int bytes) {
  __builtin_memset(dst, 0, static_cast<size_t>(Vec::kWidth) * 4);
  __builtin_memcpy(dst, static_cast<const char*>(src) + offset * bytes, static_cast<size_t>(count * bytes));
}
inline void unstage(void* dst, const void* src, int64_t offset, int64_t count, int bytes) {
  __builtin_memcpy(static_cast<char*>(dst) + offset * bytes, src, static_cast<size_t>(count * bytes));
}

// Software prefetch distance of the Adam loop, in elements (512 bytes of fp32 state ahead). The
// loop streams 4-5 arrays at DRAM speed; with the hardware prefetchers alone a stand-alone copy of
// the AVX-512 fp32 loop on 16M elements took 40-42 ms per step at 2 threads on the CI VM, with
// this prefetch 37 ms (interleaved, median of 25; 1024 elements ahead gained nothing). Prefetches
// past the end of an array are harmless (they never fault).
constexpr int64_t kAdamPrefetch = 128;

inline void prefetchLine(const void* base, int64_t byte_offset) {
  __builtin_prefetch(static_cast<const char*>(base) + byte_offset, 0, 3);
}

template <DType DT, bool kAmsgrad, bool kL2>
void adamChunk(const AdamChunkArgs& a) {
  using R = typename Vec::Reg;
  const R sign = Vec::set1(a.sign), wd = Vec::set1(a.weight_decay), decay = Vec::set1(a.decay);
  const R w1 = Vec::set1(a.w1), w1c = Vec::set1(a.w1 - 1.0f), b2 = Vec::set1(a.beta2);
  const R omb2 = Vec::set1(a.one_minus_beta2), bc2 = Vec::set1(a.bc2_sqrt);
  const R eps = Vec::set1(a.eps), nstep = Vec::set1(a.neg_step_size);
  const bool lerp_high = a.lerp_high;

  auto one = [&](void* p, const void* g, float* m, float* v, float* vm, int64_t i) {
    R G = Vec::mul(Vec::template load<DT>(g, i), sign);
    R P = Vec::template load<DT>(p, i);
    if constexpr (kL2) G = Vec::fmadd(P, wd, G);  // grad.add(param, alpha=wd)
    P = Vec::mul(P, decay);
    R M = Vec::loadF(m + i);
    const R D = Vec::sub(G, M);
    // torch's lerp_vec: fmadd(weight, end - start, start), or fmadd(weight - 1, end - start, end).
    M = lerp_high ? Vec::fmadd(w1c, D, G) : Vec::fmadd(w1, D, M);
    R V = Vec::fmadd(Vec::mul(omb2, G), G, Vec::mul(Vec::loadF(v + i), b2));
    Vec::storeF(m + i, M);
    Vec::storeF(v + i, V);
    if constexpr (kAmsgrad) {
      V = Vec::max(Vec::loadF(vm + i), V);
      Vec::storeF(vm + i, V);
    }
    const R den = Vec::add(Vec::div(Vec::sqrt(V), bc2), eps);
    P = Vec::add(P, Vec::div(Vec::mul(nstep, M), den));
    Vec::template store<DT>(p, i, P);
  };

  constexpr int kB = DT == DType::kFloat32 ? 4 : 2;
  runWithTail(a.n, [&](int64_t i, bool tail, int64_t cnt) {
    if (!tail) {
      const int64_t ahead = i + kAdamPrefetch;
      prefetchLine(a.param, ahead * kB);
      prefetchLine(a.grad, ahead * kB);
      prefetchLine(a.exp_avg, ahead * 4);
      prefetchLine(a.exp_avg_sq, ahead * 4);
      if constexpr (kAmsgrad) prefetchLine(a.max_exp_avg_sq, ahead * 4);
      one(a.param, a.grad, a.exp_avg, a.exp_avg_sq, a.max_exp_avg_sq, i);
      return;
    }
    alignas(64) float pb[Vec::kWidth], gb[Vec::kWidth], mb[Vec::kWidth], vb[Vec::kWidth], vmb[Vec::kWidth];
    stage(pb, a.param, i, cnt, kB);
    stage(gb, a.grad, i, cnt, kB);
    stage(mb, a.exp_avg, i, cnt, 4);
    stage(vb, a.exp_avg_sq, i, cnt, 4);
    if constexpr (kAmsgrad) stage(vmb, a.max_exp_avg_sq, i, cnt, 4);
    one(pb, gb, mb, vb, vmb, 0);
    unstage(a.param, pb, i, cnt, kB);
    unstage(a.exp_avg, mb, i, cnt, 4);
    unstage(a.exp_avg_sq, vb, i, cnt, 4);
    if constexpr (kAmsgrad) unstage(a.max_exp_avg_sq, vmb, i, cnt, 4);
  });
}

template <DType DT, SgdMode kMode, bool kNesterov, bool kL2>
void sgdChunk(const SgdChunkArgs& a) {
  using R = typename Vec::Reg;
  const R sign = Vec::set1(a.sign), wd = Vec::set1(a.weight_decay), mom = Vec::set1(a.momentum);
  const R omd = Vec::set1(a.one_minus_dampening), nlr = Vec::set1(a.neg_lr);

  auto one = [&](void* p, const void* g, float* b, int64_t i) {
    R G = Vec::mul(Vec::template load<DT>(g, i), sign);
    R P = Vec::template load<DT>(p, i);
    // Every torch add(x, alpha=a) below is ATen's fmadd(x, a, self).
    if constexpr (kL2) G = Vec::fmadd(P, wd, G);
    if constexpr (kMode != SgdMode::kPlain) {
      R B = G;
      if constexpr (kMode == SgdMode::kMomentumUpdate)
        B = Vec::fmadd(G, omd, Vec::mul(Vec::loadF(b + i), mom));  // buf.mul_(m).add_(g, alpha=1-d)
      Vec::storeF(b + i, B);
      G = kNesterov ? Vec::fmadd(B, mom, G) : B;
    }
    P = Vec::fmadd(G, nlr, P);  // param.add_(g, alpha=-lr)
    Vec::template store<DT>(p, i, P);
  };

  constexpr int kB = DT == DType::kFloat32 ? 4 : 2;
  constexpr bool kHasBuf = kMode != SgdMode::kPlain;
  runWithTail(a.n, [&](int64_t i, bool tail, int64_t cnt) {
    if (!tail) {
      one(a.param, a.grad, a.momentum_buffer, i);
      return;
    }
    alignas(64) float pb[Vec::kWidth], gb[Vec::kWidth], bb[Vec::kWidth];
    stage(pb, a.param, i, cnt, kB);
    stage(gb, a.grad, i, cnt, kB);
    if constexpr (kHasBuf) stage(bb, a.momentum_buffer, i, cnt, 4);
    one(pb, gb, bb, 0);
    unstage(a.param, pb, i, cnt, kB);
    if constexpr (kHasBuf) unstage(a.momentum_buffer, bb, i, cnt, 4);
  });
}

// Runtime flags -> template instance. Small tables keep the dispatch out of the hot loop.
template <DType DT>
AdamChunkFn pickAdam(bool amsgrad, bool l2) {
  if (amsgrad) return l2 ? &adamChunk<DT, true, true> : &adamChunk<DT, true, false>;
  return l2 ? &adamChunk<DT, false, true> : &adamChunk<DT, false, false>;
}

inline AdamChunkFn selectAdam(DType dt, bool amsgrad, bool l2) {
  switch (dt) {
    case DType::kFloat32: return pickAdam<DType::kFloat32>(amsgrad, l2);
    case DType::kBFloat16: return pickAdam<DType::kBFloat16>(amsgrad, l2);
    case DType::kFloat16: return pickAdam<DType::kFloat16>(amsgrad, l2);
  }
  return nullptr;
}

template <DType DT, SgdMode M>
SgdChunkFn pickSgd2(bool nesterov, bool l2) {
  if (nesterov) return l2 ? &sgdChunk<DT, M, true, true> : &sgdChunk<DT, M, true, false>;
  return l2 ? &sgdChunk<DT, M, false, true> : &sgdChunk<DT, M, false, false>;
}

template <DType DT>
SgdChunkFn pickSgd(SgdMode mode, bool nesterov, bool l2) {
  switch (mode) {
    case SgdMode::kPlain: return pickSgd2<DT, SgdMode::kPlain>(false, l2);
    case SgdMode::kMomentumInit: return pickSgd2<DT, SgdMode::kMomentumInit>(nesterov, l2);
    case SgdMode::kMomentumUpdate: return pickSgd2<DT, SgdMode::kMomentumUpdate>(nesterov, l2);
  }
  return nullptr;
}

inline SgdChunkFn selectSgd(DType dt, SgdMode mode, bool nesterov, bool l2) {
  switch (dt) {
    case DType::kFloat32: return pickSgd<DType::kFloat32>(mode, nesterov, l2);
    case DType::kBFloat16: return pickSgd<DType::kBFloat16>(mode, nesterov, l2);
    case DType::kFloat16: return pickSgd<DType::kFloat16>(mode, nesterov, l2);
  }
  return nullptr;
}
