#include "optimizers/adapter/zero/loss_scaler.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace zeroplus::zero::engine {

LossScaler::LossScaler(const Options& o) : dynamic_(o.mixed_precision() == "fp16" && o.loss_scale() == 0) {
  settings_.initScale = std::pow(2.0, o.initial_scale_power());  // Python's 2.0 ** power
  settings_.scaleWindow = o.loss_scale_window();
  settings_.hysteresis = o.hysteresis();
  settings_.minScale = o.min_loss_scale();
  settings_.consecutiveHysteresis = o.consecutive_hysteresis();
  const double initial = !dynamic_ && o.mixed_precision() == "fp16" ? o.loss_scale()
                         : dynamic_                                 ? settings_.initScale
                                                                    : 1.0;
  state_ = {initial, settings_.hysteresis, 0, -1};
}

void LossScaler::check(const Options& o, const char* op) {
  // The Python engine's checks (zero/config.py, LossScalerOptions.validate), in its order.
  TORCH_CHECK_VALUE(std::isfinite(o.loss_scale()) && o.loss_scale() >= 0, op,
                    ": options.loss_scale must be >= 0 (0: dynamic), got ", o.loss_scale());
  if (o.loss_scale() > 0) return;  // static: the dynamic knobs are not used
  TORCH_CHECK_VALUE(o.initial_scale_power() >= 0 && o.initial_scale_power() <= 64, op,
                    ": options.initial_scale_power must be in [0, 64], got ", o.initial_scale_power());
  TORCH_CHECK_VALUE(std::isfinite(o.min_loss_scale()) && o.min_loss_scale() > 0, op,
                    ": options.min_loss_scale must be a positive finite number, got ", o.min_loss_scale());
  TORCH_CHECK_VALUE(o.loss_scale_window() >= 1, op, ": options.loss_scale_window must be an integer >= 1, got ",
                    o.loss_scale_window());
  TORCH_CHECK_VALUE(o.hysteresis() >= 1, op, ": options.hysteresis must be an integer >= 1, got ", o.hysteresis());
  const double init = std::pow(2.0, o.initial_scale_power());
  TORCH_CHECK_VALUE(init >= o.min_loss_scale(), op, ": the initial scale 2^options.initial_scale_power (", init,
                    ") is below options.min_loss_scale (", o.min_loss_scale(), ")");
}

void LossScaler::load(const State& state) {
  if (dynamic_) state_ = state;
}

void LossScaler::update(bool overflow) {
  if (!dynamic_) return;  // a static scale never changes (fp32/bf16 never skip a step)
  const Settings& o = settings_;
  if (overflow) {
    if (o.hysteresis == 1 || state_.hysteresisLeft == 1) {
      TORCH_CHECK(!(state_.scale <= o.minScale && o.raiseErrorAtMinScale), "fp16 loss scale is already at its "
                  "minimum (", o.minScale, ") and gradients still overflow; lower the learning rate or train in bf16");
      state_.scale = std::max(state_.scale / o.scaleFactor, o.minScale);
    } else {
      state_.hysteresisLeft -= 1;
    }
    state_.lastOverflowIteration = state_.iteration;
  } else {
    if (o.consecutiveHysteresis) state_.hysteresisLeft = o.hysteresis;
    // Python's % with a positive window: the difference is >= 1 here, so C++'s % agrees.
    if ((state_.iteration - state_.lastOverflowIteration) % o.scaleWindow == 0) {
      if (!o.consecutiveHysteresis) state_.hysteresisLeft = o.hysteresis;
      state_.scale *= o.scaleFactor;
    }
  }
  state_.iteration += 1;
}

}  // namespace zeroplus::zero::engine
