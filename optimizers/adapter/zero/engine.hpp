// The C++ ZeRO engine (stages 1-3): buckets and their flat buffers, gradient reduction, clipping
// across shards, the step loop over buckets on the fused kernels, and at stage 3 the gathering
// and release of parameters unit by unit, driven by events from a front-end (zeroplus.hpp's
// LibTorch optimizer today):
//
//   unitForwardBegin(u)   stage 3: unit u is about to run forward (gather it, prefetch u + 1)
//   unitForwardEnd(u)     stage 3: unit u's forward returned (release it)
//   unitBackwardBegin(u)  stage 3: unit u's backward is next (gather it again, prefetch u - 1)
//   gradReady(i)        autograd finished trainable parameter i's gradient (its .grad is set)
//   endBackward()       the backward pass ended (every gradient it produces has arrived)
//   clipGradNorm(...)   the global norm across shards; scales the gradient shards
//   step(hyper)         agree on used parameters, clip if configured, step every bucket, all-gather
//   zeroGrad(toNone)    drop (or zero) the gradient shards
//
// One owner per concern: a Placement (FlatParams at stages 1-2, ShardedParams at stage 3: where
// parameters and masters live), GradReducer (where a bucket's gradient lives), BucketStepper (a
// bucket's optimizer state and kernel call), OptimizerSwapper (NVMe offload of that state),
// Collectives (every byte between ranks), BucketStates (a bucket's master and optimizer state
// read or replaced between steps, wherever they live). The engine only sequences them, as the Python engine's
// ZeroEngine does (zero/engine.py), with the same operations in the same order: the same model,
// data and bucket size train bit-identically through either front-end.
//
// Collective calls (construction, endBackward, clipGradNorm, step) must be made by every rank in
// the same order. Not thread-safe except as GradReducer documents (gradReady on the autograd
// thread). Errors are c10::Error / c10::ValueError naming the call.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <optional>
#include <vector>

#include "optimizers/adapter/zero/bucket_states.hpp"
#include "optimizers/adapter/zero/bucket_stepper.hpp"
#include "optimizers/adapter/zero/collectives.hpp"
#include "optimizers/adapter/zero/flat_params.hpp"
#include "optimizers/adapter/zero/grad_reducer.hpp"
#include "optimizers/adapter/zero/loss_scaler.hpp"
#include "optimizers/adapter/zero/optimizer_swapper.hpp"
#include "optimizers/adapter/zero/options.hpp"
#include "optimizers/adapter/zero/placement.hpp"
#include "optimizers/adapter/zero/sharded_params.hpp"

namespace zeroplus::zero::engine {

class Engine {
 public:
  // groups[g]: the trainable parameters of group g. Stage 3: units says which unit each trainable
  // parameter (groups chained) belongs to, or that it stays whole (sharded_params.hpp). Collective.
  // groupHyper[g]: group g's hyperparameters at initialize (the NVMe swapper sizes records by them).
  Engine(const std::vector<std::vector<at::Tensor>>& groups, c10::intrusive_ptr<c10d::ProcessGroup> pg,
         const Options& options, const std::vector<StepHyper>& groupHyper, const UnitLayout& units = {});

  int stage() const { return stage_; }
  const Options& options() const { return options_; }
  Collectives& comm() { return comm_; }
  std::optional<at::ScalarType> computeDtype() const { return computeDtype_; }

  // -- events --
  void unitForwardBegin(int64_t unit);
  void unitForwardEnd(int64_t unit);
  void unitBackwardBegin(int64_t unit);
  void gradReady(int64_t index);
  void endBackward();
  bool passOpen() const { return reducer_.passOpen(); }
  void setNoSync(bool on) { reducer_.setNoSync(on); }
  bool noSync() const { return reducer_.noSync(); }
  // Gradients were reduced since the last zeroGrad.
  bool hasGradients() const { return reducer_.hasGrads(); }

  // Clips the global gradient norm across all shards to maxNorm; returns the norm before
  // clipping (0-d fp32), of the unscaled gradients under fp16, where a non-finite norm (an
  // overflow: step() skips the step) clips nothing. Collective.
  at::Tensor clipGradNorm(double maxNorm, double normType, bool errorIfNonfinite);
  // One optimizer step with these per-group hyperparameters. Collective. fp16: a step whose
  // gradients overflowed on any rank is skipped on every rank (the gradients become zeros, the
  // loss scale drops); otherwise the gradients are unscaled as each bucket steps.
  void step(const std::vector<StepHyper>& hyper);
  void zeroGrad(bool setToNone);

  // -- fp16 loss scaling (loss_scaler.hpp) --
  bool fp16() const { return computeDtype_ == at::kHalf; }
  // What backward multiplies the loss by (1 unless fp16).
  double lossScale() const { return scaler_.scale(); }
  LossScaler& scaler() { return scaler_; }
  // Steps skipped on an fp16 overflow (checkpointed as Python's skipped_steps).
  int64_t skippedSteps() const { return skippedSteps_; }
  void setSkippedSteps(int64_t n) { skippedSteps_ = n; }

  // -- state (front-ends, full_state_dict, checkpoints) --
  Placement& params() { return *placement_; }
  // Stage 3's placement (nullptr at stages 1-2).
  ShardedParams* sharded() { return sharded_; }
  std::vector<BucketStepper>& steppers() { return steppers_; }
  // This rank's gradient shard per bucket (after backward; flushes a no_sync accumulation).
  std::vector<at::Tensor> gradientShards();
  // Elements of optimizer state (masters) this rank holds: about 1/world of the model.
  int64_t ownedNumel() const;
  // Reads bucket b's master and optimizer state between steps (BucketStates::read).
  BucketStates& states() { return *states_; }
  // Replaces every bucket's master and optimizer state (values[b]: BucketStates::write's) and
  // publishes the masters into the parameters on every rank (the all-gathers step() ends with);
  // returns when the offloaded records are written. Collective (load_checkpoint).
  void writeStates(const std::vector<BucketValues>& values, const char* op);
  // The NVMe optimizer swapper (nullptr unless options.offload_optimizer is "nvme").
  OptimizerSwapper* swapper() { return swapper_.get(); }

 private:
  void checkParamHomes() const;
  bool overflow();
  void resetUnitCounts();

  Options options_;
  int stage_;
  std::optional<at::ScalarType> computeDtype_;
  Collectives comm_;
  std::unique_ptr<Placement> placement_;
  ShardedParams* sharded_ = nullptr;  // placement_ at stage 3
  std::vector<int64_t> unitRemaining_;  // stage 3: gradients each unit still waits for this pass
  GradReducer reducer_;
  std::vector<BucketStepper> steppers_;
  std::unique_ptr<OptimizerSwapper> swapper_;  // after steppers_: destroyed first
  std::unique_ptr<BucketStates> states_;
  bool clippedThisStep_ = false;
  LossScaler scaler_;
  int64_t skippedSteps_ = 0;
};

}  // namespace zeroplus::zero::engine
