// Converts tensor lists to AdamSpan/SgdSpan arrays after checking every argument, then runs
// one multi-tensor kernel call. All checks happen before the first write so a bad list leaves
// params and state untouched (the step counters are bumped only after the checks, too).
#include "optimizers/adapter/fused_optimizer_ops.hpp"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "optimizers/adapter/intra_op_runner.hpp"
#include "optimizers/core/adam_kernels.hpp"
#include "optimizers/core/sgd_kernels.hpp"
#include "optimizers/core/shard_planner.hpp"

namespace zeroplus::optim::adapter {
namespace {

DType paramDType(const char* op, size_t i, const at::Tensor& p) {
  switch (p.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default:
      TORCH_CHECK(false, op, ": params[", i, "] is ", c10::toString(p.scalar_type()),
                  ", expected float32/bfloat16/float16");
  }
  return DType::kFloat32;  // unreachable: TORCH_CHECK(false) throws
}

void checkDenseCpu(const char* op, const char* arg, size_t i, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", arg, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", arg, "[", i, "] is sparse, expected a dense tensor");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", arg, "[", i, "] is on ", t.device(), ", expected cpu");
  TORCH_CHECK(t.is_contiguous(), op, ": ", arg, "[", i, "] is not contiguous");
}

void checkLike(const char* op, const char* arg, size_t i, const at::Tensor& t, at::ScalarType dtype, int64_t numel) {
  checkDenseCpu(op, arg, i, t);
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", arg, "[", i, "] is ", c10::toString(t.scalar_type()),
              ", expected ", c10::toString(dtype));
  TORCH_CHECK(t.numel() == numel, op, ": ", arg, "[", i, "] has ", t.numel(), " elements, expected ", numel);
}

void checkLength(const char* op, const char* arg, size_t got, size_t want) {
  TORCH_CHECK(got == want, op, ": ", arg, " has ", got, " tensors, expected ", want, " (one per param)");
}

// torch keeps state["step"] as a float32 (float64 under a float64 default dtype) 0-dim tensor.
void* stepSlot(const char* op, size_t i, const at::Tensor& s, bool* is_double) {
  TORCH_CHECK(s.defined() && s.device().is_cpu() && s.numel() == 1, op, ": state_steps[", i,
              "] must be a one-element CPU tensor");
  TORCH_CHECK(s.scalar_type() == at::kFloat || s.scalar_type() == at::kDouble, op, ": state_steps[", i, "] is ",
              c10::toString(s.scalar_type()), ", expected float32 or float64");
  *is_double = s.scalar_type() == at::kDouble;
  return s.data_ptr();
}

// Pieces run on torch's intra-op pool (intra_op_runner.hpp), so `threads` above torch's thread
// count gives torch's thread count; std::threads only when that pool is not available.
KernelConfig configFor(int64_t threads) {
  static const ParallelRunner runner = intraOpRunner();
  KernelConfig cfg;
  cfg.threads = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();
  cfg.runner = runner;
  return cfg;
}

void raiseOnError(const char* op, int rc) {
  // The hyperparameters were checked above with their names; what is left is a broken span.
  TORCH_CHECK(rc == 0, op, ": kernel rejected the arguments (", std::strerror(-rc), ")");
}

}  // namespace

void checkAdamListLengths(const char* op, size_t params, size_t grads, size_t exp_avgs, size_t exp_avg_sqs,
                          size_t max_exp_avg_sqs, size_t state_steps, bool amsgrad) {
  checkLength(op, "grads", grads, params);
  checkLength(op, "exp_avgs", exp_avgs, params);
  checkLength(op, "exp_avg_sqs", exp_avg_sqs, params);
  checkLength(op, "state_steps", state_steps, params);
  if (amsgrad) checkLength(op, "max_exp_avg_sqs", max_exp_avg_sqs, params);
}

