// The C++ ZeRO engine (stages 1-2): buckets and their flat buffers, gradient reduction, clipping
// across shards, and the step loop over buckets on the fused kernels, driven by events from a
// front-end (zeroplus.hpp's LibTorch optimizer today):
//
//   gradReady(i)        autograd finished trainable parameter i's gradient (its .grad is set)
//   endBackward()       the backward pass ended (every gradient it produces has arrived)
//   clipGradNorm(...)   the global norm across shards; scales the gradient shards
//   step(hyper)         agree on used parameters, clip if configured, step every bucket, all-gather
//   zeroGrad(toNone)    drop (or zero) the gradient shards
//
// One owner per concern: FlatParams (where parameters and masters live), GradReducer (where a
// bucket's gradient lives), BucketStepper (a bucket's optimizer state and kernel call),
// Collectives (every byte between ranks). The engine only sequences them, as the Python engine's
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

#include "optimizers/adapter/zero/bucket_stepper.hpp"
#include "optimizers/adapter/zero/collectives.hpp"
#include "optimizers/adapter/zero/flat_params.hpp"
#include "optimizers/adapter/zero/grad_reducer.hpp"
#include "optimizers/adapter/zero/options.hpp"

namespace zeroplus::zero::engine {

class Engine {
 public:
  // groups[g]: the trainable parameters of group g. Collective.
  Engine(const std::vector<std::vector<at::Tensor>>& groups, c10::intrusive_ptr<c10d::ProcessGroup> pg,
         const Options& options);

  int stage() const { return stage_; }
  const Options& options() const { return options_; }
  Collectives& comm() { return comm_; }
  std::optional<at::ScalarType> computeDtype() const { return computeDtype_; }

  // -- events --
  void gradReady(int64_t index);
  void endBackward();
  bool passOpen() const { return reducer_.passOpen(); }
  void setNoSync(bool on) { reducer_.setNoSync(on); }
  bool noSync() const { return reducer_.noSync(); }
  // Gradients were reduced since the last zeroGrad.
  bool hasGradients() const { return reducer_.hasGrads(); }

  // Clips the global gradient norm across all shards to maxNorm; returns the norm before
  // clipping (0-d fp32). Collective.
  at::Tensor clipGradNorm(double maxNorm, double normType, bool errorIfNonfinite);
  // One optimizer step with these per-group hyperparameters. Collective.
  void step(const std::vector<StepHyper>& hyper);
  void zeroGrad(bool setToNone);

  // -- state (front-ends, full_state_dict, checkpoints) --
  FlatParams& params() { return params_; }
  std::vector<BucketStepper>& steppers() { return steppers_; }
  // This rank's gradient shard per bucket (after backward; flushes a no_sync accumulation).
  std::vector<at::Tensor> gradientShards();
  // Elements of optimizer state (masters) this rank holds: about 1/world of the model.
  int64_t ownedNumel() const;
  // Every bucket's master into the parameters on every rank (the all-gathers step() ends with),
  // after the masters were replaced (load_checkpoint). Collective.
  void publishMasters();

 private:
  void checkParamHomes() const;

  Options options_;
  int stage_;
  std::optional<at::ScalarType> computeDtype_;
  Collectives comm_;
  FlatParams params_;
  GradReducer reducer_;
  std::vector<BucketStepper> steppers_;
  bool clippedThisStep_ = false;
};

}  // namespace zeroplus::zero::engine
