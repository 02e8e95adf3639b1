// Description: the C++ ZeRO engine through its LibTorch front-end (zeroplus.hpp:
// zeroplus::zero::initialize), ranks as threads over a HashStore on zeroplus process groups.
// Stages 1 and 2 at world sizes 1-3 train a torch::nn::Sequential equal to single-process
// LibTorch AdamW / SGD on the whole batch (1e-5); clip_grad_norm returns the single-process
// torch::nn::utils::clip_grad_norm_ value and clips; param groups keep their own lr and LR
// schedulers reach them; no_sync accumulation equals one backward over the same data; a
// parameter no rank used is not updated (torch's None-grad rule); bf16 trains close to fp32;
// bad arguments raise naming the call before anything changes. Stage 3 on models other than a
// torch::nn::Sequential: zero_units_test.cpp.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <functional>
#include <thread>

#include "optimizers/adapter/zero/engine.hpp"  // engine().sharded(): the stage-3 placement
#include "tests/cpp/plugin/rank_threads.hpp"
#include "zeroplus.hpp"

namespace {

using zeroplus::testing::randomTensor;
using zeroplus::testing::runRanks;

using zeroplus::zero::Options;

// A small MLP whose values come from private generators (ranks are threads: the global one is
// shared). Sizes make buckets and shards cut through parameters at every world size.
torch::nn::Sequential makeModel() {
  torch::nn::Sequential model(torch::nn::Linear(7, 33), torch::nn::Tanh(), torch::nn::Linear(33, 17),
                              torch::nn::ReLU(), torch::nn::Linear(17, 3));
  torch::NoGradGuard no_grad;
  uint64_t seed = 11;
  for (auto& p : model->parameters()) p.copy_(randomTensor(p.sizes(), seed++) * 0.3);
  return model;
}

struct Batch {
  at::Tensor x, y;
};
Batch batch(int step, int64_t rows) { return {randomTensor({rows, 7}, 1000 + step), randomTensor({rows, 3}, 2000 + step)}; }

// Rows [rank * per, (rank + 1) * per) of the whole batch: the data-parallel slice.
Batch slice(const Batch& b, int rank, int world) {
  const int64_t per = b.x.size(0) / world;
  return {b.x.narrow(0, rank * per, per), b.y.narrow(0, rank * per, per)};
}

// The engine's model (any stage: full_state_dict gathers stage-3 shards) against the reference.
void expectFullClose(torch::nn::Sequential& model, zeroplus::zero::ZeroOptimizer& opt, torch::nn::Sequential& reference,
                     double tol) {
  const auto full = zeroplus::zero::full_state_dict(model, opt);
  for (const auto& item : reference->named_parameters()) {
    const double diff = (full[item.key()].to(at::kFloat) - item.value().detach()).abs().max().item<double>();
    EXPECT_LE(diff, tol) << item.key();
  }
}

void expectClose(torch::nn::Sequential& a, torch::nn::Sequential& b, double tol) {
  auto pa = a->parameters(), pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    const double diff = (pa[i].detach().to(at::kFloat) - pb[i].detach().to(at::kFloat)).abs().max().item<double>();
    EXPECT_LE(diff, tol) << "parameter " << i;
  }
}

constexpr int64_t kRows = 12;  // divisible by 1, 2 and 3

struct Case {
  int world;
  int stage;
  bool sgd;
  int64_t bucketElems;
};

