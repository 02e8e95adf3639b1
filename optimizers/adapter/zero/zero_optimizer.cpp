// ZeroOptimizer (zero_optimizer.hpp): torch::optim::Optimizer over the C++ ZeRO engine, with the
// LibTorch-side event sources: a post hook on each trainable parameter's gradient accumulator
// (DDP's Reducer does the same) and the autograd engine's end-of-backward callback.
#include "optimizers/adapter/zero/zero_optimizer.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/serialize/archive.h>

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "optimizers/adapter/zero/engine.hpp"
#include "optimizers/adapter/zero/units.hpp"

namespace zeroplus::zero {
namespace {

constexpr const char* kInit = "zeroplus::zero::initialize";

// The hyperparameters of one param group for the engine's step.
engine::StepHyper hyperOf(const torch::optim::OptimizerOptions& o) {
  if (const auto* z = dynamic_cast<const optim::ZeroAdamWOptions*>(&o)) {
    return engine::AdamHyper{z->lr(), std::get<0>(z->betas()), std::get<1>(z->betas()), z->eps(), z->weight_decay(),
                             z->amsgrad(), z->maximize(), z->decoupled_weight_decay(), z->threads()};
  }
  if (const auto* a = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) {
    return engine::AdamHyper{a->lr(), std::get<0>(a->betas()), std::get<1>(a->betas()), a->eps(), a->weight_decay(),
                             a->amsgrad(), false, true, 0};
  }
  if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) {
    return engine::AdamHyper{a->lr(), std::get<0>(a->betas()), std::get<1>(a->betas()), a->eps(), a->weight_decay(),
                             a->amsgrad(), false, false, 0};
  }
  if (const auto* s = dynamic_cast<const torch::optim::SGDOptions*>(&o)) {
    return engine::SgdHyper{s->lr(), s->momentum(), s->dampening(), s->weight_decay(), s->nesterov(), false, 0};
  }
  TORCH_CHECK_TYPE(false, "zeroplus::zero: optimizer options must be zeroplus::optim::ZeroAdamWOptions, "
                   "torch::optim::AdamWOptions, torch::optim::AdamOptions or torch::optim::SGDOptions");
}

void checkOptions(const Options& o) {
  TORCH_CHECK_VALUE(o.stage() >= 1 && o.stage() <= 3, kInit, ": options.stage must be 1, 2 or 3, got ", o.stage());
  TORCH_CHECK_VALUE(o.mixed_precision() == "fp32" || o.mixed_precision() == "bf16" || o.mixed_precision() == "fp16",
                    kInit, ": options.mixed_precision must be \"fp32\", \"bf16\" or \"fp16\", got \"",
                    o.mixed_precision(), "\"");
  if (o.mixed_precision() == "fp16") engine::checkLossScaling(o, kInit);
  TORCH_CHECK_VALUE(o.grad_accum_dtype().empty() || o.grad_accum_dtype() == "fp32" || o.grad_accum_dtype() == "bf16" ||
                        o.grad_accum_dtype() == "fp16",
                    kInit, ": options.grad_accum_dtype must be \"\" (the compute dtype), \"fp32\", \"bf16\" or ",
                    "\"fp16\", got \"", o.grad_accum_dtype(), "\"");
  TORCH_CHECK_VALUE(o.reduce_bucket_elems() >= 1, kInit, ": options.reduce_bucket_elems must be >= 1, got ",
                    o.reduce_bucket_elems());
  TORCH_CHECK_VALUE(o.param_persistence_threshold() >= 0, kInit,
                    ": options.param_persistence_threshold must be >= 0, got ", o.param_persistence_threshold());
  TORCH_CHECK_VALUE(o.gradient_clipping() >= 0, kInit, ": options.gradient_clipping must be >= 0, got ",
                    o.gradient_clipping());
  // "cpu" is DeepSpeed's ZeRO-Offload: state and step in host memory. CPU training's state is
  // there already, so it is accepted and changes nothing, as the Python engine does on CPU
  // training (a DeepSpeed config carries over unchanged); with CUDA parameters the constructor
  // refuses it (the C++ engine has no host tier).
  TORCH_CHECK_VALUE(o.offload_optimizer() == "none" || o.offload_optimizer() == "cpu" || o.offload_optimizer() == "nvme",
                    kInit, ": options.offload_optimizer must be \"none\", \"cpu\" or \"nvme\", got \"",
                    o.offload_optimizer(), "\"");
  if (o.offload_optimizer() == "nvme") {
    const std::string& path = o.nvme_path();
    TORCH_CHECK_VALUE(!path.empty(), kInit, ": options.nvme_path must name a directory when offload_optimizer is "
                      "\"nvme\"");
    struct stat st {};
    TORCH_CHECK_VALUE(::stat(path.c_str(), &st) == 0, kInit, ": options.nvme_path \"", path, "\": ",
                      std::strerror(errno));
    TORCH_CHECK_VALUE(S_ISDIR(st.st_mode), kInit, ": options.nvme_path \"", path, "\" is not a directory");
    TORCH_CHECK_VALUE(::access(path.c_str(), W_OK | X_OK) == 0, kInit, ": options.nvme_path \"", path,
                      "\" is not writable: ", std::strerror(errno));
  }
}

// Deduplicated by TensorImpl (LibTorch lists a shared parameter under each name).
std::vector<at::Tensor> uniqueParams(const torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  std::unordered_set<const void*> seen;
  for (const auto& p : model.parameters(/*recurse=*/true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

// Every parameter and buffer of the model is on the trainable parameters' device (CPU or one CUDA
// device): the engine's buffers and collectives live there (a frozen parameter or buffer elsewhere
// would be broadcast on a device the group may not serve, and mix devices in forward anyway).
void checkOneDevice(const torch::nn::Module& model, const std::vector<std::vector<at::Tensor>>& trainable) {
  std::optional<at::Device> device;
  for (const auto& g : trainable) {
    for (const auto& p : g) {
      if (!device) device = p.device();
      TORCH_CHECK_VALUE(p.device() == *device, kInit, ": the trainable parameters are on ", *device, " and ",
                        p.device(), "; the engine trains parameters on one device (move the model with "
                        "model->to(device) before initialize)");
    }
  }
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    TORCH_CHECK_VALUE(item.value().device() == *device, kInit, ": parameter \"", item.key(), "\" is on ",
                      item.value().device(), ", the trainable parameters on ", *device, " (move the model with "
                      "model->to(device) before initialize)");
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    TORCH_CHECK_VALUE(item.value().device() == *device, kInit, ": buffer \"", item.key(), "\" is on ",
                      item.value().device(), ", the parameters on ", *device, " (move the model with "
                      "model->to(device) before initialize)");
  }
#ifndef ZEROPLUS_WITH_CUDA
  TORCH_CHECK_VALUE(!device->is_cuda(), kInit, ": the parameters are on ", *device, " but this zeroplus was built "
                    "without CUDA (build it against a CUDA torch: docs/build.md)");
#endif
}

// Checks the groups against the model and returns the trainable parameters of each group.
std::vector<std::vector<at::Tensor>> trainableGroups(const torch::nn::Module& model,
                                                     const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::unordered_set<const void*> inModel, grouped;
  for (const auto& p : uniqueParams(model)) inModel.insert(p.unsafeGetTensorImpl());
  std::vector<std::vector<at::Tensor>> out;
  bool anyTrainable = false;
  for (size_t g = 0; g < groups.size(); ++g) {
    out.emplace_back();
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      TORCH_CHECK_VALUE(p.defined() && inModel.count(p.unsafeGetTensorImpl()), kInit, ": param_groups[", g,
                        "].params[", i, "] is not a parameter of model");
      TORCH_CHECK_VALUE(grouped.insert(p.unsafeGetTensorImpl()).second, kInit, ": param_groups[", g, "].params[", i,
                        "] appears in more than one group");
      TORCH_CHECK_VALUE(p.device().is_cpu() || p.device().is_cuda(), kInit, ": param_groups[", g, "].params[", i,
                        "] is on ", p.device(), "; the engine trains CPU or CUDA parameters");
      TORCH_CHECK_VALUE(p.is_contiguous(), kInit, ": param_groups[", g, "].params[", i, "] is not contiguous");
      if (!p.requires_grad()) continue;
      TORCH_CHECK_TYPE(at::isFloatingType(p.scalar_type()), kInit, ": param_groups[", g, "].params[", i,
                       "] is trainable but of dtype ", p.scalar_type());
      out.back().push_back(p);
      anyTrainable = true;
    }
  }
  TORCH_CHECK_VALUE(anyTrainable, kInit, ": model has no parameter with requires_grad=true in the param groups");
  checkOneDevice(model, out);
  for (const auto& p : uniqueParams(model)) {
    TORCH_CHECK_VALUE(!p.requires_grad() || grouped.count(p.unsafeGetTensorImpl()), kInit,
                      ": a trainable parameter of model of shape ", p.sizes(),
                      " is in no param group (freeze it with requires_grad_(false) or add it to a group)");
  }
  return out;
}

// Frozen parameters and buffers: cast to the compute dtype (floating ones), then rank 0's values.
void syncUnmanaged(torch::nn::Module& model, engine::Engine& eng) {
  const auto dtype = eng.computeDtype();
  for (auto& p : uniqueParams(model)) {
    if (p.requires_grad()) continue;
    if (dtype && at::isFloatingType(p.scalar_type()) && p.scalar_type() != *dtype) p.set_data(p.detach().to(*dtype));
    at::Tensor data = p.detach();
    eng.comm().broadcastFromZero(data);
  }
  for (auto& buf : model.buffers(/*recurse=*/true)) {
    if (dtype && at::isFloatingType(buf.scalar_type()) && buf.scalar_type() != *dtype) buf.set_data(buf.to(*dtype));
    at::Tensor data = buf.detach();
    eng.comm().broadcastFromZero(data);
  }
}

}  // namespace

// What the gradient hooks reach: the engine while the optimizer lives (the hooks stay on the
// parameters' accumulators until the destructor removes them; a weak reference guards the gap).
struct ZeroOptimizer::HookState {
  // What grad_accumulator returns: a shared_ptr up to torch 2.12, an intrusive_ptr from 2.13.
  using NodeRef = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::weak_ptr<engine::Engine> engine;
  std::vector<std::pair<NodeRef, uintptr_t>> accumulators;
  bool callbackQueued = false;
  bool stepSinceZero = false;  // step() ran and zero_grad() has not since
};

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<torch::nn::Module> model, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                             const Options& options, const std::vector<torch::optim::OptimizerParamGroup>& groups,
                             std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : Optimizer(groups, std::move(defaults)), model_(std::move(model)) {
  optim::restoreGroupOptions(param_groups_, optim::groupOptionsOf(groups), *defaults_);
  TORCH_CHECK_VALUE(model_ != nullptr, kInit, ": model is null");
  TORCH_CHECK_VALUE(pg, kInit, ": pg is null");
  checkOptions(options);
  std::vector<engine::StepHyper> groupHyper;  // checked here, before anything collective
  for (size_t g = 0; g < param_groups_.size(); ++g) groupHyper.push_back(hyperOf(param_groups_[g].options()));
  const auto trainable = trainableGroups(*model_, param_groups_);
  for (const auto& g : param_groups_) groupSizes_.push_back(g.params().size());
  bool cuda = false;
  for (const auto& g : trainable) cuda = cuda || (!g.empty() && g.front().is_cuda());
  TORCH_CHECK_VALUE(!cuda || options.offload_optimizer() == "none", kInit, ": options.offload_optimizer \"",
                    options.offload_optimizer(), "\" with CUDA parameters: the C++ engine keeps a CUDA model's "
                    "optimizer state in GPU memory (ZeRO-Offload of CUDA training runs in the Python engine: "
                    "zeroplus.initialize(..., offload_optimizer=...)); use \"none\"");
  Stage3Units units;  // stage 3: found (and checked) before anything collective
  if (options.stage() == 3) units = findUnits(model_, trainable, options.param_persistence_threshold());
  engine_ = std::make_shared<engine::Engine>(trainable, std::move(pg), options, groupHyper, units.layout);
  syncUnmanaged(*model_, *engine_);
  installHooks();
  if (options.stage() == 3) wrapUnits(units, engine_);
}

ZeroOptimizer::~ZeroOptimizer() {
  for (auto& [acc, key] : hooks_->accumulators) acc->del_post_hook(key);
}

void ZeroOptimizer::installHooks() {
  hooks_ = std::make_shared<HookState>();
  hooks_->engine = engine_;
  for (const auto& b : engine_->params().buckets()) {
    for (const auto& e : b.entries) {
      auto acc = torch::autograd::impl::grad_accumulator(e.param);
      std::weak_ptr<HookState> weak = hooks_;
      const int64_t index = e.index;
      auto hook = [weak, index](const torch::autograd::variable_list& outputs,
                                const torch::autograd::variable_list& /*inputs*/) {
        auto state = weak.lock();
        auto eng = state ? state->engine.lock() : nullptr;
        if (!eng) return outputs;
        TORCH_CHECK(!(state->stepSinceZero && !eng->passOpen()),
                    "zeroplus::zero: a backward pass would add to the gradients of the previous step: call "
                    "zero_grad() on the optimizer zeroplus::zero::initialize returned (through a "
                    "torch::optim::Optimizer& it is torch's non-virtual zero_grad, which cannot reach zeroplus's "
                    "gradient buffers)");
        eng->gradReady(index);
        if (!state->callbackQueued) {
          state->callbackQueued = true;
          torch::autograd::Engine::get_default_engine().queue_callback([weak] {
            auto s = weak.lock();
            auto e = s ? s->engine.lock() : nullptr;
            if (!e) return;
            s->callbackQueued = false;
            e->endBackward();
          });
        }
        return outputs;
      };
      const uintptr_t key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(hook));
      hooks_->accumulators.emplace_back(acc, key);
    }
  }
}

