// Stages 1-2 parameter placement of the C++ ZeRO engine: every trainable parameter becomes a
// view into its bucket's flat buffer, every rank holds them all, and after each bucket's step
// this rank's shard is all-gathered into the flat buffer (the model sees the new values at once).
//
// The bucket cuts are the torch-free planner's (optimizers/core/flat_bucket_planner.hpp), fed
// exactly as the Python engine feeds it (zero/layout.py plan_buckets): parameters in reverse
// registration order, group by group from the last group, one planner segment per (group, dtype);
// shards start on 16-element boundaries. The same model and bucket size therefore give the same
// buckets, shards and masters in both front-ends.
//
// Masters: this rank's fp32 shard of each bucket. Without mixed precision (fp32 parameters) the
// master IS that shard of the flat buffer; with bf16 it is an fp32 copy made from the
// full-precision values before the parameters are rounded (Python's rule).
//
// Construction is collective (rank 0's values are broadcast, as DDP does). Not thread-safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <optional>
#include <utility>
#include <vector>

#include "optimizers/adapter/zero/collectives.hpp"
#include "optimizers/adapter/zero/placement.hpp"

namespace zeroplus::zero::engine {

// Shard starts are multiples of this many elements (64 bytes of fp32: the SIMD kernels' width).
constexpr int64_t kAlignElems = 16;

struct Entry {
  at::Tensor param;            // the user's parameter (its .data is a view into `flat`)
  int64_t index = 0;           // position in the engine's trainable list (groups chained)
  int64_t offset = 0;          // first element inside the bucket
  int64_t numel = 0;
  std::vector<int64_t> shape;  // the parameter's shape
};

// One parameter's part of one rank's shard: [shardLo, shardHi) of the shard holds elements
// [paramLo, paramHi) of the flattened parameter (all 0 when the shard holds none of it).
struct Piece {
  int64_t shardLo = 0, shardHi = 0, paramLo = 0, paramHi = 0;
  int64_t numel() const { return shardHi - shardLo; }
};

struct Bucket {
  int64_t index = 0;
  int64_t group = 0;              // param group
  at::ScalarType dtype = at::kFloat;  // compute dtype of its parameters and gradients
  int64_t numel = 0;              // padded to world * kAlignElems
  int64_t shardNumel = 0;
  std::vector<Entry> entries;
  at::Tensor flat;                // the parameters' storage (numel elements); stage 3: only while gathered
  at::Tensor shard;               // stage 3: this rank's slice (shardNumel elements), kept between uses
  int64_t unit = -1;              // stage 3: the unit whose forward uses the bucket (-1: in no unit)
  bool persistent = false;        // stage 3: its parameters stay whole on every rank (in no unit, or
                                  // small: param_persistence_threshold; never gathered or released)
  at::Device device{at::kCPU};    // where its parameters, gradients and master live (the parameters')

  // Options for a new tensor of this bucket: dtype `t` on the bucket's device.
  at::TensorOptions options(at::ScalarType t) const { return at::TensorOptions().dtype(t).device(device); }

  std::pair<int64_t, int64_t> shardRange(int rank) const { return {rank * shardNumel, (rank + 1) * shardNumel}; }
  Piece piece(const Entry& e, int rank) const;
  // [lo, hi) ranges covered by no parameter (alignment gaps, padding), in offset order.
  std::vector<std::pair<int64_t, int64_t>> gaps() const;
};

// Planning shared by both placements (FlatParams, ShardedParams): one parameter as the planner
// sees it, in the order its gradient is expected to be ready.
struct PlanItem {
  at::Tensor param;
  int64_t index = 0;  // position in the engine's trainable list (groups chained)
  int64_t group = 0;
  int64_t unit = -1;  // stage 3's unit, kept whole or not (-1 at stages 1-2 and for parameters in no unit)
  at::ScalarType dtype = at::kFloat;  // compute dtype
  bool persistent = false;  // stage 3: kept whole on every rank
};

// Buckets over `items`: consecutive items with the same (unit, group, dtype, persistent) may share
// one, of at most capElems elements (a larger parameter gets its own). Fills slots[index] =
// (bucket, entry); the buckets' flat/shard tensors are left to the placement.
std::vector<Bucket> planBuckets(const std::vector<PlanItem>& items, int worldSize, int64_t capElems,
                                std::vector<std::pair<int64_t, int64_t>>& slots);

// Bucket b's parameter values as rank 0 has them, flat: in fp32 under mixed precision (a master
// then starts from the full-precision values, not the rounded ones), else in the bucket's dtype.
// Collective (a broadcast from rank 0, DDP's rule).
at::Tensor stageRankZeroValues(const Bucket& b, bool mixedPrecision, Collectives& comm);

class FlatParams : public Placement {
 public:
  // groups[g]: the trainable parameters of param group g (contiguous, floating point, all on the
  // engine's device: CPU or one CUDA device; identical lists on every rank); computeDtype: the
  // parameters' dtype after initialize (nullopt: as they are). Collective.
  FlatParams(const std::vector<std::vector<at::Tensor>>& groups, Collectives& comm,
             std::optional<at::ScalarType> computeDtype, int64_t reduceBucketElems);

  std::vector<Bucket>& buckets() override { return buckets_; }
  const std::vector<Bucket>& buckets() const override { return buckets_; }
  at::Tensor& master(size_t b) override { return masters_[b]; }
  const std::vector<at::Tensor>& masters() const override { return masters_; }
  std::pair<int64_t, int64_t> slot(int64_t index) const override { return slots_[index]; }

  // Bucket b's master into this rank's shard of its flat buffer, then the all-gather of that
  // bucket (asynchronous: the next bucket steps meanwhile). The returned work must be waited on.
  c10::intrusive_ptr<c10d::Work> publish(size_t b) override;
  void releaseGatherInputs() override { gatherInputs_.clear(); }
  const Entry* strayParam() const override;

 private:
  Collectives& comm_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> masters_;
  std::vector<std::pair<int64_t, int64_t>> slots_;
  std::vector<at::Tensor> gatherInputs_;  // each publish's input, alive until releaseGatherInputs
};

}  // namespace zeroplus::zero::engine
