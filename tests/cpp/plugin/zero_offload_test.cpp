// Description: NVMe optimizer offload of the C++ ZeRO engine (Options::offload_optimizer "nvme",
// optimizers/adapter/zero/optimizer_swapper.hpp), ranks as threads over a HashStore: training
// at stages 1-3 (fp32 and bf16, AdamW and SGD with momentum) is bit-identical to in-memory
// training; between steps the optimizer state and the masters that are copies live only in
// their records; the swap files exist in a private directory only while the optimizer lives; a
// corrupted record raises after the step naming its file and bucket; bad options raise.
// Checkpoints read and write the state through the records: a save from an offloaded engine
// loads into in-memory and offloaded engines and every one resumes bit-identically to an engine
// that never checkpointed (the saving one too); a corrupt record during a save raises naming its
// file and keeps the previous checkpoint.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <functional>
#include <iterator>
#include <map>
#include <thread>

#include "optimizers/adapter/zero/engine.hpp"
#include "optimizers/core/swap_store.hpp"
#include "tests/cpp/plugin/rank_threads.hpp"
#include "tests/cpp/temp_dir.hpp"
#include "zeroplus.hpp"

namespace {

using zeroplus::testing::randomTensor;
using zeroplus::testing::runRanks;
using zeroplus::test_util::TempDir;

using zeroplus::zero::Options;
namespace fsys = std::filesystem;

torch::nn::Sequential makeModel() {
  torch::nn::Sequential model(torch::nn::Linear(7, 33), torch::nn::Tanh(), torch::nn::Linear(33, 17),
                              torch::nn::ReLU(), torch::nn::Linear(17, 3));
  torch::NoGradGuard no_grad;
  uint64_t seed = 11;
  for (auto& p : model->parameters()) p.copy_(randomTensor(p.sizes(), seed++) * 0.3);
  return model;
}

at::Tensor input(int step, int rank) { return randomTensor({4, 7}, 1000 + step * 10 + rank); }
at::Tensor target(int step, int rank) { return randomTensor({4, 3}, 2000 + step * 10 + rank); }

void trainSteps(torch::nn::Sequential& model, zeroplus::zero::ZeroOptimizer& opt, int rank, int first, int steps) {
  const auto dtype = opt.engine().computeDtype().value_or(at::kFloat);
  for (int s = first; s < first + steps; ++s) {
    opt.zero_grad();
    opt.backward(torch::mse_loss(model->forward(input(s, rank).to(dtype)), target(s, rank).to(dtype)));
    opt.step();
  }
}

std::shared_ptr<zeroplus::zero::ZeroOptimizer> make(torch::nn::Sequential& model,
                                                     c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& o,
                                                     bool sgd) {
  if (sgd) return zeroplus::zero::initialize(model, pg, o, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
  return zeroplus::zero::initialize(model, pg, o, zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(0.01));
}

struct Case {
  int stage;
  std::string precision;
  bool sgd;
  int world;
};

class ZeroOffload : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroOffload, BitIdenticalToInMemoryTraining) {
  const Case c = GetParam();
  TempDir nvme;
  runRanks(c.world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    // Small buckets: several records per rank, shards cutting through parameters.
    Options base = Options().stage(c.stage).param_persistence_threshold(0).mixed_precision(c.precision).reduce_bucket_elems(150);
    auto plainModel = makeModel();
    auto plain = make(plainModel, pg, base, c.sgd);
    auto swapModel = makeModel();
    std::string dir;
    {
      auto swapped = make(swapModel, pg, Options(base).offload_optimizer("nvme").nvme_path(nvme.path()), c.sgd);
      auto* swapper = swapped->engine().swapper();
      ASSERT_NE(swapper, nullptr);
      dir = swapper->directory();
      EXPECT_EQ(fsys::path(dir).parent_path(), fsys::path(nvme.path()));
      EXPECT_EQ(fsys::status(dir).permissions() & fsys::perms::all, fsys::perms::owner_all);
      trainSteps(plainModel, *plain, rank, 0, 5);
      trainSteps(swapModel, *swapped, rank, 0, 5);
      const auto a = zeroplus::zero::full_state_dict(plainModel, *plain);
      const auto b = zeroplus::zero::full_state_dict(swapModel, *swapped);
      ASSERT_EQ(a.size(), b.size());
      for (const auto& item : a) EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << item.key();
      // Between steps: no elementwise state in memory; masters that are copies swapped out too.
      auto& eng = swapped->engine();
      for (size_t k = 0; k < eng.steppers().size(); ++k) {
        for (const auto& seg : eng.steppers()[k].segments()) {
          EXPECT_FALSE(seg.state.exp_avg.defined() || seg.state.exp_avg_sq.defined() ||
                       seg.state.momentum_buffer.defined());
        }
        if (c.precision == "bf16") {
          EXPECT_EQ(eng.params().master(k).numel(), 0);
        }
        EXPECT_TRUE(fsys::exists(swapper->pathOf(k))) << swapper->pathOf(k);
      }
      EXPECT_GT(swapper->bytesRead(), 0u);
      EXPECT_EQ(eng.ownedNumel(), plain->owned_numel());
    }
    EXPECT_FALSE(fsys::exists(dir)) << dir;  // removed with its files when the optimizer went
  });
  EXPECT_TRUE(fsys::is_empty(nvme.path()));
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroOffload,
                         ::testing::Values(Case{1, "fp32", false, 2}, Case{2, "fp32", false, 2},
                                           Case{3, "fp32", false, 2}, Case{1, "bf16", false, 2},
                                           Case{2, "bf16", true, 2}, Case{3, "bf16", false, 2},
                                           Case{3, "fp32", true, 1}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return "stage" + std::to_string(c.stage) + "_" + c.precision + (c.sgd ? "_sgd" : "_adamw") +
                                  "_world" + std::to_string(c.world);
                         });

