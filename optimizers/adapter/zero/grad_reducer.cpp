#include "optimizers/adapter/zero/grad_reducer.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace zeroplus::zero::engine {
namespace {
// Full-size bucket inputs in flight at once (overlap needs two: one on the wire, one filling).
constexpr size_t kMaxInflightInputs = 2;
}  // namespace

GradReducer::GradReducer(std::vector<Bucket>& buckets, Collectives& comm, bool shardGradients,
                         std::optional<at::ScalarType> accumDtype)
    : buckets_(buckets), comm_(comm), shardGradients_(shardGradients) {
  int64_t total = 0;
  for (const Bucket& b : buckets_) {
    accumDtypes_.push_back(accumDtype.value_or(b.dtype));
    sameDtypes_ = sameDtypes_ && accumDtypes_.back() == b.dtype;
    gaps_.push_back(b.gaps());
    base_.push_back(total);
    total += static_cast<int64_t>(b.entries.size());
  }
  accum_.resize(buckets_.size());
  used_.assign(total, 0);
  defined_.assign(total, 0);
  resetPass();
}

void GradReducer::resetPass() {
  inPass_ = false;
  direct_ = -1;
  arrived_.clear();
  remaining_.clear();
  for (const Bucket& b : buckets_) {
    arrived_.emplace_back(b.entries.size(), false);
    remaining_.push_back(static_cast<int64_t>(b.entries.size()));
  }
  buffers_.assign(buckets_.size(), at::Tensor());
  passUsed_.clear();
  inflight_.clear();
  next_ = 0;
}

bool GradReducer::directPass() {
  // Stage 1 from no gradient: the accumulators themselves are all-reduced in place.
  // (Only where the accumulators are in the buckets' dtype: the buffer is the accumulator.)
  if (direct_ < 0) direct_ = (!shardGradients_ && !hasGrads_ && sameDtypes_) ? 1 : 0;
  return direct_ == 1;
}

double GradReducer::scaleOf(int64_t b) {
  // fp16 buckets were divided before the sum (launch): nothing is left to apply.
  return directPass() || buckets_[b].dtype == at::kHalf ? 1.0 : 1.0 / comm_.worldSize();
}

at::Tensor& GradReducer::accum(int64_t b) {
  at::Tensor& acc = accum_[b];
  if (!acc.defined()) {
    const Bucket& bucket = buckets_[b];
    acc = at::zeros({shardGradients_ ? bucket.shardNumel : bucket.numel}, bucket.options(accumDtypes_[b]));
  }
  return acc;
}

at::Tensor& GradReducer::accumToOverwrite(int64_t b) {
  at::Tensor& acc = accum_[b];
  if (!acc.defined()) {
    const Bucket& bucket = buckets_[b];
    acc = at::empty({shardGradients_ ? bucket.shardNumel : bucket.numel}, bucket.options(accumDtypes_[b]));
  }
  return acc;
}

at::Tensor& GradReducer::buffer(int64_t b) {
  at::Tensor& buf = buffers_[b];
  if (!buf.defined()) {
    // Every element is written once per pass: by its gradient, by zeros for a parameter without
    // one (takeGrad), or here for the gaps. No full-bucket memset.
    buf = directPass() ? accumToOverwrite(b)
                       : at::empty({buckets_[b].numel}, buckets_[b].options(buckets_[b].dtype));
    for (const auto& [lo, hi] : gaps_[b]) buf.slice(0, lo, hi).zero_();
  }
  return buf;
}

void GradReducer::takeGrad(int64_t b, int64_t e) {
  Entry& entry = buckets_[b].entries[e];
  at::Tensor region = buffer(b).slice(0, entry.offset, entry.offset + entry.numel);
  at::Tensor grad = entry.param.grad();
  if (grad.defined()) {
    if (directPass() && comm_.worldSize() > 1) {
      at::mul_out(region, grad.reshape(-1), 1.0 / comm_.worldSize());
    } else {
      region.copy_(grad.reshape(-1));
    }
    entry.param.mutable_grad() = at::Tensor();
    passUsed_.push_back(base_[b] + e);
  } else if (!arrived_[b][e]) {
    region.zero_();
  }
  if (!arrived_[b][e]) {
    arrived_[b][e] = true;
    --remaining_[b];
  }
}

