// zeroplus::plan_flat_buckets: the flat-bucket planner (core/flat_bucket_planner.hpp) for Python.
#pragma once

#include <cstdint>
#include <vector>

namespace zeroplus::optim::adapter {

// Returns the plan flattened into one int list (the op schema has no structs):
//   [num_buckets, then per bucket: segment, numel, shard_numel, used, num_entries,
//    then per entry: param index, offset, numel]
// Raises c10::Error (RuntimeError) naming the bad argument.
std::vector<int64_t> planFlatBucketsOp(const std::vector<int64_t>& numels, const std::vector<int64_t>& segments,
                                       int64_t world_size, int64_t cap_elems, int64_t align_elems);

}  // namespace zeroplus::optim::adapter