TEST(ZeroOffloadFaults, CorruptRecordRaisesNamingItsFileAndBucket) {
  TempDir nvme;
  runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto opt = make(model, pg, Options().stage(2).reduce_bucket_elems(150).offload_optimizer("nvme").nvme_path(nvme.path()),
                    false);
    trainSteps(model, *opt, rank, 0, 2);
    // Flip a payload byte of bucket 1's record once its write is on disk (before the backward
    // that starts reading it ahead).
    opt->engine().swapper()->waitForWrites();
    const std::string path = opt->engine().swapper()->pathOf(1);
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    unsigned char byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, 4096 + 5), 1);
    byte ^= 0x40;
    ASSERT_EQ(::pwrite(fd, &byte, 1, 4096 + 5), 1);
    ::close(fd);
    opt->zero_grad();
    opt->backward(torch::mse_loss(model->forward(input(2, rank)), target(2, rank)));
    try {
      opt->step();
      ADD_FAILURE() << "a corrupt record was read as state";
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path), std::string::npos) << what;
      EXPECT_NE(what.find("bucket 1"), std::string::npos) << what;
      EXPECT_NE(what.find("checksum"), std::string::npos) << what;
    }
  });
}

TEST(ZeroOffloadOrdering, ZeroGradStartsReadingTheNextStepsRecordsBeforeForward) {
  TempDir nvme;
  runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = makeModel();
    auto opt = make(model, pg, Options().stage(2).reduce_bucket_elems(150).offload_optimizer("nvme").nvme_path(nvme.path()),
                    false);
    trainSteps(model, *opt, rank, 0, 2);
    auto* swapper = opt->engine().swapper();
    swapper->waitForWrites();  // every buffer free
    const auto before = swapper->stats();
    opt->zero_grad();
    // Before any forward or backward: one read per bucket, up to the pool's buffers, is under way.
    const uint64_t buckets = opt->engine().steppers().size();
    EXPECT_EQ(swapper->stats().readsAhead - before.readsAhead, std::min<uint64_t>(buckets, 6));
    opt->backward(torch::mse_loss(model->forward(input(2, rank)), target(2, rank)));
    opt->step();
    EXPECT_EQ(swapper->stats().reads - before.reads, buckets);  // each record read once
  });
}

