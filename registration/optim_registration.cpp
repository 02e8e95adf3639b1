// Registers the fused optimizer ops (zeroplus::adam_step, adamw_step, sgd_step, cpu_isa,
// partition_params) and the torchbind classes zeroplus.ZeroParamSync (ZeRO's post-step
// broadcasts) and zeroplus.LossScaler (the core's fp16 loss scaler for the Python engine,
// wrapped by plugin/python/zeroplus/zero/loss_scaler.py).
// Schemas mark params and state as mutated (Tensor(a!)[]) so torch.compile / functionalization
// and the dispatcher know they are updated in place; the CPU kernels are bound with
// TORCH_LIBRARY_IMPL so a CUDA implementation can be added under its own dispatch key.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>

#include "optimizers/adapter/flat_plan_op.hpp"
#include "optimizers/adapter/fused_optimizer_ops.hpp"
#include "optimizers/adapter/zero_param_sync.hpp"
#include "optimizers/core/loss_scaler.hpp"
#ifdef ZEROPLUS_WITH_CUDA
#include "optimizers/adapter/fused_optimizer_cuda_ops.hpp"
#endif

namespace zeroplus::registration {
namespace {

namespace oa = zeroplus::optim::adapter;

template <bool kDecoupled>
void adamStepOp(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& state_steps,
                double lr, double beta1, double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,
                int64_t threads) {
  oa::adamStep(kDecoupled ? "zeroplus.adamw_step" : "zeroplus.adam_step", kDecoupled, params, grads, exp_avgs,
               exp_avg_sqs, max_exp_avg_sqs, state_steps,
               oa::AdamArgs{lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, threads});
}

#ifdef ZEROPLUS_WITH_CUDA
template <bool kDecoupled>
void adamStepCudaOp(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                    const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& state_steps,
                    double lr, double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                    bool maximize, int64_t threads) {
  oa::adamStepCuda(kDecoupled ? "zeroplus.adamw_step" : "zeroplus.adam_step", kDecoupled, params, grads, exp_avgs,
                   exp_avg_sqs, max_exp_avg_sqs, state_steps,
                   oa::AdamArgs{lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, threads});
}

void sgdStepCudaOp(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& momentum_buffers, c10::List<bool> init_momentum, double lr,
                   double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                   int64_t threads) {
  std::vector<bool> init(init_momentum.begin(), init_momentum.end());
  oa::sgdStepCuda("zeroplus.sgd_step", params, grads, momentum_buffers, init,
                  oa::SgdArgs{lr, momentum, dampening, weight_decay, nesterov, maximize, threads});
}
#endif

bool hasCudaKernels() {
#ifdef ZEROPLUS_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void sgdStepOp(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& momentum_buffers, c10::List<bool> init_momentum, double lr,
               double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
               int64_t threads) {
  std::vector<bool> init(init_momentum.begin(), init_momentum.end());
  oa::sgdStep("zeroplus.sgd_step", params, grads, momentum_buffers, init,
              oa::SgdArgs{lr, momentum, dampening, weight_decay, nesterov, maximize, threads});
}

// torch.classes.zeroplus.LossScaler: a dynamic optim::LossScaler (TorchScript classes derive
// from CustomClassHolder; the core class stays plain). Its settings are checked here, worded
// with the Python names (LossScalerOptions' fields): c10::ValueError reaches Python as ValueError.
class LossScalerHolder : public torch::CustomClassHolder {
 public:
  LossScalerHolder(double initScale, int64_t scaleWindow, int64_t hysteresis, double minScale,
                   bool consecutiveHysteresis, double scaleFactor, bool raiseErrorAtMinScale)
      : scaler(checked({initScale, scaleWindow, hysteresis, minScale, consecutiveHysteresis, scaleFactor,
                        raiseErrorAtMinScale})) {}

  // (scale, hysteresis_left, iteration, last_overflow_iteration): Python's state_dict fields.
  std::tuple<double, int64_t, int64_t, int64_t> state() const {
    const auto& st = scaler.state();
    return {st.scale, st.hysteresisLeft, st.iteration, st.lastOverflowIteration};
  }
  void load(double scale, int64_t hysteresisLeft, int64_t iteration, int64_t lastOverflowIteration) {
    scaler.load({scale, hysteresisLeft, iteration, lastOverflowIteration});
  }
  // False: an overflow at the minimum scale (nothing changed); Python raises
  // LossScaleAtMinimumError with atMinimumMessage(), an exception type c10 cannot name.
  bool update(bool overflow) { return scaler.update(overflow) == 0; }

  optim::LossScaler scaler;

