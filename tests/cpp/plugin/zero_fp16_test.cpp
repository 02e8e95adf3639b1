// Description: fp16 mixed precision in the C++ ZeRO engine (Options::mixed_precision "fp16",
// loss_scaler.hpp), ranks as threads. Stages 1-3 at world size 2 train equal to a single-process
// reference that does the same math by hand (fp16 model, loss * scale, each rank's fp16 gradient
// halved and summed in fp16, unscaled in fp32, torch AdamW on fp32 masters, cast back), with
// dynamic and static scaling, clip_grad_norm returning the unscaled norm; an inf in one rank's
// gradient skips the step on every rank (parameters unchanged, gradients zeroed, skipped_steps),
// the dynamic scale halves (after the hysteresis) and grows back after loss_scale_window clean
// steps, while a static scale stays; an overflow at min_loss_scale raises; the scaler's state
// survives save_checkpoint/load_checkpoint; bad knob values raise c10::ValueError naming the
// option. Bit-identity with the Python engine: tests/python/test_cpp_engine_parity.py.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <ostream>

#include "tests/cpp/plugin/rank_threads.hpp"
#include "zeroplus.hpp"

namespace {

using zeroplus::testing::randomTensor;
using zeroplus::testing::runRanks;
using zeroplus::zero::Options;

constexpr int kWorld = 2;
constexpr int64_t kRows = 4;  // per rank

torch::nn::Sequential makeModel() {
  torch::nn::Sequential model(torch::nn::Linear(7, 33), torch::nn::Tanh(), torch::nn::Linear(33, 17),
                              torch::nn::ReLU(), torch::nn::Linear(17, 3));
  torch::NoGradGuard no_grad;
  uint64_t seed = 11;
  for (auto& p : model->parameters()) p.copy_(randomTensor(p.sizes(), seed++) * 0.3);
  return model;
}

// Rank r's batch at a step (fp32; the model casts nothing: inputs go in as fp16).
at::Tensor inputOf(int step, int rank) { return randomTensor({kRows, 7}, 1000 + 10 * step + rank); }
at::Tensor targetOf(int step, int rank) { return randomTensor({kRows, 3}, 2000 + 10 * step + rank); }

at::Tensor lossOf(torch::nn::Sequential& model, const at::Tensor& x, const at::Tensor& y) {
  return torch::mse_loss(model->forward(x.to(at::kHalf)).to(at::kFloat), y);
}

// The single-process reference: what the engine computes, written out by hand.
struct Reference {
  torch::nn::Sequential model = makeModel();  // fp16, as the engine's parameters
  std::vector<at::Tensor> masters;            // fp32
  std::unique_ptr<torch::optim::Optimizer> opt;
  explicit Reference(bool sgd) {
    model->to(at::kHalf);
    for (auto& p : model->parameters()) masters.push_back(p.detach().to(at::kFloat).requires_grad_(true));
    if (sgd) {
      opt = std::make_unique<torch::optim::SGD>(masters, torch::optim::SGDOptions(0.05).momentum(0.9));
    } else {
      opt = std::make_unique<torch::optim::AdamW>(masters, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    }
  }
  // One step at this loss scale over every rank's batch; returns the clip norm (maxNorm > 0).
  double step(int step, double scale, double maxNorm) {
    auto params = model->parameters();
    std::vector<at::Tensor> sum(params.size());
    for (int r = 0; r < kWorld; ++r) {
      at::Tensor loss = lossOf(model, inputOf(step, r), targetOf(step, r)).mul(scale);
      auto grads = torch::autograd::grad({loss}, params);
      for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor half = grads[i].mul(1.0 / kWorld);  // fp16: divided before the sum
        sum[i] = r == 0 ? half : sum[i].add(half);
      }
    }
    for (size_t i = 0; i < params.size(); ++i) masters[i].mutable_grad() = sum[i].to(at::kFloat).mul(1.0 / scale);
    double norm = 0;
    if (maxNorm > 0) norm = torch::nn::utils::clip_grad_norm_(masters, maxNorm);
    opt->step();
    torch::NoGradGuard noGrad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i].detach().to(at::kHalf));
    return norm;
  }
};

