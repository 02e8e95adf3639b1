// ZeroParamSync: plan in the constructor, move data in run(). See the header for the contract.
#include "optimizers/adapter/zero_param_sync.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

namespace zeroplus::optim::adapter {
namespace {

constexpr const char* kOp = "zeroplus.ZeroParamSync";

void checkPlanned(int rc, const char* what) {
  TORCH_CHECK(rc == 0, kOp, ": ", what, " rejected the layout (", std::strerror(-rc), ")");
}

}  // namespace

ZeroParamSync::ZeroParamSync(std::vector<at::Tensor> params, std::vector<int64_t> group_sizes,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group, bool bucket_view,
                             int64_t bucket_cap_bytes)
    : params_(std::move(params)), pg_(std::move(process_group)), bucket_view_(bucket_view) {
  TORCH_CHECK(pg_, kOp, ": process_group is None");
  TORCH_CHECK(!params_.empty(), kOp, ": params is empty");
  TORCH_CHECK(bucket_cap_bytes >= 1, kOp, ": bucket_cap_bytes must be >= 1, got ", bucket_cap_bytes);
  rank_ = pg_->getRank();
  const int world = pg_->getSize();

  // Group structure, numels and placement (device as a dense index in first-appearance order).
  std::vector<std::vector<int64_t>> numels;
  std::vector<std::vector<ParamPlacement>> placement;
  size_t next = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    TORCH_CHECK(group_sizes[g] >= 0 && next + static_cast<size_t>(group_sizes[g]) <= params_.size(), kOp,
                ": group_sizes[", g, "] = ", group_sizes[g], " overruns params (", params_.size(), " tensors)");
    group_base_.push_back(next);
    numels.emplace_back();
    placement.emplace_back();
    for (int64_t i = 0; i < group_sizes[g]; ++i, ++next) {
      const at::Tensor& p = params_[next];
      TORCH_CHECK(p.defined() && p.layout() == at::kStrided, kOp, ": params[", next, "] must be a dense tensor");
      TORCH_CHECK(p.scalar_type() == params_[0].scalar_type(), kOp, ": params[", next, "] is ",
                  c10::toString(p.scalar_type()), " but params[0] is ", c10::toString(params_[0].scalar_type()));
      auto it = std::find(devices_.begin(), devices_.end(), p.device());
      if (it == devices_.end()) it = devices_.insert(devices_.end(), p.device());
      numels.back().push_back(p.numel());
      placement.back().push_back(
          ParamPlacement{p.numel(), static_cast<int>(it - devices_.begin()), p.requires_grad()});
    }
  }
  TORCH_CHECK(next == params_.size(), kOp, ": group_sizes sum to ", next, " but params has ", params_.size(),
              " tensors");
  checkPlanned(planPartition(numels, world, &plan_), "planPartition");

  if (bucket_view_) {
    checkPlanned(planBuckets(plan_, placement, /*align_elems=*/1, &layout_), "planBuckets");
    buildBucketView();
  } else {
    const int64_t cap = std::max<int64_t>(1, bucket_cap_bytes / static_cast<int64_t>(params_[0].element_size()));
    checkPlanned(planSyncChunks(plan_, placement, cap, &layout_), "planSyncChunks");
  }
  schedule_ = broadcastSchedule(plan_, &layout_);
}

void ZeroParamSync::buildBucketView() {
  // torch's _build_param_buckets: frozen parameters get private storage (they may have been in
  // an earlier bucket), trainable ones are copied in and become views of their bucket.
  for (const at::Tensor& p : params_)
    if (!p.requires_grad()) p.set_data(p.variable_data().clone());
  buffers_.clear();
  for (const Bucket& b : layout_) {
    const c10::Device device = devices_[static_cast<size_t>(b.device)];
    if (b.dummy) {  // torch.zeros(1, device=device): default dtype, still broadcast
      buffers_.push_back(at::zeros({1}, at::TensorOptions().device(device)));
      continue;
    }
    at::Tensor bucket = at::empty({b.numel}, params_[0].options().device(device).requires_grad(false));
    for (const BucketEntry& e : b.entries) {
      const at::Tensor& p = paramOf(e.param);
      at::Tensor slot = bucket.narrow(0, e.offset, e.numel);
      slot.copy_(p.variable_data().reshape({-1}));
      p.set_data(slot.view(p.sizes()));
    }
    buffers_.push_back(std::move(bucket));
  }
}

void ZeroParamSync::allocateChunks() {
  buffers_.clear();
  for (const Bucket& b : layout_)
    buffers_.push_back(
        at::empty({b.numel}, params_[0].options().device(devices_[static_cast<size_t>(b.device)]).requires_grad(false)));
}

void ZeroParamSync::copyParams(const Bucket& b, const at::Tensor& buffer, bool into_buffer) const {
  const size_t elem = buffer.element_size();
  for (const BucketEntry& e : b.entries) {
    if (e.numel == 0) continue;
    const at::Tensor& p = paramOf(e.param);
    TORCH_CHECK(p.numel() == e.numel && p.scalar_type() == buffer.scalar_type(), kOp, ": parameter (group ",
                e.param.group, ", index ", e.param.index, ") changed shape or dtype since the plan was built; ",
                "rebuild the optimizer's buckets");
    if (p.device().is_cpu() && p.is_contiguous()) {
      // The common case: a plain memcpy, no dispatcher round trip per tensor.
      char* slot = static_cast<char*>(buffer.data_ptr()) + e.offset * elem;
      char* data = static_cast<char*>(p.data_ptr());
      if (into_buffer) std::memcpy(slot, data, e.numel * elem);
      else std::memcpy(data, slot, e.numel * elem);
      continue;
    }
    // variable_data(): like torch's `param.data`, no autograd and no version bump on the param.
    at::Tensor slot = buffer.narrow(0, e.offset, e.numel);
    if (into_buffer) slot.copy_(p.variable_data().reshape({-1}));
    else p.variable_data().copy_(slot.view(p.sizes()));
  }
}

void ZeroParamSync::run() {
  if (!bucket_view_) {
    if (buffers_.size() != layout_.size()) allocateChunks();
    // Pack every chunk this rank owns before the first broadcast, so no rank's collective waits
    // behind another rank's memcpy.
    for (size_t i = 0; i < layout_.size(); ++i)
      if (layout_[i].rank == rank_) copyParams(layout_[i], buffers_[i], /*into_buffer=*/true);
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(schedule_.size());
  for (const BroadcastOp& op : schedule_) {
    std::vector<at::Tensor> tensors{buffers_[static_cast<size_t>(op.bucket)]};
    c10d::BroadcastOptions opts;
    opts.rootRank = op.src_rank;  // group rank: the C++ process group speaks group ranks
    opts.rootTensor = 0;
    works.push_back(pg_->broadcast(tensors, opts));
  }
  for (auto& w : works) w->wait();
  if (!bucket_view_) {
    for (size_t i = 0; i < layout_.size(); ++i)
      if (layout_[i].rank != rank_) copyParams(layout_[i], buffers_[i], /*into_buffer=*/false);
  }
}

std::vector<at::Tensor> ZeroParamSync::buckets() const {
  return bucket_view_ ? buffers_ : std::vector<at::Tensor>{};
}

std::vector<int64_t> ZeroParamSync::owners() const {
  std::vector<int64_t> out;
  for (const auto& g : plan_.owner) out.insert(out.end(), g.begin(), g.end());
  return out;
}

}  // namespace zeroplus::optim::adapter
