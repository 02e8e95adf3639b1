// A LibTorch program with no Python: writes a tensor to a file with zeroplus::aio::AioHandle
// (io_uring, or the thread pool where io_uring is unavailable), reads it back asynchronously
// and checks the bytes. Built against the installed CMake package (find_package(zeroplus)).
//
//   cpp_aio_roundtrip [directory=/tmp] [megabytes=8]
#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "aio/adapter/aio_handle.hpp"

int main(int argc, char** argv) {
  const std::filesystem::path dir = argc > 1 ? argv[1] : "/tmp";
  const int64_t megabytes = argc > 2 ? std::atoll(argv[2]) : 8;
  const std::string path = (dir / ("zeroplus-aio-example-" + std::to_string(::getpid()) + ".bin")).string();

  zeroplus::aio::AioHandleOptions options;  // block_size 1 MiB, queue_depth 32, engine "auto"
  zeroplus::aio::AioHandle handle(options);
  const int64_t numel = megabytes * (1 << 20) / 4;
  // Page-aligned, page-locked memory: O_DIRECT without staging copies.
  at::Tensor out = handle.newCpuLockedTensor(numel, at::kFloat);
  out.copy_(at::arange(numel, at::kFloat));
  at::Tensor in = handle.newCpuLockedTensor(numel, at::kFloat);
  in.zero_();

  try {
    handle.asyncPwrite(out, path);
    handle.wait();                 // rethrows the first I/O error (c10::Error naming path, offset, errno)
    handle.asyncPread(in, path);
    const int64_t done = handle.wait();
    std::filesystem::remove(path);
    if (!at::equal(in, out)) {
      std::cerr << "error: the bytes read back differ from those written\n";
      return 1;
    }
    std::cout << "aio roundtrip ok: " << megabytes << " MiB through engine " << handle.engineName()
              << " (" << done << " op)" << std::endl;
  } catch (const c10::Error& e) {
    std::filesystem::remove(path);
    std::cerr << "error: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
