// zeroplus_aio_bench: one timed pass of the zeroplus aio engine over an existing file, with the
// same parameters fio takes (rw, bs, iodepth, direct), printing one JSON object.
// Driven by bench/aio/run.py, which interleaves it with fio on the same file.
//
//   zeroplus_aio_bench --file F --size BYTES --rw read|write|randread|randwrite --bs BYTES
//                      --qd N [--threads N] [--engine io_uring|threads] [--direct 0|1]
//                      [--register 0|1] [--seed N]
//
// Sequential: the file is covered by transfers of up to 64 MiB (each split into bs requests)
// all submitted up front, so the engine keeps qd requests in flight as fio does. Random: one
// bs-sized transfer per block, every block exactly once in a random order (fio's random map).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "aio/core/aligned_buffer.hpp"
#include "aio/core/engine.hpp"
#include "aio/core/file.hpp"
#include "aio/core/io_error.hpp"

using namespace zeroplus::aio;

namespace {

struct Args {
  std::string file, rw = "read", engine = "io_uring";
  uint64_t size = 1ull << 30, bs = 1 << 20;
  unsigned qd = 32, threads = 1, seed = 1;
  bool direct = true, reg = true;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr, "zeroplus_aio_bench: %s\n", msg);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage(("missing value for " + k).c_str());
    const char* v = argv[++i];
    if (k == "--file") a.file = v;
    else if (k == "--size") a.size = std::strtoull(v, nullptr, 0);
    else if (k == "--rw") a.rw = v;
    else if (k == "--bs") a.bs = std::strtoull(v, nullptr, 0);
    else if (k == "--qd") a.qd = static_cast<unsigned>(std::atoi(v));
    else if (k == "--threads") a.threads = static_cast<unsigned>(std::atoi(v));
    else if (k == "--engine") a.engine = v;
    else if (k == "--direct") a.direct = std::atoi(v) != 0;
    else if (k == "--register") a.reg = std::atoi(v) != 0;
    else if (k == "--seed") a.seed = static_cast<unsigned>(std::atoi(v));
    else usage(("unknown option " + k).c_str());
  }
  if (a.file.empty() || a.bs == 0 || a.size < a.bs || a.qd == 0) usage("need --file, --size >= --bs > 0, --qd > 0");
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const bool write = a.rw == "write" || a.rw == "randwrite";
  const bool random = a.rw == "randread" || a.rw == "randwrite";
  try {
    EngineOptions eo;
    eo.kind = a.engine == "threads" ? EngineKind::ThreadPool : EngineKind::IoUring;
    eo.block_size = a.bs;
    eo.queue_depth = a.qd;
    eo.threads = a.threads;
    auto engine = Engine::create(eo);
    OpenOptions oo;
    oo.write = write;
    oo.direct = a.direct ? DirectMode::On : DirectMode::Off;
    std::shared_ptr<const File> file = File::open(a.file, oo);

    const uint64_t blocks = a.size / a.bs;
    const uint64_t span = std::min<uint64_t>(blocks * a.bs, 64ull << 20);
    AlignedBuffer buf(span);
    std::memset(buf.data(), 0x5a, span);
    const bool registered = a.reg && engine->registerBuffer(buf.data(), span);
    char* base = static_cast<char*>(buf.data());
    const OpKind op = write ? OpKind::Write : OpKind::Read;

    std::vector<Transfer> plan;
    if (random) {
      std::vector<uint64_t> order(blocks);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937_64(a.seed));
      const uint64_t slots = span / a.bs;
      for (uint64_t i = 0; i < blocks; ++i) {
        plan.push_back({op, file, base + (i % slots) * a.bs, order[i] * a.bs, a.bs});
      }
    } else {
      for (uint64_t off = 0; off < blocks * a.bs; off += span) {
        plan.push_back({op, file, base, off, std::min(span, blocks * a.bs - off)});
      }
    }
    std::vector<Ticket> tickets;
    tickets.reserve(plan.size());
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& t : plan) tickets.push_back(engine->submit(t));
    for (const auto& t : tickets) t.wait();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double bytes = static_cast<double>(blocks * a.bs);
    std::printf("{\"engine\":\"%s\",\"rw\":\"%s\",\"bs\":%llu,\"qd\":%u,\"threads\":%u,"
                "\"direct\":%d,\"registered\":%d,\"bytes\":%.0f,\"seconds\":%.6f,\"GBps\":%.4f}\n",
                toString(engine->kind()), a.rw.c_str(), static_cast<unsigned long long>(a.bs), a.qd,
                a.threads, file->direct() ? 1 : 0, registered ? 1 : 0, bytes, s, bytes / s / 1e9);
    if (registered) engine->unregisterBuffer(buf.data());
  } catch (const IoError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