class ZeroEngineParity : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroEngineParity, MatchesSingleProcessLibTorch) {
  const Case c = GetParam();
  runRanks(c.world, [c](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto reference = makeModel();
    std::shared_ptr<zeroplus::zero::ZeroOptimizer> opt;
    std::unique_ptr<torch::optim::Optimizer> ref;
    const Options options = Options().stage(c.stage).param_persistence_threshold(0).reduce_bucket_elems(c.bucketElems);
    if (c.sgd) {
      opt = zeroplus::zero::initialize(model, pg, options, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
      ref = std::make_unique<torch::optim::SGD>(reference->parameters(),
                                                torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
    } else {
      opt = zeroplus::zero::initialize(model, pg, options, zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(0.1));
      ref = std::make_unique<torch::optim::AdamW>(reference->parameters(),
                                                  torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    }
    EXPECT_EQ(opt->stage(), c.stage);
    int64_t total = 0;
    for (auto& p : model->parameters()) total += p.numel();
    EXPECT_LE(opt->owned_numel(), total / c.world + 64);  // the ZeRO saving: about 1/world of the state
    for (int step = 0; step < 5; ++step) {
      const Batch whole = batch(step, kRows);
      const Batch mine = slice(whole, rank, c.world);
      opt->zero_grad();
      opt->backward(torch::mse_loss(model->forward(mine.x), mine.y));
      ref->zero_grad();
      torch::mse_loss(reference->forward(whole.x), whole.y).backward();
      if (step >= 2) {  // clipping: the global norm across shards, then the clipped step
        const double norm = opt->clip_grad_norm(0.05);
        const double expected = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.05);
        EXPECT_NEAR(norm, expected, 1e-5 * std::max(1.0, expected)) << "step " << step;
      }
      opt->step();
      ref->step();
    }
    expectFullClose(model, *opt, reference, 1e-5);
  });
}

INSTANTIATE_TEST_SUITE_P(
    StagesAndWorlds, ZeroEngineParity,
    ::testing::Values(Case{1, 1, false, 1 << 22}, Case{2, 1, false, 1 << 22}, Case{2, 2, false, 1 << 22},
                      Case{3, 2, false, 1 << 22}, Case{2, 2, false, 100}, Case{3, 1, false, 100},
                      Case{2, 2, true, 100}, Case{3, 2, true, 1 << 22}, Case{1, 3, false, 1 << 22},
                      Case{2, 3, false, 1 << 22}, Case{3, 3, false, 1 << 22}, Case{2, 3, true, 1 << 22}),
    [](const auto& info) {
      return "world" + std::to_string(info.param.world) + "_stage" + std::to_string(info.param.stage) +
             (info.param.sgd ? "_sgd" : "_adamw") + "_bucket" + std::to_string(info.param.bucketElems);
    });

// Param groups with their own lr, an LR scheduler on the returned optimizer, no_sync
// accumulation, and a head no rank uses: as the single-process reference with the same groups.
TEST(ZeroEngine, GroupsSchedulerNoSyncAndUnusedParameters) {
  runRanks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto reference = makeModel();
    auto groupsOf = [](torch::nn::Sequential& m) {
      auto p = m->parameters();
      std::vector<at::Tensor> first(p.begin(), p.begin() + 2), rest(p.begin() + 2, p.end());
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(first, std::make_unique<zeroplus::optim::ZeroAdamWOptions>(
                                     zeroplus::optim::ZeroAdamWOptions(3e-2).weight_decay(0.0)));
      groups.emplace_back(rest);
      return groups;
    };
    auto opt = zeroplus::zero::initialize(model, pg, Options().stage(2).reduce_bucket_elems(64), groupsOf(model),
                                          zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(0.1));
    std::vector<torch::optim::OptimizerParamGroup> refGroups;
    {
      auto p = reference->parameters();
      refGroups.emplace_back(std::vector<at::Tensor>(p.begin(), p.begin() + 2),
                             std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-2).weight_decay(0.0)));
      refGroups.emplace_back(std::vector<at::Tensor>(p.begin() + 2, p.end()));
    }
    torch::optim::AdamW ref(refGroups, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    torch::optim::StepLR sched(*opt, 1, 0.5), refSched(ref, 1, 0.5);
    for (int step = 0; step < 4; ++step) {
      const Batch whole = batch(step, kRows);
      const Batch mine = slice(whole, rank, 2);
      opt->zero_grad();
      {
        auto guard = opt->no_sync();  // the first half locally, sent with the second
        opt->backward(torch::mse_loss(model->forward(mine.x.narrow(0, 0, 3)), mine.y.narrow(0, 0, 3)) * 0.5);
      }
      opt->backward(torch::mse_loss(model->forward(mine.x.narrow(0, 3, 3)), mine.y.narrow(0, 3, 3)) * 0.5);
      ref.zero_grad();
      for (int half = 0; half < 2; ++half) {
        for (int r = 0; r < 2; ++r) {
          const Batch part = slice(whole, r, 2);
          (torch::mse_loss(reference->forward(part.x.narrow(0, 3 * half, 3)), part.y.narrow(0, 3 * half, 3)) * 0.25)
              .backward();
        }
      }
      opt->step();
      ref.step();
      sched.step();
      refSched.step();
    }
    expectClose(model, reference, 1e-5);
  });
}

