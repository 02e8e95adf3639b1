// Description: the C++ ZeRO engine (zeroplus::zero::initialize) on CUDA parameters, one rank over a
// zeroplus process group (its CUDA transport: NCCL). One rank only: autograd runs a process's CUDA
// backward, with the engine's gradient hooks that wait on collectives, on one thread per device,
// so two rank threads on one GPU would wait on each other there (2 ranks on the GPU, each its own
// process: tests/python/test_cuda_cpp_engine.py). Stages 1-3 with AdamW and SGD train a
// torch::nn::Sequential on the GPU equal to single-process LibTorch AdamW / SGD on the whole batch
// on the GPU (1e-5), clip_grad_norm included; bf16 trains close to fp32; the engine's buffers,
// masters and optimizer state live on the GPU; a checkpoint of CUDA training resumes bit for bit
// on the GPU and loads into the same model trained on CPU (the format holds no device); a model
// whose parameters or buffers are on two devices, and optimizer offload with CUDA parameters,
// raise c10::ValueError naming initialize. Every case is skipped without a GPU (CI); docs/gpu.md
// lists this file for the GPU run. One case runs everywhere: the one-device check on a model
// with a buffer on the meta device.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <string>

#include "optimizers/adapter/zero/engine.hpp"  // engine(): where buffers and state live
#include "tests/cpp/plugin/rank_threads.hpp"
#include "tests/cpp/temp_dir.hpp"
#include "zeroplus.hpp"

namespace {

using zeroplus::testing::randomTensor;
using zeroplus::testing::runRanks;
using zeroplus::zero::Options;

#define SKIP_WITHOUT_GPU() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device (docs/gpu.md: run on a machine with one)"

const at::Device kGpu(at::kCUDA, 0);

torch::nn::Sequential makeModel(const at::Device& device) {
  torch::nn::Sequential model(torch::nn::Linear(7, 33), torch::nn::Tanh(), torch::nn::Linear(33, 17),
                              torch::nn::ReLU(), torch::nn::Linear(17, 3));
  {
    torch::NoGradGuard no_grad;
    uint64_t seed = 11;
    for (auto& p : model->parameters()) p.copy_(randomTensor(p.sizes(), seed++) * 0.3);
  }
  model->to(device);
  return model;
}

constexpr int64_t kRows = 12;

struct Batch {
  at::Tensor x, y;
};
Batch batch(int step, const at::Device& device) {
  return {randomTensor({kRows, 7}, 1000 + step).to(device), randomTensor({kRows, 3}, 2000 + step).to(device)};
}
Batch slice(const Batch& b, int rank, int world) {
  const int64_t per = kRows / world;
  return {b.x.narrow(0, rank * per, per), b.y.narrow(0, rank * per, per)};
}

std::shared_ptr<zeroplus::zero::ZeroOptimizer> makeOpt(torch::nn::Sequential& model,
                                                       c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                       const Options& options, bool sgd) {
  if (sgd) return zeroplus::zero::initialize(model, pg, options, torch::optim::SGDOptions(0.05).momentum(0.9));
  return zeroplus::zero::initialize(model, pg, options, zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(0.1));
}

void trainStep(torch::nn::Sequential& model, zeroplus::zero::ZeroOptimizer& opt, int step, int rank, int world,
               const at::Device& device) {
  const Batch mine = slice(batch(step, device), rank, world);
  opt.zero_grad();
  opt.backward(torch::mse_loss(model->forward(mine.x.to(model->parameters()[0].scalar_type())).to(at::kFloat), mine.y));
  opt.step();
}

// The full parameters (stage 3 gathers its shards), on the host.
std::vector<at::Tensor> fullParams(torch::nn::Sequential& model, zeroplus::zero::ZeroOptimizer& opt) {
  std::vector<at::Tensor> out;
  const auto full = zeroplus::zero::full_state_dict(model, opt);
  for (const auto& item : model->named_parameters()) out.push_back(full[item.key()].cpu());
  return out;
}

// Everything the engine allocated is on the GPU: gradient shards, masters, elementwise state; Adam's
// step count stays on the host (the fused CUDA kernels' contract).
void expectEngineOnGpu(zeroplus::zero::ZeroOptimizer& opt) {
  for (const auto& g : opt.gradient_shards()) EXPECT_TRUE(g.is_cuda()) << "gradient shard on " << g.device();
  for (const auto& stepper : opt.engine().steppers()) {
    EXPECT_TRUE(stepper.master().is_cuda()) << "master on " << stepper.master().device();
    for (const auto& s : stepper.segments()) {
      if (s.state.step.defined()) {
        EXPECT_TRUE(s.state.step.is_cpu()) << "step on " << s.state.step.device();
      }
      for (const auto* t : {&s.state.exp_avg, &s.state.exp_avg_sq, &s.state.momentum_buffer}) {
        if (t->defined()) {
          EXPECT_TRUE(t->is_cuda()) << "state on " << t->device();
        }
      }
    }
  }
}

struct Case {
  int world;
  int stage;
  bool sgd;
};

class ZeroCudaParity : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroCudaParity, MatchesSingleProcessLibTorchOnTheGpu) {
  SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  runRanks(c.world, [c](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel(kGpu);
    auto reference = makeModel(kGpu);
    auto opt = makeOpt(model, pg, Options().stage(c.stage).param_persistence_threshold(0).reduce_bucket_elems(100),
                       c.sgd);
    std::unique_ptr<torch::optim::Optimizer> ref;
    if (c.sgd) {
      ref = std::make_unique<torch::optim::SGD>(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    } else {
      ref = std::make_unique<torch::optim::AdamW>(reference->parameters(),
                                                  torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    }
    for (int step = 0; step < 4; ++step) {
      const Batch whole = batch(step, kGpu);
      const Batch mine = slice(whole, rank, c.world);
      opt->zero_grad();
      opt->backward(torch::mse_loss(model->forward(mine.x), mine.y));
      ref->zero_grad();
      torch::mse_loss(reference->forward(whole.x), whole.y).backward();
      if (step >= 2) {
        const double norm = opt->clip_grad_norm(0.05);
        const double expected = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.05);
        EXPECT_NEAR(norm, expected, 1e-5 * std::max(1.0, expected)) << "step " << step;
      }
      if (step == 3) expectEngineOnGpu(*opt);
      opt->step();
      ref->step();
    }
    const auto full = fullParams(model, *opt);
    auto expected = reference->parameters();
    for (size_t i = 0; i < full.size(); ++i) {
      EXPECT_LE((full[i] - expected[i].detach().cpu()).abs().max().item<double>(), 1e-5) << "parameter " << i;
    }
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_cuda());
  });
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroCudaParity,
                         ::testing::Values(Case{1, 1, false}, Case{1, 1, true}, Case{1, 2, false}, Case{1, 2, true},
                                           Case{1, 3, false}, Case{1, 3, true}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) + "_stage" +
                                  std::to_string(info.param.stage) + (info.param.sgd ? "_sgd" : "_adamw");
                         });

