// A pure LibTorch training loop on backend zeroplus with the ZeRO engine, no Python: a small
// MLP regresses a fixed random target on `world_size` ranks at ZeRO stage 1 or 2 through
// zeroplus.hpp (each rank sees its slice of the batch; the engine reduces the gradients during
// backward, clips the global norm across shards and steps its shard; at stage 3 it also gathers
// each layer's parameters around its forward and backward), and every rank also
// trains the same MLP single-process on the whole batch with LibTorch's torch::optim::AdamW and
// torch::nn::utils::clip_grad_norm_. Exits 1 unless the two agree (parameters and clip norms
// within 1e-5). The training loop is the single-process one but for initialize, backward and
// clip_grad_norm: no hand-written gradient all-reduce.
//
//   cpp_train_mlp <rank> <world_size> [host=127.0.0.1] [port=29512] [steps=30] [stage=2]
//   for r in 0 1; do build-package/examples/cpp_train_mlp $r 2 127.0.0.1 29512 30 2 & done; wait
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <iostream>
#include <string>

#include "zeroplus.hpp"

namespace {

torch::nn::Sequential makeMlp() {
  torch::manual_seed(0);  // identical initial weights on every rank and in the reference
  return torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::Tanh(), torch::nn::Linear(64, 64),
                               torch::nn::Tanh(), torch::nn::Linear(64, 4));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " <rank> <world_size> [host] [port] [steps] [stage]\n";
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int world = std::atoi(argv[2]);
  const std::string host = argc > 3 ? argv[3] : "127.0.0.1";
  const int port = argc > 4 ? std::atoi(argv[4]) : 29512;
  const int steps = argc > 5 ? std::atoi(argv[5]) : 30;
  const int stage = argc > 6 ? std::atoi(argv[6]) : 2;
  constexpr int64_t kBatch = 96;
  if (world < 1 || rank < 0 || rank >= world || kBatch % world != 0) {
    std::cerr << "error: need 0 <= rank < world_size and world_size dividing " << kBatch << "\n";
    return 2;
  }
  torch::set_num_threads(1);

  c10d::TCPStoreOptions storeOptions;
  storeOptions.port = static_cast<uint16_t>(port);
  storeOptions.isServer = rank == 0;
  storeOptions.numWorkers = world;
  auto store = c10::make_intrusive<c10d::TCPStore>(host, storeOptions);
  zeroplus::pg::BackendConfig config;
  config.timeout = std::chrono::seconds(60);
  auto pg = zeroplus::pg::makeProcessGroup(store, rank, world, config);

  torch::manual_seed(1);
  const auto x = torch::randn({kBatch, 16});
  const auto y = torch::randn({kBatch, 4});
  const int64_t shard = kBatch / world;
  const auto xs = x.narrow(0, rank * shard, shard);
  const auto ys = y.narrow(0, rank * shard, shard);

  auto model = makeMlp();
  auto reference = makeMlp();
  // Collective: rank 0's weights everywhere, parameters flattened into buckets, hooks installed.
  // At stage 3 every parameter is sharded: the default param_persistence_threshold (100000
  // elements, DeepSpeed's) would keep all of this toy model's parameters whole.
  auto opt = zeroplus::zero::initialize(model, pg, zeroplus::zero::Options().stage(stage).param_persistence_threshold(0),
                                        zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(1e-2));
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(1e-2));
  torch::optim::StepLR schedule(*opt, /*step_size=*/10, /*gamma=*/0.5);  // a LibTorch scheduler on it
  torch::optim::StepLR ref_schedule(ref_opt, 10, 0.5);

  double loss_value = 0, max_norm_diff = 0;
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    auto loss = torch::mse_loss(model->forward(xs), ys);
    opt->backward(loss);
    const double norm = opt->clip_grad_norm(0.5);  // the global norm across every rank's shard
    opt->step();
    schedule.step();
    std::vector<at::Tensor> global{loss.detach().clone()};
    pg->allreduce(global)->wait();
    loss_value = global[0].item<double>() / world;

    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.5);
    ref_opt.step();
    ref_schedule.step();
    max_norm_diff = std::max(max_norm_diff, std::abs(norm - ref_norm));
  }

  // The full model on every rank (at stage 3 the parameters are shards between uses: gathered here).
  double max_diff = 0;
  int64_t numel = 0;
  const auto full = zeroplus::zero::full_state_dict(model, *opt);
  for (const auto& item : reference->named_parameters()) {
    max_diff = std::max(max_diff, (full[item.key()] - item.value()).abs().max().item<double>());
    numel += item.value().numel();
  }
  std::cout << "rank " << rank << "/" << world << ", ZeRO stage " << stage << ": " << steps << " steps, loss "
            << loss_value << ", owns " << opt->owned_numel() << " of " << numel
            << " elements' optimizer state, max |param - single-process param| = " << max_diff
            << ", max |clip norm - single-process norm| = " << max_norm_diff << std::endl;
  pg->barrier()->wait();
  pg->shutdown();
  if (!(max_diff <= 1e-5) || !(max_norm_diff <= 1e-5)) {
    std::cerr << "error: rank " << rank << " diverged from the single-process run\n";
    return 1;
  }
  return 0;
}