at::Tensor flatParams(torch::nn::Sequential& model, zeroplus::zero::ZeroOptimizer& opt) {
  std::vector<at::Tensor> parts;
  for (const auto& item : zeroplus::zero::full_state_dict(model, opt)) parts.push_back(item.value().reshape(-1));
  return at::cat(parts);
}

struct Case {
  int stage;
  bool staticScale;
  bool sgd;  // SGD's update is proportional to the gradient: a scale left in it would show
};
std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << "stage " << c.stage << (c.staticScale ? " static" : " dynamic") << (c.sgd ? " sgd" : " adamw");
}

class ZeroFp16 : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroFp16, TrainsAsTheSingleProcessReference) {
  const Case c = GetParam();
  runRanks(kWorld, [c](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    Options options = Options().stage(c.stage).param_persistence_threshold(0).mixed_precision("fp16").reduce_bucket_elems(100);
    if (c.staticScale) {
      options.loss_scale(512);
    } else {
      options.initial_scale_power(10).loss_scale_window(2);
    }
    auto opt = c.sgd ? zeroplus::zero::initialize(model, pg, options, torch::optim::SGDOptions(0.05).momentum(0.9))
                     : zeroplus::zero::initialize(model, pg, options,
                                                  zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(0.1));
    for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), at::kHalf);
    Reference ref(c.sgd);
    double scale = c.staticScale ? 512 : 1024;
    for (int step = 0; step < 6; ++step) {
      EXPECT_EQ(opt->loss_scale(), scale) << "step " << step;
      opt->zero_grad();
      opt->backward(lossOf(model, inputOf(step, rank), targetOf(step, rank)));
      const double maxNorm = step >= 3 ? 0.5 : 0.0;
      const double expected = ref.step(step, scale, maxNorm);
      if (maxNorm > 0) {
        const double norm = opt->clip_grad_norm(maxNorm);  // of the unscaled gradients
        EXPECT_NEAR(norm, expected, 2e-3 * expected) << "step " << step;
      }
      opt->step();
      if (!c.staticScale && step % 2 == 1) scale *= 2;  // every window of 2 clean steps
    }
    EXPECT_EQ(opt->loss_scale(), scale);
    EXPECT_EQ(opt->skipped_steps(), 0);
    const auto full = zeroplus::zero::full_state_dict(model, *opt);
    for (const auto& item : ref.model->named_parameters()) {
      const at::Tensor want = item.value().detach().to(at::kFloat);
      const double diff = (full[item.key()].to(at::kFloat) - want).abs().max().item<double>();
      EXPECT_LE(diff, 2e-3) << item.key();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroFp16,
                         ::testing::Values(Case{1, false, false}, Case{2, false, false}, Case{3, false, false},
                                           Case{1, false, true}, Case{2, false, true}, Case{3, false, true},
                                           Case{1, true, true}, Case{2, true, false}, Case{3, true, true}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) +
                                  (info.param.staticScale ? "_static" : "_dynamic") +
                                  (info.param.sgd ? "_sgd" : "_adamw");
                         });

// An inf in rank 1's input at steps 1 and 2 (its gradients overflow; rank 0's do not): both
// ranks skip both steps. Hysteresis 2 absorbs the first overflow, the second halves the scale,
// which doubles again after two clean steps.
TEST(ZeroFp16Overflow, SkippedOnEveryRankScaleHalvesAndGrowsBack) {
  for (int stage = 1; stage <= 3; ++stage) {
    runRanks(kWorld, [stage](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      auto model = makeModel();
      const Options options =
          Options().stage(stage).param_persistence_threshold(0).mixed_precision("fp16").initial_scale_power(8).loss_scale_window(2).hysteresis(2);
      auto opt = zeroplus::zero::initialize(model, pg, options, zeroplus::optim::ZeroAdamWOptions(1e-2));
      const std::vector<double> scales{256, 256, 128, 128, 256};
      for (int step = 0; step < 5; ++step) {
        const bool overflow = step == 1 || step == 2;
        at::Tensor x = inputOf(step, rank);
        if (overflow && rank == 1) x[0][0] = std::numeric_limits<float>::infinity();
        const at::Tensor before = flatParams(model, *opt);
        opt->zero_grad();
        opt->backward(lossOf(model, x, targetOf(step, rank)));
        const double norm = opt->clip_grad_norm(1.0);
        EXPECT_EQ(std::isfinite(norm), !overflow) << "stage " << stage << " step " << step << ": " << norm;
        opt->step();
        const at::Tensor after = flatParams(model, *opt);
        EXPECT_EQ(at::equal(before, after), overflow) << "stage " << stage << " step " << step;
        if (overflow) {
          for (const auto& g : opt->gradient_shards()) EXPECT_EQ(g.abs().max().item<float>(), 0.0f);
        }
        EXPECT_EQ(opt->loss_scale(), scales[step]) << "stage " << stage << " step " << step;
      }
      EXPECT_EQ(opt->skipped_steps(), 2);
    });
  }
}

