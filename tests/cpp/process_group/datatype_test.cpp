// Unit tests of element sizes, the reduceSupported table and the reduction kernels, including
// round-to-nearest-even of fp16/bf16 results.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "process_group/core/datatype.hpp"
#include "process_group/core/half.hpp"

namespace zeroplus::pg {
namespace {

using detail::bf16ToFloat;
using detail::floatToBf16;
using detail::floatToHalf;
using detail::halfToFloat;

const DataType kTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                           DataType::kInt8,    DataType::kUInt8,   DataType::kInt16,   DataType::kInt32,
                           DataType::kInt64,   DataType::kBool};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax,
                         ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor};

// Independent reference for binary16 -> float: ldexp on the decoded fields.
float refHalfToFloat(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400), exp - 25);
  }
  return sign ? -v : v;
}

uint16_t halfBits(float f) { return floatToHalf(f); }

TEST(DatatypeTest, SizesAndNames) {
  EXPECT_EQ(elementSize(DataType::kFloat32), 4u);
  EXPECT_EQ(elementSize(DataType::kFloat64), 8u);
  EXPECT_EQ(elementSize(DataType::kFloat16), 2u);
  EXPECT_EQ(elementSize(DataType::kBFloat16), 2u);
  EXPECT_EQ(elementSize(DataType::kInt8), 1u);
  EXPECT_EQ(elementSize(DataType::kUInt8), 1u);
  EXPECT_EQ(elementSize(DataType::kInt16), 2u);
  EXPECT_EQ(elementSize(DataType::kInt32), 4u);
  EXPECT_EQ(elementSize(DataType::kInt64), 8u);
  EXPECT_EQ(elementSize(DataType::kBool), 1u);
  EXPECT_EQ(toString(DataType::kBFloat16), "bfloat16");
  EXPECT_EQ(toString(ReduceOp::kBxor), "bxor");
}

TEST(DatatypeTest, BitwiseOpsOnlyOnIntegersAndBool) {
  for (DataType t : kTypes) {
    const bool fp = t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
                    t == DataType::kBFloat16;
    for (ReduceOp op : kOps) {
      const bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
      EXPECT_EQ(reduceSupported(t, op), !(fp && bitwise)) << toString(t) << " " << toString(op);
    }
  }
}

TEST(DatatypeTest, HalfToFloatMatchesReferenceForAllBitPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = halfToFloat(static_cast<uint16_t>(h));
    const float want = refHalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
      continue;
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << h;
    ASSERT_EQ(floatToHalf(got), h) << "round trip of " << h;
  }
}

