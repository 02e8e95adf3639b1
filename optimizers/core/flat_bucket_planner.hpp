// ZeRO stage 2/3 flat-bucket layout (torch-free).
//
// Stages 2 and 3 keep every trainable parameter inside a flat buffer ("bucket") that is cut into
// world_size equal, contiguous shards; rank r owns elements [r * shard, (r + 1) * shard) of each
// bucket. The same layout serves three collectives: gradients are reduce-scattered bucket by
// bucket during backward (a bucket is the unit of overlap), parameters are all-gathered bucket by
// bucket after the step, and the optimizer steps the owned shards as flat tensors (one kernel
// call per group covers every bucket shard of that group).
//
// Input: parameters in the order their gradients are expected to become ready (the caller passes
// reverse registration order, as DDP does), each with a `segment` key. Consecutive parameters
// with the same key may share a bucket; a change of key always starts a new bucket (the caller
// uses one key per (param group, dtype, device), so a bucket never mixes hyperparameters, dtypes
// or devices). A bucket is closed when adding the next parameter would exceed cap_elems; a
// parameter larger than the cap gets a bucket of its own (parameters are never split across
// buckets, so a parameter's gradient lands in exactly one reduce-scatter).
//
// Padding: a bucket's size is rounded up to a multiple of world_size * align_elems, so every
// shard has the same length and starts on an align_elems boundary (the caller picks align_elems
// so that shard starts are 64-byte aligned for the SIMD kernels). Padding elements hold zeros and
// are never part of any parameter. Parameter offsets inside a bucket are packed (no gaps), which
// keeps the padding below world_size * align_elems elements per bucket.
//
// Pure functions: no I/O, no globals, safe from any thread. Errors: -EINVAL for world_size < 1,
// cap_elems < 1, align_elems < 1, a negative numel, segments.size() != numels.size(), or a padded
// size that would overflow int64.
#pragma once

#include <cstdint>
#include <vector>

namespace zeroplus::optim {

struct FlatEntry {
  int param = 0;       // index into the caller's parameter list
  int64_t offset = 0;  // first element inside the bucket
  int64_t numel = 0;
};

struct FlatBucket {
  int64_t segment = 0;
  int64_t numel = 0;        // padded size: a multiple of world_size * align_elems, >= 1 shard
  int64_t shard_numel = 0;  // numel / world_size
  int64_t used = 0;         // elements holding parameters (the rest is padding)
  std::vector<FlatEntry> entries;
};

struct FlatPlan {
  int world_size = 0;
  std::vector<FlatBucket> buckets;
  std::vector<int> bucket_of;  // bucket_of[param] = index into buckets
};

int planFlatBuckets(const std::vector<int64_t>& numels, const std::vector<int64_t>& segments, int world_size,
                    int64_t cap_elems, int64_t align_elems, FlatPlan* out);

// The part of `entry` that falls inside rank's shard of `bucket`, as (offset inside the
// parameter, offset inside the shard, length); length 0 when the shard holds none of it.
struct ShardSlice {
  int64_t param_offset = 0;
  int64_t shard_offset = 0;
  int64_t length = 0;
};
ShardSlice sliceInShard(const FlatBucket& bucket, const FlatEntry& entry, int rank);

}  // namespace zeroplus::optim
