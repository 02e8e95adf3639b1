#include "optimizers/adapter/zero/flat_params.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "optimizers/core/flat_bucket_planner.hpp"

namespace zeroplus::zero::engine {

Piece Bucket::piece(const Entry& e, int rank) const {
  const auto [lo, hi] = shardRange(rank);
  const int64_t a = std::max(e.offset, lo), z = std::min(e.offset + e.numel, hi);
  if (a >= z) return {};
  return {a - lo, z - lo, a - e.offset, z - e.offset};
}

std::vector<std::pair<int64_t, int64_t>> Bucket::gaps() const {
  std::vector<const Entry*> sorted;
  for (const auto& e : entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const Entry* a, const Entry* b) { return a->offset < b->offset; });
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t pos = 0;
  for (const Entry* e : sorted) {
    if (e->offset > pos) out.emplace_back(pos, e->offset);
    pos = std::max(pos, e->offset + e->numel);
  }
  if (pos < numel) out.emplace_back(pos, numel);
  return out;
}

std::vector<Bucket> planBuckets(const std::vector<PlanItem>& items, int worldSize, int64_t capElems,
                                std::vector<std::pair<int64_t, int64_t>>& slots) {
  std::vector<int64_t> numels, segments;
  std::map<std::tuple<int64_t, int64_t, int, bool>, int64_t> keys;
  for (const PlanItem& item : items) {
    const auto key = std::make_tuple(item.unit, item.group, static_cast<int>(item.dtype), item.persistent);
    segments.push_back(keys.emplace(key, static_cast<int64_t>(keys.size())).first->second);
    numels.push_back(item.param.numel());
  }
  optim::FlatPlan plan;
  const int rc = optim::planFlatBuckets(numels, segments, worldSize, capElems, kAlignElems, &plan);
  TORCH_CHECK(rc == 0, "zeroplus::zero::initialize: the parameters are too large to plan buckets for (int64 overflow)");
  std::vector<Bucket> buckets;
  for (size_t bi = 0; bi < plan.buckets.size(); ++bi) {
    const optim::FlatBucket& fb = plan.buckets[bi];
    Bucket b;
    b.index = static_cast<int64_t>(bi);
    b.numel = fb.numel;
    b.shardNumel = fb.shard_numel;
    const PlanItem& first = items[fb.entries.front().param];
    b.group = first.group;
    b.unit = first.unit;
    b.dtype = first.dtype;
    b.persistent = first.persistent;
    b.device = first.param.device();
    for (const optim::FlatEntry& fe : fb.entries) {
      const PlanItem& item = items[fe.param];
      slots[item.index] = {b.index, static_cast<int64_t>(b.entries.size())};
      b.entries.push_back({item.param, item.index, fe.offset, fe.numel, item.param.sizes().vec()});
    }
    buckets.push_back(std::move(b));
  }
  return buckets;
}

at::Tensor stageRankZeroValues(const Bucket& b, bool mixedPrecision, Collectives& comm) {
  const at::ScalarType staging = mixedPrecision ? at::kFloat : b.dtype;
  at::Tensor flat = at::zeros({b.numel}, b.options(staging));
  for (const Entry& e : b.entries) flat.slice(0, e.offset, e.offset + e.numel).copy_(e.param.detach().reshape(-1));
  comm.broadcastFromZero(flat);
  return flat;
}

FlatParams::FlatParams(const std::vector<std::vector<at::Tensor>>& groups, Collectives& comm,
                       std::optional<at::ScalarType> computeDtype, int64_t reduceBucketElems)
    : comm_(comm) {
  // Readiness order: groups from the last, parameters from the last (DDP's heuristic, and the
  // Python engine's: the same order gives the same buckets).
  std::vector<int64_t> firstIndex(groups.size(), 0);
  for (size_t g = 1; g < groups.size(); ++g) firstIndex[g] = firstIndex[g - 1] + groups[g - 1].size();
  std::vector<PlanItem> items;
  for (int64_t g = static_cast<int64_t>(groups.size()) - 1; g >= 0; --g) {
    for (int64_t i = static_cast<int64_t>(groups[g].size()) - 1; i >= 0; --i) {
      const at::Tensor& p = groups[g][i];
      items.push_back({p, firstIndex[g] + i, g, -1, computeDtype.value_or(p.scalar_type()), false});
    }
  }
  slots_.resize(items.size());
  buckets_ = planBuckets(items, comm.worldSize(), reduceBucketElems, slots_);
  const int rank = comm.rank();
  for (Bucket& b : buckets_) {
    at::Tensor flat = stageRankZeroValues(b, computeDtype.has_value(), comm);
    const auto [lo, hi] = b.shardRange(rank);
    at::Tensor master;
    if (computeDtype || b.dtype != at::kFloat) {
      master = flat.slice(0, lo, hi).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      flat = flat.to(b.dtype);
    } else {
      master = flat.slice(0, lo, hi);  // fp32 training: the master IS this rank's slice of the parameters
    }
    b.flat = flat;
    for (const Entry& e : b.entries) {
      // set_data keeps the parameter's identity (autograd, the user's references, optimizers'
      // param groups) and points it at the bucket.
      e.param.set_data(flat.slice(0, e.offset, e.offset + e.numel).view(e.shape));
    }
    masters_.push_back(master);
  }
}

c10::intrusive_ptr<c10d::Work> FlatParams::publish(size_t b) {
  Bucket& bucket = buckets_[b];
  const auto [lo, hi] = bucket.shardRange(comm_.rank());
  at::Tensor shard = bucket.flat.slice(0, lo, hi);
  if (masters_[b].data_ptr() != shard.data_ptr()) shard.copy_(masters_[b]);
  at::Tensor input = comm_.gatherInput(shard);  // kept alive until the work was waited on
  gatherInputs_.push_back(input);
  return comm_.allGather(bucket.flat, input);
}

const Entry* FlatParams::strayParam() const {
  for (const Bucket& b : buckets_) {
    const void* home = b.flat.storage().data();
    for (const Entry& e : b.entries) {
      if (e.param.storage().data() != home) return &e;
    }
  }
  return nullptr;
}

}  // namespace zeroplus::zero::engine