void ZeroOptimizer::checkGroupsUnchanged() const {
  bool same = param_groups_.size() == groupSizes_.size();
  for (size_t g = 0; same && g < param_groups_.size(); ++g) same = param_groups_[g].params().size() == groupSizes_[g];
  TORCH_CHECK(same, "zeroplus::zero::ZeroOptimizer: the param groups changed after initialize (add_param_group is "
              "not supported: the flat layout is fixed); pass every group to initialize");
}

void ZeroOptimizer::backward(const at::Tensor& loss) {
  TORCH_CHECK_VALUE(loss.defined(), "zeroplus::zero::ZeroOptimizer::backward: loss is undefined");
  TORCH_CHECK_VALUE(loss.numel() == 1, "zeroplus::zero::ZeroOptimizer::backward: loss must have one element, got "
                    "shape ", loss.sizes());
  hooks_->callbackQueued = false;  // a backward that raised dropped its queued callback
  if (engine_->fp16()) {
    // The Python engine's (loss.float() * scale).backward(): the fp32 loss times the scale.
    loss.to(at::kFloat).mul(engine_->lossScale()).backward();
  } else {
    loss.backward();
  }
}

double ZeroOptimizer::clip_grad_norm(double max_norm, double norm_type, bool error_if_nonfinite) {
  return engine_->clipGradNorm(max_norm, norm_type, error_if_nonfinite).item<double>();
}