class ZeroCudaBf16 : public ::testing::TestWithParam<int> {};

TEST_P(ZeroCudaBf16, TrainsCloseToFp32) {
  SKIP_WITHOUT_GPU();
  const int stage = GetParam();
  runRanks(1, [stage](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel(kGpu);
    auto reference = makeModel(kGpu);
    auto opt = makeOpt(model, pg, Options().stage(stage).param_persistence_threshold(0).mixed_precision("bf16"), false);
    torch::optim::AdamW ref(reference->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    EXPECT_EQ(model->parameters()[0].scalar_type(), at::kBFloat16);
    for (int step = 0; step < 3; ++step) {
      trainStep(model, *opt, step, rank, 1, kGpu);
      const Batch whole = batch(step, kGpu);
      ref.zero_grad();
      torch::mse_loss(reference->forward(whole.x), whole.y).backward();
      ref.step();
    }
    expectEngineOnGpu(*opt);
    const auto full = fullParams(model, *opt);
    auto expected = reference->parameters();
    for (size_t i = 0; i < full.size(); ++i) {
      EXPECT_LE((full[i].to(at::kFloat) - expected[i].detach().cpu()).abs().max().item<double>(), 5e-2)
          << "parameter " << i;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroCudaBf16, ::testing::Values(1, 2, 3));

// Save after 2 steps of CUDA training; a fresh CUDA engine loads it and its next 2 steps equal the
// uninterrupted run's bit for bit; the same checkpoint loads into the model trained on CPU (the
// values are the saved ones exactly, whatever device wrote them).
class ZeroCudaCheckpoint : public ::testing::TestWithParam<int> {};

TEST_P(ZeroCudaCheckpoint, ResumesBitForBitAndLoadsOnCpu) {
  SKIP_WITHOUT_GPU();
  const int stage = GetParam();
  zeroplus::test_util::TempDir dir("zeroplus-cuda-ckpt");
  const std::string path = dir.file("step2");
  runRanks(1, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    const Options options = Options().stage(stage).param_persistence_threshold(0).reduce_bucket_elems(100);
    auto model = makeModel(kGpu);
    auto opt = makeOpt(model, pg, options, false);
    trainStep(model, *opt, 0, rank, 1, kGpu);
    trainStep(model, *opt, 1, rank, 1, kGpu);
    zeroplus::save_checkpoint(path, model, *opt);
    const auto saved = fullParams(model, *opt);
    trainStep(model, *opt, 2, rank, 1, kGpu);
    trainStep(model, *opt, 3, rank, 1, kGpu);
    const auto uninterrupted = fullParams(model, *opt);

    auto resumed = makeModel(kGpu);
    auto resumedOpt = makeOpt(resumed, pg, options, false);
    zeroplus::load_checkpoint(path, resumed, *resumedOpt);
    EXPECT_TRUE(resumed->parameters()[0].is_cuda());
    trainStep(resumed, *resumedOpt, 2, rank, 1, kGpu);
    trainStep(resumed, *resumedOpt, 3, rank, 1, kGpu);
    const auto after = fullParams(resumed, *resumedOpt);
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_TRUE(torch::equal(after[i], uninterrupted[i])) << "parameter " << i;
    }

    auto onCpu = makeModel(at::kCPU);
    auto cpuOpt = makeOpt(onCpu, pg, options, false);
    zeroplus::load_checkpoint(path, onCpu, *cpuOpt);
    const auto loaded = fullParams(onCpu, *cpuOpt);
    for (size_t i = 0; i < loaded.size(); ++i) EXPECT_TRUE(torch::equal(loaded[i], saved[i])) << "parameter " << i;
  });
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroCudaCheckpoint, ::testing::Values(1, 2, 3));

template <typename Fn>
std::string valueErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "(no c10::ValueError)";
}

TEST(ZeroCuda, ParametersOnTwoDevicesOrOffloadWithCudaRaiseNamingInitialize) {
  SKIP_WITHOUT_GPU();
  zeroplus::test_util::TempDir dir("zeroplus-cuda-nvme");
  runRanks(1, [&](int /*rank*/, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto split = makeModel(at::kCPU);
    (*split)[0]->to(kGpu);
    std::string msg = valueErrorOf([&] { makeOpt(split, pg, Options().stage(2), false); });
    EXPECT_NE(msg.find("zeroplus::zero::initialize: the trainable parameters are on"), std::string::npos) << msg;
    for (const char* offload : {"cpu", "nvme"}) {
      auto model = makeModel(kGpu);
      msg = valueErrorOf([&] {
        makeOpt(model, pg, Options().stage(2).offload_optimizer(offload).nvme_path(dir.path()), false);
      });
      EXPECT_NE(msg.find("options.offload_optimizer \"" + std::string(offload) + "\" with CUDA parameters"),
                std::string::npos)
          << msg;
    }
  });
}

// Runs everywhere: the one-device rule names the stray buffer (here on the meta device).
struct WithBufferImpl : torch::nn::Module {
  WithBufferImpl() {
    fc = register_module("fc", torch::nn::Linear(3, 2));
    stat = register_buffer("running_stat", torch::zeros({2}, at::TensorOptions().device(at::kMeta)));
  }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
  at::Tensor stat;
};
TORCH_MODULE(WithBuffer);

TEST(ZeroCuda, BufferOnAnotherDeviceRaisesNamingIt) {
  runRanks(1, [](int /*rank*/, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    WithBuffer model;
    const std::string msg = valueErrorOf([&] {
      zeroplus::zero::initialize(model.ptr(), pg, Options().stage(2), zeroplus::optim::ZeroAdamWOptions(1e-3));
    });
    EXPECT_NE(msg.find("zeroplus::zero::initialize: buffer \"running_stat\" is on meta, the parameters on cpu"),
              std::string::npos)
        << msg;
  });
}

}  // namespace
