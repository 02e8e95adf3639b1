// zeroplus::zero::ZeroOptimizer and zeroplus::zero::initialize: the LibTorch front-end of the
// C++ ZeRO engine (engine.hpp). Include "zeroplus.hpp" rather than this header.
//
//   auto pg = zeroplus::pg::makeProcessGroup(store, rank, world);
//   torch::nn::Sequential model(...);                          // model->forward(x) unchanged
//   auto opt = zeroplus::zero::initialize(model, pg, zeroplus::zero::Options().stage(2),
//                                         zeroplus::optim::ZeroAdamWOptions(1e-3));
//   opt->zero_grad();
//   opt->backward(loss);            // or loss.backward(): the engine hears of it either way
//   opt->clip_grad_norm(1.0);       // the global norm across shards
//   opt->step();                    // a torch::optim::Optimizer: LR schedulers work
//
// Contract
//  * initialize is collective (every rank, same model structure, same order of calls on `pg`):
//    rank 0's parameter and buffer values are broadcast (DDP's rule), every trainable parameter
//    becomes a view into a flat bucket (identity kept: references and autograd stay valid), and a
//    gradient hook is installed on each. Move the model (dtype, device) before initialize.
//  * Optimizers: zeroplus::optim::ZeroAdamWOptions (AdamW, or Adam with
//    decoupled_weight_decay(false)), torch::optim::AdamWOptions, torch::optim::AdamOptions,
//    torch::optim::SGDOptions; one param group per call, or groups through the overload taking
//    OptimizerParamGroups (each may carry its own options of the same kind). Hyperparameters are
//    read from the param groups at every step, so C++ LR schedulers and set_lr work.
//  * After backward, gradients live in the engine (p.grad() is undefined, as its memory is the
//    point of ZeRO-2): clip with clip_grad_norm, read them with gradient_shards().
//  * zero_grad must be called on the ZeroOptimizer (torch::optim::Optimizer::zero_grad is not
//    virtual): a backward that would add to the previous step's gradients without a zero_grad in
//    between raises, naming this call, instead of silently accumulating across steps.
//  * backward, clip_grad_norm and step are collective. Not thread-safe (one call at a time).
//  * Errors: c10::ValueError / c10::TypeError / c10::Error naming "zeroplus::zero::initialize" or
//    the method and the argument, raised before anything changes where the argument is checkable.
//  * Stage 3 takes any module: the children of every outermost torch::nn::Sequential in its tree
//    (the model itself, or e.g. a GPT holder's `blocks`) are the units, gathered around their
//    forward and again for their backward, released after (the user's forward is unchanged; seq[i]
//    is then zeroplus's wrapper of child i, named_children() and every parameter name are
//    unchanged). Parameters in no unit (embeddings, final norm, head: called by the user's own
//    forward, which LibTorch gives no hook into) stay whole on every rank, their gradients and
//    optimizer state sharded as at stage 2. A model with no Sequential holding parameters raises
//    (units.hpp). Between uses a unit's parameter has its full shape but holds no memory (reads
//    give NaN): read values through full_state_dict. Keep the optimizer alive while the model is used.
//  * Devices: the model's parameters and buffers on one device, CPU or one CUDA device (a build
//    against a CUDA torch; pg must serve that device's tensors: the zeroplus backend serves both).
//    The engine's buffers, masters and optimizer state live there too (Adam's step count on the
//    host, as torch's non-capturable Adam keeps it), its collectives run on that device's tensors,
//    and on CUDA its kernels are queued on the current stream; host reads (clip_grad_norm's result,
//    the fp16 overflow check, the per-step agreement) synchronise. A model on two devices raises.
//  * Options::offload_optimizer "nvme" keeps each bucket's optimizer state on NVMe between steps
//    (optimizer_swapper.hpp), CPU parameters only. The CPU offload tier of CUDA training
//    (ZeRO-Offload) is the Python engine's; with CUDA parameters any offload_optimizer but "none"
//    raises.
//  * Options::mixed_precision "fp16": fp16 parameters with fp32 masters, and dynamic loss scaling
//    with the Python engine's (DeepSpeed's) rules and knobs (options.hpp, loss_scaler.hpp): use
//    opt->backward(loss) (it multiplies by loss_scale(); a plain loss.backward() is not scaled);
//    clip_grad_norm returns the unscaled norm (inf/NaN on an overflow step, clipping nothing);
//    step() skips a step whose gradients overflowed on any rank, on every rank, and zeroes them.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/ordered_dict.h>

#include <memory>
#include <string>
#include <vector>

#include "optimizers/adapter/zero/options.hpp"
#include "optimizers/adapter/zero_adamw.hpp"

