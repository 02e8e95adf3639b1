#include "optimizers/adapter/zero/loss_scaler.hpp"

#include <c10/util/Exception.h>

#include <cmath>

namespace zeroplus::zero::engine {
namespace {

optim::LossScalerSettings settingsOf(const Options& o) {
  optim::LossScalerSettings s;
  s.initScale = std::pow(2.0, o.initial_scale_power());  // Python's 2.0 ** power
  s.scaleWindow = o.loss_scale_window();
  s.hysteresis = o.hysteresis();
  s.minScale = o.min_loss_scale();
  s.consecutiveHysteresis = o.consecutive_hysteresis();
  return s;
}

}  // namespace

void checkLossScaling(const Options& o, const char* op) {
  // The Options-level rules (the Python config's checks of the same DeepSpeed keys, config.py).
  TORCH_CHECK_VALUE(std::isfinite(o.loss_scale()) && o.loss_scale() >= 0, op,
                    ": options.loss_scale must be >= 0 (0: dynamic), got ", o.loss_scale());
  if (o.loss_scale() > 0) return;  // static: the dynamic knobs are not used
  TORCH_CHECK_VALUE(o.initial_scale_power() >= 0 && o.initial_scale_power() <= 64, op,
                    ": options.initial_scale_power must be in [0, 64], got ", o.initial_scale_power());
  // The scaler's own rules are the core's; here they get the Options' names.
  const optim::LossScalerSettings s = settingsOf(o);
  optim::LossScalerProblem problem;
  if (optim::checkLossScalerSettings(s, &problem) == 0) return;
  using Field = optim::LossScalerProblem::Field;
  switch (problem.field) {
    case Field::kInitBelowMin:
      TORCH_CHECK_VALUE(false, op, ": the initial scale 2^options.initial_scale_power (", s.initScale,
                        ") is below options.min_loss_scale (", s.minScale, ")");
    case Field::kInitScale:  // 2^[0, 64] is always positive and finite; kept for completeness
      TORCH_CHECK_VALUE(false, op, ": the initial scale 2^options.initial_scale_power must be ", problem.rule,
                        ", got ", s.initScale);
    case Field::kMinScale:
      TORCH_CHECK_VALUE(false, op, ": options.min_loss_scale must be ", problem.rule, ", got ", s.minScale);
    case Field::kScaleWindow:
      TORCH_CHECK_VALUE(false, op, ": options.loss_scale_window must be ", problem.rule, ", got ", s.scaleWindow);
    case Field::kHysteresis:
      TORCH_CHECK_VALUE(false, op, ": options.hysteresis must be ", problem.rule, ", got ", s.hysteresis);
    case Field::kScaleFactor:  // not an option: always 2
      break;
  }
  TORCH_CHECK_VALUE(false, op, ": the loss scaler refuses these options");
}

LossScaler makeLossScaler(const Options& o) {
  if (o.mixed_precision() != "fp16") return LossScaler::fixed(1.0);
  if (o.loss_scale() > 0) return LossScaler::fixed(o.loss_scale());
  return LossScaler(settingsOf(o));
}

void updateLossScale(LossScaler& scaler, bool overflow) {
  TORCH_CHECK(scaler.update(overflow) == 0, scaler.atMinimumMessage());
}

}  // namespace zeroplus::zero::engine
