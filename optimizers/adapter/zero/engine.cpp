#include "optimizers/adapter/zero/engine.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <string>

namespace zeroplus::zero::engine {
namespace {

std::optional<at::ScalarType> dtypeNamed(const std::string& name) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  if (name == "fp32") return at::kFloat;
  return std::nullopt;
}

std::optional<at::ScalarType> computeDtypeOf(const Options& o) {
  return o.mixed_precision() == "fp32" ? std::nullopt : dtypeNamed(o.mixed_precision());
}

// One shard's clipping term (undefined for an empty shard): max |g| or sum |g|^p, in fp32
// (the Python engine's clipping.local_term).
at::Tensor localTerm(const at::Tensor& shard, double normType) {
  if (shard.numel() == 0) return {};
  if (std::isinf(normType)) {
    auto [lo, hi] = at::aminmax(shard);
    return at::maximum(lo.neg(), hi).to(at::kFloat);
  }
  return at::pow(at::linalg_vector_norm(shard, normType, std::nullopt, false, at::kFloat), normType);
}

}  // namespace

namespace {
// The parameters' device (initialize checked they share one).
at::Device deviceOf(const std::vector<std::vector<at::Tensor>>& groups) {
  for (const auto& g : groups) {
    if (!g.empty()) return g.front().device();
  }
  return at::kCPU;
}

std::unique_ptr<Placement> makePlacement(const std::vector<std::vector<at::Tensor>>& groups, Collectives& comm,
                                         const Options& options, std::optional<at::ScalarType> dtype,
                                         const UnitLayout& units) {
  if (options.stage() == 3) return std::make_unique<ShardedParams>(groups, units, comm, dtype);
  return std::make_unique<FlatParams>(groups, comm, dtype, options.reduce_bucket_elems());
}
}  // namespace

Engine::Engine(const std::vector<std::vector<at::Tensor>>& groups, c10::intrusive_ptr<c10d::ProcessGroup> pg,
               const Options& options, const std::vector<StepHyper>& groupHyper, const UnitLayout& units)
    : options_(options),
      stage_(static_cast<int>(options.stage())),
      computeDtype_(computeDtypeOf(options)),
      comm_(std::move(pg), deviceOf(groups)),
      placement_(makePlacement(groups, comm_, options, computeDtype_, units)),
      sharded_(dynamic_cast<ShardedParams*>(placement_.get())),
      reducer_(placement_->buckets(), comm_, /*shardGradients=*/stage_ >= 2, dtypeNamed(options.grad_accum_dtype())),
      scaler_(makeLossScaler(options)) {
  for (size_t b = 0; b < placement_->buckets().size(); ++b) {
    steppers_.emplace_back(placement_->buckets()[b], placement_->master(b), comm_.rank());
  }
  if (options_.offload_optimizer() == "nvme") {
    swapper_ = std::make_unique<OptimizerSwapper>(options_, *placement_, steppers_, groupHyper, comm_.rank());
  }
  states_ = std::make_unique<BucketStates>(*placement_, steppers_, swapper_.get());
  resetUnitCounts();
}

void Engine::resetUnitCounts() {
  if (sharded_ == nullptr) return;
  unitRemaining_.resize(sharded_->unitCount());
  for (int64_t u = 0; u < sharded_->unitCount(); ++u) unitRemaining_[u] = sharded_->paramsOf(u);
}

void Engine::unitForwardBegin(int64_t unit) {
  sharded_->gather(unit);
  if (unit + 1 < sharded_->unitCount()) sharded_->prefetch(unit + 1);  // overlaps this unit's compute
}

void Engine::unitForwardEnd(int64_t unit) { sharded_->release(unit); }

void Engine::unitBackwardBegin(int64_t unit) {
  sharded_->gather(unit);
  if (unit > 0) sharded_->prefetch(unit - 1);
}

void Engine::gradReady(int64_t index) {
  const auto [b, e] = placement_->slot(index);
  reducer_.onGrad(b, e);
  if (sharded_ != nullptr) {
    // The unit's gradients are all taken: its parameters are not needed by this backward again.
    // (A persistent parameter, unit -1, is never released.)
    const int64_t unit = sharded_->unitOf(index);
    if (unit >= 0 && --unitRemaining_[unit] == 0) sharded_->release(unit);
  }
}