void GradReducer::onGrad(int64_t b, int64_t e) {
  if (noSync_) {
    localPending_ = true;
    return;
  }
  inPass_ = true;
  TORCH_CHECK(b >= next_, "zeroplus::zero: parameter of shape ", buckets_[b].entries[e].param.sizes(),
              " received a second gradient after its bucket was reduced in this backward pass (several "
              "backward calls through one graph); run one backward per micro-step");
  takeGrad(b, e);
  launchReady();
}

void GradReducer::launchReady() {
  while (next_ < static_cast<int64_t>(buckets_.size()) && remaining_[next_] == 0) launch(next_);
}

void GradReducer::launch(int64_t b) {
  const Bucket& bucket = buckets_[b];
  at::Tensor buf = buffer(b);
  InFlight f{b, nullptr, at::Tensor(), at::Tensor()};
  // fp16: divided before the sum (DDP and DeepSpeed do too): the sum of averaged gradients cannot
  // overflow where the sum of raw ones might. Others: 1/N is applied when accumulating.
  if (!directPass() && comm_.worldSize() > 1 && bucket.dtype == at::kHalf) buf.div_(comm_.worldSize());
  if (directPass()) {
    f.work = comm_.allReduce(buf);
    f.out = buf;  // the accumulator itself: not an input to drop
  } else if (shardGradients_) {
    // A zero accumulator takes the result directly: no second shard-sized output alive.
    at::Tensor out = !hasGrads_ && accumDtypes_[b] == bucket.dtype ? accumToOverwrite(b)
                                : at::empty({bucket.shardNumel}, bucket.options(bucket.dtype));
    f.work = comm_.reduceScatter(out, buf);
    f.out = out;
    f.input = buf;
  } else {
    f.work = comm_.allReduce(buf);
    f.out = buf;
    f.input = buf;
  }
  inflight_.push_back(std::move(f));
  buffers_[b] = at::Tensor();
  next_ = b + 1;
  retireInputs();
}

void GradReducer::retireInputs() {
  // Keep at most kMaxInflightInputs full-size inputs alive: wait for older collectives. Their
  // results go into the accumulators at once when the pass started from no gradient (a failed
  // pass frees them anyway), else they are kept and added when the whole pass succeeded.
  std::vector<InFlight*> live;
  for (InFlight& f : inflight_) {
    if (f.work && f.input.defined()) live.push_back(&f);
  }
  if (live.size() <= kMaxInflightInputs) return;
  for (size_t i = 0; i + kMaxInflightInputs < live.size(); ++i) {
    InFlight& f = *live[i];
    f.work->wait();
    f.work = nullptr;
    if (!hasGrads_) {
      settle(f);
    } else if (f.out.data_ptr() != f.input.data_ptr()) {
      f.input = at::Tensor();
    }
  }
}

void GradReducer::settle(InFlight& f) {
  const int64_t b = f.bucket;
  f.settled = true;
  const double scale = scaleOf(b);
  at::Tensor& acc = accum_[b];
  if (!(acc.defined() && f.out.is_same(acc)) && !hasGrads_ && f.out.scalar_type() == accumDtypes_[b]) {
    f.out = accumToOverwrite(b).copy_(f.out);  // no gradient yet: the accumulator is the result
  }
  if (accum_[b].defined() && f.out.is_same(accum_[b])) {
    if (scale != 1.0) accum_[b].mul_(scale);  // bitwise 0 + scale * sum, as add_ gives
  } else {
    accum(b).add_(f.out, scale);
  }
  f.out = at::Tensor();
  f.input = at::Tensor();
}

