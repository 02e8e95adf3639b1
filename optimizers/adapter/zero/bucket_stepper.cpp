#include "optimizers/adapter/zero/bucket_stepper.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

#include "optimizers/adapter/fused_optimizer_ops.hpp"
#ifdef ZEROPLUS_WITH_CUDA
#include "optimizers/adapter/fused_optimizer_cuda_ops.hpp"
#endif

namespace zeroplus::zero::engine {
namespace {
constexpr const char* kOp = "zeroplus::zero step";

// Elementwise state lives beside the master (CPU or CUDA); `step` is a 0-d fp32 host tensor on
// both (the fused CUDA kernels read it on the host, as torch's non-capturable Adam keeps it).
at::Tensor fp32Zeros(int64_t n, const at::Tensor& like) {
  return at::zeros({n}, at::TensorOptions().dtype(at::kFloat).device(like.device()));
}

void adamKernel(const char* op, bool decoupled, const std::vector<at::Tensor>& params,
                const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& m,
                const std::vector<at::Tensor>& v, const std::vector<at::Tensor>& vmax,
                const std::vector<at::Tensor>& steps, const optim::adapter::AdamArgs& args) {
  if (params.front().is_cuda()) {
#ifdef ZEROPLUS_WITH_CUDA
    optim::adapter::adamStepCuda(op, decoupled, params, grads, m, v, vmax, steps, args);
    return;
#else
    TORCH_CHECK(false, kOp, ": the master is on ", params.front().device(),
                " but this zeroplus was built without CUDA");
#endif
  }
  optim::adapter::adamStep(op, decoupled, params, grads, m, v, vmax, steps, args);
}

void sgdKernel(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& bufs, const std::vector<bool>& init,
               const optim::adapter::SgdArgs& args) {
  if (params.front().is_cuda()) {
#ifdef ZEROPLUS_WITH_CUDA
    optim::adapter::sgdStepCuda("zeroplus.sgd_step", params, grads, bufs, init, args);
    return;
#else
    TORCH_CHECK(false, kOp, ": the master is on ", params.front().device(),
                " but this zeroplus was built without CUDA");
#endif
  }
  optim::adapter::sgdStep("zeroplus.sgd_step", params, grads, bufs, init, args);
}
}  // namespace

BucketStepper::BucketStepper(const Bucket& bucket, at::Tensor master, int rank) : master_(std::move(master)) {
  for (int64_t e = 0; e < static_cast<int64_t>(bucket.entries.size()); ++e) {
    const Piece pc = bucket.piece(bucket.entries[e], rank);
    if (pc.numel() == 0) continue;
    segments_.push_back({e, pc.shardLo, pc.shardHi, master_.slice(0, pc.shardLo, pc.shardHi), {}});
  }
}

void BucketStepper::check(const StepHyper& hyper, int64_t group) {
  const std::string where = "param_groups[" + std::to_string(group) + "]";
  try {
    if (const auto* a = std::get_if<AdamHyper>(&hyper)) {
      optim::adapter::checkAdamArgs(kOp, {a->lr, a->beta1, a->beta2, a->weight_decay, a->eps, a->amsgrad,
                                          a->maximize, a->threads});
    } else {
      const auto& s = std::get<SgdHyper>(hyper);
      optim::adapter::checkSgdArgs(kOp, {s.lr, s.momentum, s.dampening, s.weight_decay, s.nesterov, s.maximize,
                                         s.threads});
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, where, ": ", e.what_without_backtrace(), "; nothing was updated");
  }
}

void BucketStepper::step(const at::Tensor& gradShard, const std::vector<uint8_t>& stepped, int64_t flagBase,
                         const StepHyper& hyper, double invScale) {
  if (segments_.empty()) return;
  at::Tensor grad = gradShard.scalar_type() == master_.scalar_type() ? gradShard : gradShard.to(master_.scalar_type());
  // fp16: unscaled in fp32 after the cast, in place on the copy (the Python engine's BucketOptimizer.step)
  if (invScale != 1.0) grad = grad.is_same(gradShard) ? grad.mul(invScale) : grad.mul_(invScale);
  std::vector<Segment*> live;
  for (Segment& s : segments_) {
    if (stepped[flagBase + s.entry]) live.push_back(&s);
  }
  if (live.empty()) return;
  std::vector<at::Tensor> params, grads;
  for (Segment* s : live) {
    params.push_back(s->master);
    grads.push_back(grad.slice(0, s->lo, s->hi));
  }
  if (const auto* a = std::get_if<AdamHyper>(&hyper)) {
    std::vector<at::Tensor> m, v, vmax, steps;
    for (Segment* s : live) {
      SegmentState& st = s->state;
      const int64_t n = s->hi - s->lo;
      if (!st.step.defined()) st.step = at::zeros({}, at::TensorOptions().dtype(at::kFloat));
      if (!st.exp_avg.defined()) st.exp_avg = fp32Zeros(n, master_);
      if (!st.exp_avg_sq.defined()) st.exp_avg_sq = fp32Zeros(n, master_);
      if (a->amsgrad && !st.max_exp_avg_sq.defined()) st.max_exp_avg_sq = fp32Zeros(n, master_);
      m.push_back(st.exp_avg);
      v.push_back(st.exp_avg_sq);
      if (a->amsgrad) vmax.push_back(st.max_exp_avg_sq);
      steps.push_back(st.step);
    }
    adamKernel(a->decoupled ? "zeroplus.adamw_step" : "zeroplus.adam_step", a->decoupled, params, grads, m, v, vmax,
               steps, {a->lr, a->beta1, a->beta2, a->weight_decay, a->eps, a->amsgrad, a->maximize, a->threads});
    return;
  }
  const auto& sh = std::get<SgdHyper>(hyper);
  std::vector<at::Tensor> bufs;
  std::vector<bool> init;
  if (sh.momentum != 0) {
    for (Segment* s : live) {
      SegmentState& st = s->state;
      // torch creates the buffer at the first step as a copy of the gradient: the kernel does.
      init.push_back(!st.momentum_buffer.defined());
      if (!st.momentum_buffer.defined()) {
        st.momentum_buffer = at::empty({s->hi - s->lo}, at::TensorOptions().dtype(at::kFloat).device(master_.device()));
      }
      bufs.push_back(st.momentum_buffer);
    }
  }
  sgdKernel(params, grads, bufs, init,
            {sh.lr, sh.momentum, sh.dampening, sh.weight_decay, sh.nesterov, sh.maximize, sh.threads});
}

}  // namespace zeroplus::zero::engine
