// engine::BucketStates: reads and replaces one bucket's fp32 master and optimizer state on this
// rank wherever they live between steps — in the steppers' tensors, or (Options::offload_optimizer
// "nvme") in the OptimizerSwapper's record — for the code outside the step loop that needs them
// (checkpoint_io.cpp). The one place that asks where a bucket's state lives; callers see values.
//
//   read(b)    the bucket's values per segment. In memory: the live tensors themselves (valid
//              until the next step or write); offloaded: copies read through the swapper's fetch
//              path, the record given back unchanged (no write, nothing left bound).
//   write(b)   replaces the bucket's master and state and publishes the master into the
//              parameters (an all-gather at stages 1-2, whose work the caller waits on: the
//              engine's writeStates does). Offloaded: into a fresh record whose write starts
//              at once (the read of the old one is skipped: a corrupt record is simply replaced).
//   finish()   waits for the writes write() started: a following step reads what was loaded (a
//              failed write keeps its record in memory and is raised by the next step, as the
//              step's own write faults are).
//
// Errors: c10::Error naming `op`, the bucket and the swap file; a failed read changes nothing.
// Not thread-safe: the training thread, between steps.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

#include "optimizers/adapter/zero/bucket_stepper.hpp"
#include "optimizers/adapter/zero/optimizer_swapper.hpp"
#include "optimizers/adapter/zero/placement.hpp"

namespace zeroplus::zero::engine {

// One segment's values (BucketStepper's segments, in order): its piece of the fp32 master and
// the state it has (undefined tensors: kinds it does not have; `step` 0-d fp32).
struct SegmentValues {
  at::Tensor master;
  SegmentState state;
};
using BucketValues = std::vector<SegmentValues>;

class BucketStates {
 public:
  // swapper: nullptr when the state lives in memory.
  BucketStates(Placement& placement, std::vector<BucketStepper>& steppers, OptimizerSwapper* swapper)
      : placement_(placement), steppers_(steppers), swapper_(swapper) {}

  // Before a series of reads: the writes in flight end first (a record being written is read
  // from its buffer either way; this makes the order plain).
  void beginRead();
  BucketValues read(size_t b, const char* op);
  // values: one per segment, masters of the segments' lengths (any float dtype), state fp32.
  c10::intrusive_ptr<c10d::Work> write(size_t b, const BucketValues& values, const char* op);
  void finish();

 private:
  Placement& placement_;
  std::vector<BucketStepper>& steppers_;
  OptimizerSwapper* swapper_;
};

}  // namespace zeroplus::zero::engine
