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
  // gathered unit by unit: the children of the model's torch::nn::Sequentials; the parameters of
  // no unit stay whole, units.hpp).
  TORCH_ARG(int64_t, stage) = 1;
  // "fp32" (no mixed precision), "bf16" or "fp16": parameters, gradients and their reduction in
  // the 16-bit dtype, fp32 masters and optimizer state. fp16 scales the loss (backward), unscales
  // at the step and skips a step whose gradients overflowed on any rank (loss_scaler.hpp).
  TORCH_ARG(std::string, mixed_precision) = "fp32";
  // fp16 loss scaling: DeepSpeed's fp16 keys, the Python engine's defaults (ds_keys.py FP16).
  // loss_scale > 0: a static scale (the dynamic knobs below are unused); 0: dynamic.
  TORCH_ARG(double, loss_scale) = 0.0;
  // The dynamic scale starts at 2^initial_scale_power (0..64).
  TORCH_ARG(double, initial_scale_power) = 16.0;
  // Clean steps since the last overflow before the scale doubles (>= 1).
  TORCH_ARG(int64_t, loss_scale_window) = 1000;
  // Overflows absorbed before the scale halves (>= 1).
  TORCH_ARG(int64_t, hysteresis) = 2;
  // Refill hysteresis after every clean step (not only when the scale grows).
  TORCH_ARG(bool, consecutive_hysteresis) = false;
  // Floor of the dynamic scale (> 0); an overflow at the floor raises.
  TORCH_ARG(double, min_loss_scale) = 1.0;
  // Stage 3: a parameter of a unit with at most this many elements stays whole on every rank
  // (handled as at stage 2: no gather around its use, its gradient reduce-scattered, its optimizer
  // state sharded), as DeepSpeed's stage3_param_persistence_threshold and the Python engine's
  // param_persistence_threshold keep small ones (biases, norms): gathering them costs more in
  // latency than their shards save. Same default as both (100000 elements); 0 shards every
  // parameter a unit holds. >= 0.
  TORCH_ARG(int64_t, param_persistence_threshold) = 100000;
  // The dtype gradients are accumulated in between backward and step (DeepSpeed's
  // data_types.grad_accum_dtype, the Python engine's config key): "fp32", "bf16" or "fp16"; ""
  // keeps them in the compute dtype. "fp32" under bf16 sums the micro-batches' bf16 gradients in
  // fp32 (no bf16 rounding per accumulation), at 4 bytes per element of the shard instead of 2.
  TORCH_ARG(std::string, grad_accum_dtype) = "";
  // Elements per gradient bucket (DeepSpeed's reduce_bucket_size); the Python default.
  TORCH_ARG(int64_t, reduce_bucket_elems) = int64_t{1} << 22;
  // > 0: step() clips the global gradient norm to this unless clip_grad_norm ran this step.
  TORCH_ARG(double, gradient_clipping) = 0.0;
  // "none"; "cpu" (DeepSpeed's ZeRO-Offload: state and step in host memory, where CPU training
  // keeps them anyway: accepted, no effect, as in the Python engine on CPU training); or "nvme":
  // between steps each bucket's optimizer state (and its fp32 master when the master is a copy,
  // as under bf16) lives only in a swap record under nvme_path, read ahead from zero_grad on and
  // written behind the step (docs/offload.md, "The C++ engine"). CPU parameters only: with CUDA
  // parameters initialize refuses anything but "none" (the Python engine offloads CUDA training).
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
