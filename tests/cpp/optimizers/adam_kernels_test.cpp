// Adam/AdamW kernels: every SIMD variant against the scalar reference (all option combinations,
// fp32/bf16/fp16 params, odd lengths and tails), the reference against a double-precision
// oracle over 50 steps, multi-span and multi-thread equivalence, and argument errors.
#include "optimizers/core/adam_kernels.hpp"

#include <cerrno>
#include <tuple>

#include "kernel_test_util.hpp"

namespace zeroplus::optim::test {
namespace {

const int64_t kLengths[] = {0, 1, 7, 8, 15, 16, 17, 31, 33, 100, 257, 1029};

AdamOptions optionsFor(int combo) {
  AdamOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.8;
  o.beta2 = 0.99;
  o.eps = 1e-6;
  o.amsgrad = combo & 1;
  o.maximize = (combo >> 1) & 1;
  const int wd_mode = combo >> 2;  // 0 none, 1 Adam L2, 2 AdamW decoupled
  o.weight_decay = wd_mode ? 0.05 : 0.0;
  o.decoupled_weight_decay = wd_mode == 2;
  return o;
}

std::string comboName(int combo) {
  const AdamOptions o = optionsFor(combo);
  std::string s = o.decoupled_weight_decay ? "adamw" : (o.weight_decay != 0 ? "adam_l2" : "adam");
  if (o.amsgrad) s += "_amsgrad";
  if (o.maximize) s += "_maximize";
  return s;
}

// One tensor's worth of Adam state for a given parameter dtype.
struct AdamBuffers {
  Typed param, grad;
  std::vector<float> m, v, vmax;
  AdamBuffers(DType dt, int64_t n, uint32_t seed)
      : param(makeTyped(dt, randomFloats(n, seed, -1.f, 1.f))),
        grad(dt, n),
        m(static_cast<size_t>(n), 0.f),
        v(static_cast<size_t>(n), 0.f),
        vmax(static_cast<size_t>(n), 0.f) {}
  AdamSpan span(int64_t n, int64_t step) {
    return AdamSpan{param.data(), grad.data(), m.data(), v.data(), vmax.data(), n, step};
  }
};

using SimdParam = std::tuple<Isa, DType, int>;

class AdamSimdTest : public ::testing::TestWithParam<SimdParam> {};

TEST_P(AdamSimdTest, MatchesScalarReference) {
  const auto [isa, dt, combo] = GetParam();
  ZEROPLUS_SKIP_IF_UNSUPPORTED(isa);
  const AdamOptions opt = optionsFor(combo);
  const bool narrow = dt != DType::kFloat32;
  for (int64_t n : kLengths) {
    AdamBuffers ref(dt, n, 7), simd(dt, n, 7);
    for (int64_t step = 1; step <= 3; ++step) {
      const auto g = randomFloats(n, 100 + static_cast<uint32_t>(step), -2.f, 2.f);
      for (int64_t i = 0; i < n; ++i) ref.grad.set(i, g[i]), simd.grad.set(i, g[i]);
      AdamSpan rs = ref.span(n, step), ss = simd.span(n, step);
      ASSERT_EQ(adamStepReference(opt, dt, {&rs, 1}), 0);
      ASSERT_EQ(adamStep(opt, dt, {&ss, 1}, KernelConfig{isa, 1, 1 << 15}), 0);
      for (int64_t i = 0; i < n; ++i) {
        // 16-bit params may round to the neighbouring value when fp32 results differ by an ulp.
        ASSERT_TRUE(closeUlps(simd.param.get(i), ref.param.get(i), ulpOf(dt), narrow ? 1.f : 8.f, narrow ? 1e-5f : 1e-7f))
            << "param " << i << " n=" << n << " step=" << step;
        const float st = narrow ? 1e-3f : 8 * ulpOf(DType::kFloat32);
        ASSERT_TRUE(closeUlps(simd.m[i], ref.m[i], st, 1.f, 1e-7f)) << "exp_avg " << i << " n=" << n;
        ASSERT_TRUE(closeUlps(simd.v[i], ref.v[i], st, 1.f, 1e-9f)) << "exp_avg_sq " << i << " n=" << n;
        if (opt.amsgrad) ASSERT_TRUE(closeUlps(simd.vmax[i], ref.vmax[i], st, 1.f, 1e-9f)) << "max " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllCombos, AdamSimdTest,
                         ::testing::Combine(::testing::ValuesIn(simdIsas()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                                            ::testing::Range(0, 12)),
                         [](const ::testing::TestParamInfo<SimdParam>& info) {
                           return std::string(isaName(std::get<0>(info.param))) + "_" +
                                  dtypeName(std::get<1>(info.param)) + "_" + comboName(std::get<2>(info.param));
                         });

// Independent oracle: torch's formulas in double precision, 50 steps, every option combination.
class AdamReferenceTest : public ::testing::TestWithParam<int> {};

TEST_P(AdamReferenceTest, FollowsTorchFormulasInDouble) {
  const AdamOptions o = optionsFor(GetParam());
  const int64_t n = 37;
  AdamBuffers buf(DType::kFloat32, n, 3);
  std::vector<double> p(n), m(n, 0.0), v(n, 0.0), vmax(n, 0.0);
  for (int64_t i = 0; i < n; ++i) p[i] = buf.param.get(i);
  for (int64_t step = 1; step <= 50; ++step) {
    const auto g32 = randomFloats(n, 1000 + static_cast<uint32_t>(step), -1.f, 1.f);
    for (int64_t i = 0; i < n; ++i) buf.grad.set(i, g32[i]);
    AdamSpan s = buf.span(n, step);
    ASSERT_EQ(adamStepReference(o, DType::kFloat32, {&s, 1}), 0);
    const double bc1 = 1 - std::pow(o.beta1, step), bc2 = 1 - std::pow(o.beta2, step);
    for (int64_t i = 0; i < n; ++i) {
      double g = o.maximize ? -g32[i] : g32[i];
      if (o.weight_decay != 0 && !o.decoupled_weight_decay) g += o.weight_decay * p[i];
      if (o.weight_decay != 0 && o.decoupled_weight_decay) p[i] *= 1 - o.lr * o.weight_decay;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      vmax[i] = std::max(vmax[i], v[i]);
      const double vv = o.amsgrad ? vmax[i] : v[i];
      p[i] -= o.lr / bc1 * m[i] / (std::sqrt(vv) / std::sqrt(bc2) + o.eps);
    }
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(buf.param.get(i), p[i], 1e-5 * std::max(1.0, std::fabs(p[i]))) << i;
}

INSTANTIATE_TEST_SUITE_P(AllCombos, AdamReferenceTest, ::testing::Range(0, 12),
                         [](const ::testing::TestParamInfo<int>& info) { return comboName(info.param); });

TEST(AdamKernels, FirstStepMovesByLrTimesSign) {
  // With zero state, step 1 gives m/sqrt(v) bias-corrected = g/|g|: p moves by ~lr against g.
  AdamOptions o;
  o.lr = 0.1;
  AdamBuffers b(DType::kFloat32, 2, 1);
  b.param.set(0, 1.f), b.param.set(1, 1.f), b.grad.set(0, 3.f), b.grad.set(1, -0.5f);
  AdamSpan s = b.span(2, 1);
  ASSERT_EQ(adamStep(o, DType::kFloat32, {&s, 1}), 0);
  EXPECT_NEAR(b.param.get(0), 0.9f, 1e-6);
  EXPECT_NEAR(b.param.get(1), 1.1f, 1e-6);
}

// One instance per ISA, so a CPU without one reports a skip (it was a silent `continue`).
class AdamLerpHighBranchTest : public ::testing::TestWithParam<Isa> {};

TEST_P(AdamLerpHighBranchTest, MatchesReference) {
  const Isa isa = GetParam();
  ZEROPLUS_SKIP_IF_UNSUPPORTED(isa);
  AdamOptions o;
  o.beta1 = 0.3;  // weight 0.7 >= 0.5 selects torch's second lerp formula
  AdamBuffers r(DType::kFloat32, 50, 5), s(DType::kFloat32, 50, 5);
  const auto g = randomFloats(50, 9, -1.f, 1.f);
  for (int64_t i = 0; i < 50; ++i) r.grad.set(i, g[i]), s.grad.set(i, g[i]);
  AdamSpan rs = r.span(50, 1), ss = s.span(50, 1);
  ASSERT_EQ(adamStepReference(o, DType::kFloat32, {&rs, 1}), 0);
  ASSERT_EQ(adamStep(o, DType::kFloat32, {&ss, 1}, KernelConfig{isa, 1, 1}), 0);
  for (int64_t i = 0; i < 50; ++i) EXPECT_TRUE(closeUlps(s.m[i], r.m[i], ulpOf(DType::kFloat32), 4, 0)) << i;
}

INSTANTIATE_TEST_SUITE_P(Isas, AdamLerpHighBranchTest, ::testing::ValuesIn(simdIsas()),
                         [](const ::testing::TestParamInfo<Isa>& info) { return std::string(isaName(info.param)); });

TEST(AdamKernels, MultiSpanAndThreadsAreBitwiseEqualToSeparateCalls) {
  const AdamOptions o = optionsFor(8 | 1);  // AdamW + amsgrad
  const int64_t sizes[] = {1000, 3, 0, 4096, 77, 20000};
  std::vector<AdamBuffers> one, many;
  for (int64_t k = 0; k < 6; ++k) {
    one.emplace_back(DType::kBFloat16, sizes[k], 11 + k);
    many.emplace_back(DType::kBFloat16, sizes[k], 11 + k);
    const auto g = randomFloats(sizes[k], 50 + k, -1.f, 1.f);
    for (int64_t i = 0; i < sizes[k]; ++i) one[k].grad.set(i, g[i]), many[k].grad.set(i, g[i]);
  }
  std::vector<AdamSpan> spans;
  for (int64_t k = 0; k < 6; ++k) {
    AdamSpan s = one[k].span(sizes[k], k + 1);
    ASSERT_EQ(adamStep(o, DType::kBFloat16, {&s, 1}, KernelConfig{activeIsa(), 1, 1}), 0);
    spans.push_back(many[k].span(sizes[k], k + 1));  // per-tensor step counts differ
  }
  ASSERT_EQ(adamStep(o, DType::kBFloat16, spans, KernelConfig{activeIsa(), 2, 64}), 0);
  for (int64_t k = 0; k < 6; ++k)
    for (int64_t i = 0; i < sizes[k]; ++i) {
      ASSERT_EQ(one[k].param.get(i), many[k].param.get(i)) << k << ":" << i;
      ASSERT_EQ(one[k].vmax[i], many[k].vmax[i]) << k << ":" << i;
    }
}

// A borrowed pool (KernelConfig::runner): the pieces it is handed cover every element once, are
// cut at multiples of 64 elements, number at most `threads`, and give the same bits as one thread.
TEST(AdamKernels, RunnerPiecesAreAlignedCappedAndBitwiseEqual) {
  const AdamOptions o = optionsFor(8);  // AdamW
  const int64_t sizes[] = {70001, 5, 3000};
  std::vector<AdamBuffers> one, pooled;
  for (int64_t k = 0; k < 3; ++k) {
    one.emplace_back(DType::kFloat32, sizes[k], 21 + k);
    pooled.emplace_back(DType::kFloat32, sizes[k], 21 + k);
    const auto g = randomFloats(sizes[k], 60 + k, -1.f, 1.f);
    for (int64_t i = 0; i < sizes[k]; ++i) one[k].grad.set(i, g[i]), pooled[k].grad.set(i, g[i]);
  }
  std::vector<AdamSpan> serial, spans;
  for (int64_t k = 0; k < 3; ++k) {
    serial.push_back(one[k].span(sizes[k], 3));
    spans.push_back(pooled[k].span(sizes[k], 3));
  }
  ASSERT_EQ(adamStep(o, DType::kFloat32, serial, KernelConfig{activeIsa(), 1, 1}), 0);

  std::vector<std::pair<int64_t, int64_t>> units;  // what the runner was asked to split
  int64_t calls = 0;
  KernelConfig cfg{activeIsa(), 3, 1000};
  // A pool of 8 threads, run one piece at a time in reverse order: the kernel must not depend on
  // the order or on which thread runs a piece.
  cfg.runner = [&](int64_t count, int64_t grain, const RangeBody& body) {
    ++calls;
    units.emplace_back(count, grain);
    std::vector<std::pair<int64_t, int64_t>> pieces;
    const int64_t n = std::min<int64_t>(8, (count + grain - 1) / grain);
    const int64_t chunk = (count + n - 1) / n;
    for (int64_t b = 0; b < count; b += chunk) pieces.emplace_back(b, std::min(count, b + chunk));
    EXPECT_LE(pieces.size(), 3u);  // grain caps the pool at `threads` pieces
    for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) body(it->first, it->second);
  };
  ASSERT_EQ(adamStep(o, DType::kFloat32, spans, cfg), 0);
  ASSERT_EQ(calls, 1);
  const int64_t total = 70001 + 5 + 3000;
  EXPECT_EQ(units[0].first, (total + 63) / 64);  // 64-element units
  for (int64_t k = 0; k < 3; ++k)
    for (int64_t i = 0; i < sizes[k]; ++i) {
      ASSERT_EQ(one[k].param.get(i), pooled[k].param.get(i)) << k << ":" << i;
      ASSERT_EQ(one[k].m[i], pooled[k].m[i]) << k << ":" << i;
    }

  // Too little work for two pieces: the runner is not called at all.
  AdamBuffers small(DType::kFloat32, 100, 5);
  AdamSpan ss = small.span(100, 1);
  ASSERT_EQ(adamStep(o, DType::kFloat32, {&ss, 1}, cfg), 0);
  EXPECT_EQ(calls, 1);
}

TEST(AdamKernels, RejectsBadArguments) {
  AdamBuffers b(DType::kFloat32, 4, 1);
  AdamSpan s = b.span(4, 1);
  AdamOptions o;
  o.lr = -1;
  EXPECT_EQ(adamStep(o, DType::kFloat32, {&s, 1}), -EINVAL);
  o = AdamOptions{};
  o.beta2 = 1.0;
  EXPECT_EQ(adamStep(o, DType::kFloat32, {&s, 1}), -EINVAL);
  o = AdamOptions{};
  o.eps = std::nan("");
  EXPECT_EQ(adamStep(o, DType::kFloat32, {&s, 1}), -EINVAL);
  o = AdamOptions{};
  o.amsgrad = true;
  AdamSpan no_max = s;
  no_max.max_exp_avg_sq = nullptr;
  EXPECT_EQ(adamStep(o, DType::kFloat32, {&no_max, 1}), -EINVAL);
  AdamSpan bad_step = s;
  bad_step.step = 0;
  EXPECT_EQ(adamStep(AdamOptions{}, DType::kFloat32, {&bad_step, 1}), -EINVAL);
  AdamSpan null_grad = s;
  null_grad.grad = nullptr;
  EXPECT_EQ(adamStep(AdamOptions{}, DType::kFloat32, {&null_grad, 1}), -EINVAL);
  AdamSpan empty{};  // numel 0 with null pointers is a valid no-op
  EXPECT_EQ(adamStep(AdamOptions{}, DType::kFloat32, {&empty, 1}), 0);
}

TEST(CpuIsa, ParseAndResolve) {
  EXPECT_EQ(parseIsa("avx2"), Isa::kAvx2);
  EXPECT_EQ(parseIsa("AVX2"), std::nullopt);
  EXPECT_EQ(resolveIsa(Isa::kScalar), Isa::kScalar);
  EXPECT_TRUE(cpuSupports(resolveIsa(Isa::kAvx512)));
  EXPECT_TRUE(cpuSupports(activeIsa()));
}

}  // namespace
}  // namespace zeroplus::optim::test
