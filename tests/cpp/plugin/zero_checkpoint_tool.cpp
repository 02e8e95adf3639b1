// A small LibTorch program for tests/python/test_cpp_checkpoint_interop.py: the C++ ZeRO engine
// (ranks as threads over a HashStore) trains or loads the fixed model
// Sequential(Linear(7,33), Tanh, Linear(33,17), ReLU, Linear(17,3)) on deterministic data both
// languages compute alike, and writes parameters with torch::pickle_save (name -> tensor).
//
//   zero_checkpoint_tool save DIR WORLD STAGE adamw|sgd fp32|bf16|fp16 [NVME_DIR]
//       2 steps, save_checkpoint(DIR/ckpt), DIR/at_save.pt, one more step, DIR/step3.pt
//   zero_checkpoint_tool load CKPT OUTDIR WORLD STAGE adamw|sgd fp32|bf16|fp16 [NVME_DIR]
//       fresh model, load_checkpoint(CKPT), OUTDIR/loaded.pt, step 3, OUTDIR/step3.pt
// Beside at_save.pt / loaded.pt, scaler.pt holds the loss scale and skipped steps there (fp64
// tensors "scale", "skipped_steps"); fp16 runs with initial_scale_power 19 and hysteresis 1 (the
// Python test's knobs): the first step overflows and is skipped, the scale halves.
// NVME_DIR: the engine offloads its optimizer state there (Options::offload_optimizer "nvme").
// Exit status 0 on success; 1 with the error on stderr.
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <thread>

#include "zeroplus.hpp"

namespace {

constexpr int64_t kRows = 12;

// The same values numpy/torch compute in Python: sin/cos of a float32 ramp.
std::pair<at::Tensor, at::Tensor> batch(int step) {
  const at::Tensor x = at::sin(at::arange(kRows * 7, at::kFloat) * 0.37 + step).reshape({kRows, 7});
  const at::Tensor y = at::cos(at::arange(kRows * 3, at::kFloat) * 0.21 + step).reshape({kRows, 3});
  return {x, y};
}

torch::nn::Sequential makeModel() {
  torch::nn::Sequential model(torch::nn::Linear(7, 33), torch::nn::Tanh(), torch::nn::Linear(33, 17),
                              torch::nn::ReLU(), torch::nn::Linear(17, 3));
  torch::NoGradGuard no_grad;
  int64_t k = 0;
  for (auto& p : model->parameters()) {
    p.copy_(at::sin(at::arange(p.numel(), at::kFloat) * 0.7 + static_cast<double>(k++)).reshape(p.sizes()) * 0.3);
  }
  return model;
}

void step(torch::nn::Sequential& model, zeroplus::zero::ZeroOptimizer& opt, int s, int rank, int world) {
  auto [x, y] = batch(s);
  const int64_t per = kRows / world;
  at::Tensor out = model->forward(x.narrow(0, rank * per, per).to(model->parameters()[0].scalar_type()));
  opt.zero_grad();
  opt.backward(torch::mse_loss(out.to(at::kFloat), y.narrow(0, rank * per, per)));
  opt.step();
}

// Collective (stage 3 gathers the parameters); rank 0 writes.
void writeParams(torch::nn::Sequential& model, zeroplus::zero::ZeroOptimizer& opt, int rank, const std::string& file) {
  const auto full = zeroplus::zero::full_state_dict(model, opt);
  if (rank != 0) return;
  c10::Dict<std::string, at::Tensor> d;
  for (const auto& item : model->named_parameters()) d.insert(item.key(), full[item.key()]);
  const std::vector<char> bytes = torch::pickle_save(d);
  std::ofstream(file, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void writeScaler(zeroplus::zero::ZeroOptimizer& opt, int rank, const std::string& file) {
  if (rank != 0) return;
  c10::Dict<std::string, at::Tensor> d;
  d.insert("scale", at::tensor(opt.loss_scale(), at::kDouble));
  d.insert("skipped_steps", at::tensor(static_cast<double>(opt.skipped_steps()), at::kDouble));
  const std::vector<char> bytes = torch::pickle_save(d);
  std::ofstream(file, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> a(argv + 1, argv + argc);
  const bool save = !a.empty() && a[0] == "save";
  const size_t fixed = save ? 6u : 7u;
  if (a.size() != fixed && a.size() != fixed + 1) {
    std::cerr << "usage: zero_checkpoint_tool save DIR WORLD STAGE adamw|sgd fp32|bf16|fp16 [NVME_DIR]\n"
                 "       zero_checkpoint_tool load CKPT OUTDIR WORLD STAGE adamw|sgd fp32|bf16|fp16 [NVME_DIR]\n";
    return 2;
  }
  const size_t o = save ? 2 : 3;
  const int world = std::stoi(a[o]), stage = std::stoi(a[o + 1]);
  const bool sgd = a[o + 2] == "sgd";
  const std::string precision = a[o + 3];
  const std::string nvme = a.size() > fixed ? a[fixed] : "";
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        zeroplus::pg::BackendConfig config;
        config.timeout = std::chrono::seconds(60);
        auto pg = zeroplus::pg::makeProcessGroup(store, rank, world, config);
        auto model = makeModel();
        auto options = zeroplus::zero::Options().stage(stage).param_persistence_threshold(0).mixed_precision(precision).reduce_bucket_elems(200);
        if (!nvme.empty()) options.offload_optimizer("nvme").nvme_path(nvme);
        if (precision == "fp16") options.initial_scale_power(19).hysteresis(1);
        auto opt = sgd ? zeroplus::zero::initialize(model, pg, options, torch::optim::SGDOptions(0.05).momentum(0.9))
                       : zeroplus::zero::initialize(model, pg, options,
                                                    zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(0.1));
        if (save) {
          for (int s = 0; s < 2; ++s) step(model, *opt, s, rank, world);
          zeroplus::save_checkpoint(a[1] + "/ckpt", model, *opt);
          writeParams(model, *opt, rank, a[1] + "/at_save.pt");
          writeScaler(*opt, rank, a[1] + "/scaler.pt");
        } else {
          zeroplus::load_checkpoint(a[1], model, *opt);
          writeParams(model, *opt, rank, a[2] + "/loaded.pt");
          writeScaler(*opt, rank, a[2] + "/scaler.pt");
        }
        step(model, *opt, 2, rank, world);
        writeParams(model, *opt, rank, (save ? a[1] : a[2]) + "/step3.pt");
        pg->shutdown();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < world; ++rank) {
    if (!errors[rank].empty()) {
      std::cerr << "rank " << rank << ": " << errors[rank] << "\n";
      return 1;
    }
  }
  return 0;
}
