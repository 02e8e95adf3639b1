// fp16 loss scaler (optimizers/core/loss_scaler.hpp), the one implementation of DeepSpeed's rules
// behind both ZeRO engines: hand-computed traces of scale, hysteresis and iteration per update,
// the settings' checks in their order, the minimum (raise or clamp), state loading and the static
// scaler. The engines' use of it (skipped steps, agreement across ranks, checkpoints) is tested in
// tests/cpp/plugin/zero_fp16_test.cpp and the Python fp16 tests.
#include "optimizers/core/loss_scaler.hpp"

#include <gtest/gtest.h>

#include <cerrno>
#include <cmath>
#include <limits>
#include <vector>

namespace zeroplus::optim {
namespace {

using Field = LossScalerProblem::Field;

LossScalerSettings settings(double init, int64_t window, int64_t hysteresis, double minScale = 1.0) {
  LossScalerSettings s;
  s.initScale = init;
  s.scaleWindow = window;
  s.hysteresis = hysteresis;
  s.minScale = minScale;
  return s;
}

// The scale after each update of `overflows` (true: an overflow step).
std::vector<double> scalesAfter(LossScaler& scaler, const std::vector<bool>& overflows) {
  std::vector<double> out;
  for (bool overflow : overflows) {
    EXPECT_EQ(scaler.update(overflow), 0);
    out.push_back(scaler.scale());
  }
  return out;
}

TEST(LossScaler, DefaultsAreDeepSpeeds) {
  const LossScaler scaler{LossScalerSettings{}};
  EXPECT_TRUE(scaler.dynamic());
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_EQ(scaler.settings().scaleWindow, 1000);
  EXPECT_EQ(scaler.settings().hysteresis, 2);
  EXPECT_EQ(scaler.settings().minScale, 1.0);
  EXPECT_FALSE(scaler.settings().consecutiveHysteresis);
  EXPECT_EQ(scaler.settings().scaleFactor, 2.0);
  EXPECT_TRUE(scaler.settings().raiseErrorAtMinScale);
  EXPECT_EQ(scaler.state().hysteresisLeft, 2);
  EXPECT_EQ(scaler.state().iteration, 0);
  EXPECT_EQ(scaler.state().lastOverflowIteration, -1);
}

TEST(LossScaler, HysteresisTwoAbsorbsTheFirstOverflow) {
  // tests/python/test_zero_stage2.py's trace: clean, overflow, overflow, clean.
  LossScaler scaler{LossScalerSettings{}};
  EXPECT_EQ(scalesAfter(scaler, {false, true, true, false}), (std::vector<double>{65536, 65536, 32768, 32768}));
  EXPECT_EQ(scaler.state().hysteresisLeft, 1);  // only a growth (or consecutive_hysteresis) refills it
  EXPECT_EQ(scaler.state().iteration, 4);
  EXPECT_EQ(scaler.state().lastOverflowIteration, 2);
}

TEST(LossScaler, HysteresisOneHalvesOnEveryOverflow) {
  LossScaler scaler{settings(65536, 1000, 1)};
  EXPECT_EQ(scalesAfter(scaler, {false, true, true, false}), (std::vector<double>{65536, 32768, 16384, 16384}));
}

TEST(LossScaler, GrowsEveryWindowCleanStepsSinceTheLastOverflow) {
  // Window 2: the scale doubles when (iteration - last overflow) % 2 == 0, counted from -1.
  LossScaler scaler{settings(256, 2, 1)};
  EXPECT_EQ(scalesAfter(scaler, {false, false, false, false, true, false, false}),
            (std::vector<double>{256, 512, 512, 1024, 512, 512, 1024}));
  EXPECT_EQ(scaler.state().lastOverflowIteration, 4);
  EXPECT_EQ(scaler.state().iteration, 7);
}

TEST(LossScaler, WindowOneGrowsAfterEveryCleanStep) {
  LossScaler scaler{settings(4, 1, 1)};
  EXPECT_EQ(scalesAfter(scaler, {false, false, true, false}), (std::vector<double>{8, 16, 8, 16}));
}

TEST(LossScaler, GrowthRefillsHysteresis) {
  LossScaler scaler{settings(8, 2, 2)};
  EXPECT_EQ(scalesAfter(scaler, {true}), (std::vector<double>{8}));
  EXPECT_EQ(scaler.state().hysteresisLeft, 1);
  EXPECT_EQ(scalesAfter(scaler, {false}), (std::vector<double>{8}));  // 1 step since the overflow
  EXPECT_EQ(scaler.state().hysteresisLeft, 1);                         // not refilled without growth
  EXPECT_EQ(scalesAfter(scaler, {false}), (std::vector<double>{16}));
  EXPECT_EQ(scaler.state().hysteresisLeft, 2);
  EXPECT_EQ(scalesAfter(scaler, {true}), (std::vector<double>{16}));  // absorbed again
}

TEST(LossScaler, ConsecutiveHysteresisRefillsAfterEveryCleanStep) {
  LossScalerSettings s = settings(1024, 1000, 3);
  LossScaler plain{s};
  EXPECT_EQ(scalesAfter(plain, {true, false, true, true}), (std::vector<double>{1024, 1024, 1024, 512}));
  s.consecutiveHysteresis = true;
  LossScaler consecutive{s};
  EXPECT_EQ(scalesAfter(consecutive, {true, false, true, true, true}),
            (std::vector<double>{1024, 1024, 1024, 1024, 512}));
  EXPECT_EQ(consecutive.state().hysteresisLeft, 1);
}

TEST(LossScaler, ScaleFactorDividesAndMultiplies) {
  LossScalerSettings s = settings(81, 1, 1);
  s.scaleFactor = 3;
  LossScaler scaler{s};
  EXPECT_EQ(scalesAfter(scaler, {false, true, true}), (std::vector<double>{243, 81, 27}));
}

TEST(LossScaler, NeverDropsBelowTheMinimum) {
  LossScaler scaler{settings(3, 1000, 1, 2)};
  EXPECT_EQ(scalesAfter(scaler, {true}), (std::vector<double>{2}));  // max(1.5, 2)
}

TEST(LossScaler, AnOverflowAtTheMinimumFailsAndChangesNothing) {
  LossScaler scaler{settings(3, 1000, 1, 2)};
  ASSERT_EQ(scaler.update(true), 0);
  const LossScalerState before = scaler.state();
  EXPECT_EQ(scaler.update(true), -ERANGE);
  EXPECT_EQ(scaler.state().scale, before.scale);
  EXPECT_EQ(scaler.state().hysteresisLeft, before.hysteresisLeft);
  EXPECT_EQ(scaler.state().iteration, before.iteration);  // the failed update is not counted
  EXPECT_EQ(scaler.state().lastOverflowIteration, before.lastOverflowIteration);
  EXPECT_NE(scaler.atMinimumMessage().find("already at its minimum (2)"), std::string::npos)
      << scaler.atMinimumMessage();
  EXPECT_EQ(scaler.update(false), 0);  // a clean step still works after the caller handled it
}

TEST(LossScaler, HysteresisIsConsumedBeforeTheMinimumFails) {
  LossScaler scaler{settings(1, 1000, 2, 1)};
  EXPECT_EQ(scaler.update(true), 0);  // absorbed: the scale is not touched
  EXPECT_EQ(scaler.state().hysteresisLeft, 1);
  EXPECT_EQ(scaler.update(true), -ERANGE);
}

TEST(LossScaler, WithoutRaisingTheMinimumHolds) {
  LossScalerSettings s = settings(2, 1000, 1, 2);
  s.raiseErrorAtMinScale = false;
  LossScaler scaler{s};
  EXPECT_EQ(scalesAfter(scaler, {true, true}), (std::vector<double>{2, 2}));
  EXPECT_EQ(scaler.state().iteration, 2);
  EXPECT_EQ(scaler.state().lastOverflowIteration, 1);
}

TEST(LossScaler, LoadedStateContinues) {
  // A checkpoint's state (the fields of DeepSpeed's DynamicLossScaler, test_checkpoint_deepspeed.py).
  LossScaler scaler{settings(4096, 100, 2)};
  scaler.load({4096, 1, 57, 17});
  EXPECT_EQ(scaler.scale(), 4096);
  EXPECT_EQ(scaler.update(false), 0);  // (57 - 17) % 100 != 0
  EXPECT_EQ(scaler.scale(), 4096);
  EXPECT_EQ(scaler.update(true), 0);  // hysteresis left 1: halves
  EXPECT_EQ(scaler.scale(), 2048);
  EXPECT_EQ(scaler.state().iteration, 59);
  EXPECT_EQ(scaler.state().lastOverflowIteration, 58);
}

TEST(LossScaler, LoadedStateWithTheWindowDue) {
  LossScaler scaler{settings(16, 100, 2)};
  scaler.load({16, 1, 116, 16});  // (116 - 16) % 100 == 0
  EXPECT_EQ(scaler.update(false), 0);
  EXPECT_EQ(scaler.scale(), 32);
  EXPECT_EQ(scaler.state().hysteresisLeft, 2);
}

TEST(LossScaler, FixedScaleNeverChanges) {
  LossScaler scaler = LossScaler::fixed(128);
  EXPECT_FALSE(scaler.dynamic());
  EXPECT_EQ(scaler.scale(), 128);
  for (bool overflow : {true, true, true, false}) EXPECT_EQ(scaler.update(overflow), 0);
  EXPECT_EQ(scaler.scale(), 128);
  EXPECT_EQ(scaler.state().iteration, 0);
  scaler.load({4, 1, 5, 3});  // a static scaler keeps its scale
  EXPECT_EQ(scaler.scale(), 128);
}

struct BadSettings {
  const char* name;
  LossScalerSettings settings;
  Field field;
};

class LossScalerCheck : public ::testing::TestWithParam<BadSettings> {};

TEST_P(LossScalerCheck, NamesTheFirstBrokenRule) {
  LossScalerProblem problem;
  EXPECT_EQ(checkLossScalerSettings(GetParam().settings, &problem), -EINVAL);
  EXPECT_EQ(problem.field, GetParam().field);
  EXPECT_EQ(checkLossScalerSettings(GetParam().settings, nullptr), -EINVAL);
}

LossScalerSettings with(void (*edit)(LossScalerSettings&)) {
  LossScalerSettings s;
  edit(s);
  return s;
}

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

INSTANTIATE_TEST_SUITE_P(
    Rules, LossScalerCheck,
    ::testing::Values(
        BadSettings{"InitZero", with([](LossScalerSettings& s) { s.initScale = 0; }), Field::kInitScale},
        BadSettings{"InitNegative", with([](LossScalerSettings& s) { s.initScale = -2; }), Field::kInitScale},
        BadSettings{"InitInf", with([](LossScalerSettings& s) { s.initScale = kInf; }), Field::kInitScale},
        BadSettings{"InitNan", with([](LossScalerSettings& s) { s.initScale = kNan; }), Field::kInitScale},
        BadSettings{"MinZero", with([](LossScalerSettings& s) { s.minScale = 0; }), Field::kMinScale},
        BadSettings{"MinInf", with([](LossScalerSettings& s) { s.minScale = kInf; }), Field::kMinScale},
        BadSettings{"MinNan", with([](LossScalerSettings& s) { s.minScale = kNan; }), Field::kMinScale},
        BadSettings{"FactorOne", with([](LossScalerSettings& s) { s.scaleFactor = 1; }), Field::kScaleFactor},
        BadSettings{"FactorNan", with([](LossScalerSettings& s) { s.scaleFactor = kNan; }), Field::kScaleFactor},
        BadSettings{"WindowZero", with([](LossScalerSettings& s) { s.scaleWindow = 0; }), Field::kScaleWindow},
        BadSettings{"WindowNegative", with([](LossScalerSettings& s) { s.scaleWindow = -1; }), Field::kScaleWindow},
        BadSettings{"HysteresisZero", with([](LossScalerSettings& s) { s.hysteresis = 0; }), Field::kHysteresis},
        BadSettings{"InitBelowMin", with([](LossScalerSettings& s) { s.initScale = 1; s.minScale = 2; }),
                    Field::kInitBelowMin},
        // The order is the Python engine's: init, min, factor, window, hysteresis, init >= min.
        BadSettings{"InitBeforeWindow", with([](LossScalerSettings& s) { s.initScale = 0; s.scaleWindow = 0; }),
                    Field::kInitScale},
        BadSettings{"MinBeforeFactor", with([](LossScalerSettings& s) { s.minScale = -1; s.scaleFactor = 0; }),
                    Field::kMinScale},
        BadSettings{"FactorBeforeWindow", with([](LossScalerSettings& s) { s.scaleFactor = 0.5; s.scaleWindow = 0; }),
                    Field::kScaleFactor},
        BadSettings{"WindowBeforeHysteresis",
                    with([](LossScalerSettings& s) { s.scaleWindow = 0; s.hysteresis = 0; }), Field::kScaleWindow},
        BadSettings{"HysteresisBeforeInitBelowMin",
                    with([](LossScalerSettings& s) { s.hysteresis = 0; s.initScale = 1; s.minScale = 4; }),
                    Field::kHysteresis}),
    [](const ::testing::TestParamInfo<BadSettings>& info) { return std::string(info.param.name); });

TEST(LossScalerCheck, AcceptsTheDefaultsAndTheEdges) {
  EXPECT_EQ(checkLossScalerSettings(LossScalerSettings{}, nullptr), 0);
  EXPECT_EQ(checkLossScalerSettings(settings(1, 1, 1, 1), nullptr), 0);  // init == min, window/hysteresis 1
  LossScalerSettings s;
  s.scaleFactor = 1.0000001;
  EXPECT_EQ(checkLossScalerSettings(s, nullptr), 0);
}

TEST(LossScalerCheck, RulesAreWorded) {
  LossScalerProblem problem;
  ASSERT_EQ(checkLossScalerSettings(with([](LossScalerSettings& s) { s.minScale = 0; }), &problem), -EINVAL);
  EXPECT_STREQ(problem.rule, "a positive finite number");
  ASSERT_EQ(checkLossScalerSettings(with([](LossScalerSettings& s) { s.scaleFactor = 1; }), &problem), -EINVAL);
  EXPECT_STREQ(problem.rule, "> 1");
  ASSERT_EQ(checkLossScalerSettings(with([](LossScalerSettings& s) { s.hysteresis = 0; }), &problem), -EINVAL);
  EXPECT_STREQ(problem.rule, "an integer >= 1");
}

}  // namespace
}  // namespace zeroplus::optim