void GradReducer::finishPass() {
  try {
    for (int64_t b = next_; b < static_cast<int64_t>(buckets_.size()); ++b) {
      for (int64_t e = 0; e < static_cast<int64_t>(buckets_[b].entries.size()); ++e) {
        if (!arrived_[b][e]) takeGrad(b, e);  // no gradient this pass: zeros, or a no_sync leftover
      }
      launch(b);
    }
    for (InFlight& f : inflight_) {
      if (f.work) {
        f.work->wait();
        f.work = nullptr;
      }
    }
    for (InFlight& f : inflight_) {
      if (!f.settled) settle(f);
    }
    for (int64_t flag : passUsed_) used_[flag] = 1;
    hasGrads_ = true;
    localPending_ = false;
  } catch (...) {
    abandonPass();
    throw;
  }
  resetPass();
}

void GradReducer::abandonPass() {
  for (InFlight& f : inflight_) {
    if (f.work) {
      try {
        f.work->wait();
      } catch (...) {  // the failure that ended the pass is what the caller sees
      }
      f.work = nullptr;
    }
  }
  if (!hasGrads_) {
    for (auto& acc : accum_) acc = at::Tensor();
  }
  resetPass();
}

void GradReducer::endBackward() {
  if (inPass_) finishPass();
}

void GradReducer::flush() {
  if (inPass_) abandonPass();  // a backward that raised left its pass open
  if (localPending_) {
    inPass_ = true;
    finishPass();
  }
}

at::Tensor GradReducer::shard(size_t b) {
  if (shardGradients_) return accum(static_cast<int64_t>(b));
  const auto [lo, hi] = buckets_[b].shardRange(comm_.rank());
  return accum(static_cast<int64_t>(b)).slice(0, lo, hi);
}

void GradReducer::scale(const at::Tensor& coef) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    at::Tensor g = shard(b);
    g.mul_(coef.to(g.scalar_type()));
  }
}

bool GradReducer::allFinite() {
  at::Tensor finite;  // on the shards' device: one host read for all buckets (one sync on CUDA)
  for (size_t b = 0; b < buckets_.size(); ++b) {
    at::Tensor g = shard(b);
    if (g.numel() == 0) continue;
    // max |g| is finite exactly when every element is (the Python engine's clipping.all_finite)
    auto [lo, hi] = at::aminmax(g);
    at::Tensor here = at::isfinite(at::maximum(lo.neg(), hi));
    finite = finite.defined() ? at::logical_and(finite, here) : here;
  }
  return !finite.defined() || finite.item<bool>();
}

std::vector<uint8_t> GradReducer::agree() {
  if (!used_.empty()) {
    // On the engine's device (a CUDA group's backend may serve CUDA tensors only); read back on the host.
    at::Tensor flags = at::from_blob(used_.data(), {static_cast<int64_t>(used_.size())}, at::kByte)
                           .to(comm_.device(), /*non_blocking=*/false, /*copy=*/true);
    comm_.allReduceMax(flags);
    flags = flags.cpu();
    const uint8_t* agreed = flags.data_ptr<uint8_t>();
    for (size_t i = 0; i < defined_.size(); ++i) {
      if (agreed[i]) defined_[i] = 1;
    }
  }
  return defined_;
}

void GradReducer::zero(bool setToNone) {
  if (inPass_) abandonPass();  // a backward that raised left it open
  for (auto& acc : accum_) {
    if (!acc.defined()) continue;
    if (setToNone) {
      acc = at::Tensor();
    } else {
      acc.zero_();
    }
  }
  for (Bucket& b : buckets_) {
    for (Entry& e : b.entries) {
      if (e.param.grad().defined()) e.param.mutable_grad() = at::Tensor();
    }
  }
  std::fill(used_.begin(), used_.end(), 0);
  if (setToNone) std::fill(defined_.begin(), defined_.end(), 0);
  hasGrads_ = false;
  localPending_ = false;
}

}  // namespace zeroplus::zero::engine
