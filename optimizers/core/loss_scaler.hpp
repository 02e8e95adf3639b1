// fp16 loss scaling with DeepSpeed's rules: the one implementation both ZeRO front-ends drive.
// The C++ engine holds one (adapter/zero/loss_scaler.hpp turns its Options into Settings and the
// status codes below into c10 errors); the Python engine holds one through the TorchScript class
// torch.classes.zeroplus.LossScaler (registration/optim_registration.cpp), wrapped by
// plugin/python/zeroplus/zero/loss_scaler.py. One implementation is why both front-ends scale,
// skip and grow on the same steps and share checkpoints.
//
//  * Dynamic: the scale starts at Settings::initScale. An overflow consumes one unit of
//    hysteresis; only when hysteresis is down to one does it divide the scale by scaleFactor
//    (never below minScale; an overflow with the scale already at minScale fails when
//    raiseErrorAtMinScale). Every scaleWindow clean steps since the last overflow the scale is
//    multiplied by scaleFactor and hysteresis is refilled (after every clean step with
//    consecutiveHysteresis).
//  * Fixed (LossScaler::fixed): a static scale (fp16 with a configured loss_scale, or 1 for
//    fp32/bf16); update() changes nothing.
//
// The overflow decision is made by the engine and agreed across ranks before update() is called,
// so every rank's scaler stays identical. Plain values, no torch, no I/O; not thread-safe (one
// engine owns it). Errors are values: checkLossScalerSettings returns -EINVAL and names the
// problem, update returns -ERANGE; the front-ends word the exceptions in their own vocabulary.
#pragma once

#include <cstdint>
#include <string>

namespace zeroplus::optim {

// The dynamic scaler's knobs; defaults are DeepSpeed's (the Python engine's ds_keys.py FP16).
struct LossScalerSettings {
  double initScale = 65536.0;
  int64_t scaleWindow = 1000;
  int64_t hysteresis = 2;
  double minScale = 1.0;
  bool consecutiveHysteresis = false;
  double scaleFactor = 2.0;
  bool raiseErrorAtMinScale = true;
};

// What a checkpoint holds of a dynamic scaler (the Python engine's scaler.state_dict()).
struct LossScalerState {
  double scale = 65536.0;
  int64_t hysteresisLeft = 2;
  int64_t iteration = 0;
  int64_t lastOverflowIteration = -1;
};

// The first rule a LossScalerSettings breaks, in this order: initScale and minScale positive
// finite numbers, scaleFactor > 1, scaleWindow and hysteresis >= 1, initScale >= minScale.
struct LossScalerProblem {
  // The field that broke its rule; kInitBelowMin: the one rule between two fields.
  enum class Field { kInitScale, kMinScale, kScaleFactor, kScaleWindow, kHysteresis, kInitBelowMin };
  Field field = Field::kInitScale;
  // What the field must be ("a positive finite number", "> 1", "an integer >= 1"); empty for
  // kInitBelowMin.
  const char* rule = "";
};

// 0 when every rule holds; -EINVAL with *problem (when not null) naming the first broken one.
int checkLossScalerSettings(const LossScalerSettings& settings, LossScalerProblem* problem);

class LossScaler {
 public:
  using Settings = LossScalerSettings;
  using State = LossScalerState;

  // A dynamic scaler. Precondition: checkLossScalerSettings(settings) == 0 (the front-ends check
  // first and raise; a scaler built from broken settings may divide by zero or never grow).
  explicit LossScaler(const Settings& settings);
  // A static scaler of this scale (> 0); its settings are the defaults and are not used.
  static LossScaler fixed(double scale);

  bool dynamic() const { return dynamic_; }
  double scale() const { return state_.scale; }
  const State& state() const { return state_; }
  const Settings& settings() const { return settings_; }

  // A checkpoint's state (dynamic only: a static scaler keeps its scale). Not checked here: the
  // checkpoint readers refuse a non-finite or non-positive scale before calling this.
  void load(const State& state);

  // After every step that had gradients; overflow is the agreed decision. 0, or -ERANGE when an
  // overflow found the scale at its minimum with raiseErrorAtMinScale: nothing changed (not even
  // the iteration), the caller raises with atMinimumMessage().
  int update(bool overflow);

  // The error an update's -ERANGE stands for, worded once for both front-ends.
  std::string atMinimumMessage() const;

 private:
  LossScaler(bool dynamic, const Settings& settings, const State& state)
      : dynamic_(dynamic), settings_(settings), state_(state) {}

  bool dynamic_;
  Settings settings_;
  State state_;
};

}  // namespace zeroplus::optim