// Written as !(x >= 0) so NaN fails too. ValueError, like torch's constructor checks of the same
// ranges; raised before any step counter moves.
void checkAdamArgs(const char* op, const AdamArgs& a) {
  TORCH_CHECK_VALUE(a.lr >= 0.0, op, ": lr is ", a.lr, ", expected >= 0; nothing was updated");
  TORCH_CHECK_VALUE(a.beta1 >= 0.0 && a.beta1 < 1.0, op, ": beta1 is ", a.beta1,
                    ", expected in [0, 1); nothing was updated");
  TORCH_CHECK_VALUE(a.beta2 >= 0.0 && a.beta2 < 1.0, op, ": beta2 is ", a.beta2,
                    ", expected in [0, 1); nothing was updated");
  TORCH_CHECK_VALUE(a.eps >= 0.0, op, ": eps is ", a.eps, ", expected >= 0; nothing was updated");
  TORCH_CHECK_VALUE(a.weight_decay >= 0.0, op, ": weight_decay is ", a.weight_decay,
                    ", expected >= 0; nothing was updated");
}

void checkSgdArgs(const char* op, const SgdArgs& a) {
  TORCH_CHECK_VALUE(a.lr >= 0.0, op, ": lr is ", a.lr, ", expected >= 0; nothing was updated");
  TORCH_CHECK_VALUE(a.momentum >= 0.0, op, ": momentum is ", a.momentum, ", expected >= 0; nothing was updated");
  TORCH_CHECK_VALUE(a.dampening == a.dampening, op, ": dampening is ", a.dampening,
                    ", expected a number; nothing was updated");
  TORCH_CHECK_VALUE(a.weight_decay >= 0.0, op, ": weight_decay is ", a.weight_decay,
                    ", expected >= 0; nothing was updated");
  TORCH_CHECK(!a.nesterov || (a.momentum > 0 && a.dampening == 0), op,
              ": nesterov requires a momentum and zero dampening");
}

void checkSgdListLengths(const char* op, size_t params, size_t grads, size_t momentum_buffers, size_t init_momentum,
                         bool has_momentum) {
  checkLength(op, "grads", grads, params);
  if (has_momentum) {
    checkLength(op, "momentum_buffers", momentum_buffers, params);
    checkLength(op, "init_momentum", init_momentum, params);
  }
}

void adamStep(const char* op, bool decoupled, const std::vector<at::Tensor>& params,
              const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
              const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& max_exp_avg_sqs,
              const std::vector<at::Tensor>& state_steps, const AdamArgs& a) {
  const size_t n = params.size();
  checkAdamListLengths(op, n, grads.size(), exp_avgs.size(), exp_avg_sqs.size(), max_exp_avg_sqs.size(),
                       state_steps.size(), a.amsgrad);
  checkAdamArgs(op, a);
  if (n == 0) return;

  const DType dtype = paramDType(op, 0, params[0]);
  std::vector<AdamSpan> spans(n);
  std::vector<std::pair<void*, bool>> steps(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    checkDenseCpu(op, "params", i, p);
    TORCH_CHECK(paramDType(op, i, p) == dtype, op, ": params[", i, "] is ", c10::toString(p.scalar_type()),
                " but params[0] is ", c10::toString(params[0].scalar_type()), "; one dtype per call");
    const int64_t numel = p.numel();
    checkLike(op, "grads", i, grads[i], p.scalar_type(), numel);
    checkLike(op, "exp_avgs", i, exp_avgs[i], at::kFloat, numel);
    checkLike(op, "exp_avg_sqs", i, exp_avg_sqs[i], at::kFloat, numel);
    if (a.amsgrad) checkLike(op, "max_exp_avg_sqs", i, max_exp_avg_sqs[i], at::kFloat, numel);
    bool is_double = false;
    steps[i] = {stepSlot(op, i, state_steps[i], &is_double), is_double};
    AdamSpan& s = spans[i];
    s.param = p.data_ptr();
    s.grad = grads[i].data_ptr();
    s.exp_avg = exp_avgs[i].data_ptr<float>();
    s.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    s.max_exp_avg_sq = a.amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr;
    s.numel = numel;
  }
  // All checks passed: bump torch's step counters (step_t += 1) and hand the new values over.
  for (size_t i = 0; i < n; ++i) {
    double next;
    if (steps[i].second) {
      next = ++*static_cast<double*>(steps[i].first);
    } else {
      next = ++*static_cast<float*>(steps[i].first);
    }
    spans[i].step = static_cast<int64_t>(next);
  }
  AdamOptions o;
  o.lr = a.lr;
  o.beta1 = a.beta1;
  o.beta2 = a.beta2;
  o.eps = a.eps;
  o.weight_decay = a.weight_decay;
  o.decoupled_weight_decay = decoupled;
  o.amsgrad = a.amsgrad;
  o.maximize = a.maximize;
  raiseOnError(op, optim::adamStep(o, dtype, spans, configFor(a.threads)));
}

