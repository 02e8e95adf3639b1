// 16-bit conversions used by the scalar reference: exhaustive round trips and rounding rules.
#include "optimizers/core/dtype.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace zeroplus::optim {
namespace {

TEST(DType, HalfRoundTripsEveryValue) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = halfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(halfToFloat(floatToHalf(f))));
      continue;
    }
    ASSERT_EQ(floatToHalf(f), h) << std::hex << h;
  }
}

TEST(DType, HalfKnownValuesAndRounding) {
  EXPECT_EQ(floatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(floatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(floatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(floatToHalf(1e6f), 0x7c00);                // overflow -> inf
  EXPECT_EQ(floatToHalf(0x1.0p-24f), 0x0001);          // smallest subnormal
  EXPECT_EQ(floatToHalf(1.0f + 0x1.0p-11f), 0x3c00);   // tie -> even
  EXPECT_EQ(floatToHalf(1.0f + 0x1.8p-11f), 0x3c01);   // above half -> up
  EXPECT_EQ(halfToFloat(0x0001), 0x1.0p-24f);
}

TEST(DType, Bf16RoundingAndNaN) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = bf16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(floatToBf16(f), h) << std::hex << h;
  }
  EXPECT_EQ(floatToBf16(1.0f + 0x1.0p-8f), 0x3f80);   // tie -> even (down)
  EXPECT_EQ(floatToBf16(1.0f + 0x1.8p-8f), 0x3f81);   // above half -> up
  EXPECT_EQ(floatToBf16(1.0f + 0x3.0p-8f), 0x3f82);   // tie at odd -> up to even
  EXPECT_TRUE(std::isnan(bf16ToFloat(floatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(floatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
}

}  // namespace
}  // namespace zeroplus::optim
