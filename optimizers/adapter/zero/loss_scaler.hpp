// The C++ engine's edge of fp16 loss scaling: the rules live in optimizers/core/loss_scaler.hpp
// (shared with the Python engine); this file turns the engine's Options into a scaler and the
// core's status codes into c10 errors worded with the Options' names.
//
//  * fp16 with Options::loss_scale 0: a dynamic scaler starting at 2^initial_scale_power, with
//    loss_scale_window, hysteresis, min_loss_scale and consecutive_hysteresis.
//  * fp16 with loss_scale > 0: a static scaler of that scale; fp32/bf16: a static scale of 1.
#pragma once

#include "optimizers/adapter/zero/options.hpp"
#include "optimizers/core/loss_scaler.hpp"

namespace zeroplus::zero::engine {

using LossScaler = optim::LossScaler;

// Raises c10::ValueError naming the option ("zeroplus::zero::initialize: options.hysteresis
// must be an integer >= 1, got 0") for a value the core refuses. fp16 only.
void checkLossScaling(const Options& options, const char* op);

// The engine's scaler (options checked by checkLossScaling).
LossScaler makeLossScaler(const Options& options);

// scaler.update(overflow) after every step that had gradients (overflow: the agreed decision).
// Raises c10::Error (Python's LossScaleAtMinimumError) on an overflow with the scale at its
// minimum; the scaler is then unchanged.
void updateLossScale(LossScaler& scaler, bool overflow);

}  // namespace zeroplus::zero::engine