// offload_optimizer("cpu") (a DeepSpeed config's ZeRO-Offload) on CPU training: the state is in
// host memory already, so it is accepted, swaps nothing, and trains bit-identically to "none".
TEST(ZeroOffloadCpu, CpuDeviceIsAcceptedAndChangesNothingOnCpuTraining) {
  for (int stage = 1; stage <= 3; ++stage) {
    runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      const Options base = Options().stage(stage).param_persistence_threshold(0).reduce_bucket_elems(150);
      auto plainModel = makeModel();
      auto plain = make(plainModel, pg, base, false);
      auto cpuModel = makeModel();
      auto cpu = make(cpuModel, pg, Options(base).offload_optimizer("cpu"), false);
      EXPECT_EQ(cpu->engine().swapper(), nullptr);
      trainSteps(plainModel, *plain, rank, 0, 3);
      trainSteps(cpuModel, *cpu, rank, 0, 3);
      const auto a = zeroplus::zero::full_state_dict(plainModel, *plain);
      const auto b = zeroplus::zero::full_state_dict(cpuModel, *cpu);
      for (const auto& item : a) EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << stage << " " << item.key();
      EXPECT_EQ(cpu->owned_numel(), plain->owned_numel());
    });
  }
}

// The pool's buffers are sized for the records the optimizer really writes: a 4 KiB header and
// one 64-byte-aligned fp32 slot per kind (a master copy under bf16; Adam's two moments, a third
// with amsgrad; SGD's momentum buffer), for the largest bucket's shard.
TEST(ZeroOffloadBuffers, SizedForTheKindsTheOptimizerCreates) {
  TempDir nvme;
  struct Sizing {
    std::string precision;
    bool sgd;
    bool amsgrad;
    size_t slots;
  };
  for (const Sizing& c : {Sizing{"fp32", false, false, 2}, Sizing{"bf16", false, false, 3},
                          Sizing{"fp32", false, true, 3}, Sizing{"fp32", true, false, 1},
                          Sizing{"bf16", true, false, 2}}) {
    runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      auto model = makeModel();
      const Options o = Options().stage(2).mixed_precision(c.precision).reduce_bucket_elems(150)
                            .offload_optimizer("nvme").nvme_path(nvme.path());
      auto opt = c.sgd ? zeroplus::zero::initialize(model, pg, o, torch::optim::SGDOptions(0.05).momentum(0.9))
                       : zeroplus::zero::initialize(model, pg, o, zeroplus::optim::ZeroAdamWOptions(1e-2).amsgrad(c.amsgrad));
      int64_t largest = 0;
      for (const auto& b : opt->engine().params().buckets()) largest = std::max(largest, b.shardNumel);
      const size_t slot = (static_cast<size_t>(largest) * 4 + 63) / 64 * 64;
      EXPECT_EQ(opt->engine().swapper()->bufferBytes(), 4096 + c.slots * slot)
          << c.precision << (c.sgd ? " sgd" : " adamw") << (c.amsgrad ? " amsgrad" : "");
      trainSteps(model, *opt, rank, 0, 2);  // the records fit: no buffer grows
      EXPECT_EQ(opt->engine().swapper()->bufferBytes(), 4096 + c.slots * slot);
    });
  }
}

