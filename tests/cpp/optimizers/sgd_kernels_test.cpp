// SGD kernels: every SIMD variant against the scalar reference for all option combinations
// (momentum, dampening, nesterov, weight decay, maximize) and dtypes, the momentum-buffer
// initialisation rule, a double-precision oracle, and argument errors.
#include "optimizers/core/sgd_kernels.hpp"

#include <cerrno>
#include <tuple>

#include "kernel_test_util.hpp"

namespace zeroplus::optim::test {
namespace {

const int64_t kLengths[] = {0, 1, 7, 8, 15, 16, 17, 33, 257, 1029};

// combo bits: 0 maximize, 1 weight decay, 2-3 momentum kind (0 none, 1 plain, 2 dampened, 3 nesterov)
SgdOptions optionsFor(int combo) {
  SgdOptions o;
  o.lr = 0.05;
  o.maximize = combo & 1;
  o.weight_decay = (combo >> 1) & 1 ? 0.01 : 0.0;
  const int kind = combo >> 2;
  o.momentum = kind ? 0.9 : 0.0;
  o.dampening = kind == 2 ? 0.3 : 0.0;
  o.nesterov = kind == 3;
  return o;
}

std::string comboName(int combo) {
  const char* kinds[] = {"plain", "momentum", "dampened", "nesterov"};
  std::string s = kinds[combo >> 2];
  if ((combo >> 1) & 1) s += "_wd";
  if (combo & 1) s += "_maximize";
  return s;
}

struct SgdBuffers {
  Typed param, grad;
  std::vector<float> buf;
  SgdBuffers(DType dt, int64_t n, uint32_t seed)
      : param(makeTyped(dt, randomFloats(n, seed, -1.f, 1.f))), grad(dt, n), buf(static_cast<size_t>(n), 0.f) {}
  SgdSpan span(int64_t n, bool init) { return SgdSpan{param.data(), grad.data(), buf.data(), n, init}; }
};

using SimdParam = std::tuple<Isa, DType, int>;
class SgdSimdTest : public ::testing::TestWithParam<SimdParam> {};

TEST_P(SgdSimdTest, MatchesScalarReference) {
  const auto [isa, dt, combo] = GetParam();
  ZEROPLUS_SKIP_IF_UNSUPPORTED(isa);
  const SgdOptions opt = optionsFor(combo);
  const bool narrow = dt != DType::kFloat32;
  for (int64_t n : kLengths) {
    SgdBuffers ref(dt, n, 21), simd(dt, n, 21);
    for (int step = 1; step <= 3; ++step) {
      const auto g = randomFloats(n, 300 + static_cast<uint32_t>(step), -2.f, 2.f);
      for (int64_t i = 0; i < n; ++i) ref.grad.set(i, g[i]), simd.grad.set(i, g[i]);
      SgdSpan rs = ref.span(n, step == 1), ss = simd.span(n, step == 1);
      ASSERT_EQ(sgdStepReference(opt, dt, {&rs, 1}), 0);
      ASSERT_EQ(sgdStep(opt, dt, {&ss, 1}, KernelConfig{isa, 1, 1 << 15}), 0);
      for (int64_t i = 0; i < n; ++i) {
        // Absolute floors: buf*momentum + (1-dampening)*g cancels, and the SIMD build may fuse it
        // into one FMA, so errors scale with the O(1) terms, not with the small result.
        ASSERT_TRUE(closeUlps(simd.param.get(i), ref.param.get(i), ulpOf(dt), narrow ? 1.f : 4.f, narrow ? 1e-5f : 1e-6f))
            << "param " << i << " n=" << n << " step=" << step;
        ASSERT_TRUE(closeUlps(simd.buf[i], ref.buf[i], narrow ? 1e-3f : ulpOf(DType::kFloat32), 4.f, 1e-6f))
            << "momentum_buffer " << i << " n=" << n;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllCombos, SgdSimdTest,
                         ::testing::Combine(::testing::ValuesIn(simdIsas()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                                            ::testing::Range(0, 16)),
                         [](const ::testing::TestParamInfo<SimdParam>& info) {
                           return std::string(isaName(std::get<0>(info.param))) + "_" +
                                  dtypeName(std::get<1>(info.param)) + "_" + comboName(std::get<2>(info.param));
                         });

class SgdReferenceTest : public ::testing::TestWithParam<int> {};

TEST_P(SgdReferenceTest, FollowsTorchFormulasInDouble) {
  const SgdOptions o = optionsFor(GetParam());
  const int64_t n = 29;
  SgdBuffers b(DType::kFloat32, n, 4);
  std::vector<double> p(n), buf(n, 0.0);
  for (int64_t i = 0; i < n; ++i) p[i] = b.param.get(i);
  for (int step = 1; step <= 50; ++step) {
    const auto g32 = randomFloats(n, 700 + static_cast<uint32_t>(step), -1.f, 1.f);
    for (int64_t i = 0; i < n; ++i) b.grad.set(i, g32[i]);
    SgdSpan s = b.span(n, step == 1);
    ASSERT_EQ(sgdStepReference(o, DType::kFloat32, {&s, 1}), 0);
    for (int64_t i = 0; i < n; ++i) {
      double g = o.maximize ? -g32[i] : g32[i];
      g += o.weight_decay * p[i];
      if (o.momentum != 0) {
        buf[i] = step == 1 ? g : o.momentum * buf[i] + (1 - o.dampening) * g;
        g = o.nesterov ? g + o.momentum * buf[i] : buf[i];
      }
      p[i] -= o.lr * g;
    }
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(b.param.get(i), p[i], 1e-5 * std::max(1.0, std::fabs(p[i]))) << i;
}

INSTANTIATE_TEST_SUITE_P(AllCombos, SgdReferenceTest, ::testing::Range(0, 16),
                         [](const ::testing::TestParamInfo<int>& info) { return comboName(info.param); });

// One instance per ISA, so a CPU without one reports a skip (it was a silent `continue`).
class SgdFirstStepTest : public ::testing::TestWithParam<Isa> {};

TEST_P(SgdFirstStepTest, BufferIsTheGradientUndampened) {
  const Isa isa = GetParam();
  ZEROPLUS_SKIP_IF_UNSUPPORTED(isa);
  SgdOptions o;
  o.lr = 1.0;
  o.momentum = 0.9;
  o.dampening = 0.5;
  SgdBuffers b(DType::kFloat32, 3, 1);
  for (int64_t i = 0; i < 3; ++i) b.param.set(i, 0.f), b.grad.set(i, float(i + 1)), b.buf[i] = 123.f;
  SgdSpan s = b.span(3, true);
  ASSERT_EQ(sgdStep(o, DType::kFloat32, {&s, 1}, KernelConfig{isa, 1, 1}), 0);
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(b.buf[i], float(i + 1));  // stale contents ignored, no dampening
    EXPECT_EQ(b.param.get(i), -float(i + 1));
  }
  s.init_momentum = false;
  ASSERT_EQ(sgdStep(o, DType::kFloat32, {&s, 1}, KernelConfig{isa, 1, 1}), 0);
  for (int64_t i = 0; i < 3; ++i) EXPECT_FLOAT_EQ(b.buf[i], 0.9f * (i + 1) + 0.5f * (i + 1));
}

INSTANTIATE_TEST_SUITE_P(Isas, SgdFirstStepTest, ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) { return std::string(isaName(info.param)); });

TEST(SgdKernels, RejectsBadArguments) {
  SgdBuffers b(DType::kFloat32, 4, 1);
  SgdSpan s = b.span(4, true);
  SgdOptions o;
  o.nesterov = true;  // torch: "Nesterov momentum requires a momentum and zero dampening"
  EXPECT_EQ(sgdStep(o, DType::kFloat32, {&s, 1}), -EINVAL);
  o.momentum = 0.9;
  o.dampening = 0.1;
  EXPECT_EQ(sgdStep(o, DType::kFloat32, {&s, 1}), -EINVAL);
  o = SgdOptions{};
  o.momentum = 0.9;
  SgdSpan no_buf = s;
  no_buf.momentum_buffer = nullptr;
  EXPECT_EQ(sgdStep(o, DType::kFloat32, {&no_buf, 1}), -EINVAL);
  o.momentum = 0.0;  // no momentum: the buffer may be absent
  EXPECT_EQ(sgdStep(o, DType::kFloat32, {&no_buf, 1}), 0);
  o.lr = -0.1;
  EXPECT_EQ(sgdStep(o, DType::kFloat32, {&s, 1}), -EINVAL);
}

}  // namespace
}  // namespace zeroplus::optim::test
