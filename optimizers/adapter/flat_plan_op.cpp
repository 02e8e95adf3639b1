#include "optimizers/adapter/flat_plan_op.hpp"

#include <c10/util/Exception.h>

#include <limits>

#include "optimizers/core/flat_bucket_planner.hpp"

namespace zeroplus::optim::adapter {

std::vector<int64_t> planFlatBucketsOp(const std::vector<int64_t>& numels, const std::vector<int64_t>& segments,
                                       int64_t world_size, int64_t cap_elems, int64_t align_elems) {
  constexpr const char* op = "zeroplus.plan_flat_buckets";
  TORCH_CHECK(world_size >= 1 && world_size <= std::numeric_limits<int>::max(), op,
              ": world_size must be >= 1, got ", world_size);
  TORCH_CHECK(cap_elems >= 1, op, ": cap_elems must be >= 1, got ", cap_elems);
  TORCH_CHECK(align_elems >= 1, op, ": align_elems must be >= 1, got ", align_elems);
  TORCH_CHECK(segments.size() == numels.size(), op, ": segments has ", segments.size(), " entries, numels has ",
              numels.size());
  for (size_t i = 0; i < numels.size(); ++i)
    TORCH_CHECK(numels[i] >= 0, op, ": numels[", i, "] must be >= 0, got ", numels[i]);
  FlatPlan plan;
  const int rc = planFlatBuckets(numels, segments, static_cast<int>(world_size), cap_elems, align_elems, &plan);
  TORCH_CHECK(rc == 0, op, ": the padded bucket size overflows int64 (numels too large)");
  std::vector<int64_t> out{static_cast<int64_t>(plan.buckets.size())};
  for (const FlatBucket& b : plan.buckets) {
    out.insert(out.end(), {b.segment, b.numel, b.shard_numel, b.used, static_cast<int64_t>(b.entries.size())});
    for (const FlatEntry& e : b.entries) out.insert(out.end(), {int64_t{e.param}, e.offset, e.numel});
  }
  return out;
}

}  // namespace zeroplus::optim::adapter