// A group that needs one more kind of state after its records were planned (momentum set after
// the first steps, amsgrad switched on) moves that record into a larger buffer at its store and
// trains bit-identically to the same change in memory.
TEST(ZeroOffloadBuffers, ARecordGrowsWhenTheHyperparametersNeedAnotherKind) {
  TempDir nvme;
  for (const bool sgd : {true, false}) {
    runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      const Options base = Options().stage(2).mixed_precision(sgd ? "bf16" : "fp32").reduce_bucket_elems(150);
      auto make = [&](torch::nn::Sequential& m, const Options& o) {
        return sgd ? zeroplus::zero::initialize(m, pg, o, torch::optim::SGDOptions(0.05))
                   : zeroplus::zero::initialize(m, pg, o, zeroplus::optim::ZeroAdamWOptions(1e-2));
      };
      auto plainModel = makeModel();
      auto plain = make(plainModel, base);
      auto swapModel = makeModel();
      auto swapped = make(swapModel, Options(base).offload_optimizer("nvme").nvme_path(nvme.path()));
      const size_t before = swapped->engine().swapper()->bufferBytes();
      trainSteps(plainModel, *plain, rank, 0, 2);
      trainSteps(swapModel, *swapped, rank, 0, 2);
      for (auto* opt : {plain.get(), swapped.get()}) {
        auto& options = opt->param_groups()[0].options();
        if (sgd) {
          static_cast<torch::optim::SGDOptions&>(options).momentum(0.9);
        } else {
          static_cast<zeroplus::optim::ZeroAdamWOptions&>(options).amsgrad(true);
        }
      }
      trainSteps(plainModel, *plain, rank, 2, 3);
      trainSteps(swapModel, *swapped, rank, 2, 3);
      EXPECT_GT(swapped->engine().swapper()->bufferBytes(), before);
      const auto a = zeroplus::zero::full_state_dict(plainModel, *plain);
      const auto b = zeroplus::zero::full_state_dict(swapModel, *swapped);
      for (const auto& item : a) EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << sgd << " " << item.key();
    });
  }
}

// Equal-size buckets, a pool that reads several records ahead: when momentum is switched on,
// bucket 0's record grows (and with it the pool's buffer size) while the next buckets' records
// sit read ahead in buffers of the old size. Each must move into a buffer of the new size at its
// own store, not be written past the end of the one it was read into (the store refuses that:
// a fault at endStep). Slots of 8 KiB: past any page rounding of the old buffers.
TEST(ZeroOffloadBuffers, RecordsReadAheadBeforeAnotherGrewMoveToo) {
  TempDir nvme;
  runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto makeWide = [] {
      torch::nn::Sequential m(torch::nn::Linear(64, 64), torch::nn::Tanh(), torch::nn::Linear(64, 64), torch::nn::Tanh(),
                              torch::nn::Linear(64, 64));
      torch::NoGradGuard no_grad;
      uint64_t seed = 40;
      for (auto& p : m->parameters()) p.copy_(randomTensor(p.sizes(), seed++) * 0.1);
      return m;
    };
    auto train = [&](torch::nn::Sequential& m, zeroplus::zero::ZeroOptimizer& opt, int first, int steps) {
      for (int s = first; s < first + steps; ++s) {
        opt.zero_grad();
        const at::Tensor x = randomTensor({4, 64}, 500 + s * 10 + rank).to(at::kBFloat16);
        opt.backward(torch::mse_loss(m->forward(x).to(at::kFloat), randomTensor({4, 64}, 600 + s * 10 + rank)));
        opt.step();
      }
    };
    const Options base = Options().stage(2).mixed_precision("bf16").reduce_bucket_elems(64 * 64 + 64);
    auto plainModel = makeWide();
    auto plain = zeroplus::zero::initialize(plainModel, pg, base, torch::optim::SGDOptions(0.05));
    auto swapModel = makeWide();
    auto swapped = zeroplus::zero::initialize(
        swapModel, pg, Options(base).offload_optimizer("nvme").nvme_path(nvme.path()).offload_buffer_count(6),
        torch::optim::SGDOptions(0.05));
    ASSERT_EQ(swapped->engine().params().buckets().size(), 3u);
    train(plainModel, *plain, 0, 2);
    train(swapModel, *swapped, 0, 2);
    for (auto* opt : {plain.get(), swapped.get()}) {
      static_cast<torch::optim::SGDOptions&>(opt->param_groups()[0].options()).momentum(0.9);
    }
    train(plainModel, *plain, 2, 3);
    train(swapModel, *swapped, 2, 3);  // a fault would raise here, at the step's end
    const auto a = zeroplus::zero::full_state_dict(plainModel, *plain);
    const auto b = zeroplus::zero::full_state_dict(swapModel, *swapped);
    for (const auto& item : a) EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << item.key();
  });
}

