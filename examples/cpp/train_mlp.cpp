// A pure LibTorch training loop on backend zeroplus with the ZeRO-1 optimizer, no Python:
// a small MLP regresses a fixed random target on `world_size` ranks (each sees its slice of the
// batch, gradients averaged with an allreduce, zeroplus::optim::ZeroAdamW steps the shards),
// and every rank also trains the same MLP single-process on the whole batch with LibTorch's
// torch::optim::AdamW. Exits 1 unless the two agree (parameters within 1e-5).
//
//   cpp_train_mlp <rank> <world_size> [host=127.0.0.1] [port=29512] [steps=30]
//   for r in 0 1; do build-package/examples/cpp_train_mlp $r 2 127.0.0.1 29512 & done; wait
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <iostream>
#include <string>

#include "optimizers/adapter/zero_adamw.hpp"
#include "process_group/adapter/process_group.hpp"

namespace {

torch::nn::Sequential makeMlp() {
  torch::manual_seed(0);  // identical initial weights on every rank and in the reference
  return torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::Tanh(), torch::nn::Linear(64, 64),
                               torch::nn::Tanh(), torch::nn::Linear(64, 4));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " <rank> <world_size> [host] [port] [steps]\n";
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int world = std::atoi(argv[2]);
  const std::string host = argc > 3 ? argv[3] : "127.0.0.1";
  const int port = argc > 4 ? std::atoi(argv[4]) : 29512;
  const int steps = argc > 5 ? std::atoi(argv[5]) : 30;
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
  zeroplus::optim::ZeroAdamW opt(model->parameters(), pg, zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(1e-2));
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(1e-2));

  double loss_value = 0;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    auto loss = torch::mse_loss(model->forward(xs), ys);
    loss.backward();
    // DDP's job in a C++ loop: average the gradients over the group.
    for (auto& p : model->parameters()) {
      std::vector<at::Tensor> grad{p.grad()};
      pg->allreduce(grad)->wait();
      p.grad().div_(world);
    }
    opt.step();
    std::vector<at::Tensor> global{loss.detach().clone()};
    pg->allreduce(global)->wait();
    loss_value = global[0].item<double>() / world;

    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    ref_opt.step();
  }

  double max_diff = 0;
  const auto params = model->parameters();
  const auto ref_params = reference->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    max_diff = std::max(max_diff, (params[i] - ref_params[i]).abs().max().item<double>());
  }
  std::cout << "rank " << rank << "/" << world << ": " << steps << " steps, loss " << loss_value
            << ", owns " << opt.ownedNumel() << " of " << torch::nn::utils::parameters_to_vector(params).numel()
            << " elements' optimizer state, max |param - single-process param| = " << max_diff << std::endl;
  pg->barrier()->wait();
  pg->shutdown();
  if (!(max_diff <= 1e-5)) {
    std::cerr << "error: rank " << rank << " diverged from the single-process run\n";
    return 1;
  }
  return 0;
}
