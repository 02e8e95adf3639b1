// Step time of the C++ ZeRO engine with the optimizer state in memory against NVMe optimizer
// offload (Options::offload_optimizer "nvme"), ranks as threads on zeroplus process groups.
//
//   build/bin/bench_cpp_offload --nvme DIR [--layers 12] [--width 2048] [--worlds 1,2]
//                               [--reps 3] [--steps 5] [--stage 2] [--precision fp32] [--buffers N] --json OUT
//
// Model: a Sequential of `layers` Linear(width, width) layers with ReLU between them (12 x 2048
// ~ 50M parameters). Each repetition builds a fresh model and optimizer per mode, runs two
// warm-up iterations, then times `steps` iterations of zero_grad + forward + backward + step:
// the write-behind runs during the next forward and backward, so the iteration (not step()
// alone) is what offload costs. Reported: the median over repetitions of each repetition's
// median iteration (and step()) time, rank 0's clock. bench/zero/bench_cpp_offload.py runs this
// and plots it. Benchmarks are not tests: no assertion on times.
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "optimizers/adapter/zero/engine.hpp"
#include "optimizers/core/swap_store.hpp"
#include "zeroplus.hpp"

namespace {

struct Args {
  std::string nvme, json = "bench_cpp_offload.json", precision = "fp32";
  int layers = 12, width = 2048, reps = 3, steps = 5, stage = 2, buffers = 0;  // 0: the engine's default pool
  std::vector<int> worlds = {1, 2};
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Rank 0's medians over the timed iterations. The offload breakdown comes from the swap store's
// counters (optimizers/core/swap_store.hpp SwapStats), per iteration: time the training thread
// was blocked on reads (in step()) and on writes (anywhere: the next step, a buffer wanted by a
// read), CRC time (records read and written), and how each record came in.
struct Times {
  double iter = 0, step = 0, fwdbwd = 0;
  double readWait = 0, writeWait = 0, checksum = 0;
  double readsAhead = 0, readsOnDemand = 0, inBuffer = 0, refused = 0;
  double bytesRead = 0, bytesWritten = 0, maxInFlight = 0, buffers = 0, records = 0, recordBytes = 0;
  double peakBufferBytes = 0;  // the pool's most bytes at once
};

Times runOnce(const Args& a, int world, bool offload) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<Times> out(world);
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto pg = zeroplus::pg::makeProcessGroup(store, rank, world);
        torch::manual_seed(1);
        torch::nn::Sequential model;
        for (int l = 0; l < a.layers; ++l) {
          model->push_back(torch::nn::Linear(a.width, a.width));
          if (l + 1 < a.layers) model->push_back(torch::nn::ReLU());
        }
        auto o = zeroplus::zero::Options().stage(a.stage).param_persistence_threshold(0).mixed_precision(a.precision);
        if (offload) o.offload_optimizer("nvme").nvme_path(a.nvme);
        if (offload && a.buffers > 0) o.offload_buffer_count(a.buffers);
        auto opt = zeroplus::zero::initialize(model, pg, o, zeroplus::optim::ZeroAdamWOptions(1e-4));
        at::Tensor x = torch::randn({8, a.width}), y = torch::randn({8, a.width});
        auto* swapper = opt->engine().swapper();
        std::vector<double> iters, steps, fwdbwds, readWait, writeWait, checksum, ahead, onDemand, inBuffer, refused,
            bytesRead, bytesWritten;
        zeroplus::swap::SwapStats last;
        for (int s = 0; s < a.steps + 2; ++s) {
          pg->barrier()->wait();
          if (swapper) last = swapper->stats();
          const auto t0 = std::chrono::steady_clock::now();
          opt->zero_grad();
          opt->backward(torch::mse_loss(model->forward(x), y));
          const auto t1 = std::chrono::steady_clock::now();
          opt->step();
          const auto t2 = std::chrono::steady_clock::now();
          if (s >= 2) {
            iters.push_back(std::chrono::duration<double>(t2 - t0).count());
            steps.push_back(std::chrono::duration<double>(t2 - t1).count());
            fwdbwds.push_back(std::chrono::duration<double>(t1 - t0).count());
            if (swapper) {
              const auto now = swapper->stats();
              readWait.push_back((now.readWaitNs - last.readWaitNs) * 1e-9);
              writeWait.push_back((now.writeWaitNs - last.writeWaitNs) * 1e-9);
              checksum.push_back((now.checksumNs - last.checksumNs) * 1e-9);
              ahead.push_back(static_cast<double>(now.readsAhead - last.readsAhead));
              onDemand.push_back(static_cast<double>(now.readsOnDemand - last.readsOnDemand));
              inBuffer.push_back(static_cast<double>(now.fetchesInBuffer - last.fetchesInBuffer));
              refused.push_back(static_cast<double>(now.prefetchesRefused - last.prefetchesRefused));
              bytesRead.push_back(static_cast<double>(now.bytesRead - last.bytesRead));
              bytesWritten.push_back(static_cast<double>(now.bytesWritten - last.bytesWritten));
            }
          }
        }
        Times t;
        t.iter = median(iters);
        t.step = median(steps);
        t.fwdbwd = median(fwdbwds);
        if (swapper) {
          t.readWait = median(readWait);
          t.writeWait = median(writeWait);
          t.checksum = median(checksum);
          t.readsAhead = median(ahead);
          t.readsOnDemand = median(onDemand);
          t.inBuffer = median(inBuffer);
          t.refused = median(refused);
          t.bytesRead = median(bytesRead);
          t.bytesWritten = median(bytesWritten);
          const auto st = swapper->stats();
          t.maxInFlight = static_cast<double>(st.maxInFlight);
          t.buffers = static_cast<double>(st.buffers);
          t.peakBufferBytes = static_cast<double>(st.peakBufferBytes);
          t.records = static_cast<double>(opt->engine().steppers().size());
          t.recordBytes = st.writes ? static_cast<double>(st.bytesWritten) / static_cast<double>(st.writes) : 0;
        }
        out[rank] = t;
        opt.reset();
        pg->shutdown();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (!e.empty()) throw std::runtime_error(e);
  }
  return out[0];
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--nvme") a.nvme = v;
    else if (k == "--json") a.json = v;
    else if (k == "--precision") a.precision = v;
    else if (k == "--layers") a.layers = std::stoi(v);
    else if (k == "--width") a.width = std::stoi(v);
    else if (k == "--reps") a.reps = std::stoi(v);
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--stage") a.stage = std::stoi(v);
    else if (k == "--buffers") a.buffers = std::stoi(v);
    else if (k == "--worlds") {
      a.worlds.clear();
      std::stringstream ss(v);
      for (std::string w; std::getline(ss, w, ',');) a.worlds.push_back(std::stoi(w));
    } else {
      std::fprintf(stderr, "unknown argument %s\n", k.c_str());
      return 2;
    }
  }
  if (a.nvme.empty()) {
    std::fprintf(stderr, "--nvme DIR is required\n");
    return 2;
  }
  const long long params = static_cast<long long>(a.layers) * (static_cast<long long>(a.width) * a.width + a.width);
  std::ofstream json(a.json);
  json << "{\"params\": " << params << ", \"stage\": " << a.stage << ", \"precision\": \"" << a.precision
       << "\", \"steps\": " << a.steps << ", \"reps\": " << a.reps << ", \"rows\": [";
  std::printf("%-6s %-9s %9s %9s %9s %9s %9s %9s %6s %6s %6s\n", "world", "mode", "iter_s", "step_s", "fwdbwd_s",
              "rdwait_s", "wrwait_s", "crc_s", "ahead", "demand", "inbuf");
  bool first = true;
  for (int world : a.worlds) {
    for (int rep = 0; rep < a.reps; ++rep) {
      for (bool offload : {false, true}) {  // interleaved: drift in the machine's load hits both
        const Times t = runOnce(a, world, offload);
        std::printf("%-6d %-9s %9.4f %9.4f %9.4f %9.4f %9.4f %9.4f %6.0f %6.0f %6.0f\n", world,
                    offload ? "nvme" : "memory", t.iter, t.step, t.fwdbwd, t.readWait, t.writeWait, t.checksum,
                    t.readsAhead, t.readsOnDemand, t.inBuffer);
        std::fflush(stdout);
        json << (first ? "" : ", ") << "{\"world\": " << world << ", \"mode\": \"" << (offload ? "nvme" : "memory")
             << "\", \"rep\": " << rep << ", \"iter_s\": " << t.iter << ", \"step_s\": " << t.step
             << ", \"fwdbwd_s\": " << t.fwdbwd << ", \"read_wait_s\": " << t.readWait << ", \"write_wait_s\": "
             << t.writeWait << ", \"checksum_s\": " << t.checksum << ", \"reads_ahead\": " << t.readsAhead
             << ", \"reads_on_demand\": " << t.readsOnDemand << ", \"fetches_in_buffer\": " << t.inBuffer
             << ", \"prefetches_refused\": " << t.refused << ", \"bytes_read\": " << t.bytesRead
             << ", \"bytes_written\": " << t.bytesWritten << ", \"max_in_flight\": " << t.maxInFlight
             << ", \"buffers\": " << t.buffers << ", \"records\": " << t.records << ", \"record_bytes\": "
             << t.recordBytes << ", \"peak_buffer_bytes\": " << t.peakBufferBytes << "}";
        first = false;
      }
    }
  }
  json << "]}\n";
  return 0;
}
