// A LibTorch program with no Python: joins a zeroplus group through a TCPStore and all-reduces.
//
//   cpp_allreduce <rank> <world_size> [host=127.0.0.1] [port=29511]
//
// Run one process per rank, e.g.:  for r in 0 1; do build/bin/cpp_allreduce $r 2 & done; wait
// Each rank checks the sum itself and exits 1, with a message, unless it is exact.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "process_group/adapter/backend.hpp"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " <rank> <world_size> [host] [port]\n";
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int world = std::atoi(argv[2]);
  if (world < 1 || rank < 0 || rank >= world) {
    std::cerr << "error: rank must be in [0, world_size) and world_size >= 1, got rank " << argv[1]
              << " world_size " << argv[2] << "\n";
    return 2;
  }
  const std::string host = argc > 3 ? argv[3] : "127.0.0.1";
  const int port = argc > 4 ? std::atoi(argv[4]) : 29511;

  c10d::TCPStoreOptions storeOptions;
  storeOptions.port = static_cast<uint16_t>(port);
  storeOptions.isServer = rank == 0;
  storeOptions.numWorkers = world;
  auto store = c10::make_intrusive<c10d::TCPStore>(host, storeOptions);

  zeroplus::pg::BackendConfig config;
  config.timeout = std::chrono::seconds(60);
  auto backend = c10::make_intrusive<zeroplus::pg::ZeroPlusBackend>(store, rank, world, config);

  // Rank r contributes r + 1, so the sum is world * (world + 1) / 2 in every element: a small
  // integer, exact in float, so the comparison below is exact too.
  std::vector<at::Tensor> tensors{at::full({4}, static_cast<float>(rank + 1))};
  backend->allreduce(tensors)->wait();
  const float expected = static_cast<float>(world * (world + 1) / 2);
  const bool ok = at::equal(tensors[0], at::full({4}, expected));
  if (ok) {
    std::cout << "rank " << rank << ": allreduce of 4 floats over " << world << " ranks = " << expected << ": ok"
              << std::endl;
  } else {
    std::cerr << "error: rank " << rank << ": allreduce over " << world << " ranks gave [";
    const auto got = tensors[0].accessor<float, 1>();
    for (int64_t i = 0; i < got.size(0); ++i) std::cerr << (i ? ", " : "") << got[i];
    std::cerr << "], expected " << expected << " in every element" << std::endl;
  }
  // The barrier and shutdown run either way, so the other ranks are not left waiting.
  backend->barrier()->wait();
  backend->shutdown();
  return ok ? 0 : 1;
}
