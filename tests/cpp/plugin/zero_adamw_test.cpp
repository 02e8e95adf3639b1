// Description: zeroplus::optim::ZeroAdamW (optimizers/adapter/zero_adamw.hpp) on groups made by
// pg::makeProcessGroup, ranks as threads over a HashStore: parameters after several steps match
// LibTorch's own AdamW/Adam on every rank at world sizes 1-3 (the partition spreads the state),
// LR changes through set_lr take effect, and the refusals of the contract raise before anything
// is written.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <functional>
#include <thread>

#include "optimizers/adapter/zero_adamw.hpp"
#include "process_group/adapter/process_group.hpp"
#include "tests/cpp/plugin/rank_threads.hpp"

namespace {

using zeroplus::testing::runRanks;

using zeroplus::optim::ZeroAdamW;
using zeroplus::optim::ZeroAdamWOptions;

// Random values from a private generator: ranks are threads, and the global one is shared.
at::Tensor randomTensor(int64_t numel, uint64_t seed) {
  return at::randn({numel}, at::detail::createCPUGenerator(seed), at::kFloat);
}

// Parameters of assorted sizes (odd, 1-element, larger) so every world size gives every rank a
// different share; identical on every rank.
std::vector<at::Tensor> makeParams() {
  std::vector<at::Tensor> params;
  uint64_t seed = 7;
  for (int64_t n : {37, 1, 300, 5, 64, 128}) params.push_back(randomTensor(n, seed++).requires_grad_(true));
  return params;
}

void setGrads(const std::vector<at::Tensor>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = randomTensor(params[i].numel(), 100 * step + i);
  }
}

class ZeroAdamWParity : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ZeroAdamWParity, MatchesLibTorchOptimizerOnEveryRank) {
  const auto [world, decoupled] = GetParam();
  runRanks(world, [decoupled = decoupled, world = world](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto params = makeParams();
    std::vector<at::Tensor> reference;
    for (const auto& p : params) reference.push_back(p.detach().clone().requires_grad_(true));
    ZeroAdamW opt(params, pg, ZeroAdamWOptions(1e-2).weight_decay(0.1).decoupled_weight_decay(decoupled));
    std::unique_ptr<torch::optim::Optimizer> ref;
    if (decoupled) {
      ref = std::make_unique<torch::optim::AdamW>(reference, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    } else {
      ref = std::make_unique<torch::optim::Adam>(reference, torch::optim::AdamOptions(1e-2).weight_decay(0.1));
    }
    int64_t owned = opt.ownedNumel();
    EXPECT_GT(owned, 0);
    for (int step = 0; step < 6; ++step) {
      if (step == 3) {  // an LR scheduler's set_lr reaches the kernels
        static_cast<ZeroAdamWOptions&>(opt.param_groups()[0].options()).set_lr(3e-3);
        ref->param_groups()[0].options().set_lr(3e-3);
      }
      setGrads(params, step);
      setGrads(reference, step);
      opt.step();
      ref->step();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::allclose(params[i], reference[i], 1e-5, 1e-6))
          << "rank " << rank << "/" << world << " param " << i << " max diff "
          << (params[i] - reference[i]).abs().max().item<double>();
    }
    const auto owners = opt.owners();
    ASSERT_EQ(owners.size(), params.size());
    for (auto o : owners) EXPECT_TRUE(o >= 0 && o < world);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ZeroAdamWParity,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Bool()));

// A group's own ZeroAdamWOptions (its lr, weight decay) are kept, fields left at their constructor
// defaults inherit the optimizer's defaults (torch's rule for its own types; torch::optim::Optimizer
// replaced the options of a type it does not know by the defaults, so every group trained with
// the default lr).
TEST(ZeroAdamW, GroupOptionsOverDefaults) {
  runRanks(2, [](int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto params = makeParams();
    std::vector<at::Tensor> reference;
    for (const auto& p : params) reference.push_back(p.detach().clone().requires_grad_(true));
    auto groupsOf = [](const std::vector<at::Tensor>& ps, bool zero) {
      std::vector<torch::optim::OptimizerParamGroup> groups;
      std::vector<at::Tensor> first(ps.begin(), ps.begin() + 2), rest(ps.begin() + 2, ps.end());
      if (zero) {
        groups.emplace_back(first, std::make_unique<ZeroAdamWOptions>(ZeroAdamWOptions(3e-2).weight_decay(0.0)));
      } else {
        groups.emplace_back(first, std::make_unique<torch::optim::AdamWOptions>(
                                       torch::optim::AdamWOptions(3e-2).weight_decay(0.0)));
      }
      groups.emplace_back(rest);
      return groups;
    };
    ZeroAdamW opt(groupsOf(params, true), pg, ZeroAdamWOptions(1e-2).weight_decay(0.1).eps(1e-6));
    torch::optim::AdamW ref(groupsOf(reference, false), torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-6));
    const auto& own = static_cast<const ZeroAdamWOptions&>(opt.param_groups()[0].options());
    EXPECT_DOUBLE_EQ(own.lr(), 3e-2);
    EXPECT_DOUBLE_EQ(own.weight_decay(), 0.0);
    EXPECT_DOUBLE_EQ(own.eps(), 1e-6);  // left at its default in the group: the optimizer's
    for (int step = 0; step < 4; ++step) {
      setGrads(params, step);
      setGrads(reference, step);
      opt.step();
      ref.step();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::allclose(params[i], reference[i], 1e-5, 1e-6)) << "param " << i;
    }
  });
}

TEST(ZeroAdamW, RefusesWhatTheContractExcludes) {
  runRanks(1, [](int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    // Bad hyperparameters: ValueError naming the field, before any state exists.
    auto params = makeParams();
    EXPECT_THROW(ZeroAdamW(params, pg, ZeroAdamWOptions(-1.0)), c10::ValueError);
    // Non-contiguous parameters.
    auto t = randomTensor(16, 1).view({4, 4}).t().requires_grad_(true);
    try {
      ZeroAdamW bad({t}, pg);
      ADD_FAILURE() << "a non-contiguous parameter was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("params[0] must be contiguous"), std::string::npos) << e.what();
    }
    // add_param_group after construction: step() refuses and leaves the parameters alone.
    ZeroAdamW opt(params, pg);
    opt.add_param_group(torch::optim::OptimizerParamGroup({randomTensor(3, 2).requires_grad_(true)}));
    setGrads(params, 0);
    const auto before = params[0].detach().clone();
    try {
      opt.step();
      ADD_FAILURE() << "step() after add_param_group did not raise";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("add_param_group is not supported"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(at::equal(before, params[0]));
    // Sharded state: save() says so.
    torch::serialize::OutputArchive archive;
    EXPECT_THROW(opt.save(archive), c10::Error);
  });
}

}  // namespace
