// Description: ZeRO stage 3 of the C++ engine on LibTorch models other than a bare
// torch::nn::Sequential (optimizers/adapter/zero/units.hpp), ranks as threads over a HashStore: a
// holder with its own forward (an embedding, a Sequential of blocks, a final norm, a head) has its
// blocks sharded and released between uses and the rest whole on every rank, and trains equal to
// single-process LibTorch AdamW on the whole batch (fp32; bf16 against the same mixed-precision
// math; NVMe offload; no_sync; clipping; the blocks' norms and biases kept whole by
// param_persistence_threshold, and by default every parameter of so small a model); its checkpoint keeps the parameter names and loads at
// stages 1 and 3; a module shared by two units stays whole; a ModuleList's inner Sequentials are
// found and the list warned about; models without a Sequential raise naming the remedy.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "optimizers/adapter/zero/engine.hpp"  // engine().sharded(): the stage-3 placement
#include "tests/cpp/plugin/rank_threads.hpp"
#include "tests/cpp/temp_dir.hpp"
#include "zeroplus.hpp"

namespace {

using zeroplus::testing::randomTensor;
using zeroplus::testing::runRanks;
using zeroplus::test_util::TempDir;

using zeroplus::zero::Options;

constexpr int64_t kVocab = 11, kDim = 8, kLen = 5, kLayers = 3;

// A pre-norm residual block holding a Sequential of its own: the engine must not split it (only
// the outermost Sequential's children are units).
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        mlp(register_module("mlp", torch::nn::Sequential(torch::nn::Linear(kDim, 2 * kDim), torch::nn::Tanh(),
                                                         torch::nn::Linear(2 * kDim, kDim)))) {}
  at::Tensor forward(at::Tensor x) { return x + mlp->forward(ln(x)); }
  torch::nn::LayerNorm ln;
  torch::nn::Sequential mlp;
};
TORCH_MODULE(Block);

// What a LibTorch user writes: a holder with its own forward calling blocks->forward.
struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl()
      : tok_emb(register_module("tok_emb", torch::nn::Embedding(kVocab, kDim))),
        blocks(register_module("blocks", torch::nn::Sequential())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        head(register_module("head", torch::nn::Linear(kDim, kVocab))) {
    for (int64_t i = 0; i < kLayers; ++i) blocks->push_back(Block());
  }
  at::Tensor forward(const at::Tensor& ids) { return head(ln_f(blocks->forward(tok_emb(ids)))); }
  torch::nn::Embedding tok_emb;
  torch::nn::Sequential blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyLm);

TinyLm makeLm() {
  TinyLm model;
  torch::NoGradGuard no_grad;
  uint64_t seed = 300;
  for (auto& p : model->parameters()) p.copy_(randomTensor(p.sizes(), seed++) * 0.3);
  return model;
}

bool isUnitParam(const std::string& name) { return name.rfind("blocks.", 0) == 0; }

struct Tokens {
  at::Tensor ids, next;
};
Tokens tokens(int step, int64_t rows) {
  auto gen = [](uint64_t seed, int64_t rows) {
    return at::randint(kVocab, {rows, kLen}, at::detail::createCPUGenerator(seed),
                       at::TensorOptions().dtype(at::kLong));
  };
  return {gen(3000 + step, rows), gen(4000 + step, rows)};
}
Tokens tokenSlice(const Tokens& t, int64_t lo, int64_t n) { return {t.ids.narrow(0, lo, n), t.next.narrow(0, lo, n)}; }

at::Tensor lmLoss(TinyLm& model, const Tokens& t) {
  return torch::nn::functional::cross_entropy(model->forward(t.ids).reshape({-1, kVocab}).to(at::kFloat),
                                             t.next.reshape(-1));
}