at::Tensor ZeroOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  checkGroupsUnchanged();
  std::vector<engine::StepHyper> hyper;
  for (const auto& g : param_groups_) hyper.push_back(hyperOf(g.options()));
  hooks_->callbackQueued = false;
  engine_->step(hyper);
  hooks_->stepSinceZero = engine_->hasGradients();
  return loss;
}

void ZeroOptimizer::zero_grad(bool set_to_none) {
  hooks_->callbackQueued = false;
  engine_->zeroGrad(set_to_none);
  hooks_->stepSinceZero = false;
}

void ZeroOptimizer::save(torch::serialize::OutputArchive& /*archive*/) const {
  TORCH_CHECK(false, "zeroplus::zero::ZeroOptimizer does not support save(): its state is sharded across ranks; "
              "zeroplus::zero::full_state_dict(model, opt) gives the full model on every rank");
}

void ZeroOptimizer::load(torch::serialize::InputArchive& /*archive*/) {
  TORCH_CHECK(false, "zeroplus::zero::ZeroOptimizer does not support load(): its state is sharded across ranks");
}

ZeroOptimizer::NoSyncGuard::NoSyncGuard(ZeroOptimizer& opt) : opt_(opt), previous_(opt.engine_->noSync()) {
  opt_.engine_->setNoSync(true);
}
ZeroOptimizer::NoSyncGuard::~NoSyncGuard() { opt_.engine_->setNoSync(previous_); }