TEST(DatatypeTest, FloatToHalfRoundsToNearestEven) {
  const float ulp1 = std::ldexp(1.0f, -10);  // spacing of binary16 in [1, 2)
  EXPECT_EQ(halfBits(1.0f + ulp1 / 2), halfBits(1.0f));                          // tie -> even (down)
  EXPECT_EQ(halfBits(1.0f + 3 * ulp1 / 2), halfBits(1.0f + 2 * ulp1));          // tie -> even (up)
  EXPECT_EQ(halfBits(1.0f + ulp1 / 2 + ulp1 / 64), halfBits(1.0f + ulp1));       // above tie -> up
  EXPECT_EQ(halfBits(65504.0f), 0x7BFF);
  EXPECT_EQ(halfBits(65519.0f), 0x7BFF);  // below the halfway point to 65536 stays finite
  EXPECT_EQ(halfBits(65520.0f), 0x7C00);  // the tie rounds to even, which is infinity
  EXPECT_EQ(halfBits(std::ldexp(1.0f, -25)), 0x0000);  // half the smallest subnormal: tie -> 0
  EXPECT_EQ(halfBits(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 subnormal ulps: tie -> even (2)
  EXPECT_TRUE(std::isnan(halfToFloat(halfBits(std::numeric_limits<float>::quiet_NaN()))));
  // Random floats in range agree with rounding through double, which is exact here.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-60000.0f, 60000.0f);
  for (int i = 0; i < 100000; ++i) {
    const float f = dist(rng);
    const float r = halfToFloat(halfBits(f));
    const float ulp = std::ldexp(1.0f, std::ilogb(r == 0 ? f : r) - 10);
    ASSERT_LE(std::fabs(static_cast<double>(r) - f), ulp / 2 + 1e-30) << f;
  }
}

TEST(DatatypeTest, Bfloat16RoundsToNearestEven) {
  const float ulp1 = std::ldexp(1.0f, -7);
  EXPECT_EQ(floatToBf16(1.0f + ulp1 / 2), floatToBf16(1.0f));
  EXPECT_EQ(floatToBf16(1.0f + 3 * ulp1 / 2), floatToBf16(1.0f + 2 * ulp1));
  EXPECT_EQ(floatToBf16(1.0f + ulp1 / 2 + ulp1 / 64), floatToBf16(1.0f + ulp1));
  EXPECT_TRUE(std::isnan(bf16ToFloat(floatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(bf16ToFloat(floatToBf16(std::numeric_limits<float>::infinity()))));
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16ToFloat(static_cast<uint16_t>(b));
    if (!std::isnan(f)) {
      ASSERT_EQ(floatToBf16(f), b);
    }
  }
}

TEST(DatatypeTest, HalfSumIsComputedInFloatAndRoundedOnce) {
  // 1 + 2^-11 is a tie in binary16: rounds to 1. (1 + 2^-10) + 2^-11 rounds up to 1 + 2^-9.
  std::vector<uint16_t> a = {halfBits(1.0f), halfBits(1.0f + std::ldexp(1.0f, -10)), halfBits(65504.0f),
                             halfBits(std::ldexp(1.0f, -24))};
  const std::vector<uint16_t> b = {halfBits(std::ldexp(1.0f, -11)), halfBits(std::ldexp(1.0f, -11)),
                                   halfBits(65504.0f), halfBits(std::ldexp(1.0f, -24))};
  reduceInto(a.data(), b.data(), a.size(), DataType::kFloat16, ReduceOp::kSum);
  EXPECT_EQ(a[0], halfBits(1.0f));
  EXPECT_EQ(a[1], halfBits(1.0f + std::ldexp(1.0f, -9)));
  EXPECT_EQ(a[2], 0x7C00);  // overflow -> +inf
  EXPECT_EQ(a[3], halfBits(std::ldexp(1.0f, -23)));

  std::vector<uint16_t> x = {floatToBf16(1.0f), floatToBf16(1.0f + std::ldexp(1.0f, -7)), floatToBf16(3.0f)};
  const std::vector<uint16_t> y = {floatToBf16(std::ldexp(1.0f, -8)), floatToBf16(std::ldexp(1.0f, -8)),
                                   floatToBf16(-0.5f)};
  reduceInto(x.data(), y.data(), x.size(), DataType::kBFloat16, ReduceOp::kSum);
  EXPECT_EQ(x[0], floatToBf16(1.0f));
  EXPECT_EQ(x[1], floatToBf16(1.0f + std::ldexp(1.0f, -6)));
  EXPECT_EQ(bf16ToFloat(x[2]), 2.5f);
  reduceInto(x.data(), y.data(), x.size(), DataType::kBFloat16, ReduceOp::kMax);
  EXPECT_EQ(bf16ToFloat(x[2]), 2.5f);
}

template <typename T>
void checkIntegerOps(DataType type) {
  std::mt19937_64 rng(11);
  const size_t n = 1037;  // odd: exercises the scalar tail after vectorised bodies
  std::vector<T> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<T>(rng());
    b[i] = static_cast<T>(rng());
  }
  using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
  for (ReduceOp op : kOps) {
    std::vector<T> d = a;
    reduceInto(d.data(), b.data(), n, type, op);
    for (size_t i = 0; i < n; ++i) {
      T want{};
      switch (op) {
        case ReduceOp::kSum: want = static_cast<T>(static_cast<U>(a[i]) + static_cast<U>(b[i])); break;
        case ReduceOp::kProduct: want = static_cast<T>(static_cast<U>(a[i]) * static_cast<U>(b[i])); break;
        case ReduceOp::kMin: want = std::min(a[i], b[i]); break;
        case ReduceOp::kMax: want = std::max(a[i], b[i]); break;
        case ReduceOp::kBand: want = static_cast<T>(a[i] & b[i]); break;
        case ReduceOp::kBor: want = static_cast<T>(a[i] | b[i]); break;
        case ReduceOp::kBxor: want = static_cast<T>(a[i] ^ b[i]); break;
      }
      ASSERT_EQ(d[i], want) << toString(type) << " " << toString(op) << " at " << i;
    }
  }
}

TEST(DatatypeTest, IntegerOpsWrapLikeTorch) {
  checkIntegerOps<int8_t>(DataType::kInt8);
  checkIntegerOps<uint8_t>(DataType::kUInt8);
  checkIntegerOps<int16_t>(DataType::kInt16);
  checkIntegerOps<int32_t>(DataType::kInt32);
  checkIntegerOps<int64_t>(DataType::kInt64);
}

template <typename T>
void checkFloatOps(DataType type) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> dist(-4, 4);
  const size_t n = 1037;
  std::vector<T> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<T>(dist(rng));
    b[i] = static_cast<T>(dist(rng));
  }
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
    std::vector<T> d = a;
    reduceInto(d.data(), b.data(), n, type, op);
    for (size_t i = 0; i < n; ++i) {
      T want = op == ReduceOp::kSum ? a[i] + b[i]
               : op == ReduceOp::kProduct ? a[i] * b[i]
               : op == ReduceOp::kMin ? std::min(a[i], b[i])
                                      : std::max(a[i], b[i]);
      ASSERT_EQ(d[i], want) << toString(op) << " at " << i;
    }
  }
}