// The single-process reference with the engine's mixed precision: bf16 parameters for forward and
// backward, fp32 masters stepped by torch's AdamW. Each rank's gradient is computed on its own
// slice and the two are summed and halved in bf16, as the engine reduces them.
struct Bf16Reference {
  TinyLm model;
  std::vector<at::Tensor> masters;
  std::unique_ptr<torch::optim::AdamW> opt;
  explicit Bf16Reference(TinyLm m) : model(std::move(m)) {
    for (auto& p : model->parameters()) masters.push_back(p.detach().clone().requires_grad_(true));
    model->to(at::kBFloat16);
    opt = std::make_unique<torch::optim::AdamW>(masters, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  }
  void step(const Tokens& whole, int world) {
    const int64_t per = whole.ids.size(0) / world;
    auto params = model->parameters();
    std::vector<at::Tensor> sum(params.size());
    for (int r = 0; r < world; ++r) {
      for (auto& p : params) p.mutable_grad() = at::Tensor();
      lmLoss(model, tokenSlice(whole, r * per, per)).backward();
      for (size_t i = 0; i < params.size(); ++i) sum[i] = r == 0 ? params[i].grad().clone() : sum[i] + params[i].grad();
    }
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) masters[i].mutable_grad() = sum[i].mul(1.0 / world).to(at::kFloat);
    opt->step();
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i]);
  }
};

struct HolderCase {
  bool bf16;
  bool nvme;
  // options.param_persistence_threshold; -1: the default (100000, DeepSpeed's and the Python
  // engine's), which keeps every parameter of this small model whole.
  int64_t persist = 0;
};

class ZeroUnitsHolder : public ::testing::TestWithParam<HolderCase> {};

// Stage 3 on the holder: the Sequential's children (the blocks) are the units, sharded and released
// between uses; tok_emb, ln_f and head are called by the user's forward, not by the engine, so they
// stay whole on every rank. 2 ranks train like single-process AdamW on the whole batch.
TEST_P(ZeroUnitsHolder, Stage3HolderMatchesSingleProcessLibTorch) {
  const HolderCase c = GetParam();
  TempDir dir;
  runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeLm();
    std::vector<std::string> names;
    for (const auto& item : model->named_parameters()) names.push_back(item.key());
    Options options = Options().stage(3);
    if (c.persist >= 0) options.param_persistence_threshold(c.persist);
    const int64_t persist = c.persist >= 0 ? c.persist : options.param_persistence_threshold();
    if (c.bf16) options.mixed_precision("bf16");
    if (c.nvme) options.offload_optimizer("nvme").nvme_path(dir.path());
    auto opt =
        zeroplus::zero::initialize(model, pg, options, zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(0.1));
    TinyLm reference = makeLm();
    torch::optim::AdamW ref(reference->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    Bf16Reference mixed(makeLm());
    TinyLm& expected = c.bf16 ? mixed.model : reference;
    // bf16 against the same mixed-precision math: the parameters agree exactly on this data (an
    // fp32 master differing in its last bit between the fused kernel and torch's AdamW could round
    // to the next bf16 value, about 4e-3 relative, but does not here).
    constexpr double kTol = 1e-5;

    auto* sharded = opt->engine().sharded();
    ASSERT_NE(sharded, nullptr);
    EXPECT_EQ(sharded->unitCount(), kLayers);  // the blocks; each block's mlp Sequential is not split
    int64_t total = 0;
    for (auto& p : model->parameters()) total += p.numel();
    EXPECT_LE(opt->owned_numel(), total / 2 + 128);
    // Sharded: a block's parameter larger than the persistence threshold; every other one whole.
    auto isSharded = [&](const std::string& name, const at::Tensor& p) {
      return isUnitParam(name) && p.numel() > persist;
    };
    int64_t shardedParams = 0;
    for (const auto& item : model->named_parameters()) shardedParams += isSharded(item.key(), item.value());
    EXPECT_EQ(shardedParams, c.persist == 0 ? 6 * kLayers : c.persist > 0 ? 2 * kLayers : 0);

    auto checkAtRest = [&](const char* when) {
      EXPECT_EQ(sharded->gatheredBytes(), 0) << when;
      auto want = expected->named_parameters();
      for (const auto& item : model->named_parameters()) {
        const at::Tensor p = item.value().detach();
        EXPECT_EQ(p.sizes(), want[item.key()].sizes()) << item.key();
        if (isSharded(item.key(), p)) {
          EXPECT_TRUE(p.isnan().all().item<bool>()) << when << ": " << item.key() << " holds values at rest";
        } else {  // persistent: whole, with the trained values
          const double diff = (p.to(at::kFloat) - want[item.key()].detach().to(at::kFloat)).abs().max().item<double>();
          EXPECT_LE(diff, kTol) << when << ": " << item.key();
        }
      }
    };
    checkAtRest("after initialize");
    for (int step = 0; step < 4; ++step) {
      const Tokens whole = tokens(step, 8);
      const Tokens mine = tokenSlice(whole, rank * 4, 4);
      opt->zero_grad();
      if (!c.bf16 && step == 1) {  // no_sync: the first half locally, sent with the second
        {
          auto guard = opt->no_sync();
          opt->backward(lmLoss(model, tokenSlice(mine, 0, 2)) * 0.5);
        }
        opt->backward(lmLoss(model, tokenSlice(mine, 2, 2)) * 0.5);
      } else {
        opt->backward(lmLoss(model, mine));
      }
      EXPECT_EQ(sharded->gatheredBytes(), 0) << "units still gathered after backward";
      if (c.bf16) {
        opt->step();
        mixed.step(whole, 2);
      } else {
        ref.zero_grad();
        lmLoss(reference, whole).backward();
        if (step == 2) {
          const double norm = opt->clip_grad_norm(0.05);
          const double want = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.05);
          EXPECT_NEAR(norm, want, 1e-5 * std::max(1.0, want));
        }
        opt->step();
        ref.step();
      }
      checkAtRest("after a step");
    }
    std::vector<std::string> after;
    for (const auto& item : model->named_parameters()) after.push_back(item.key());
    EXPECT_EQ(after, names);
    const auto full = zeroplus::zero::full_state_dict(model, *opt);
    for (const auto& item : expected->named_parameters()) {
      const at::Tensor want = item.value().detach().to(at::kFloat);
      const double diff = (full[item.key()].to(at::kFloat) - want).abs().max().item<double>();
      EXPECT_LE(diff, kTol) << item.key();
    }
    checkAtRest("after full_state_dict");
  });
}