TEST(ZeroFp16Overflow, StaticScaleSkipsAndStays) {
  runRanks(kWorld, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto opt = zeroplus::zero::initialize(model, pg, Options().stage(2).mixed_precision("fp16").loss_scale(64),
                                          zeroplus::optim::ZeroAdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      at::Tensor x = inputOf(step, rank);
      if (step == 1 && rank == 0) x[0][0] = std::numeric_limits<float>::quiet_NaN();
      const at::Tensor before = flatParams(model, *opt);
      opt->zero_grad();
      opt->backward(lossOf(model, x, targetOf(step, rank)));
      opt->step();
      EXPECT_EQ(at::equal(before, flatParams(model, *opt)), step == 1);
      EXPECT_EQ(opt->loss_scale(), 64.0);
    }
    EXPECT_EQ(opt->skipped_steps(), 1);
  });
}

TEST(ZeroFp16Overflow, AtTheMinimumScaleRaises) {
  runRanks(kWorld, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto opt = zeroplus::zero::initialize(
        model, pg, Options().mixed_precision("fp16").initial_scale_power(1).min_loss_scale(1).hysteresis(1),
        zeroplus::optim::ZeroAdamWOptions(1e-2));
    for (int step = 0; step < 2; ++step) {
      at::Tensor x = inputOf(step, rank);
      if (rank == 1) x[0][0] = std::numeric_limits<float>::infinity();
      opt->zero_grad();
      opt->backward(lossOf(model, x, targetOf(step, rank)));
      if (step == 0) {
        opt->step();  // 2 -> 1
        EXPECT_EQ(opt->loss_scale(), 1.0);
      } else {
        try {
          opt->step();
          ADD_FAILURE() << "no error at the minimum scale";
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("minimum"), std::string::npos) << e.what();
        }
      }
    }
  });
}