int64_t ZeroOptimizer::stage() const { return engine_->stage(); }
double ZeroOptimizer::loss_scale() const { return engine_->lossScale(); }
int64_t ZeroOptimizer::skipped_steps() const { return engine_->skippedSteps(); }
std::vector<at::Tensor> ZeroOptimizer::gradient_shards() { return engine_->gradientShards(); }
int64_t ZeroOptimizer::owned_numel() const { return engine_->ownedNumel(); }

// -- initialize ----------------------------------------------------------------------------------

std::shared_ptr<ZeroOptimizer> initialize(const std::shared_ptr<torch::nn::Module>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          std::vector<torch::optim::OptimizerParamGroup> groups,
                                          const torch::optim::OptimizerOptions& defaults) {
  TORCH_CHECK_VALUE(model != nullptr, kInit, ": model is null");
  TORCH_CHECK_VALUE(!groups.empty(), kInit, ": param groups are empty");
  const auto kind = hyperOf(defaults).index();
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].has_options()) {
      TORCH_CHECK_TYPE(typeid(groups[g].options()) == typeid(defaults), kInit, ": param_groups[", g,
                       "] has options of another optimizer kind than the defaults");
    }
  }
  (void)kind;
  return std::make_shared<ZeroOptimizer>(model, std::move(pg), options, groups, defaults.clone());
}

