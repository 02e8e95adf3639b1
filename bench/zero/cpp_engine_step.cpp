// The C++ front-end's step time, for bench/zero/bench_cpp_engine.py (which runs the Python
// front-end on the same model beside it): an MLP (Linear(dim, dim) + GELU, `layers` times) at
// ZeRO stage S, `world` ranks as threads of this process on zeroplus process groups (each with
// one intra-op thread, as the Python ranks), AdamW(lr 3e-4, wd 0.01). A step = zero_grad,
// forward + backward (opt->backward), step. Prints one JSON object: every step's time (the
// slower rank's), after `warmup` untimed steps.
//
//   zero_engine_step_bench <stage> <world> <dim> <layers> <batch> <steps> <warmup> <fp32|bf16>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "zeroplus.hpp"

int main(int argc, char** argv) {
  if (argc != 9) {
    std::cerr << "usage: " << argv[0] << " <stage> <world> <dim> <layers> <batch> <steps> <warmup> <fp32|bf16>\n";
    return 2;
  }
  const int stage = std::atoi(argv[1]), world = std::atoi(argv[2]);
  const int64_t dim = std::atoll(argv[3]), layers = std::atoll(argv[4]), batch = std::atoll(argv[5]);
  const int steps = std::atoi(argv[6]), warmup = std::atoi(argv[7]);
  const std::string precision = argv[8];
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::vector<double>> times(world);
  std::vector<std::string> errors(world);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < world; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        at::set_num_threads(1);  // per thread (OpenMP): the Python ranks run one intra-op thread each
        auto pg = zeroplus::pg::makeProcessGroup(store, rank, world);
        torch::nn::Sequential model;
        for (int64_t l = 0; l < layers; ++l) {
          model->push_back(torch::nn::Linear(dim, dim));
          model->push_back(torch::nn::GELU());
        }
        auto opt = zeroplus::zero::initialize(model, pg,
                                              zeroplus::zero::Options().stage(stage).param_persistence_threshold(0).mixed_precision(precision),
                                              zeroplus::optim::ZeroAdamWOptions(3e-4).weight_decay(0.01));
        const auto gen = at::detail::createCPUGenerator(100 + rank);
        at::Tensor x = at::randn({batch, dim}, gen, at::kFloat), y = at::randn({batch, dim}, gen, at::kFloat);
        if (precision == "bf16") x = x.to(at::kBFloat16);
        for (int s = 0; s < warmup + steps; ++s) {
          pg->barrier()->wait();
          const auto t0 = std::chrono::steady_clock::now();
          opt->zero_grad();
          opt->backward(torch::mse_loss(model->forward(x).to(at::kFloat), y));
          opt->step();
          const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (s >= warmup) times[rank].push_back(dt);
        }
        pg->barrier()->wait();
        pg->shutdown();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int rank = 0; rank < world; ++rank) {
    if (!errors[rank].empty()) {
      std::cerr << "rank " << rank << ": " << errors[rank] << "\n";
      return 1;
    }
  }
  std::cout << "{\"step_seconds\": [";
  for (int s = 0; s < steps; ++s) {
    double slowest = 0;
    for (int rank = 0; rank < world; ++rank) slowest = std::max(slowest, times[rank][s]);
    std::cout << (s ? ", " : "") << slowest;
  }
  std::cout << "]}" << std::endl;
  return 0;
}
