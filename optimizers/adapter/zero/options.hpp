// What the C++ ZeRO engine is configured with, besides the model, the process group and the
// optimizer's hyperparameters: zeroplus::zero::Options (the LibTorch spelling of the Python
// `zeroplus.initialize` keywords and of zeroplus.zero.EngineOptions), and the per-group step
// hyperparameters the engine reads from a torch::optim param group before every step.
//
// Defaults are the Python engine's (plugin/python/zeroplus/zero/policies.py): the same
// bucket size gives the same bucket cuts, so both front-ends train bit-identically.
// Options are plain values; the engine checks them once at initialize (c10::ValueError naming
// the field) and never changes them.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <variant>

namespace zeroplus::zero {

struct Options {
  // ZeRO stage: 1 (optimizer state sharded), 2 (+ gradients sharded), 3 (+ parameters sharded,
  // gathered unit by unit: a torch::nn::Sequential's children).
  TORCH_ARG(int64_t, stage) = 1;
  // "fp32" (no mixed precision) or "bf16": parameters, gradients and their reduction in
  // bfloat16, fp32 masters and optimizer state. "fp16" (loss scaling) is the Python engine's.
  TORCH_ARG(std::string, mixed_precision) = "fp32";
  // Elements per gradient bucket (DeepSpeed's reduce_bucket_size); the Python default.
  TORCH_ARG(int64_t, reduce_bucket_elems) = int64_t{1} << 22;
  // > 0: step() clips the global gradient norm to this unless clip_grad_norm ran this step.
  TORCH_ARG(double, gradient_clipping) = 0.0;
  // "none", or "nvme": between steps each bucket's optimizer state (and its fp32 master when the
  // master is a copy, as under bf16) lives only in a swap record under nvme_path, read ahead
  // from zero_grad on and written behind the step (docs/offload.md, "The C++ engine").
  TORCH_ARG(std::string, offload_optimizer) = "none";
  // An existing, writable directory; the engine makes a private subdirectory in it (0700) and
  // removes it, with its files, when the optimizer is destroyed. Required with "nvme".
  TORCH_ARG(std::string, nvme_path) = "";
  // With "nvme": records in memory at once (DeepSpeed's offload_optimizer.buffer_count), each a
  // buffer sized for the largest bucket's record: the read-ahead holds at most this many
  // records before the step, so more buffers hide more reads behind forward/backward for more
  // memory. >= 1.
  TORCH_ARG(int64_t, offload_buffer_count) = 6;
};

namespace engine {

// One group's hyperparameters for one step, read from its torch::optim options.
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled;
  int64_t threads;
};
struct SgdHyper {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize;
  int64_t threads;
};
using StepHyper = std::variant<AdamHyper, SgdHyper>;

}  // namespace engine
}  // namespace zeroplus::zero