TEST(ZeroOffloadOrdering, OneBufferPoolTrainsBitIdentically) {
  TempDir nvme;
  runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    Options base = Options().stage(2).reduce_bucket_elems(150);
    auto plainModel = makeModel();
    auto plain = make(plainModel, pg, base, false);
    auto swapModel = makeModel();
    // One buffer: every read waits for the write before it; fetches evict reads ahead or grow.
    auto swapped = make(swapModel, pg, Options(base).offload_optimizer("nvme").nvme_path(nvme.path()).offload_buffer_count(1),
                        false);
    trainSteps(plainModel, *plain, rank, 0, 4);
    trainSteps(swapModel, *swapped, rank, 0, 4);
    const auto a = zeroplus::zero::full_state_dict(plainModel, *plain);
    const auto b = zeroplus::zero::full_state_dict(swapModel, *swapped);
    for (const auto& item : a) EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << item.key();
  });
}

TEST(ZeroOffloadFaults, BadOptionsRaiseNamingTheField) {
  TempDir nvme;
  const std::string file = nvme.path() + "/plain-file";
  { std::ofstream(file) << "x"; }
  runRanks(1, [&](int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto expectValueError = [&](const Options& o, const std::string& needle) {
      auto model = makeModel();
      try {
        make(model, pg, o, false);
        ADD_FAILURE() << "no error for " << needle;
      } catch (const c10::ValueError& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    expectValueError(Options().offload_optimizer("disk"),
                     "options.offload_optimizer must be \"none\", \"cpu\" or \"nvme\", got \"disk\"");
    expectValueError(Options().offload_optimizer("nvme"), "options.nvme_path");
    expectValueError(Options().offload_optimizer("nvme").nvme_path(nvme.path() + "/missing"), "options.nvme_path");
    expectValueError(Options().offload_optimizer("nvme").nvme_path(file), "not a directory");
    expectValueError(Options().offload_optimizer("nvme").nvme_path(nvme.path()).offload_buffer_count(0),
                     "options.offload_buffer_count");
  });
}

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The full model (gathered at stage 3: collective), name -> tensor.
std::map<std::string, at::Tensor> fullParams(torch::nn::Sequential& model, zeroplus::zero::ZeroOptimizer& opt) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : zeroplus::zero::full_state_dict(model, opt)) out[item.key()] = item.value();
  return out;
}

void expectBitIdentical(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, t] : want) EXPECT_TRUE(torch::equal(got.at(name), t)) << what << ": " << name;
}

// Between steps an offloaded engine holds no elementwise state, and no master that is a copy, in
// memory: a checkpoint's reads and writes left nothing bound.
void expectSwappedOut(zeroplus::zero::ZeroOptimizer& opt, const std::string& what) {
  auto& eng = opt.engine();
  for (size_t b = 0; b < eng.steppers().size(); ++b) {
    for (const auto& seg : eng.steppers()[b].segments()) {
      EXPECT_FALSE(seg.state.exp_avg.defined() || seg.state.exp_avg_sq.defined() ||
                   seg.state.max_exp_avg_sq.defined() || seg.state.momentum_buffer.defined())
          << what << ": bucket " << b;
    }
    if (opt.engine().computeDtype()) {
      EXPECT_EQ(eng.params().master(b).numel(), 0) << what << ": bucket " << b;
    }
  }
}

void scramble(torch::nn::Sequential& model) {
  torch::NoGradGuard no_grad;
  uint64_t seed = 77;
  for (auto& p : model->parameters()) p.copy_(randomTensor(p.sizes(), seed++));
}

