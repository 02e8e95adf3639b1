// zeroplus::optim::ZeroAdamW: ZeRO stage 1 AdamW/Adam for LibTorch training loops without
// Python, on zeroplus's fused CPU kernels. The C++ counterpart of
// zeroplus.ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW): every rank keeps
// the optimizer state (exp_avg, exp_avg_sq, step) of the parameters it owns only, steps those,
// then broadcasts them from their owners so all ranks end with identical parameters.
//
//   auto pg = zeroplus::pg::makeProcessGroup(store, rank, world);        // process_group.hpp
//   zeroplus::optim::ZeroAdamW opt(model->parameters(), pg, zeroplus::optim::ZeroAdamWOptions(1e-3));
//   loss.backward();  average the gradients over the group (DDP's job; see examples/cpp/train_mlp.cpp)
//   opt.step();
//
// Contract
//  * Partition: torch's ZeroRedundancyOptimizer partition (sorted-greedy by numel, ties to the
//    lowest rank; core/shard_planner.hpp), fixed at construction. owners() lists it.
//  * Parameters: dense contiguous CPU tensors of one dtype (float32, bfloat16 or float16), the
//    same list in the same order on every rank. State is float32. Groups may carry their own
//    ZeroAdamWOptions (lr, betas, ...), so LR schedulers that call set_lr work.
//  * step() is collective: every rank calls it, in the same order as its other collectives on
//    `process_group`, and it blocks until the parameters are synchronised. Gradients must
//    already be averaged across ranks (as DDP does); a parameter whose grad is undefined on its
//    owner is not updated (torch's rule), but is still broadcast.
//  * Threading: not thread-safe; one step()/zero_grad() at a time. The kernels use
//    options.threads() threads (0: at::get_num_threads()).
//  * Ownership: holds references to the parameters, its state tensors and the process group.
//    Parameters may be re-pointed between steps (`p.set_data(...)`) if shape and dtype stay.
//  * Errors: c10::Error / c10::ValueError naming "zeroplus::optim::ZeroAdamW" and the offending
//    parameter or field, raised before anything is written (bad hyperparameters, dtypes, devices,
//    param groups changed after construction). Collective failures propagate from the process
//    group's Work::wait() (c10::DistBackendError) and leave the parameters unspecified.
//  * Not supported (raise): add_param_group after construction, save()/load() (the state is
//    sharded; use the Python API's consolidate_state_dict for checkpoints), CUDA parameters.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/optimizer.h>

#include <tuple>
#include <vector>

#include "optimizers/adapter/zero_param_sync.hpp"

namespace zeroplus::optim {

struct ZeroAdamWOptions : public torch::optim::OptimizerCloneableOptions<ZeroAdamWOptions> {
  ZeroAdamWOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): like torch::optim
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;  // (a comma inside TORCH_ARG would split it)
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
  // true: AdamW (decoupled weight decay); false: Adam (weight decay added to the gradient).
  TORCH_ARG(bool, decoupled_weight_decay) = true;
  TORCH_ARG(int64_t, threads) = 0;

 public:
  double get_lr() const override;
  void set_lr(const double lr) override;

  // This group's options over the optimizer's defaults, field by field: a field left at its
  // constructor default takes the defaults' value (torch's rule for its own option types, which
  // torch::optim::Optimizer applies to those only: it replaces the options of any other type
  // with the defaults, dropping a group's own lr).
  ZeroAdamWOptions mergedOver(const ZeroAdamWOptions& defaults) const;
};

// The param groups' own options of the optimizer `opt` restored over what torch::optim::Optimizer
// kept (see mergedOver): `given[g]` is group g's options as passed in (null: none). Called by the
// constructors of ZeroAdamW and zeroplus::zero::ZeroOptimizer.
void restoreGroupOptions(std::vector<torch::optim::OptimizerParamGroup>& groups,
                         const std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>& given,
                         const torch::optim::OptimizerOptions& defaults);
std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> groupOptionsOf(
    const std::vector<torch::optim::OptimizerParamGroup>& groups);

class ZeroAdamW : public torch::optim::Optimizer {
 public:
  ZeroAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
            c10::intrusive_ptr<c10d::ProcessGroup> process_group, ZeroAdamWOptions defaults = {});
  ZeroAdamW(std::vector<at::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
            ZeroAdamWOptions defaults = {});

  // Steps the owned parameters with the fused kernels, then broadcasts every parameter from its
  // owner. Returns the closure's loss (undefined tensor without a closure).
  at::Tensor step(LossClosure closure = nullptr) override;

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Owner rank of every parameter, groups chained in order.
  std::vector<int64_t> owners() const;
  // Elements whose optimizer state this rank holds (the ZeRO-1 saving: about numel / world).
  int64_t ownedNumel() const;

 private:
  struct GroupsTag {};
  ZeroAdamW(GroupsTag tag, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
            c10::intrusive_ptr<c10d::ProcessGroup> process_group, ZeroAdamWOptions defaults);
  struct ParamState {
    at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq, step;
  };
  void checkGroupsUnchanged() const;

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::vector<int64_t> group_sizes_;
  std::vector<int64_t> owners_;
  std::vector<ParamState> states_;  // one per parameter; defined only for owned ones
  c10::intrusive_ptr<adapter::ZeroParamSync> sync_;  // owner broadcasts (planner + flat chunks)
};

}  // namespace zeroplus::optim
