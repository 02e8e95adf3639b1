// ZeRO stage-1 partition plan and flat-bucket layout (torch-free).
//
// planPartition reproduces torch.distributed.optim.ZeroRedundancyOptimizer._partition_parameters
// exactly, because ownership is observable (each owner steps with its own gradients, and
// state_dict indices map through the partition):
//   * one running size per rank, shared by all param groups, visited in order;
//   * within a group, parameters sorted by numel descending with a STABLE sort (Python's
//     sorted keeps registration order among equal sizes);
//   * each goes to the rank with the smallest running size, ties to the lowest rank.
// Frozen parameters are partitioned like any other.
//
// planBuckets reproduces parameters_as_bucket_view: per (device, rank) one flat buffer holding
// that rank's TRAINABLE parameters in partition order (group by group, sorted order within a
// group), contiguous by default (alignment 1 matches torch byte for byte); a bucket with nothing
// in it is a 1-element dummy that is still broadcast. broadcastSchedule lists the collectives of
// _sync_params in torch's issue order, so every rank issues them identically.
//
// All functions are pure: no I/O, no globals, safe from any thread. Errors: -EINVAL for
// world_size < 1, negative numel, alignment < 1, or shape mismatches between arguments.
#pragma once

#include <cstdint>
#include <vector>

namespace zeroplus::optim {

struct ParamRef {
  int group = 0;
  int index = 0;  // position within the group's "params" list (registration order)
  bool operator==(const ParamRef&) const = default;
};

struct PartitionPlan {
  int world_size = 0;
  // params[rank][group]: that rank's parameters of that group, in torch's order (numel desc).
  std::vector<std::vector<std::vector<ParamRef>>> params;
  // owner[group][index]: the rank that updates the parameter.
  std::vector<std::vector<int>> owner;
  std::vector<int64_t> rank_numel;  // elements owned per rank (the running sizes at the end)
};

// group_numels[g][i] = numel of parameter i of group g.
int planPartition(const std::vector<std::vector<int64_t>>& group_numels, int world_size, PartitionPlan* out);

struct BucketEntry {
  ParamRef param;
  int64_t offset = 0;  // in elements from the bucket start
  int64_t numel = 0;
};

struct Bucket {
  int device = 0;
  int rank = 0;
  int64_t numel = 0;   // allocated elements (>= 1; 1 for a dummy)
  bool dummy = false;  // no trainable parameter of this rank lives on this device
  std::vector<BucketEntry> entries;
};

struct ParamPlacement {
  int64_t numel = 0;
  int device = 0;  // small dense index assigned by the caller, identical on every rank
  bool trainable = true;
};

// buckets ordered by device (first appearance in partition order, rank 0 first, like torch's
// dict insertion order), then rank. align_elems rounds every entry offset up (1 = torch).
int planBuckets(const PartitionPlan& plan, const std::vector<std::vector<ParamPlacement>>& placement,
                int64_t align_elems, std::vector<Bucket>* out);

// planSyncChunks lays out the flat buffers zeroplus uses for parameters_as_bucket_view=False:
// per (device, rank), ALL of that rank's parameters (frozen ones too, since torch broadcasts
// them in this mode) in partition order, cut into chunks of at most cap_elems elements (a
// parameter larger than the cap gets a chunk of its own; parameters are never split). A rank
// with nothing on a device gets no chunk: every rank derives the same plan, so no dummy is
// needed. Devices are ordered as in planBuckets. The chunks are staging buffers: the owner packs
// its parameters in, one broadcast per chunk moves them, the receivers unpack. -EINVAL as above,
// or for cap_elems < 1.
int planSyncChunks(const PartitionPlan& plan, const std::vector<std::vector<ParamPlacement>>& placement,
                   int64_t cap_elems, std::vector<Bucket>* out);

struct BroadcastOp {
  int src_rank = 0;   // group rank that owns the data
  int bucket = -1;    // index into planBuckets' result, or -1 for a single parameter
  ParamRef param;     // valid when bucket == -1
};

// Without buckets: for each rank, each of its params (all groups, frozen included).
// With buckets (from planBuckets or planSyncChunks): one op per bucket, in bucket order.
std::vector<BroadcastOp> broadcastSchedule(const PartitionPlan& plan, const std::vector<Bucket>* buckets);

}  // namespace zeroplus::optim
