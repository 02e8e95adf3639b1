// Where a ZeRO engine's parameters live, behind one interface the engine sequences:
//   FlatParams     (flat_params.hpp)    stages 1-2: whole on every rank, all-gathered after a step
//   ShardedParams  (sharded_params.hpp) stage 3: this rank's shard between uses, gathered unit by
//                                       unit around forward and backward
// Both plan the same Buckets (flat_params.hpp) and keep this rank's fp32 master of each bucket's
// shard; the engine's reducer and steppers work on buckets and masters only, never on a
// parameter's .data.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <utility>
#include <vector>

namespace zeroplus::zero::engine {

struct Bucket;
struct Entry;

class Placement {
 public:
  virtual ~Placement() = default;
  virtual std::vector<Bucket>& buckets() = 0;
  virtual const std::vector<Bucket>& buckets() const = 0;
  virtual at::Tensor& master(size_t b) = 0;
  virtual const std::vector<at::Tensor>& masters() const = 0;
  // (bucket, entry) of trainable parameter `index` (groups chained).
  virtual std::pair<int64_t, int64_t> slot(int64_t index) const = 0;
  // After bucket b stepped: its master into the parameters (an all-gather at stages 1-2, whose
  // work is returned; this rank's shard at stage 3: null).
  virtual c10::intrusive_ptr<c10d::Work> publish(size_t b) = 0;
  // Drops what publish kept alive for its collectives (after their works were waited on).
  virtual void releaseGatherInputs() {}
  // The first parameter whose .data is no longer where this placement put it (the model was
  // moved or a parameter replaced after initialize), or nullptr.
  virtual const Entry* strayParam() const = 0;
};

}  // namespace zeroplus::zero::engine
