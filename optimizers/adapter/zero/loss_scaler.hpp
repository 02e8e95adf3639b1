// fp16 loss scaling for the C++ ZeRO engine, with the Python engine's rules (DeepSpeed's):
// plugin/python/zeroplus/zero/loss_scaler.py (DynamicLossScaler and StaticLossScaler), operation
// for operation, so both front-ends scale, skip and grow on the same steps.
//
//  * Dynamic (fp16, Options::loss_scale 0): the scale starts at 2^initial_scale_power. An
//    overflow consumes one unit of hysteresis; only when hysteresis is down to one does it halve
//    the scale (never below min_loss_scale; an overflow at the minimum raises). Every
//    loss_scale_window clean steps since the last overflow the scale doubles and hysteresis is
//    refilled (after every clean step with consecutive_hysteresis).
//  * Static (fp16 with loss_scale > 0, or fp32/bf16 with scale 1): update() changes nothing.
//
// The overflow decision is made by the engine and agreed across ranks before update() is called,
// so every rank's scaler stays identical. Plain values, no torch; not thread-safe.
#pragma once

#include <cstdint>

#include "optimizers/adapter/zero/options.hpp"

namespace zeroplus::zero::engine {

class LossScaler {
 public:
  // Python's LossScalerOptions (the options dict of a dynamic scaler's state).
  struct Settings {
    double initScale = 65536.0;
    int64_t scaleWindow = 1000;
    int64_t hysteresis = 2;
    double minScale = 1.0;
    bool consecutiveHysteresis = false;
    double scaleFactor = 2.0;
    bool raiseErrorAtMinScale = true;
  };
  // What the state dict holds (Python's DynamicLossScaler.state_dict minus "options").
  struct State {
    double scale;
    int64_t hysteresisLeft, iteration, lastOverflowIteration;
  };

  // From the engine's Options (checked by checkOptions): dynamic for fp16 with loss_scale 0,
  // static otherwise (fp16: loss_scale; fp32/bf16: 1).
  explicit LossScaler(const Options& options);

  // Raises c10::ValueError naming the option ("zeroplus::zero::initialize: options.hysteresis
  // must be ...") for a value the Python engine refuses. fp16 only.
  static void check(const Options& options, const char* op);

  bool dynamic() const { return dynamic_; }
  double scale() const { return state_.scale; }
  const State& state() const { return state_; }
  const Settings& settings() const { return settings_; }
  // A checkpoint's state (dynamic only; a static scaler keeps its scale, as Python's does).
  void load(const State& state);

  // After every step that had gradients: overflow is the agreed decision. Raises c10::Error
  // (Python's LossScaleAtMinimumError) on an overflow with the scale at its minimum.
  void update(bool overflow);

 private:
  bool dynamic_;
  Settings settings_;
  State state_;
};

}  // namespace zeroplus::zero::engine
