#include "optimizers/core/flat_bucket_planner.hpp"

#include <algorithm>
#include <cerrno>
#include <limits>

namespace zeroplus::optim {
namespace {

// ceil(n / m) * m without overflow; -1 when the result does not fit int64.
int64_t roundUp(int64_t n, int64_t m) {
  const int64_t q = n / m + (n % m != 0 ? 1 : 0);
  if (q > std::numeric_limits<int64_t>::max() / m) return -1;
  return q * m;
}

}  // namespace

int planFlatBuckets(const std::vector<int64_t>& numels, const std::vector<int64_t>& segments, int world_size,
                    int64_t cap_elems, int64_t align_elems, FlatPlan* out) {
  if (out == nullptr || world_size < 1 || cap_elems < 1 || align_elems < 1 || segments.size() != numels.size())
    return -EINVAL;
  if (align_elems > std::numeric_limits<int64_t>::max() / world_size) return -EINVAL;
  const int64_t quantum = align_elems * world_size;

  FlatPlan plan;
  plan.world_size = world_size;
  plan.bucket_of.assign(numels.size(), -1);
  FlatBucket open;
  bool have_open = false;

  auto close = [&]() -> bool {
    if (!have_open) return true;
    // An empty bucket (only zero-numel parameters) still gets one shard per rank, so every
    // collective has a non-empty buffer and every rank derives the same plan.
    open.numel = roundUp(std::max<int64_t>(open.used, 1), quantum);
    if (open.numel < 0) return false;
    open.shard_numel = open.numel / world_size;
    plan.buckets.push_back(std::move(open));
    open = FlatBucket{};
    have_open = false;
    return true;
  };

  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t n = numels[i];
    if (n < 0) return -EINVAL;
    const bool fits = have_open && open.segment == segments[i] && n <= cap_elems - open.used;
    if (!fits) {
      if (!close()) return -EINVAL;
      open.segment = segments[i];
      have_open = true;
    }
    if (open.used > std::numeric_limits<int64_t>::max() - n) return -EINVAL;
    open.entries.push_back(FlatEntry{static_cast<int>(i), open.used, n});
    open.used += n;
    plan.bucket_of[i] = static_cast<int>(plan.buckets.size());
  }
  if (!close()) return -EINVAL;
  *out = std::move(plan);
  return 0;
}

ShardSlice sliceInShard(const FlatBucket& bucket, const FlatEntry& entry, int rank) {
  const int64_t shard_begin = bucket.shard_numel * rank;
  const int64_t shard_end = shard_begin + bucket.shard_numel;
  const int64_t lo = std::max(entry.offset, shard_begin);
  const int64_t hi = std::min(entry.offset + entry.numel, shard_end);
  if (lo >= hi) return {};
  return ShardSlice{lo - entry.offset, lo - shard_begin, hi - lo};
}

}  // namespace zeroplus::optim