void Engine::endBackward() {
  if (sharded_ != nullptr) {
    sharded_->releaseAll();  // units whose parameters got no gradient (unused this pass)
    resetUnitCounts();
  }
  // The step reads buckets 0, 1, ...: reads not started since zero_grad (no zero_grad between
  // accumulation steps) start now, while the reduction settles.
  if (swapper_) swapper_->prefetchAhead();
  reducer_.endBackward();
}

std::vector<at::Tensor> Engine::gradientShards() {
  reducer_.flush();
  std::vector<at::Tensor> out;
  for (size_t b = 0; b < placement_->buckets().size(); ++b) out.push_back(reducer_.shard(b));
  return out;
}

at::Tensor Engine::clipGradNorm(double maxNorm, double normType, bool errorIfNonfinite) {
  constexpr const char* kOp = "zeroplus::zero clip_grad_norm";
  TORCH_CHECK_VALUE(maxNorm > 0, kOp, ": max_norm must be > 0, got ", maxNorm);
  TORCH_CHECK_VALUE(normType > 0, kOp, ": norm_type must be a positive number or inf, got ", normType);
  at::NoGradGuard noGrad;
  reducer_.flush();
  const size_t n = placement_->buckets().size();
  at::Tensor total;
  if (std::isinf(normType)) {
    at::Tensor local = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
    for (size_t b = 0; b < n; ++b) {
      at::Tensor t = localTerm(reducer_.shard(b), normType);
      if (t.defined()) local = at::maximum(local, t);
    }
    comm_.allReduceMax(local);
    total = local;
  } else {
    // [replicated, tp-sharded]
    at::Tensor parts = at::zeros({2}, at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
    for (size_t b = 0; b < n; ++b) {
      at::Tensor t = localTerm(reducer_.shard(b), normType);
      if (t.defined()) parts.select(0, 0).add_(t);
    }
    comm_.allReduceSum(parts);
    total = at::pow(parts.sum(), 1.0 / normType);
  }
  if (fp16()) total = total.div(scaler_.scale());  // the shards hold loss-scaled values
  const bool finite = std::isfinite(total.item<float>());  // one host read (a device sync on CUDA)
  if (!finite && errorIfNonfinite) {
    TORCH_CHECK(false, "The total norm of order ", normType, " for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`");
  }
  if (fp16() && !finite) {  // an overflow: step() skips this step
    clippedThisStep_ = true;
    return total;
  }
  // Python's `max_norm / (total + 1e-6)` is reciprocal() * max_norm (Tensor.__rtruediv__): the same bits.
  at::Tensor coef = at::clamp(total.add(1e-6).reciprocal().mul(maxNorm), std::nullopt, 1.0);
  reducer_.scale(coef);
  clippedThisStep_ = true;
  return total;
}

void Engine::checkParamHomes() const {
  if (const Entry* stray = placement_->strayParam()) {
    TORCH_CHECK(false, "zeroplus::zero step: the parameter of shape ", c10::IntArrayRef(stray->shape),
                " (trainable parameter ", stray->index, ") no longer lives in zeroplus's buffers: the model was "
                "moved or its parameters replaced after zeroplus::zero::initialize (set_data, model->to(...)), so "
                "the step could not update it; move the model before initialize");
  }
}

void Engine::step(const std::vector<StepHyper>& hyper) {
  at::NoGradGuard noGrad;
  checkParamHomes();
  auto& buckets = placement_->buckets();
  for (const Bucket& b : buckets) {
    TORCH_CHECK(b.group < static_cast<int64_t>(hyper.size()), "zeroplus::zero step: ", hyper.size(),
                " hyperparameter sets for param group ", b.group);
  }
  for (size_t g = 0; g < hyper.size(); ++g) BucketStepper::check(hyper[g], static_cast<int64_t>(g));
  reducer_.flush();
  if (sharded_ != nullptr) {
    sharded_->releaseAll();  // a backward that raised left units gathered
    resetUnitCounts();
  }
  // Which parameters this step updates (one small collective); without a backward since
  // zero_grad no rank has anything to agree on.
  const std::vector<uint8_t> stepped = reducer_.hasGrads() ? reducer_.agree() : reducer_.defined();
  bool any = false;
  for (uint8_t s : stepped) any = any || s;
  if (!any) return;  // every grad None: torch's step changes nothing either
  if (fp16() && overflow()) {  // every rank skips it: the gradients become zeros, the scale drops
    updateLossScale(scaler_, true);
    ++skippedSteps_;
    reducer_.zero(/*setToNone=*/false);
    clippedThisStep_ = false;
    return;
  }
  if (options_.gradient_clipping() > 0 && !clippedThisStep_) {
    clipGradNorm(options_.gradient_clipping(), 2.0, false);
  }
  const double invScale = fp16() ? 1.0 / scaler_.scale() : 1.0;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::exception_ptr failure;
  try {
    // NVMe offload: the previous step's writes ran during forward and backward; faults found
    // from here on are raised after the step's last collective (every rank finished the step).
    if (swapper_) swapper_->beginStep();
    for (size_t i = 0; i < buckets.size(); ++i) {
      // A record that cannot be read leaves its bucket unstepped; its publish still runs (collective).
      const bool live = !swapper_ || swapper_->fetch(i);
      if (live) steppers_[i].step(reducer_.shard(i), stepped, reducer_.flagBase(i), hyper[buckets[i].group], invScale);
      auto work = placement_->publish(i);  // stages 1-2: the all-gather runs while the next bucket steps
      if (work) works.push_back(std::move(work));
      if (swapper_) swapper_->store(i);  // publish has copied the master: write it behind
    }
  } catch (...) {
    failure = std::current_exception();
    if (swapper_) swapper_->abandon();
  }
  for (auto& w : works) w->wait();  // every started all-gather is waited on, also after a failure
  placement_->releaseGatherInputs();
  clippedThisStep_ = false;
  if (failure) std::rethrow_exception(failure);
  updateLossScale(scaler_, false);
  if (swapper_) swapper_->endStep();
}

bool Engine::overflow() {
  // Inf/NaN in any rank's gradient shard, agreed across ranks (one all-reduce of one fp32).
  at::Tensor local = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
  if (!reducer_.allFinite()) local.fill_(1.0);
  comm_.allReduceMax(local);
  return local.item<float>() != 0;
}

void Engine::zeroGrad(bool setToNone) {
  reducer_.zero(setToNone);
  if (swapper_) {
    swapper_->poll();  // writes finish during forward and backward; the next step waits
    // The next step's records are read from here on, into the buffers as the writes free them:
    // forward and backward hide up to offload_buffer_count reads.
    swapper_->prefetchAhead();
  }
  if (sharded_ != nullptr) {
    sharded_->releaseAll();  // a backward that raised left units gathered
    resetUnitCounts();
  }
  clippedThisStep_ = false;
}

void Engine::writeStates(const std::vector<BucketValues>& values, const char* op) {
  at::NoGradGuard noGrad;
  TORCH_CHECK(values.size() == placement_->buckets().size(), op, ": values for ", values.size(), " buckets, the "
              "engine has ", placement_->buckets().size());
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::exception_ptr failure;
  try {
    for (size_t i = 0; i < values.size(); ++i) {
      // stage 3: the shard only, no collective (a persistent bucket is all-gathered)
      auto work = states_->write(i, values[i], op);
      if (work) works.push_back(std::move(work));
    }
  } catch (...) {
    failure = std::current_exception();
  }
  for (auto& w : works) w->wait();
  placement_->releaseGatherInputs();
  states_->finish();
  if (failure) std::rethrow_exception(failure);
}

int64_t Engine::ownedNumel() const {
  int64_t n = 0;
  for (const Bucket& b : placement_->buckets()) n += b.shardNumel;  // masters may be swapped out
  return n;
}

}  // namespace zeroplus::zero::engine
