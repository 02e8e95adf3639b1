// Stage-3 parameter placement of the C++ ZeRO engine: between uses every rank holds only its
// shard of each bucket; a unit's buckets are all-gathered just before the unit runs (forward, and
// again before its backward) and freed right after.
//
// Persistent parameters (unit -1: in no unit, so nothing gathers them around their use; the
// front-end decides which, units.hpp) are placed as at stage 2: whole on every rank in a flat
// buffer they view for good, gradients reduce-scattered, this rank's shard stepped, and the
// bucket all-gathered after the step (publish returns that work). The Python engine keeps its
// param_persistence_threshold and persistent_modules parameters the same way.
//
// Buckets: one per (unit, param group, dtype), and per run of consecutive persistent parameters
// of a group and dtype, planned in readiness order: the reverse of the model's registration order
// (a unit sits where its first parameter is registered), so gradients are reduce-scattered unit by
// unit as backward produces them. Each sharded bucket keeps
//   shard   this rank's slice, in the compute dtype (kept between uses);
//   master  its fp32 copy (the shard itself without mixed precision);
//   flat    the gathered buffer. Its storage is freed (resized to 0 bytes) when the unit is
//           released and re-filled in place when gathered again, so tensors autograd saved in
//           forward (views of the parameters) see the gathered values again in backward: the
//           storage object is the same, only its bytes come and go.
// A parameter at rest shows a stride-0 expansion of one NaN element of its dtype: its shape,
// numel and dtype are the full parameter's (what the model reports is what DDP reports), it holds
// no memory, a read gives NaN and a write raises. Gathered, it views `flat`. A persistent bucket's
// flat buffer is never freed, its shard is this rank's slice of it and its master is that slice
// (fp32) or an fp32 copy (bf16), as FlatParams keeps them.
//
// Construction is collective (rank 0's values are broadcast, then each rank keeps its shard).
// prefetch/gather/release are collective in the sense that every rank must gather the same units
// in the same order (forward and backward order are the model's). Not thread-safe; called from
// the training thread and the autograd thread (which LibTorch runs on the caller's thread on CPU).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <vector>

#include "optimizers/adapter/zero/collectives.hpp"
#include "optimizers/adapter/zero/flat_params.hpp"
#include "optimizers/adapter/zero/placement.hpp"

namespace zeroplus::zero::engine {

// Which unit each trainable parameter belongs to (groups chained), from the front-end.
struct UnitLayout {
  int64_t unitCount = 0;
  std::vector<int64_t> unitOf;    // -1 (persistent: kept whole) or 0 <= unitOf[i] < unitCount
  // The unit whose place in the readiness order and whose buckets parameter i joins: unitOf[i],
  // or for a parameter of a unit kept whole by param_persistence_threshold that unit (its own
  // bucket run beside the unit's sharded ones, as the Python engine lays it out); -1 for one in
  // no unit (placed where it is registered). Empty: unitOf.
  std::vector<int64_t> homeUnit;
  std::vector<int64_t> position;  // where the model registers parameter i (readiness: the reverse)
};

class ShardedParams : public Placement {
 public:
  // groups[g]: the trainable parameters of group g; layout: one entry per trainable parameter.
  ShardedParams(const std::vector<std::vector<at::Tensor>>& groups, const UnitLayout& layout, Collectives& comm,
                std::optional<at::ScalarType> computeDtype);

  std::vector<Bucket>& buckets() override { return buckets_; }
  const std::vector<Bucket>& buckets() const override { return buckets_; }
  at::Tensor& master(size_t b) override { return masters_[b]; }
  const std::vector<at::Tensor>& masters() const override { return masters_; }
  std::pair<int64_t, int64_t> slot(int64_t index) const override { return slots_[index]; }
  // master -> shard, no collective; a persistent bucket's shard is then all-gathered (the work).
  c10::intrusive_ptr<c10d::Work> publish(size_t b) override;
  void releaseGatherInputs() override { gatherInputs_.clear(); }
  const Entry* strayParam() const override;

  int64_t unitCount() const { return static_cast<int64_t>(units_.size()); }
  // The unit of trainable parameter `index`, or -1 when it is persistent.
  int64_t unitOf(int64_t index) const { return unitOfParam_[index]; }
  int64_t paramsOf(int64_t unit) const { return units_[unit].params; }
  // Starts unit u's all-gathers (nothing when it is gathered or on its way).
  void prefetch(int64_t u);
  // Unit u's parameters are full (waits for its all-gathers).
  void gather(int64_t u);
  // Unit u back to shards: its storage freed, its parameters at rest.
  void release(int64_t u);
  void releaseAll();
  bool gathered(int64_t u) const { return units_[u].state == State::kGathered; }
  // Bytes of gathered parameter storage held right now (0 between steps; persistent buckets not
  // counted: they are never released).
  int64_t gatheredBytes() const;
  // Bytes kept for reuse by the next gathers (never more than the most ever gathered at once).
  int64_t pooledBytes() const { return static_cast<int64_t>(pooledBytes_); }
  int64_t peakGatheredBytes() const { return static_cast<int64_t>(peakLive_); }

 private:
  enum class State { kReleased, kInFlight, kGathered };
  struct Unit {
    std::vector<size_t> buckets;
    int64_t params = 0;  // trainable parameters in the unit
    State state = State::kReleased;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
  };
  void showFull(size_t b);
  void showResting(size_t b);
  at::Tensor restingBase(at::ScalarType dtype);

  Collectives& comm_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> masters_;
  std::vector<std::pair<int64_t, int64_t>> slots_;
  std::vector<int64_t> unitOfParam_;
  std::vector<Unit> units_;
  std::vector<std::vector<at::Tensor>> fullViews_;  // [bucket][entry]: views of flat, made once
  std::vector<at::Tensor> restingBases_;            // one NaN element per dtype in use
  std::vector<at::Tensor> gatherInputs_;            // persistent publishes' inputs, until their works end
  // Released gathered storage, by byte size, handed to the next gather of that size: a fresh
  // allocation per gather would page-fault the whole unit in again (glibc maps large blocks and
  // unmaps them on free). Bounded by the most ever gathered at once: what a release would push
  // beyond it is freed.
  std::map<size_t, std::vector<at::DataPtr>> freeStorage_;
  size_t pooledBytes_ = 0, liveBytes_ = 0, peakLive_ = 0;
  void attachStorage(Bucket& bucket);
  void detachStorage(Bucket& bucket);
};

}  // namespace zeroplus::zero::engine