class ZeroOffloadCheckpoint : public ::testing::TestWithParam<Case> {};

// Save from an offloaded engine after 2 steps; load into an in-memory engine and into an
// offloaded one: 2 more steps in each, and in the saving engine itself, are bit-identical to 4
// steps of an engine that never checkpointed.
TEST_P(ZeroOffloadCheckpoint, SaveAndLoadThroughTheSwapRecordsResumeBitIdentically) {
  const Case c = GetParam();
  TempDir nvme, ckpt;
  const std::string path = ckpt.path() + "/step2";
  runRanks(c.world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    const Options base = Options().stage(c.stage).param_persistence_threshold(0).mixed_precision(c.precision).reduce_bucket_elems(150);
    const Options offload = Options(base).offload_optimizer("nvme").nvme_path(nvme.path());
    std::map<std::string, at::Tensor> expected, atSave;
    {
      auto model = makeModel();
      auto opt = make(model, pg, base, c.sgd);
      trainSteps(model, *opt, rank, 0, 2);
      atSave = fullParams(model, *opt);
      zeroplus::save_checkpoint(ckpt.path() + "/in-memory/step2", model, *opt);
      trainSteps(model, *opt, rank, 2, 2);
      expected = fullParams(model, *opt);
    }
    {
      auto model = makeModel();
      auto opt = make(model, pg, offload, c.sgd);
      trainSteps(model, *opt, rank, 0, 2);
      zeroplus::save_checkpoint(path, model, *opt);
      expectSwappedOut(*opt, "after save");
      // The same bytes as the in-memory engine's checkpoint of the same training.
      const std::string shard = "/rank0000" + std::to_string(rank) + ".bin";
      EXPECT_EQ(readFile(path + shard), readFile(ckpt.path() + "/in-memory/step2" + shard)) << shard;
      trainSteps(model, *opt, rank, 2, 2);  // the records the save read are still the state
      expectBitIdentical(fullParams(model, *opt), expected, "the saving engine");
    }
    for (const bool offloaded : {false, true}) {
      const std::string what = offloaded ? "loaded into an offloaded engine" : "loaded into an in-memory engine";
      auto model = makeModel();
      scramble(model);  // other values: the load must replace them all
      auto opt = make(model, pg, offloaded ? offload : base, c.sgd);
      trainSteps(model, *opt, rank, 5, 1);  // state of its own in the records, replaced by the load
      zeroplus::load_checkpoint(ckpt.path(), model, *opt);  // through `latest`
      if (offloaded) expectSwappedOut(*opt, what);
      expectBitIdentical(fullParams(model, *opt), atSave, what + " (at load)");
      trainSteps(model, *opt, rank, 2, 2);
      expectBitIdentical(fullParams(model, *opt), expected, what);
    }
  });
  EXPECT_TRUE(fsys::is_empty(nvme.path()));
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroOffloadCheckpoint,
                         ::testing::Values(Case{2, "fp32", false, 2}, Case{1, "bf16", true, 2},
                                           Case{3, "bf16", false, 2}, Case{2, "fp32", true, 2}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return "stage" + std::to_string(c.stage) + "_" + c.precision + (c.sgd ? "_sgd" : "_adamw") +
                                  "_world" + std::to_string(c.world);
                         });

// A checkpoint taken before any step (masters only, no optimizer state) loaded into an offloaded
// engine that has state: the records lose their state slots, the next steps create them anew,
// exactly as a fresh engine's first steps do.
TEST(ZeroOffloadCheckpointLoad, ACheckpointWithoutStateEmptiesTheRecords) {
  TempDir nvme, ckpt;
  runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    const Options base = Options().stage(2).mixed_precision("bf16").reduce_bucket_elems(150);
    std::map<std::string, at::Tensor> expected;
    {
      auto model = makeModel();
      auto opt = make(model, pg, base, false);
      zeroplus::save_checkpoint(ckpt.path() + "/step0", model, *opt);
      trainSteps(model, *opt, rank, 0, 2);
      expected = fullParams(model, *opt);
    }
    auto model = makeModel();
    scramble(model);
    auto opt = make(model, pg, Options(base).offload_optimizer("nvme").nvme_path(nvme.path()), false);
    trainSteps(model, *opt, rank, 5, 2);
    zeroplus::load_checkpoint(ckpt.path() + "/step0", model, *opt);
    expectSwappedOut(*opt, "after load");
    for (const auto& stepper : opt->engine().steppers()) {
      for (const auto& seg : stepper.segments()) EXPECT_FALSE(seg.state.step.defined());
    }
    trainSteps(model, *opt, rank, 0, 2);
    expectBitIdentical(fullParams(model, *opt), expected, "after the load of a stateless checkpoint");
  });
}