INSTANTIATE_TEST_SUITE_P(PrecisionAndOffload, ZeroUnitsHolder,
                         ::testing::Values(HolderCase{false, false}, HolderCase{true, false}, HolderCase{false, true},
                                           HolderCase{true, true},
                                           // norms and biases (at most 2 * kDim elements) whole, the weights sharded
                                           HolderCase{false, false, 2 * kDim}, HolderCase{true, true, 2 * kDim},
                                           HolderCase{false, false, -1}),
                         [](const auto& info) {
                           const int64_t persist = info.param.persist;
                           return std::string(info.param.bf16 ? "bf16" : "fp32") + (info.param.nvme ? "_nvme" : "") +
                                  (persist > 0 ? "_persist" + std::to_string(persist)
                                               : persist < 0 ? "_default_persistence" : "");
                         });

// A stage-3 checkpoint of the holder keeps the user's parameter names (the unit wrappers change
// none): it loads into the same holder at stage 1 and at stage 3 (whose persistent buckets are
// all-gathered by the load), in memory and with NVMe offload, and each continues as the saved run.
TEST(ZeroUnits, Stage3HolderCheckpointLoadsAtStages1And3) {
  TempDir dir, nvme;
  runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto train = [&](TinyLm& model, zeroplus::zero::ZeroOptimizer& opt, int step) {
      opt.zero_grad();
      opt.backward(lmLoss(model, tokenSlice(tokens(step, 8), rank * 4, 4)));
      opt.step();
    };
    auto model = makeLm();
    auto opt = zeroplus::zero::initialize(model, pg, Options().stage(3).param_persistence_threshold(0), zeroplus::optim::ZeroAdamWOptions(1e-2));
    for (int step = 0; step < 2; ++step) train(model, *opt, step);
    zeroplus::save_checkpoint(dir.path() + "/step2", model, *opt);
    train(model, *opt, 2);
    const auto want = zeroplus::zero::full_state_dict(model, *opt);
    for (const auto& [stage, offload] : {std::pair{1, false}, std::pair{3, false}, std::pair{3, true}}) {
      TinyLm other;  // other values: the load replaces them all
      Options options = Options().stage(stage).param_persistence_threshold(0);
      if (offload) options.offload_optimizer("nvme").nvme_path(nvme.path());
      auto otherOpt = zeroplus::zero::initialize(other, pg, options, zeroplus::optim::ZeroAdamWOptions(1e-2));
      zeroplus::load_checkpoint(dir.path() + "/step2", other, *otherOpt);
      train(other, *otherOpt, 2);
      const auto got = zeroplus::zero::full_state_dict(other, *otherOpt);
      ASSERT_EQ(got.size(), want.size());
      for (const auto& item : want) {
        EXPECT_LE((item.value() - got[item.key()]).abs().max().item<double>(), 1e-6)
            << "stage " << stage << (offload ? " nvme " : " ") << item.key();
      }
    }
  });
}

