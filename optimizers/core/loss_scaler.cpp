#include "optimizers/core/loss_scaler.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <sstream>

namespace zeroplus::optim {
namespace {

int broken(LossScalerProblem* problem, LossScalerProblem::Field field, const char* rule) {
  if (problem != nullptr) *problem = LossScalerProblem{field, rule};
  return -EINVAL;
}

bool positiveFinite(double v) { return std::isfinite(v) && v > 0; }

}  // namespace

int checkLossScalerSettings(const LossScalerSettings& s, LossScalerProblem* problem) {
  using Field = LossScalerProblem::Field;
  // DeepSpeed's order as the Python engine always checked it, so the first message is the same.
  if (!positiveFinite(s.initScale)) return broken(problem, Field::kInitScale, "a positive finite number");
  if (!positiveFinite(s.minScale)) return broken(problem, Field::kMinScale, "a positive finite number");
  if (!(s.scaleFactor > 1)) return broken(problem, Field::kScaleFactor, "> 1");  // NaN fails too
  if (s.scaleWindow < 1) return broken(problem, Field::kScaleWindow, "an integer >= 1");
  if (s.hysteresis < 1) return broken(problem, Field::kHysteresis, "an integer >= 1");
  if (s.initScale < s.minScale) return broken(problem, Field::kInitBelowMin, "");
  return 0;
}

LossScaler::LossScaler(const Settings& settings)
    : LossScaler(true, settings, State{settings.initScale, settings.hysteresis, 0, -1}) {}

LossScaler LossScaler::fixed(double scale) {
  const Settings defaults;
  return LossScaler(false, defaults, State{scale, defaults.hysteresis, 0, -1});
}

void LossScaler::load(const State& state) {
  if (dynamic_) state_ = state;
}

int LossScaler::update(bool overflow) {
  if (!dynamic_) return 0;  // a static scale never changes (fp32/bf16 never skip a step)
  const Settings& o = settings_;
  if (overflow) {
    if (o.hysteresis == 1 || state_.hysteresisLeft == 1) {
      // Checked before anything changes: the caller raises and the scaler is as it was.
      if (state_.scale <= o.minScale && o.raiseErrorAtMinScale) return -ERANGE;
      state_.scale = std::max(state_.scale / o.scaleFactor, o.minScale);
    } else {
      state_.hysteresisLeft -= 1;
    }
    state_.lastOverflowIteration = state_.iteration;
  } else {
    if (o.consecutiveHysteresis) state_.hysteresisLeft = o.hysteresis;
    // DeepSpeed's (Python's) % with a positive window: the difference is >= 1 here (the last
    // overflow is an earlier iteration, or -1), so C++'s % agrees with it.
    if ((state_.iteration - state_.lastOverflowIteration) % o.scaleWindow == 0) {
      if (!o.consecutiveHysteresis) state_.hysteresisLeft = o.hysteresis;
      state_.scale *= o.scaleFactor;
    }
  }
  state_.iteration += 1;
  return 0;
}

std::string LossScaler::atMinimumMessage() const {
  std::ostringstream out;
  out << "fp16 loss scale is already at its minimum (" << settings_.minScale
      << ") and gradients still overflow; lower the learning rate or train in bf16";
  return out.str();
}

}  // namespace zeroplus::optim
