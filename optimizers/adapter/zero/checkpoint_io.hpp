// zeroplus::save_checkpoint and zeroplus::load_checkpoint for the C++ ZeRO engine (stages 1-3):
// the Python package's checkpoint format (docs/checkpoints.md; plugin/python/zeroplus/checkpoint),
// so a checkpoint saved here loads in Python (zeroplus.load_checkpoint) at any world size and
// stage, and a Python stage-1/2/3 checkpoint of the same model loads here at any world size.
// Include "zeroplus.hpp" rather than this header.
//
//   zeroplus::save_checkpoint("ckpt/step100", model, *opt);
//   zeroplus::load_checkpoint("ckpt/step100", model, *opt);   // or "ckpt": what ckpt/latest names
//
// Contract
//  * Both are collective over the optimizer's process group: every rank calls them with the same
//    path, model and optimizer (the ones zeroplus::zero::initialize was given and returned).
//  * save: PATH = ROOT/NAME. Each rank writes the fp32 masters and optimizer state it owns
//    (exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer; Adam's step in the manifest), rank 0
//    also frozen parameters and buffers; rank 0 commits: staging directory, fdatasync, rename,
//    manifest last (sealed with its SHA-256), then ROOT/latest names NAME. A PATH holding a
//    complete zeroplus checkpoint is swapped for the new one atomically; any other non-empty PATH
//    is refused before anything is written. A crash leaves the old state or the new checkpoint.
//  * load: every rank validates before anything changes: the manifest's seal and fields, the
//    model against it (missing, unexpected and mis-shaped names, in torch's load_state_dict
//    wording), the param groups (same parameters), the optimizer state keys against this
//    optimizer's kind, and the CRC-32 of every block it reads; the ranks then agree that all of
//    them succeeded. Only then are the masters, optimizer state, group hyperparameters (as
//    torch's load_state_dict does), frozen parameters and buffers replaced and the masters
//    all-gathered into every rank's parameters.
//  * Where the state lives is engine::BucketStates' business (bucket_states.hpp): with
//    Options::offload_optimizer "nvme" save reads each bucket's record through the swapper and
//    streams it into the shard file (the same bytes as an in-memory engine's), giving the record
//    back unchanged; load writes the loaded masters and state into fresh records and waits for
//    their writes. A record that fails its check during a save fails the save (naming the file).
//  * Errors: c10::Error / c10::ValueError naming the call and the path; on every rank; nothing is
//    changed by a failed load and nothing the user owns is removed by a failed save.
//  * Not thread-safe with training: call between steps.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>

#include "optimizers/adapter/zero/zero_optimizer.hpp"

namespace zeroplus {

void save_checkpoint(const std::string& path, const std::shared_ptr<torch::nn::Module>& model,
                     zero::ZeroOptimizer& optimizer);
void load_checkpoint(const std::string& path, const std::shared_ptr<torch::nn::Module>& model,
                     zero::ZeroOptimizer& optimizer);

template <typename Impl>
void save_checkpoint(const std::string& path, torch::nn::ModuleHolder<Impl>& model, zero::ZeroOptimizer& optimizer) {
  save_checkpoint(path, std::static_pointer_cast<torch::nn::Module>(model.ptr()), optimizer);
}
template <typename Impl>
void load_checkpoint(const std::string& path, torch::nn::ModuleHolder<Impl>& model, zero::ZeroOptimizer& optimizer) {
  load_checkpoint(path, std::static_pointer_cast<torch::nn::Module>(model.ptr()), optimizer);
}

}  // namespace zeroplus