// A module shared by two units (its parameters are needed by both) stays whole: gathering it with
// one unit only would leave the other reading a released parameter.
struct SharingBlockImpl : torch::nn::Module {
  explicit SharingBlockImpl(torch::nn::Linear shared) : shared(register_module("shared", std::move(shared))),
                                                        own(register_module("own", torch::nn::Linear(6, 6))) {}
  at::Tensor forward(at::Tensor x) { return torch::tanh(own(shared(x))); }
  torch::nn::Linear shared, own;
};
TORCH_MODULE(SharingBlock);

TEST(ZeroUnits, Stage3ParameterSharedByTwoUnitsStaysWhole) {
  runRanks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto build = [](torch::nn::Linear& shared) {
      shared = torch::nn::Linear(6, 6);
      torch::nn::Sequential model{SharingBlock{shared}, SharingBlock{shared}};
      torch::NoGradGuard no_grad;
      uint64_t seed = 500;
      for (auto& p : model->parameters()) p.copy_(randomTensor(p.sizes(), seed++) * 0.3);
      return model;
    };
    torch::nn::Linear shared{nullptr}, refShared{nullptr};
    auto model = build(shared);
    auto reference = build(refShared);
    auto opt = zeroplus::zero::initialize(model, pg, Options().stage(3).param_persistence_threshold(0), zeroplus::optim::ZeroAdamWOptions(1e-2));
    // LibTorch lists the shared parameters under both names: step each tensor once.
    std::vector<at::Tensor> unique;
    for (const auto& p : reference->parameters()) {
      bool seen = false;
      for (const auto& q : unique) seen = seen || q.is_same(p);
      if (!seen) unique.push_back(p);
    }
    torch::optim::AdamW ref(unique, torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      const at::Tensor x = randomTensor({8, 6}, 600 + step), y = randomTensor({8, 6}, 700 + step);
      opt->zero_grad();
      opt->backward(torch::mse_loss(model->forward(x.narrow(0, rank * 4, 4)), y.narrow(0, rank * 4, 4)));
      opt->step();
      ref.zero_grad();
      torch::mse_loss(reference->forward(x), y).backward();
      ref.step();
      EXPECT_LE((shared->weight.detach() - refShared->weight.detach()).abs().max().item<double>(), 1e-5)
          << "the shared weight is not whole between steps";
    }
    const auto full = zeroplus::zero::full_state_dict(model, *opt);
    for (const auto& item : reference->named_parameters()) {
      EXPECT_LE((full[item.key()] - item.value().detach()).abs().max().item<double>(), 1e-5) << item.key();
    }
  });
}