TEST(ZeroEngine, ParameterNoRankUsedIsNotUpdated) {
  runRanks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto head = model[4]->as<torch::nn::Linear>();
    auto opt = zeroplus::zero::initialize(model, pg, Options().stage(2), zeroplus::optim::ZeroAdamWOptions(1e-2));
    const at::Tensor before = head->weight.detach().clone();
    for (int step = 0; step < 2; ++step) {
      opt->zero_grad();
      // Only the first three layers run: the head gets no gradient on any rank.
      auto h = model[2]->as<torch::nn::Linear>()->forward(model[0]->as<torch::nn::Linear>()->forward(
          randomTensor({4, 7}, 50 + rank)));
      opt->backward(h.pow(2).mean());
      opt->step();
    }
    EXPECT_TRUE(at::equal(head->weight.detach(), before)) << "AdamW weight decay touched a parameter without grad";
  });
}

// Stage 3: between uses every parameter has its full shape and dtype but no memory (the gathered
// storage is freed), this rank holds about 1/world of the model, model->forward is the user's,
// parameter names are unchanged, and full_state_dict gathers the values the reference has.
TEST(ZeroEngine, Stage3ShardsBetweenUsesAndGathersForFullState) {
  runRanks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto reference = makeModel();
    std::vector<std::string> names;
    for (const auto& item : model->named_parameters()) names.push_back(item.key());
    auto opt = zeroplus::zero::initialize(model, pg, Options().stage(3).param_persistence_threshold(0), zeroplus::optim::ZeroAdamWOptions(1e-2));
    torch::optim::AdamW ref(reference->parameters(), torch::optim::AdamWOptions(1e-2));
    auto* sharded = opt->engine().sharded();
    ASSERT_NE(sharded, nullptr);
    EXPECT_EQ(sharded->unitCount(), 5);
    auto checkAtRest = [&] {
      EXPECT_EQ(sharded->gatheredBytes(), 0);
      // Buffers kept for the next gathers: never more than was ever gathered at once (prefetch:
      // about two units), well below the whole model.
      EXPECT_LE(sharded->pooledBytes(), sharded->peakGatheredBytes());
      int64_t modelBytes = 0;
      for (const auto& b : sharded->buckets()) modelBytes += b.numel * 4;
      EXPECT_LT(sharded->peakGatheredBytes(), modelBytes);
      auto mine = model->parameters(), theirs = reference->parameters();
      for (size_t i = 0; i < mine.size(); ++i) {
        EXPECT_EQ(mine[i].sizes(), theirs[i].sizes());
        EXPECT_TRUE(mine[i].detach().isnan().all().item<bool>()) << "parameter " << i << " holds values at rest";
      }
    };
    checkAtRest();
    for (int step = 0; step < 3; ++step) {
      const Batch whole = batch(step, kRows);
      const Batch mine = slice(whole, rank, 2);
      opt->zero_grad();
      opt->backward(torch::mse_loss(model->forward(mine.x), mine.y));
      EXPECT_EQ(sharded->gatheredBytes(), 0) << "units still gathered after backward";
      opt->step();
      ref.zero_grad();
      torch::mse_loss(reference->forward(whole.x), whole.y).backward();
      ref.step();
      checkAtRest();
    }
    std::vector<std::string> after;
    for (const auto& item : model->named_parameters()) after.push_back(item.key());
    EXPECT_EQ(after, names);
    const auto full = zeroplus::zero::full_state_dict(model, *opt);
    checkAtRest();
    auto refParams = reference->named_parameters();
    for (const auto& item : refParams) {
      const double diff = (full[item.key()] - item.value().detach()).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5) << item.key();
    }
    {  // inference under no_grad gathers and releases too
      torch::NoGradGuard no_grad;
      const Batch b = batch(9, 4);
      const double diff = (model->forward(b.x) - reference->forward(b.x)).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5);
      checkAtRest();
    }
  });
}