namespace {
std::shared_ptr<ZeroOptimizer> singleGroup(const std::shared_ptr<torch::nn::Module>& model,
                                           c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                           const torch::optim::OptimizerOptions& defaults) {
  TORCH_CHECK_VALUE(model != nullptr, kInit, ": model is null");
  std::vector<torch::optim::OptimizerParamGroup> groups{torch::optim::OptimizerParamGroup(uniqueParams(*model))};
  return initialize(model, std::move(pg), options, std::move(groups), defaults);
}
}  // namespace

std::shared_ptr<ZeroOptimizer> initialize(const std::shared_ptr<torch::nn::Module>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          const optim::ZeroAdamWOptions& optimizer) {
  return singleGroup(model, std::move(pg), options, optimizer);
}
std::shared_ptr<ZeroOptimizer> initialize(const std::shared_ptr<torch::nn::Module>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          const torch::optim::AdamWOptions& optimizer) {
  return singleGroup(model, std::move(pg), options, optimizer);
}
std::shared_ptr<ZeroOptimizer> initialize(const std::shared_ptr<torch::nn::Module>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          const torch::optim::AdamOptions& optimizer) {
  return singleGroup(model, std::move(pg), options, optimizer);
}
std::shared_ptr<ZeroOptimizer> initialize(const std::shared_ptr<torch::nn::Module>& model,
                                          c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& options,
                                          const torch::optim::SGDOptions& optimizer) {
  return singleGroup(model, std::move(pg), options, optimizer);
}

torch::OrderedDict<std::string, at::Tensor> full_state_dict(const std::shared_ptr<torch::nn::Module>& model,
                                                            ZeroOptimizer& optimizer) {
  TORCH_CHECK_VALUE(model != nullptr, "zeroplus::zero::full_state_dict: model is null");
  TORCH_CHECK_VALUE(model.get() == optimizer.model().get(),
                    "zeroplus::zero::full_state_dict: optimizer was not initialized with this model");
  at::NoGradGuard noGrad;
  torch::OrderedDict<std::string, at::Tensor> out;
  if (auto* sharded = optimizer.engine().sharded()) {
    // Unit by unit (collective): the peak is one unit beside the output.
    std::unordered_map<const void*, at::Tensor> full;
    for (int64_t u = 0; u < sharded->unitCount(); ++u) {
      sharded->gather(u);
      for (const auto& b : sharded->buckets()) {
        if (b.unit != u || b.persistent) continue;  // persistent ones are whole: cloned below
        for (const auto& e : b.entries) full.emplace(e.param.unsafeGetTensorImpl(), e.param.detach().clone());
      }
      sharded->release(u);
    }
    for (const auto& item : model->named_parameters(/*recurse=*/true)) {
      auto found = full.find(item.value().unsafeGetTensorImpl());
      out.insert(item.key(), found != full.end() ? found->second : item.value().detach().clone());
    }
    for (const auto& item : model->named_buffers(/*recurse=*/true)) out.insert(item.key(), item.value().detach().clone());
    return out;
  }
  for (const auto& item : model->named_parameters(/*recurse=*/true)) out.insert(item.key(), item.value().detach().clone());
  for (const auto& item : model->named_buffers(/*recurse=*/true)) out.insert(item.key(), item.value().detach().clone());
  return out;
}

}  // namespace zeroplus::zero
