// One bucket's optimizer step in the C++ ZeRO engine: the fused Adam/AdamW/SGD kernels
// (fused_optimizer_ops.hpp) over this rank's shard of the bucket's fp32 master.
//
// The shard is stepped as *segments*, one per parameter piece it holds (Bucket::piece), each with
// its own optimizer state and step count, exactly as torch.optim keeps state per parameter and as
// the Python engine's BucketOptimizer does: a parameter whose gradient is not defined (no rank
// used it) is skipped entirely (no weight decay, no moment change, no step count). State is
// created lazily at a segment's first step: fp32 zeros and a 0-d fp32 `step` (torch's keys).
//
// Ownership: segments are views of the master; the stepper owns their state tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "optimizers/adapter/zero/flat_params.hpp"
#include "optimizers/adapter/zero/options.hpp"

namespace zeroplus::zero::engine {

struct SegmentState {
  at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq, step;  // Adam family
  at::Tensor momentum_buffer;                              // SGD
};

struct Segment {
  int64_t entry;   // index into the bucket's entries
  int64_t lo, hi;  // in shard coordinates
  at::Tensor master;  // master[lo:hi]
  SegmentState state;
};

class BucketStepper {
 public:
  BucketStepper(const Bucket& bucket, at::Tensor master, int rank);

  // Raises c10::ValueError naming group `group` and the field when the kernels would refuse a
  // hyperparameter; called for every bucket before any bucket steps.
  static void check(const StepHyper& hyper, int64_t group);

  // One step of this rank's shard. gradShard: the bucket's gradient shard (any float dtype);
  // stepped[flagBase + entry]: whether that parameter is updated. invScale: 1 / the fp16 loss
  // scale the shard holds (1: nothing to unscale), applied after the cast to fp32.
  void step(const at::Tensor& gradShard, const std::vector<uint8_t>& stepped, int64_t flagBase,
            const StepHyper& hyper, double invScale = 1.0);

  std::vector<Segment>& segments() { return segments_; }
  const std::vector<Segment>& segments() const { return segments_; }
  const at::Tensor& master() const { return master_; }
  // The master's storage was replaced (set_ on its TensorImpl: the NVMe swapper binds it to a
  // record and empties it after the step): the segments' views follow it.
  void rebindMaster() {
    for (Segment& s : segments_) s.master = master_.slice(0, s.lo, s.hi);
  }

 private:
  at::Tensor master_;
  std::vector<Segment> segments_;
};

}  // namespace zeroplus::zero::engine