TEST(ZeroFp16Checkpoint, ScalerStateRoundTrips) {
  const auto dir = std::filesystem::temp_directory_path() / ("zeroplus_fp16_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "step3").string();
  runRanks(kWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    const Options options =
        Options().stage(2).mixed_precision("fp16").initial_scale_power(8).loss_scale_window(3).hysteresis(1);
    auto model = makeModel();
    auto opt = zeroplus::zero::initialize(model, pg, options, zeroplus::optim::ZeroAdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {  // clean, overflow (256 -> 128), clean
      at::Tensor x = inputOf(step, rank);
      if (step == 1 && rank == 0) x[0][0] = std::numeric_limits<float>::infinity();
      opt->zero_grad();
      opt->backward(lossOf(model, x, targetOf(step, rank)));
      opt->step();
    }
    EXPECT_EQ(opt->loss_scale(), 128.0);
    zeroplus::save_checkpoint(path, model, *opt);
    auto model2 = makeModel();
    auto opt2 = zeroplus::zero::initialize(model2, pg, options, zeroplus::optim::ZeroAdamWOptions(1e-2));
    EXPECT_EQ(opt2->loss_scale(), 256.0);
    zeroplus::load_checkpoint(path, model2, *opt2);
    EXPECT_EQ(opt2->loss_scale(), 128.0);
    EXPECT_EQ(opt2->skipped_steps(), 1);
    // Both continue identically: two more clean steps reach the window (3 since the overflow).
    for (int step = 3; step < 5; ++step) {
      for (auto* o : {&opt, &opt2}) {
        auto& m = o == &opt ? model : model2;
        (*o)->zero_grad();
        (*o)->backward(lossOf(m, inputOf(step, rank), targetOf(step, rank)));
        (*o)->step();
      }
      EXPECT_EQ(opt->loss_scale(), opt2->loss_scale()) << "step " << step;
      EXPECT_TRUE(at::equal(flatParams(model, *opt), flatParams(model2, *opt2))) << "step " << step;
    }
    EXPECT_EQ(opt2->loss_scale(), 256.0);
  });
  std::filesystem::remove_all(dir);
}

// NVMe optimizer offload under fp16 (the master is a copy: it lives in the record too): the same
// bits as in memory, through an overflow step that skips the swapper's step entirely.
TEST(ZeroFp16Overflow, NvmeOffloadTrainsAsInMemory) {
  const auto dir = std::filesystem::temp_directory_path() / ("zeroplus_fp16_nvme_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (int stage : {2, 3}) {
    runRanks(kWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      const Options base = Options().stage(stage).param_persistence_threshold(0).mixed_precision("fp16").initial_scale_power(8).loss_scale_window(2)
                               .hysteresis(1).reduce_bucket_elems(100);
      auto model = makeModel();
      auto swapped = makeModel();
      auto opt = zeroplus::zero::initialize(model, pg, base, zeroplus::optim::ZeroAdamWOptions(1e-2));
      const Options nvme = Options(base).offload_optimizer("nvme").nvme_path(dir.string());
      auto opt2 = zeroplus::zero::initialize(swapped, pg, nvme,
                                             zeroplus::optim::ZeroAdamWOptions(1e-2));
      for (int step = 0; step < 5; ++step) {
        at::Tensor x = inputOf(step, rank);
        if (step == 2 && rank == 1) x[0][0] = std::numeric_limits<float>::infinity();
        for (auto* o : {&opt, &opt2}) {
          auto& m = o == &opt ? model : swapped;
          (*o)->zero_grad();
          (*o)->backward(lossOf(m, x, targetOf(step, rank)));
          (*o)->step();
        }
        EXPECT_EQ(opt->loss_scale(), opt2->loss_scale()) << "step " << step;
        EXPECT_TRUE(at::equal(flatParams(model, *opt), flatParams(swapped, *opt2)))
            << "stage " << stage << " step " << step;
      }
      EXPECT_EQ(opt2->skipped_steps(), 1);
    });
  }
  std::filesystem::remove_all(dir);
}

TEST(ZeroFp16Options, BadKnobsRaiseNamingTheOption) {
  runRanks(1, [](int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    const Options fp16 = Options().mixed_precision("fp16");
    auto expectError = [&](Options o, const std::string& needle) {
      try {
        zeroplus::zero::initialize(model, pg, o, zeroplus::optim::ZeroAdamWOptions());
        ADD_FAILURE() << "no error; expected one naming " << needle;
      } catch (const c10::ValueError& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    expectError(Options().mixed_precision("fp8"), "options.mixed_precision");
    expectError(Options(fp16).loss_scale(-1), "options.loss_scale");
    expectError(Options(fp16).loss_scale(std::numeric_limits<double>::infinity()), "options.loss_scale");
    expectError(Options(fp16).initial_scale_power(65), "options.initial_scale_power");
    expectError(Options(fp16).initial_scale_power(-1), "options.initial_scale_power");
    expectError(Options(fp16).loss_scale_window(0), "options.loss_scale_window");
    expectError(Options(fp16).hysteresis(0), "options.hysteresis");
    expectError(Options(fp16).min_loss_scale(0), "options.min_loss_scale");
    expectError(Options(fp16).initial_scale_power(2).min_loss_scale(8), "options.min_loss_scale");
    // fp32/bf16 do not read the fp16 knobs; a static scale does not read the dynamic ones
    EXPECT_NO_THROW(
        zeroplus::zero::initialize(model, pg, Options().hysteresis(0), zeroplus::optim::ZeroAdamWOptions()));
    EXPECT_NO_THROW(zeroplus::zero::initialize(model, pg, Options(fp16).loss_scale(4).hysteresis(0),
                                               zeroplus::optim::ZeroAdamWOptions()));
  });
}

}  // namespace