namespace zeroplus::zero {

namespace engine {
class Engine;
}

class ZeroOptimizer : public torch::optim::Optimizer {
 public:
  // Use initialize(); public for std::make_shared.
  ZeroOptimizer(std::shared_ptr<torch::nn::Module> model, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                const Options& options, const std::vector<torch::optim::OptimizerParamGroup>& groups,
                std::unique_ptr<torch::optim::OptimizerOptions> defaults);
  ~ZeroOptimizer() override;

  // loss.backward() (loss: a defined one-element tensor); under fp16 the fp32 loss times
  // loss_scale() (the Python engine's opt.backward). Collective.
  void backward(const at::Tensor& loss);
  // Clips the global gradient norm across every rank's shards to max_norm; returns the norm
  // before clipping (what torch::nn::utils::clip_grad_norm_ returns on the unsharded model).
  double clip_grad_norm(double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false);
  at::Tensor step(LossClosure closure = nullptr) override;
  void zero_grad(bool set_to_none = true);
  // The optimizer state is sharded: save and load raise, naming zeroplus::zero::full_state_dict.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Gradients stay local (no communication) while the guard lives, like DDP's no_sync().
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(ZeroOptimizer& opt);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    ZeroOptimizer& opt_;
    bool previous_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  int64_t stage() const;
  // What backward multiplies the loss by: the fp16 loss scale (dynamic: it halves after
  // overflows, doubles after Options::loss_scale_window clean steps); 1 for fp32 and bf16.
  double loss_scale() const;
  // Steps skipped because the fp16 gradients overflowed on some rank.
  int64_t skipped_steps() const;
  // This rank's gradient shard per bucket (after backward).
  std::vector<at::Tensor> gradient_shards();
  // Elements of fp32 master / optimizer state held by this rank (about numel / world).
  int64_t owned_numel() const;
  engine::Engine& engine() { return *engine_; }
  const std::shared_ptr<torch::nn::Module>& model() const { return model_; }

 private:
  struct HookState;
  void installHooks();
  void checkGroupsUnchanged() const;

  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<engine::Engine> engine_;
  std::shared_ptr<HookState> hooks_;
  std::vector<size_t> groupSizes_;
};

// -- initialize: one overload per optimizer kind; the holder forms take torch::nn::Sequential, a
// TORCH_MODULE holder of your own module, etc.
std::shared_ptr<ZeroOptimizer> initialize(const std::shared_ptr<torch::nn::Module>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          const optim::ZeroAdamWOptions& optimizer);
std::shared_ptr<ZeroOptimizer> initialize(const std::shared_ptr<torch::nn::Module>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          const torch::optim::AdamWOptions& optimizer);
std::shared_ptr<ZeroOptimizer> initialize(const std::shared_ptr<torch::nn::Module>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          const torch::optim::AdamOptions& optimizer);
std::shared_ptr<ZeroOptimizer> initialize(const std::shared_ptr<torch::nn::Module>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          const torch::optim::SGDOptions& optimizer);
// Param groups (parameters of `model`; every trainable parameter of the model in exactly one
// group), each with its own options of defaults' kind or none (defaults apply).
std::shared_ptr<ZeroOptimizer> initialize(const std::shared_ptr<torch::nn::Module>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          std::vector<torch::optim::OptimizerParamGroup> groups,
                                          const torch::optim::OptimizerOptions& defaults);

template <typename Impl, typename Opt>
std::shared_ptr<ZeroOptimizer> initialize(torch::nn::ModuleHolder<Impl>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          const Opt& optimizer) {
  return initialize(std::static_pointer_cast<torch::nn::Module>(model.ptr()), std::move(pg), options, optimizer);
}
template <typename Impl>
std::shared_ptr<ZeroOptimizer> initialize(torch::nn::ModuleHolder<Impl>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          std::vector<torch::optim::OptimizerParamGroup> groups,
                                          const torch::optim::OptimizerOptions& defaults) {
  return initialize(std::static_pointer_cast<torch::nn::Module>(model.ptr()), std::move(pg), options,
                    std::move(groups), defaults);
}

// What model->named_parameters() and named_buffers() hold on the unsharded model: name -> full
// tensor (a copy), parameters first, on every rank. Collective at stage 3 (stages 1-2: local).
torch::OrderedDict<std::string, at::Tensor> full_state_dict(const std::shared_ptr<torch::nn::Module>& model,
                                                            ZeroOptimizer& optimizer);
template <typename Impl>
torch::OrderedDict<std::string, at::Tensor> full_state_dict(torch::nn::ModuleHolder<Impl>& model,
                                                            ZeroOptimizer& optimizer) {
  return full_state_dict(std::static_pointer_cast<torch::nn::Module>(model.ptr()), optimizer);
}

}  // namespace zeroplus::zero