 private:
  static optim::LossScaler checked(const optim::LossScalerSettings& s) {
    optim::LossScalerProblem problem;
    if (optim::checkLossScalerSettings(s, &problem) == 0) return optim::LossScaler(s);
    using Field = optim::LossScalerProblem::Field;
    switch (problem.field) {
      case Field::kInitScale:
        TORCH_CHECK_VALUE(false, "loss scaler: init_scale must be ", problem.rule, ", got ", s.initScale);
      case Field::kMinScale:
        TORCH_CHECK_VALUE(false, "loss scaler: min_scale must be ", problem.rule, ", got ", s.minScale);
      case Field::kScaleFactor:
        TORCH_CHECK_VALUE(false, "loss scaler: scale_factor must be ", problem.rule, ", got ", s.scaleFactor);
      case Field::kScaleWindow:
        TORCH_CHECK_VALUE(false, "loss scaler: scale_window must be ", problem.rule, ", got ", s.scaleWindow);
      case Field::kHysteresis:
        TORCH_CHECK_VALUE(false, "loss scaler: hysteresis must be ", problem.rule, ", got ", s.hysteresis);
      case Field::kInitBelowMin:
        TORCH_CHECK_VALUE(false, "loss scaler: init_scale (", s.initScale, ") is below min_scale (", s.minScale, ")");
    }
    TORCH_CHECK_VALUE(false, "loss scaler: settings refused");
  }
};

}  // namespace
}  // namespace zeroplus::registration

TORCH_LIBRARY_FRAGMENT(zeroplus, m) {
#define ZEROPLUS_ADAM_ARGS                                                                     \
  "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "      \
  "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] state_steps, float lr, float beta1, float beta2, " \
  "float weight_decay, float eps, bool amsgrad, bool maximize, int threads=0) -> ()"
  m.def("adam_step" ZEROPLUS_ADAM_ARGS);
  m.def("adamw_step" ZEROPLUS_ADAM_ARGS);
#undef ZEROPLUS_ADAM_ARGS
  m.def(
      "sgd_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, bool[] init_momentum, "
      "float lr, float momentum, float dampening, float weight_decay, bool nesterov, bool maximize, "
      "int threads=0) -> ()");
  m.def("cpu_isa() -> str", &zeroplus::optim::adapter::activeIsaName);
  // True when this build has the CUDA kernels (the Python optimizers then fuse CUDA params too).
  m.def("has_cuda_kernels() -> bool", &zeroplus::registration::hasCudaKernels);
  m.def("partition_params(int[] numels, int[] group_sizes, int world_size) -> int[]",
        &zeroplus::optim::adapter::partitionParams);
  // ZeRO stage 2/3 flat-bucket layout (see optimizers/adapter/flat_plan_op.hpp for the encoding).
  m.def("plan_flat_buckets(int[] numels, int[] segments, int world_size, int cap_elems, int align_elems) -> int[]",
        &zeroplus::optim::adapter::planFlatBucketsOp);
  using zeroplus::optim::adapter::ZeroParamSync;
  m.class_<ZeroParamSync>("ZeroParamSync")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, c10::intrusive_ptr<c10d::ProcessGroup>, bool,
                       int64_t>())
      .def("run", &ZeroParamSync::run)
      .def("buckets", &ZeroParamSync::buckets)
      .def("num_devices", &ZeroParamSync::numDevices)
      .def("num_broadcasts", &ZeroParamSync::numBroadcasts)
      .def("owners", &ZeroParamSync::owners);
  using zeroplus::registration::LossScalerHolder;
  using LossScalerRef = c10::intrusive_ptr<LossScalerHolder>;
  m.class_<LossScalerHolder>("LossScaler")
      .def(torch::init<double, int64_t, int64_t, double, bool, double, bool>())
      .def("scale", [](const LossScalerRef& s) { return s->scaler.scale(); })
      .def("state", &LossScalerHolder::state)
      .def("load", &LossScalerHolder::load)
      .def("update", &LossScalerHolder::update)
      .def("at_minimum_message", [](const LossScalerRef& s) { return s->scaler.atMinimumMessage(); });
}

TORCH_LIBRARY_IMPL(zeroplus, CPU, m) {
  m.impl("adam_step", &zeroplus::registration::adamStepOp<false>);
  m.impl("adamw_step", &zeroplus::registration::adamStepOp<true>);
  m.impl("sgd_step", &zeroplus::registration::sgdStepOp);
}

#ifdef ZEROPLUS_WITH_CUDA
TORCH_LIBRARY_IMPL(zeroplus, CUDA, m) {
  m.impl("adam_step", &zeroplus::registration::adamStepCudaOp<false>);
  m.impl("adamw_step", &zeroplus::registration::adamStepCudaOp<true>);
  m.impl("sgd_step", &zeroplus::registration::sgdStepCudaOp);
}
#endif