void sgdStep(const char* op, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& momentum_buffers, const std::vector<bool>& init_momentum,
             const SgdArgs& a) {
  const size_t n = params.size();
  const bool has_momentum = a.momentum != 0.0;
  checkSgdListLengths(op, n, grads.size(), momentum_buffers.size(), init_momentum.size(), has_momentum);
  checkSgdArgs(op, a);
  if (n == 0) return;

  const DType dtype = paramDType(op, 0, params[0]);
  std::vector<SgdSpan> spans(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    checkDenseCpu(op, "params", i, p);
    TORCH_CHECK(paramDType(op, i, p) == dtype, op, ": params[", i, "] is ", c10::toString(p.scalar_type()),
                " but params[0] is ", c10::toString(params[0].scalar_type()), "; one dtype per call");
    checkLike(op, "grads", i, grads[i], p.scalar_type(), p.numel());
    SgdSpan& s = spans[i];
    s.param = p.data_ptr();
    s.grad = grads[i].data_ptr();
    s.numel = p.numel();
    if (has_momentum) {
      checkLike(op, "momentum_buffers", i, momentum_buffers[i], at::kFloat, p.numel());
      s.momentum_buffer = momentum_buffers[i].data_ptr<float>();
      s.init_momentum = init_momentum[i];
    }
  }
  SgdOptions o;
  o.lr = a.lr;
  o.momentum = a.momentum;
  o.dampening = a.dampening;
  o.weight_decay = a.weight_decay;
  o.nesterov = a.nesterov;
  o.maximize = a.maximize;
  raiseOnError(op, optim::sgdStep(o, dtype, spans, configFor(a.threads)));
}

std::vector<int64_t> partitionParams(const std::vector<int64_t>& numels, const std::vector<int64_t>& group_sizes,
                                     int64_t world_size) {
  constexpr const char* op = "zeroplus.partition_params";
  TORCH_CHECK(world_size >= 1, op, ": world_size must be >= 1, got ", world_size);
  std::vector<std::vector<int64_t>> groups;
  size_t next = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    TORCH_CHECK(group_sizes[g] >= 0 && next + static_cast<size_t>(group_sizes[g]) <= numels.size(), op,
                ": group_sizes[", g, "] = ", group_sizes[g], " overruns numels (", numels.size(), " entries)");
    groups.emplace_back(numels.begin() + static_cast<std::ptrdiff_t>(next),
                        numels.begin() + static_cast<std::ptrdiff_t>(next + group_sizes[g]));
    next += static_cast<size_t>(group_sizes[g]);
  }
  TORCH_CHECK(next == numels.size(), op, ": group_sizes sum to ", next, " but numels has ", numels.size(), " entries");
  PartitionPlan plan;
  const int rc = planPartition(groups, static_cast<int>(world_size), &plan);
  TORCH_CHECK(rc == 0, op, ": invalid arguments (", std::strerror(-rc), "); numels must be >= 0");
  // Re-derive assignment order: per group, ranks' lists are each in sorted order, and the global
  // sorted order interleaves them; replaying the stable sort gives it back.
  std::vector<int64_t> out;
  out.reserve(numels.size() * 2);
  int64_t base = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<int64_t> order(groups[g].size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return groups[g][a] > groups[g][b]; });
    for (int64_t i : order) {
      out.push_back(plan.owner[g][static_cast<size_t>(i)]);
      out.push_back(base + i);
    }
    base += static_cast<int64_t>(groups[g].size());
  }
  return out;
}

std::string activeIsaName() { return isaName(activeIsa()); }

}  // namespace zeroplus::optim::adapter
