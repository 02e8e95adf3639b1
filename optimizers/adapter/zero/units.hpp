// Stage 3 in the LibTorch front-end: which calls the engine can intercept, hence which
// parameters are sharded (gathered around their unit's use) and which stay whole on every rank.
// The Python engine's counterpart is plugin/python/zeroplus/zero/stage3/units.py (module hooks).
//
// LibTorch modules have no forward hooks, so the engine can bracket only calls it makes itself,
// and it makes them inside a torch::nn::Sequential's forward: initialize replaces the Sequential's
// entry for each child by a wrapper that gathers the child's parameters, runs the child and
// releases them (a hook on the output gathers them again for backward). Hence:
//  * units: the children of every torch::nn::Sequential in the model's tree that is not inside
//    another one (the model itself when it is one; a Sequential inside a block stays part of that
//    block's unit), numbered in registration order across the tree;
//  * a trainable parameter in exactly one unit's subtree and registered by no module outside the
//    units is sharded with that unit;
//  * a parameter of a unit with at most options.param_persistence_threshold elements is
//    persistent too (below), but keeps its unit's place in the bucket order (UnitLayout::homeUnit);
//  * every other trainable parameter is persistent: whole on every rank, its gradient
//    reduce-scattered and its optimizer state sharded as at stage 2 (a holder's embedding, final
//    norm and head, which its own forward calls; a module shared by two units, as tied weights).
//    The Python engine keeps the same parameters whole when given them as persistent_modules;
//  * no unit holding a trainable parameter raises (stage 3 would shard nothing). The message
//    names each torch::nn::ModuleList / ModuleDict holding parameters: the user's forward calls
//    their elements itself (layers[i]->as<Block>()), so no wrapper can stand in for them; hold the
//    blocks in a torch::nn::Sequential instead. Where units exist, a ModuleList / ModuleDict whose
//    parameters stay whole gets a warning naming it.
//
// The wrappers hold the engine weakly: a model used after its optimizer was destroyed raises
// (its parameters were shards only the engine could gather). Not thread-safe; initialize only.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>
#include <string>
#include <vector>

#include "optimizers/adapter/zero/sharded_params.hpp"

namespace zeroplus::zero {

namespace engine {
class Engine;
}

struct Stage3Units {
  engine::UnitLayout layout;  // per trainable parameter (groups chained)
  // The Sequentials whose children are the units, in unit order (unit numbers run on from one
  // Sequential to the next), with their qualified names ("" for the model itself).
  std::vector<std::shared_ptr<torch::nn::SequentialImpl>> sequentials;
  std::vector<std::string> names;
};

// The units of `model` for these trainable parameters (groups chained); parameters of a unit with
// at most persistenceThreshold elements stay whole. Changes nothing; raises c10::ValueError
// naming zeroplus::zero::initialize when no unit holds a trainable parameter (whatever the
// threshold: a model whose units are all small trains with them whole) or
// the model's Sequentials were already wrapped by an earlier initialize.
Stage3Units findUnits(const std::shared_ptr<torch::nn::Module>& model,
                      const std::vector<std::vector<at::Tensor>>& trainable, int64_t persistenceThreshold);

// Replaces each unit's entry in its Sequential by the wrapper that gathers it through `engine`.
// The registered children (named_children, every parameter name) stay; seq[i] is the wrapper.
void wrapUnits(const Stage3Units& units, const std::shared_ptr<engine::Engine>& engine);

}  // namespace zeroplus::zero