class ZeroEngineBf16 : public ::testing::TestWithParam<int> {};

TEST_P(ZeroEngineBf16, TrainsCloseToFp32) {
  const int stage = GetParam();
  runRanks(2, [stage](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto reference = makeModel();
    auto opt = zeroplus::zero::initialize(model, pg, Options().stage(stage).param_persistence_threshold(0).mixed_precision("bf16"),
                                          zeroplus::optim::ZeroAdamWOptions(1e-2));
    torch::optim::AdamW ref(reference->parameters(), torch::optim::AdamWOptions(1e-2));
    EXPECT_EQ(model->parameters()[0].scalar_type(), at::kBFloat16);
    for (int step = 0; step < 3; ++step) {
      const Batch whole = batch(step, kRows);
      const Batch mine = slice(whole, rank, 2);
      opt->zero_grad();
      opt->backward(torch::mse_loss(model->forward(mine.x.to(at::kBFloat16)).to(at::kFloat), mine.y));
      opt->step();
      ref.zero_grad();
      torch::mse_loss(reference->forward(whole.x), whole.y).backward();
      ref.step();
    }
    if (stage == 3) {
      auto full = zeroplus::zero::full_state_dict(model, *opt);
      for (const auto& item : reference->named_parameters()) {
        const double diff = (full[item.key()].to(at::kFloat) - item.value().detach()).abs().max().item<double>();
        EXPECT_LE(diff, 5e-2) << item.key();
      }
    } else {
      expectClose(model, reference, 5e-2);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroEngineBf16, ::testing::Values(1, 2, 3));

// A backward that raises half way (after the last layers' buckets were reduced, before the first
// layers' gradients exist) leaves nothing behind: gathered units are released, the open pass is
// dropped at zero_grad, and training goes on exactly as if that step had not happened.
struct FailingBackward : public torch::autograd::Function<FailingBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* /*ctx*/, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list /*grads*/) {
    throw std::runtime_error("injected backward failure");
  }
};

struct InjectorImpl : public torch::nn::Module {
  bool armed = false;
  at::Tensor forward(const at::Tensor& x) { return armed ? FailingBackward::apply(x) : x; }
};
TORCH_MODULE(Injector);

class ZeroEngineFaults : public ::testing::TestWithParam<int> {};

TEST_P(ZeroEngineFaults, BackwardFailingHalfWayLeavesTheEngineAsBefore) {
  const int stage = GetParam();
  runRanks(2, [stage](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto build = [](Injector& injector) {
      auto base = makeModel();
      torch::nn::Sequential model;
      int i = 0;
      for (const auto& child : *base) {
        if (i++ == 2) model->push_back(injector);
        model->push_back(child);
      }
      return model;
    };
    Injector injector, refInjector;
    auto model = build(injector);
    auto reference = build(refInjector);
    auto opt = zeroplus::zero::initialize(model, pg, Options().stage(stage).param_persistence_threshold(0).reduce_bucket_elems(64),
                                          zeroplus::optim::ZeroAdamWOptions(1e-2));
    torch::optim::AdamW ref(reference->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 4; ++step) {
      const Batch whole = batch(step, kRows);
      const Batch mine = slice(whole, rank, 2);
      opt->zero_grad();
      injector->armed = step == 1;
      if (step == 1) {
        EXPECT_ANY_THROW(opt->backward(torch::mse_loss(model->forward(mine.x), mine.y)));
        continue;  // the user's loop moves on to the next batch
      }
      opt->backward(torch::mse_loss(model->forward(mine.x), mine.y));
      opt->step();
      ref.zero_grad();
      torch::mse_loss(reference->forward(whole.x), whole.y).backward();
      ref.step();
    }
    if (auto* sharded = opt->engine().sharded()) {
      EXPECT_EQ(sharded->gatheredBytes(), 0);
    }
    expectFullClose(model, *opt, reference, 1e-5);
  });
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroEngineFaults, ::testing::Values(1, 2, 3));

TEST(ZeroEngine, ForgottenZeroGradRaisesInsteadOfAccumulatingAcrossSteps) {
  runRanks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto opt = zeroplus::zero::initialize(model, pg, Options().stage(2), zeroplus::optim::ZeroAdamWOptions(1e-2));
    const Batch b = slice(batch(0, kRows), rank, 2);
    opt->backward(torch::mse_loss(model->forward(b.x), b.y));
    opt->step();
    torch::optim::Optimizer& base = *opt;
    base.zero_grad();  // torch's non-virtual zero_grad: cannot reach the engine
    try {
      opt->backward(torch::mse_loss(model->forward(b.x), b.y));
      ADD_FAILURE() << "backward after step without zeroplus's zero_grad did not raise";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("zero_grad()"), std::string::npos) << e.what();
    }
    opt->zero_grad();
    opt->backward(torch::mse_loss(model->forward(b.x), b.y));
    opt->step();
  });
}

