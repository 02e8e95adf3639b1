// Description: zeroplus::save_checkpoint / load_checkpoint on the C++ ZeRO engine, ranks as
// threads over a HashStore: train 2 steps, save, load into a fresh model and optimizer at the
// same and at another world size and stage, then both continue training equal to an
// uninterrupted run (bitwise for AdamW fp32 and SGD, as the masters and state are restored
// exactly); a load that fails validation (another model, a corrupted shard) changes nothing and
// raises naming the call and the path on every rank; a path that is a user's directory is refused.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <thread>

#include "tests/cpp/plugin/rank_threads.hpp"
#include "zeroplus.hpp"

namespace {

using zeroplus::testing::randomTensor;
using zeroplus::testing::runRanks;

using zeroplus::zero::Options;

torch::nn::Sequential makeModel(uint64_t seed = 11) {
  torch::nn::Sequential model(torch::nn::Linear(7, 33), torch::nn::Tanh(), torch::nn::Linear(33, 17),
                              torch::nn::ReLU(), torch::nn::Linear(17, 3));
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) p.copy_(randomTensor(p.sizes(), seed++) * 0.3);
  return model;
}

constexpr int64_t kRows = 12;

void trainStep(torch::nn::Sequential& model, zeroplus::zero::ZeroOptimizer& opt, int step, int rank, int world) {
  const at::Tensor x = randomTensor({kRows, 7}, 1000 + step), y = randomTensor({kRows, 3}, 2000 + step);
  const int64_t per = kRows / world;
  opt.zero_grad();
  opt.backward(torch::mse_loss(model->forward(x.narrow(0, rank * per, per)), y.narrow(0, rank * per, per)));
  opt.step();
}

std::shared_ptr<zeroplus::zero::ZeroOptimizer> makeOpt(torch::nn::Sequential& model,
                                                       c10::intrusive_ptr<c10d::ProcessGroup> pg, int stage, bool sgd,
                                                       int64_t bucket) {
  const Options options = Options().stage(stage).param_persistence_threshold(0).reduce_bucket_elems(bucket);
  if (sgd) return zeroplus::zero::initialize(model, pg, options, torch::optim::SGDOptions(0.05).momentum(0.9));
  return zeroplus::zero::initialize(model, pg, options, zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(0.1));
}

std::vector<at::Tensor> snapshot(torch::nn::Sequential& model) {
  std::vector<at::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

// The full parameters at any stage (stage 3 holds shards between uses: gathered here).
std::vector<at::Tensor> snapshot(torch::nn::Sequential& model, zeroplus::zero::ZeroOptimizer& opt) {
  std::vector<at::Tensor> out;
  const auto full = zeroplus::zero::full_state_dict(model, opt);
  for (const auto& item : model->named_parameters()) out.push_back(full[item.key()]);
  return out;
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/zeroplus_ckpt_cpp_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
  std::string path;
};

struct Case {
  int saveWorld, saveStage, loadWorld, loadStage;
  bool sgd;
};

class ZeroCheckpoint : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroCheckpoint, ResumeEqualsUninterruptedRun) {
  const Case c = GetParam();
  TempDir dir;
  const std::string path = dir.path + "/step2";
  // Uninterrupted: 4 steps at the load's world size (the data-parallel sum is the same whatever
  // the world size up to rounding, so compare to the load's world).
  std::vector<at::Tensor> expected;
  runRanks(c.loadWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto opt = makeOpt(model, pg, c.loadStage, c.sgd, 100);
    for (int step = 0; step < 4; ++step) trainStep(model, *opt, step, rank, c.loadWorld);
    const auto full = snapshot(model, *opt);  // collective: every rank
    if (rank == 0) expected = full;
  });
  // Interrupted: 2 steps at the save's world size, saved, then 2 steps after the load.
  std::vector<at::Tensor> atSave;
  runRanks(c.saveWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto opt = makeOpt(model, pg, c.saveStage, c.sgd, 100);
    for (int step = 0; step < 2; ++step) trainStep(model, *opt, step, rank, c.saveWorld);
    zeroplus::save_checkpoint(path, model, *opt);
    const auto saved = snapshot(model, *opt);
    if (rank == 0) atSave = saved;
  });
  std::vector<at::Tensor> resumed;
  runRanks(c.loadWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel(/*seed=*/99);  // other values: the load must replace them all
    auto opt = makeOpt(model, pg, c.loadStage, c.sgd, 64);  // other buckets too
    zeroplus::load_checkpoint(dir.path, model, *opt);      // through `latest`
    auto loaded = snapshot(model, *opt);
    for (size_t i = 0; i < loaded.size(); ++i) EXPECT_TRUE(loaded[i].equal(atSave[i])) << "rank " << rank << " param " << i;
    for (int step = 2; step < 4; ++step) trainStep(model, *opt, step, rank, c.loadWorld);
    const auto last = snapshot(model, *opt);
    if (rank == 0) resumed = last;
  });
  ASSERT_EQ(resumed.size(), expected.size());
  for (size_t i = 0; i < resumed.size(); ++i) {
    const double diff = (resumed[i] - expected[i]).abs().max().item<double>();
    EXPECT_LE(diff, c.saveWorld == c.loadWorld ? 1e-6 : 1e-5) << "param " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    WorldsAndStages, ZeroCheckpoint,
    ::testing::Values(Case{2, 2, 2, 2, false}, Case{2, 2, 3, 1, false}, Case{1, 1, 2, 2, true}, Case{3, 2, 2, 2, true},
                      Case{2, 3, 3, 2, false}, Case{3, 1, 2, 3, true}, Case{2, 3, 2, 3, false}),
    [](const auto& info) {
      const Case& c = info.param;
      return "w" + std::to_string(c.saveWorld) + "s" + std::to_string(c.saveStage) + "_to_w" +
             std::to_string(c.loadWorld) + "s" + std::to_string(c.loadStage) + (c.sgd ? "_sgd" : "_adamw");
    });

