// Torch adapter for the fused optimizer kernels: lists of CPU tensors in, pointer spans out.
//
// Contract (all ops):
//  * Every list has one entry per parameter; params are float32, bfloat16 or float16 (one dtype
//    per call), contiguous CPU tensors; grads match their param's dtype and numel; optimizer
//    state tensors are contiguous float32 CPU tensors of the same numel; step tensors are
//    one-element float32/float64 CPU tensors (torch's state["step"]) incremented here.
//  * Violations raise c10::Error before anything is written, with the op and argument named,
//    e.g. "zeroplus.adamw_step: params[3] is float64, expected float32/bfloat16/float16".
//  * The call blocks; params and state are updated in place. `threads` <= 0 means
//    at::get_num_threads(). The kernels are chosen by CPU features (ZEROPLUS_CPU_ISA).
//  * The adapter holds no reference to any tensor after returning.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace zeroplus::optim::adapter {

struct AdamArgs {
  double lr, beta1, beta2, weight_decay, eps;
  bool amsgrad, maximize;
  int64_t threads;
};

void adamStep(const char* op, bool decoupled, const std::vector<at::Tensor>& params,
              const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
              const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& max_exp_avg_sqs,
              const std::vector<at::Tensor>& state_steps, const AdamArgs& args);

struct SgdArgs {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize;
  int64_t threads;
};

// init_momentum[i] marks a buffer created for this step (torch's "buf is None" case).
void sgdStep(const char* op, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& momentum_buffers, const std::vector<bool>& init_momentum,
             const SgdArgs& args);

// List-length checks shared by the CPU and CUDA adapters: every list has one entry per param
// (max_exp_avg_sqs only with amsgrad; momentum lists only with momentum). Raise c10::Error.
void checkAdamListLengths(const char* op, size_t params, size_t grads, size_t exp_avgs, size_t exp_avg_sqs,
                          size_t max_exp_avg_sqs, size_t state_steps, bool amsgrad);
void checkSgdListLengths(const char* op, size_t params, size_t grads, size_t momentum_buffers, size_t init_momentum,
                         bool has_momentum);

// Hyperparameter ranges the kernels accept (torch's constructor ranges; NaN fails): raise
// c10::ValueError naming the field and its value, e.g. "zeroplus.adam_step: lr is nan, expected
// >= 0". Called before any step counter is bumped, so a rejected call changes nothing.
void checkAdamArgs(const char* op, const AdamArgs& args);
void checkSgdArgs(const char* op, const SgdArgs& args);

// ZeroRedundancyOptimizer's sorted-greedy partition (core/shard_planner.hpp) for Python:
// `numels` flattened over groups, `group_sizes[g]` params in group g. Returns (rank, flat index)
// pairs, flattened, in assignment order (group by group, numel descending, stable), so the
// caller can append each parameter to its rank's list in torch's order.
std::vector<int64_t> partitionParams(const std::vector<int64_t>& numels, const std::vector<int64_t>& group_sizes,
                                     int64_t world_size);

// Name of the ISA the kernels run with on this machine ("scalar", "avx2", "avx512").
std::string activeIsaName();

}  // namespace zeroplus::optim::adapter