TEST(ZeroEngine, BadArgumentsRaiseNamingThem) {
  runRanks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    const at::Tensor before = model->parameters()[0].detach().clone();
    auto expectError = [&](const std::function<void()>& fn, const std::string& needle) {
      try {
        fn();
        ADD_FAILURE() << "no error; expected one mentioning " << needle;
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    expectError([&] { zeroplus::zero::initialize(model, pg, Options().stage(4), zeroplus::optim::ZeroAdamWOptions()); },
                "options.stage");
    {  // stage 3 needs a Sequential's children as units (zero_units_test.cpp: the other refusals)
      auto linear = torch::nn::Linear(3, 3);
      expectError([&] { zeroplus::zero::initialize(linear, pg, Options().stage(3), zeroplus::optim::ZeroAdamWOptions()); },
                  "torch::nn::Sequential");
    }
    expectError([&] { zeroplus::zero::initialize(model, pg, Options().mixed_precision("fp8"), zeroplus::optim::ZeroAdamWOptions()); },
                "options.mixed_precision");
    expectError([&] { zeroplus::zero::initialize(model, pg, Options().reduce_bucket_elems(0), zeroplus::optim::ZeroAdamWOptions()); },
                "options.reduce_bucket_elems");
    expectError([&] {
      zeroplus::zero::initialize(model, pg, Options().grad_accum_dtype("fp64"), zeroplus::optim::ZeroAdamWOptions());
    }, "options.grad_accum_dtype must be");
    std::vector<torch::optim::OptimizerParamGroup> stranger;
    stranger.emplace_back(std::vector<at::Tensor>{torch::zeros({3}, torch::requires_grad())});
    expectError([&] { zeroplus::zero::initialize(model, pg, Options(), std::move(stranger), zeroplus::optim::ZeroAdamWOptions()); },
                "is not a parameter of model");
    EXPECT_TRUE(at::equal(model->parameters()[0].detach(), before));
    // A bad lr set after initialize (what an LR scheduler could do) raises before any update.
    auto opt = zeroplus::zero::initialize(model, pg, Options().stage(2), zeroplus::optim::ZeroAdamWOptions(1e-2));
    const Batch b = slice(batch(0, kRows), rank, 2);
    opt->backward(torch::mse_loss(model->forward(b.x), b.y));
    const at::Tensor held = model->parameters()[0].detach().clone();
    opt->param_groups()[0].options().set_lr(-1.0);
    expectError([&] { opt->step(); }, "lr");
    EXPECT_TRUE(at::equal(model->parameters()[0].detach(), held));
    expectError([&] { opt->clip_grad_norm(0.0); }, "max_norm");
    expectError([&] { opt->backward(at::Tensor()); }, "loss");
  });
}

}  // namespace
