// ZeroAdamW (zero_adamw.hpp): torch::optim::Optimizer over the fused Adam kernels
// (fused_optimizer_ops.hpp) and the ZeRO-1 owner broadcast (zero_param_sync.hpp).
#include "optimizers/adapter/zero_adamw.hpp"

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include "optimizers/adapter/fused_optimizer_ops.hpp"

namespace zeroplus::optim {
namespace {

constexpr const char* kOp = "zeroplus::optim::ZeroAdamW";
// Largest staging chunk of the post-step broadcast (zeroplus.optim.zero.SYNC_BUCKET_CAP_BYTES).
constexpr int64_t kSyncBucketCapBytes = 32 << 20;

std::vector<torch::optim::OptimizerParamGroup> singleGroup(std::vector<at::Tensor> params) {
  return {torch::optim::OptimizerParamGroup(std::move(params))};
}

}  // namespace

ZeroAdamWOptions::ZeroAdamWOptions(double lr) : lr_(lr) {}
double ZeroAdamWOptions::get_lr() const { return lr(); }
void ZeroAdamWOptions::set_lr(const double lr) { this->lr(lr); }

ZeroAdamWOptions ZeroAdamWOptions::mergedOver(const ZeroAdamWOptions& defaults) const {
  const ZeroAdamWOptions unset;
  ZeroAdamWOptions out = defaults;
  if (lr() != unset.lr()) out.lr(lr());
  if (betas() != unset.betas()) out.betas(betas());
  if (eps() != unset.eps()) out.eps(eps());
  if (weight_decay() != unset.weight_decay()) out.weight_decay(weight_decay());
  if (amsgrad() != unset.amsgrad()) out.amsgrad(amsgrad());
  if (maximize() != unset.maximize()) out.maximize(maximize());
  if (decoupled_weight_decay() != unset.decoupled_weight_decay()) out.decoupled_weight_decay(decoupled_weight_decay());
  if (threads() != unset.threads()) out.threads(threads());
  return out;
}

std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> groupOptionsOf(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> out;
  for (const auto& g : groups) out.push_back(g.has_options() ? g.options().clone() : nullptr);
  return out;
}

void restoreGroupOptions(std::vector<torch::optim::OptimizerParamGroup>& groups,
                         const std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>& given,
                         const torch::optim::OptimizerOptions& defaults) {
  const auto* zeroDefaults = dynamic_cast<const ZeroAdamWOptions*>(&defaults);
  for (size_t g = 0; g < groups.size() && g < given.size(); ++g) {
    const auto* own = given[g] ? dynamic_cast<const ZeroAdamWOptions*>(given[g].get()) : nullptr;
    if (own != nullptr && zeroDefaults != nullptr) {
      groups[g].set_options(std::make_unique<ZeroAdamWOptions>(own->mergedOver(*zeroDefaults)));
    }
  }
}

ZeroAdamW::ZeroAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                     c10::intrusive_ptr<c10d::ProcessGroup> process_group, ZeroAdamWOptions defaults)
    : ZeroAdamW(GroupsTag{}, param_groups, std::move(process_group), std::move(defaults)) {}

ZeroAdamW::ZeroAdamW(GroupsTag /*tag*/, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     c10::intrusive_ptr<c10d::ProcessGroup> process_group, ZeroAdamWOptions defaults)
    : Optimizer(param_groups, std::make_unique<ZeroAdamWOptions>(defaults)), pg_(std::move(process_group)) {
  restoreGroupOptions(param_groups_, groupOptionsOf(param_groups), *defaults_);
  TORCH_CHECK(pg_, kOp, ": process_group is null");
  std::vector<at::Tensor> chained;
  for (const auto& group : param_groups_) {
    const auto& o = static_cast<const ZeroAdamWOptions&>(group.options());
    adapter::checkAdamArgs(kOp, {o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                                 o.amsgrad(), o.maximize(), o.threads()});
    group_sizes_.push_back(static_cast<int64_t>(group.params().size()));
    for (const auto& p : group.params()) {
      const size_t i = chained.size();
      TORCH_CHECK(p.defined() && p.device().is_cpu(), kOp, ": params[", i, "] must be a CPU tensor, got ",
                  p.defined() ? p.device().str() : std::string("an undefined tensor"));
      TORCH_CHECK(p.is_contiguous(), kOp, ": params[", i, "] must be contiguous");
      chained.push_back(p);
    }
  }
  // The planner (ZeroParamSync) checks dtypes agree and computes torch's partition.
  sync_ = c10::make_intrusive<adapter::ZeroParamSync>(chained, group_sizes_, pg_, /*bucket_view=*/false,
                                                      kSyncBucketCapBytes);
  owners_ = sync_->owners();
  states_.resize(chained.size());
}

ZeroAdamW::ZeroAdamW(std::vector<at::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                     ZeroAdamWOptions defaults)
    : ZeroAdamW(singleGroup(std::move(params)), std::move(process_group), std::move(defaults)) {}

void ZeroAdamW::checkGroupsUnchanged() const {
  bool same = param_groups_.size() == group_sizes_.size();
  for (size_t g = 0; same && g < param_groups_.size(); ++g) {
    same = static_cast<int64_t>(param_groups_[g].params().size()) == group_sizes_[g];
  }
  TORCH_CHECK(same, kOp, ": the param groups changed after construction (add_param_group is not supported; "
              "build a new optimizer)");
}

at::Tensor ZeroAdamW::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  checkGroupsUnchanged();
  const int64_t rank = pg_->getRank();
  size_t flat = 0;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const ZeroAdamWOptions&>(group.options());
    const adapter::AdamArgs args{o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                                 o.amsgrad(), o.maximize(), o.threads()};
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
    for (const auto& p : group.params()) {
      const size_t i = flat++;
      if (owners_[i] != rank || !p.grad().defined()) continue;
      ParamState& s = states_[i];
      if (!s.step.defined()) {  // torch's lazy state: created at the first step with a gradient
        const auto f32 = p.options().dtype(at::kFloat);
        s.exp_avg = at::zeros({p.numel()}, f32);
        s.exp_avg_sq = at::zeros({p.numel()}, f32);
        if (o.amsgrad()) s.max_exp_avg_sq = at::zeros({p.numel()}, f32);
        s.step = at::zeros({}, f32);
      }
      params.push_back(p);
      grads.push_back(p.grad().contiguous());
      exp_avgs.push_back(s.exp_avg);
      exp_avg_sqs.push_back(s.exp_avg_sq);
      if (o.amsgrad()) max_exp_avg_sqs.push_back(s.max_exp_avg_sq);
      steps.push_back(s.step);
    }
    if (!params.empty()) {
      adapter::adamStep(kOp, o.decoupled_weight_decay(), params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                        steps, args);
    }
  }
  sync_->run();  // collective: owners broadcast their updated parameters
  return loss;
}

void ZeroAdamW::save(torch::serialize::OutputArchive& /*archive*/) const {
  TORCH_CHECK(false, kOp, " does not support save(): its state is sharded across ranks; checkpoint through the "
              "Python API (consolidate_state_dict)");
}

void ZeroAdamW::load(torch::serialize::InputArchive& /*archive*/) {
  TORCH_CHECK(false, kOp, " does not support load(): its state is sharded across ranks");
}

std::vector<int64_t> ZeroAdamW::owners() const { return owners_; }

int64_t ZeroAdamW::ownedNumel() const {
  const int64_t rank = pg_->getRank();
  int64_t n = 0;
  size_t i = 0;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      if (owners_[i++] == rank) n += p.numel();
    }
  }
  return n;
}

}  // namespace zeroplus::optim
