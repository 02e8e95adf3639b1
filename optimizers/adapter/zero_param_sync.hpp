// ZeroParamSync: the post-step parameter synchronisation of ZeroRedundancyOptimizer, planned and
// executed in C++ (torchbind class zeroplus.ZeroParamSync).
//
// Setup (constructor) versus run:
//  * The constructor takes every managed parameter (chained over param groups, the order of
//    torch's _all_params), the group sizes and the process group. It recomputes the sorted-greedy
//    partition with the torch-free planner (core/shard_planner.hpp), so it agrees with
//    zeroplus.partition_params and with torch, and lays out flat buffers:
//      - bucket_view=true: torch's parameters_as_bucket_view layout (planBuckets, one bucket per
//        (device, rank), trainable params only, 1-element dummies). The constructor copies each
//        trainable parameter into its bucket and re-points its data at the bucket view, and
//        clones frozen parameters out, exactly as torch's _build_param_buckets does.
//      - bucket_view=false: staging chunks (planSyncChunks) of at most bucket_cap_bytes holding
//        every parameter of a rank (frozen ones too); allocated on the first run().
//  * run() is collective: every rank of the group must call it in the same order as its other
//    collectives. It packs this rank's own parameters into their chunks, issues one async
//    broadcast per buffer in the planner's schedule (owner rank as root), waits for all, and
//    unpacks received chunks into the parameters. It blocks until done; errors from the process
//    group propagate as c10::Error from Work::wait().
//
// Ownership and lifetime: the object holds references to the parameters (not raw pointers; the
// data pointer is read on every run, so `param.data = ...` between runs is fine as long as the
// shape and dtype stay) and owns the buckets/chunks. Rebuild it after add_param_group or a
// trainability change. Not thread-safe: one run() at a time.
//
// Memory: bucket_view=false costs one staging copy of the parameters (sum of all chunks), the
// price of moving a shard in a few large broadcasts instead of one per tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/custom_class.h>

#include <vector>

#include "optimizers/core/shard_planner.hpp"

namespace zeroplus::optim::adapter {

class ZeroParamSync : public torch::CustomClassHolder {
 public:
  ZeroParamSync(std::vector<at::Tensor> params, std::vector<int64_t> group_sizes,
                c10::intrusive_ptr<c10d::ProcessGroup> process_group, bool bucket_view, int64_t bucket_cap_bytes);

  void run();

  // bucket_view: the buckets in planner order (device-major, rank-minor), for torch's _buckets.
  std::vector<at::Tensor> buckets() const;
  int64_t numDevices() const { return static_cast<int64_t>(devices_.size()); }
  // Collectives one run() issues (the number torch issues is the parameter count).
  int64_t numBroadcasts() const { return static_cast<int64_t>(schedule_.size()); }
  // Owner group rank per parameter, in the constructor's order.
  std::vector<int64_t> owners() const;

 private:
  const at::Tensor& paramOf(const ParamRef& r) const { return params_[group_base_[r.group] + r.index]; }
  void buildBucketView();
  void allocateChunks();
  void copyParams(const Bucket& b, const at::Tensor& buffer, bool into_buffer) const;

  std::vector<at::Tensor> params_;
  std::vector<size_t> group_base_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  bool bucket_view_;
  int rank_;
  PartitionPlan plan_;
  std::vector<c10::Device> devices_;  // dense device index -> device
  std::vector<Bucket> layout_;        // planBuckets or planSyncChunks result
  std::vector<at::Tensor> buffers_;   // one per layout_ entry (chunks: empty until first run)
  std::vector<BroadcastOp> schedule_;
};

}  // namespace zeroplus::optim::adapter