// A swap record that fails its check while a save reads it: every rank raises c10::Error naming
// the file, the checkpoint already at the path is untouched (and still loads), no staging
// directory is left, and nothing stays bound in the swapper.
TEST(ZeroOffloadCheckpointFaults, CorruptRecordDuringSaveRaisesNamingTheFileAndKeepsThePreviousCheckpoint) {
  TempDir nvme, ckpt;
  const std::string path = ckpt.path() + "/ck";
  std::string corrupted;  // rank 1's record file
  std::map<std::string, at::Tensor> atFirstSave;
  runRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    const Options o = Options().stage(2).reduce_bucket_elems(150).offload_optimizer("nvme").nvme_path(nvme.path());
    auto model = makeModel();
    auto opt = make(model, pg, o, false);
    trainSteps(model, *opt, rank, 0, 2);
    zeroplus::save_checkpoint(path, model, *opt);
    if (rank == 0) atFirstSave = fullParams(model, *opt);
    const std::string manifest = readFile(path + "/manifest.json"), shard = readFile(path + "/rank00001.bin");
    ASSERT_FALSE(manifest.empty());
    trainSteps(model, *opt, rank, 2, 1);
    opt->engine().swapper()->waitForWrites();
    if (rank == 1) {
      corrupted = opt->engine().swapper()->pathOf(1);
      const int fd = ::open(corrupted.c_str(), O_RDWR);
      ASSERT_GE(fd, 0);
      unsigned char byte = 0;
      ASSERT_EQ(::pread(fd, &byte, 1, 4096 + 5), 1);
      byte ^= 0x40;
      ASSERT_EQ(::pwrite(fd, &byte, 1, 4096 + 5), 1);
      ::close(fd);
    }
    pg->barrier()->wait();
    try {
      zeroplus::save_checkpoint(path, model, *opt);
      ADD_FAILURE() << "rank " << rank << ": a save over a corrupt swap record succeeded";
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("zeroplus::save_checkpoint(\"" + path + "\")"), std::string::npos) << what;
      EXPECT_NE(what.find(corrupted), std::string::npos) << what;
      EXPECT_NE(what.find("bucket 1"), std::string::npos) << what;
      EXPECT_NE(what.find("checksum"), std::string::npos) << what;
      EXPECT_NE(what.find("an existing one at the path is unchanged"), std::string::npos) << what;
    }
    expectSwappedOut(*opt, "after the failed save");
    EXPECT_EQ(readFile(path + "/manifest.json"), manifest);
    EXPECT_EQ(readFile(path + "/rank00001.bin"), shard);
    pg->barrier()->wait();
    std::vector<std::string> names;
    for (const auto& e : fsys::directory_iterator(ckpt.path())) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, (std::vector<std::string>{"ck", "latest"}));
    // The previous checkpoint still loads.
    auto fresh = makeModel();
    scramble(fresh);
    auto freshOpt = make(fresh, pg, Options().stage(2).reduce_bucket_elems(150), false);
    zeroplus::load_checkpoint(path, fresh, *freshOpt);
    const auto loaded = fullParams(fresh, *freshOpt);
    if (rank == 0) expectBitIdentical(loaded, atFirstSave, "the previous checkpoint");
  });
}

}  // namespace
