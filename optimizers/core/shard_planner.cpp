#include "optimizers/core/shard_planner.hpp"

#include <algorithm>
#include <cerrno>
#include <numeric>

namespace zeroplus::optim {

int planPartition(const std::vector<std::vector<int64_t>>& group_numels, int world_size, PartitionPlan* out) {
  if (world_size < 1 || out == nullptr) return -EINVAL;
  for (const auto& g : group_numels)
    for (int64_t n : g)
      if (n < 0) return -EINVAL;

  PartitionPlan plan;
  plan.world_size = world_size;
  plan.params.assign(static_cast<size_t>(world_size),
                     std::vector<std::vector<ParamRef>>(group_numels.size()));
  plan.owner.resize(group_numels.size());
  plan.rank_numel.assign(static_cast<size_t>(world_size), 0);

  for (size_t g = 0; g < group_numels.size(); ++g) {
    const auto& numels = group_numels[g];
    std::vector<int> order(numels.size());
    std::iota(order.begin(), order.end(), 0);
    // Stable: equal sizes keep registration order, as Python's sorted(..., reverse=True) does.
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return numels[a] > numels[b]; });
    plan.owner[g].assign(numels.size(), 0);
    for (int i : order) {
      // min_element returns the FIRST minimum: ties go to the lowest rank (torch's _get_min_index).
      const auto it = std::min_element(plan.rank_numel.begin(), plan.rank_numel.end());
      const int rank = static_cast<int>(it - plan.rank_numel.begin());
      plan.params[rank][g].push_back(ParamRef{static_cast<int>(g), i});
      plan.owner[g][i] = rank;
      *it += numels[i];
    }
  }
  *out = std::move(plan);
  return 0;
}

namespace {

// Devices in first-appearance order over (rank, group, param): torch fills a dict that way.
std::vector<int> devicesInPartitionOrder(const PartitionPlan& plan,
                                         const std::vector<std::vector<ParamPlacement>>& placement) {
  std::vector<int> devices;
  for (const auto& groups : plan.params)
    for (const auto& refs : groups)
      for (const ParamRef& r : refs) {
        const int d = placement[r.group][r.index].device;
        if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
      }
  return devices;
}

bool placementMatches(const PartitionPlan& plan, const std::vector<std::vector<ParamPlacement>>& placement) {
  if (placement.size() != plan.owner.size()) return false;
  for (size_t g = 0; g < placement.size(); ++g)
    if (placement[g].size() != plan.owner[g].size()) return false;
  return true;
}

}  // namespace

int planBuckets(const PartitionPlan& plan, const std::vector<std::vector<ParamPlacement>>& placement,
                int64_t align_elems, std::vector<Bucket>* out) {
  if (out == nullptr || align_elems < 1 || !placementMatches(plan, placement)) return -EINVAL;
  const std::vector<int> devices = devicesInPartitionOrder(plan, placement);

  std::vector<Bucket> buckets;
  for (int device : devices) {
    for (int rank = 0; rank < plan.world_size; ++rank) {
      Bucket b;
      b.device = device;
      b.rank = rank;
      int64_t offset = 0;
      for (const auto& refs : plan.params[rank]) {
        for (const ParamRef& r : refs) {
          const ParamPlacement& pp = placement[r.group][r.index];
          if (pp.device != device || !pp.trainable) continue;  // frozen params are cloned out
          offset = (offset + align_elems - 1) / align_elems * align_elems;
          b.entries.push_back(BucketEntry{r, offset, pp.numel});
          offset += pp.numel;
        }
      }
      b.dummy = offset == 0;
      b.numel = b.dummy ? 1 : offset;
      buckets.push_back(std::move(b));
    }
  }
  *out = std::move(buckets);
  return 0;
}

int planSyncChunks(const PartitionPlan& plan, const std::vector<std::vector<ParamPlacement>>& placement,
                   int64_t cap_elems, std::vector<Bucket>* out) {
  if (out == nullptr || cap_elems < 1 || !placementMatches(plan, placement)) return -EINVAL;
  std::vector<Bucket> chunks;
  for (int device : devicesInPartitionOrder(plan, placement)) {
    for (int rank = 0; rank < plan.world_size; ++rank) {
      Bucket cur;
      cur.device = device;
      cur.rank = rank;
      for (const auto& refs : plan.params[rank]) {
        for (const ParamRef& r : refs) {
          const ParamPlacement& pp = placement[r.group][r.index];
          if (pp.device != device) continue;
          if (cur.numel > 0 && cur.numel + pp.numel > cap_elems) {
            chunks.push_back(std::move(cur));
            cur = Bucket{};
            cur.device = device;
            cur.rank = rank;
          }
          cur.entries.push_back(BucketEntry{r, cur.numel, pp.numel});
          cur.numel += pp.numel;
        }
      }
      // Zero-element parameters leave an empty chunk: nothing to move, so nothing is scheduled.
      if (cur.numel > 0) chunks.push_back(std::move(cur));
    }
  }
  *out = std::move(chunks);
  return 0;
}

std::vector<BroadcastOp> broadcastSchedule(const PartitionPlan& plan, const std::vector<Bucket>* buckets) {
  std::vector<BroadcastOp> ops;
  if (buckets != nullptr) {
    for (size_t i = 0; i < buckets->size(); ++i)
      ops.push_back(BroadcastOp{(*buckets)[i].rank, static_cast<int>(i), {}});
    return ops;
  }
  for (int rank = 0; rank < plan.world_size; ++rank)
    for (const auto& refs : plan.params[rank])
      for (const ParamRef& r : refs) ops.push_back(BroadcastOp{rank, -1, r});
  return ops;
}

}  // namespace zeroplus::optim