TEST(DatatypeTest, FloatOpsAreExactIeee) {
  checkFloatOps<float>(DataType::kFloat32);
  checkFloatOps<double>(DataType::kFloat64);
}

TEST(DatatypeTest, HalfOpsMatchFloatComputationRoundedOnce) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> dist(-100, 100);
  const size_t n = 1001;
  for (DataType t : {DataType::kFloat16, DataType::kBFloat16}) {
    auto load = [&](uint16_t v) { return t == DataType::kFloat16 ? halfToFloat(v) : bf16ToFloat(v); };
    auto store = [&](float v) { return t == DataType::kFloat16 ? floatToHalf(v) : floatToBf16(v); };
    std::vector<uint16_t> a(n), b(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = store(dist(rng));
      b[i] = store(dist(rng));
    }
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
      std::vector<uint16_t> d = a;
      reduceInto(d.data(), b.data(), n, t, op);
      for (size_t i = 0; i < n; ++i) {
        const float x = load(a[i]), y = load(b[i]);
        const float f = op == ReduceOp::kSum ? x + y
                        : op == ReduceOp::kProduct ? x * y
                        : op == ReduceOp::kMin ? std::min(x, y)
                                               : std::max(x, y);
        ASSERT_EQ(d[i], store(f)) << toString(t) << " " << toString(op) << " at " << i;
      }
    }
  }
}

TEST(DatatypeTest, BoolOpsAreLogical) {
  const std::vector<uint8_t> a = {0, 0, 1, 1}, b = {0, 1, 0, 1};
  auto apply = [&](ReduceOp op) {
    std::vector<uint8_t> d = a;
    reduceInto(d.data(), b.data(), d.size(), DataType::kBool, op);
    return d;
  };
  const std::vector<uint8_t> any = {0, 1, 1, 1}, all = {0, 0, 0, 1}, one = {0, 1, 1, 0};
  EXPECT_EQ(apply(ReduceOp::kSum), any);
  EXPECT_EQ(apply(ReduceOp::kMax), any);
  EXPECT_EQ(apply(ReduceOp::kBor), any);
  EXPECT_EQ(apply(ReduceOp::kProduct), all);
  EXPECT_EQ(apply(ReduceOp::kMin), all);
  EXPECT_EQ(apply(ReduceOp::kBand), all);
  EXPECT_EQ(apply(ReduceOp::kBxor), one);
}

TEST(DatatypeTest, ZeroCountTouchesNothing) {
  float d = 1.0f, s = 2.0f;
  reduceInto(&d, &s, 0, DataType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(d, 1.0f);
}

}  // namespace
}  // namespace zeroplus::pg