// Models the engine cannot intercept: no Sequential (nothing could be sharded), and blocks held in
// a torch::nn::ModuleList (the user's forward calls its elements itself). Both raise naming
// initialize and the remedy instead of silently keeping every parameter whole.
struct TwoLinearsImpl : torch::nn::Module {
  TwoLinearsImpl()
      : a(register_module("a", torch::nn::Linear(4, 4))), b(register_module("b", torch::nn::Linear(4, 2))) {}
  at::Tensor forward(const at::Tensor& x) { return b(a(x)); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(TwoLinears);

struct RepeatedNetImpl : torch::nn::Module {
  RepeatedNetImpl() : layers(register_module("layers", torch::nn::ModuleList())) {
    for (int i = 0; i < 3; ++i) layers->push_back(torch::nn::Linear(4, 4));
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& m : *layers) x = torch::tanh(m->as<torch::nn::LinearImpl>()->forward(x));
    return x;
  }
  torch::nn::ModuleList layers;
};
TORCH_MODULE(RepeatedNet);

TEST(ZeroUnits, Stage3RefusesModelsWithoutASequential) {
  runRanks(2, [](int /*rank*/, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto expectError = [](const std::function<void()>& fn, const std::vector<std::string>& needles) {
      try {
        fn();
        ADD_FAILURE() << "no error";
      } catch (const c10::Error& e) {
        for (const auto& n : needles) {
          EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << n << " in " << e.what();
        }
      }
    };
    const auto stage3 = Options().stage(3);
    TwoLinears plain;
    expectError([&] { zeroplus::zero::initialize(plain, pg, stage3, zeroplus::optim::ZeroAdamWOptions()); },
                {"zeroplus::zero::initialize", "hold the repeated blocks in a torch::nn::Sequential"});
    RepeatedNet listed;
    const at::Tensor before = listed->parameters()[0].detach().clone();
    expectError([&] { zeroplus::zero::initialize(listed, pg, stage3, zeroplus::optim::ZeroAdamWOptions()); },
                {"zeroplus::zero::initialize", "\"layers\" is a torch::nn::ModuleList",
                 "hold the repeated blocks in a torch::nn::Sequential"});
    EXPECT_TRUE(at::equal(listed->parameters()[0].detach(), before));  // nothing changed
    TinyLm lm = makeLm();
    expectError([&] {
      zeroplus::zero::initialize(lm, pg, Options().stage(3).param_persistence_threshold(-1),
                                 zeroplus::optim::ZeroAdamWOptions());
    }, {"zeroplus::zero::initialize", "options.param_persistence_threshold must be >= 0, got -1"});
    // Stages 1 and 2 take any model.
    auto opt = zeroplus::zero::initialize(listed, pg, Options().stage(2), zeroplus::optim::ZeroAdamWOptions());
    EXPECT_EQ(opt->stage(), 2);
  });
}


// Blocks in a ModuleList whose blocks hold a Sequential of their own: those inner Sequentials are
// found (their children become units), the rest of the list stays whole, and initialize warns
// naming the list. Training equals single-process AdamW.
struct ListOfBlocksImpl : torch::nn::Module {
  ListOfBlocksImpl() : layers(register_module("layers", torch::nn::ModuleList())) {
    for (int i = 0; i < 2; ++i) layers->push_back(Block());
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& m : *layers) x = m->as<BlockImpl>()->forward(x);
    return x;
  }
  torch::nn::ModuleList layers;
};
TORCH_MODULE(ListOfBlocks);

struct CapturedWarnings : c10::WarningHandler {
  std::vector<std::string> messages;
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
};

TEST(ZeroUnits, Stage3ModuleListShardsInnerSequentialsAndWarns) {
  runRanks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto build = [] {
      ListOfBlocks model;
      torch::NoGradGuard no_grad;
      uint64_t seed = 800;
      for (auto& p : model->parameters()) p.copy_(randomTensor(p.sizes(), seed++) * 0.3);
      return model;
    };
    auto model = build();
    auto reference = build();
    CapturedWarnings warnings;
    std::shared_ptr<zeroplus::zero::ZeroOptimizer> opt;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);  // per thread: this rank's
      opt = zeroplus::zero::initialize(model, pg, Options().stage(3).param_persistence_threshold(0), zeroplus::optim::ZeroAdamWOptions(1e-2));
    }
    ASSERT_EQ(warnings.messages.size(), 1u);
    EXPECT_NE(warnings.messages[0].find("\"layers\" is a torch::nn::ModuleList"), std::string::npos)
        << warnings.messages[0];
    EXPECT_EQ(opt->engine().sharded()->unitCount(), 6);  // each block's mlp: Linear, Tanh, Linear
    torch::optim::AdamW ref(reference->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      const at::Tensor x = randomTensor({8, kDim}, 900 + step), y = randomTensor({8, kDim}, 950 + step);
      opt->zero_grad();
      opt->backward(torch::mse_loss(model->forward(x.narrow(0, rank * 4, 4)), y.narrow(0, rank * 4, 4)));
      opt->step();
      ref.zero_grad();
      torch::mse_loss(reference->forward(x), y).backward();
      ref.step();
    }
    for (const auto& item : model->named_parameters()) {
      const bool inMlp = item.key().find(".mlp.") != std::string::npos;
      EXPECT_EQ(item.value().detach().isnan().all().item<bool>(), inMlp) << item.key();  // at rest: shards only
    }
    const auto full = zeroplus::zero::full_state_dict(model, *opt);
    for (const auto& item : reference->named_parameters()) {
      EXPECT_LE((full[item.key()] - item.value().detach()).abs().max().item<double>(), 1e-5) << item.key();
    }
  });
}

}  // namespace