TEST(ZeroCheckpointErrors, FailedLoadsChangeNothingAndSavesRefuseForeignDirectories) {
  TempDir dir;
  const std::string path = dir.path + "/ck";
  runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto opt = makeOpt(model, pg, 2, false, 100);
    trainStep(model, *opt, 0, rank, 2);
    zeroplus::save_checkpoint(path, model, *opt);
    pg->barrier()->wait();
    // Another model: refused in torch's load_state_dict wording, on every rank.
    torch::nn::Sequential other(torch::nn::Linear(7, 33), torch::nn::Tanh(), torch::nn::Linear(33, 5));
    auto otherOpt = zeroplus::zero::initialize(other, pg, Options().stage(1), zeroplus::optim::ZeroAdamWOptions(1e-2));
    const auto before = snapshot(other);
    try {
      zeroplus::load_checkpoint(path, other, *otherOpt);
      ADD_FAILURE() << "loaded into another model";
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("zeroplus::load_checkpoint(\"" + path + "\")"), std::string::npos) << what;
      EXPECT_NE(what.find("size mismatch for 2.weight"), std::string::npos) << what;
      EXPECT_NE(what.find("Unexpected key(s) in state_dict: \"4.weight\""), std::string::npos) << what;
    }
    const auto after = snapshot(other);
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].equal(before[i]));
    pg->barrier()->wait();
    // A corrupted shard of rank 1: every rank raises, nothing changes.
    if (rank == 0) {
      std::fstream f(path + "/rank00001.bin", std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(8);
      f.put('\x55');
    }
    pg->barrier()->wait();
    auto fresh = makeModel(5);
    auto freshOpt = makeOpt(fresh, pg, 1, false, 100);
    const auto fb = snapshot(fresh);
    try {
      zeroplus::load_checkpoint(path, fresh, *freshOpt);
      ADD_FAILURE() << "loaded a corrupted checkpoint";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("nothing was changed"), std::string::npos) << e.what();
    }
    const auto fa = snapshot(fresh);
    for (size_t i = 0; i < fa.size(); ++i) EXPECT_TRUE(fa[i].equal(fb[i]));
    // A directory of the user's own at the path: refused before anything is written.
    if (rank == 0) {
      std::system(("mkdir -p '" + dir.path + "/mine' && echo keep > '" + dir.path + "/mine/notes.txt'").c_str());
    }
    pg->barrier()->wait();
    try {
      zeroplus::save_checkpoint(dir.path + "/mine", model, *opt);
      ADD_FAILURE() << "saved over a user's directory";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("not a zeroplus checkpoint"), std::string::npos) << e.what();
    }
    std::ifstream keep(dir.path + "/mine/notes.txt");
    std::string word;
    keep >> word;
    EXPECT_EQ(word, "keep");
  });
}

}  // namespace
