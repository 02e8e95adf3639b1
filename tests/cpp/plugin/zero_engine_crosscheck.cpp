// zero_engine_crosscheck: the C++ half of tests/python/test_cpp_engine_parity.py, which asserts
// that the Python engine (zeroplus.initialize) and the C++ engine (zeroplus::zero::initialize)
// train bit-identically on the same model, data and configuration.
//
//   zero_engine_crosscheck IN OUT [IN OUT ...]
//   zero_engine_crosscheck --rank R --world 2 --store FILE IN OUT [IN OUT ...]
//
// The first form runs both ranks as threads of this process; the second runs rank R only, its
// group meeting the other rank's process through a c10d::FileStore, and writes that rank's OUT
// (its "masters" hold its own shards only). CUDA training needs the second form: autograd runs
// every CUDA backward (and the engine's gradient hooks, which wait on collectives) on one thread
// per device per process, so two rank threads on one GPU would wait on each other there.
//
// IN (written by Python's torch.save, read with torch::pickle_load) is a dict:
//   "model"              "mlp": Sequential(Linear(7, 33), Tanh, Linear(33, 17), ReLU, Linear(17, 3)),
//                        loss mse_loss(out.float(), target); "holder": TinyLm below (an embedding,
//                        a Sequential of blocks, a final norm and a head, with its own forward),
//                        inputs and targets token ids, loss cross_entropy(logits.float(), next)
//   "params"             {"0.weight": tensor, ...}: the model's initial values
//   "inputs", "targets"  [step][rank] -> tensor: each rank's batch per step
//   "stage"              1 | 2 | 3
//   "mixed_precision"    "fp32" | "bf16" | "fp16" (inputs are cast to bf16/fp16 as the Python
//                        engine's forward pre-hook does; the loss is mse_loss(out.float(), target))
//   "fp16"               (fp16 only) the loss-scaler knobs: {"initial_scale_power", "loss_scale_window",
//                        "hysteresis", "loss_scale"}, DeepSpeed's fp16 block as the Python side passes it
//   "optimizer"          "adamw" (lr, betas, eps, weight_decay) | "sgd" (lr, momentum,
//                        dampening, weight_decay, nesterov)
//   "bucket_elems"       reduce_bucket_elems
//   "clip"               [step] -> max_norm for clip_grad_norm, or <= 0: no call that step
//   "gradient_clipping"  Options::gradient_clipping (clipping inside step())
//   "grad_accum_dtype"   (optional) Options::grad_accum_dtype ("fp32", ...; absent: the compute dtype)
//   "micro_batches"      (optional, default 1) backward passes per step: each rank's batch cut into
//                        this many chunks along dim 0, one backward each, gradients accumulated
//   "device"             (optional, default "cpu") where the model and the batches live: "cuda"
//                        trains on the GPU (tests/python/test_cuda_cpp_engine.py); the outputs
//                        are host tensors either way
// OUT (torch::pickle_save: torch.load reads it) is a dict: "params" {name: final tensor, as the
// module holds it}, "trace" {"grad.STEP.BUCKET": rank 0's gradient shard after backward,
// "param.STEP.NAME": the parameter after the step}, "masters" {"RANK.BUCKET": that rank's
// final fp32 master shard of that bucket}, "norms" (fp64 tensor) [step] -> clip_grad_norm's
// result (NaN where there was no call) and "scales" (fp64) [step] -> the loss scale after the step.
//
// Ranks are threads over one c10d::HashStore, each with a zeroplus process group (the Python
// side runs 2 processes on backend "zeroplus"): with 2 ranks every sum is a + b, so the transport
// cannot change bits. Intra-op parallelism is off (one thread) in every rank thread, as in the
// Python test's ranks: OpenMP's thread count is per thread, and a rank thread left at the
// machine's default computed fp32 Linear gradients that differed from the Python ranks' in the
// last bit (bf16 ones did not), before the engine saw them.
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <limits>
#include <thread>
#include <unordered_set>

#include "optimizers/adapter/zero/engine.hpp"  // masters (not in the public API)
#include "zeroplus.hpp"

namespace {

std::vector<char> readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "zero_engine_crosscheck: cannot open ", path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void writeFile(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(out.good(), "zero_engine_crosscheck: cannot write ", path);
}

struct Config {
  c10::Dict<c10::IValue, c10::IValue> d;
  c10::IValue at(const std::string& key) const {
    TORCH_CHECK(d.contains(key), "zero_engine_crosscheck: input has no \"", key, "\"");
    return d.at(key);
  }
  double num(const std::string& key) const {
    auto v = at(key);
    return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  }
};

torch::nn::Sequential makeMlp() {
  return torch::nn::Sequential(torch::nn::Linear(7, 33), torch::nn::Tanh(), torch::nn::Linear(33, 17),
                               torch::nn::ReLU(), torch::nn::Linear(17, 3));
}

// The Python test's _TinyLm, module for module (the same parameter names). At stage 3 the blocks
// are the units and tok_emb, ln_f and head stay whole (persistent_modules on the Python side).
constexpr int64_t kVocab = 13, kDim = 12, kLayers = 3;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        mlp(register_module("mlp", torch::nn::Sequential(torch::nn::Linear(kDim, 2 * kDim), torch::nn::Tanh(),
                                                         torch::nn::Linear(2 * kDim, kDim)))) {}
  at::Tensor forward(at::Tensor x) { return x + mlp->forward(ln(x)); }
  torch::nn::LayerNorm ln;
  torch::nn::Sequential mlp;
};
TORCH_MODULE(Block);

struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl()
      : tok_emb(register_module("tok_emb", torch::nn::Embedding(kVocab, kDim))),
        blocks(register_module("blocks", torch::nn::Sequential())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        head(register_module("head", torch::nn::Linear(kDim, kVocab))) {
    for (int64_t i = 0; i < kLayers; ++i) blocks->push_back(Block());
  }
  // 2-D activations (tokens, dim): on more dimensions torch::nn::Linear rounds matmul and bias
  // separately in bf16, unlike Python's F.linear (tests/python/test_cpp_engine_parity.py).
  at::Tensor forward(const at::Tensor& ids) { return head(ln_f(blocks->forward(tok_emb(ids).reshape({-1, kDim})))); }
  torch::nn::Embedding tok_emb;
  torch::nn::Sequential blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyLm);

// One rank's training run; returns the final parameters and the per-step clip norms.
c10::impl::GenericDict trainRank(const Config& cfg, int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
  const bool holder = cfg.d.contains("model") && cfg.at("model").toStringRef() == "holder";
  std::shared_ptr<torch::nn::Module> model;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss;
  if (holder) {
    TinyLm lm;
    model = lm.ptr();
    loss = [lm](const at::Tensor& ids, const at::Tensor& next) mutable {
      return torch::nn::functional::cross_entropy(lm->forward(ids).to(at::kFloat).reshape({-1, kVocab}),
                                                  next.reshape(-1));
    };
  } else {
    auto mlp = makeMlp();
    model = mlp.ptr();
    loss = [mlp](const at::Tensor& x, const at::Tensor& y) mutable {
      return torch::mse_loss(mlp->forward(x).to(at::kFloat), y);
    };
  }
  {
    torch::NoGradGuard noGrad;
    auto initial = cfg.at("params").toGenericDict();
    for (auto& item : model->named_parameters()) {
      item.value().copy_(initial.at(item.key()).toTensor());
    }
  }
  const at::Device device(cfg.d.contains("device") ? cfg.at("device").toStringRef() : std::string("cpu"));
  model->to(device);
  const std::string precision = cfg.at("mixed_precision").toStringRef();
  const bool lowPrecision = precision == "bf16" || precision == "fp16";
  auto options = zeroplus::zero::Options()
                     .stage(cfg.at("stage").toInt())
                     .param_persistence_threshold(cfg.at("persistence_threshold").toInt())
                     .mixed_precision(precision)
                     .reduce_bucket_elems(cfg.at("bucket_elems").toInt())
                     .gradient_clipping(cfg.num("gradient_clipping"));
  if (cfg.d.contains("grad_accum_dtype")) options.grad_accum_dtype(cfg.at("grad_accum_dtype").toStringRef());
  const int64_t micro = cfg.d.contains("micro_batches") ? cfg.at("micro_batches").toInt() : 1;
  if (precision == "fp16" && cfg.d.contains("fp16")) {
    for (const auto& kv : cfg.at("fp16").toGenericDict()) {
      const std::string& key = kv.key().toStringRef();
      const c10::IValue& v = kv.value();
      const double x = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
      if (key == "initial_scale_power") options.initial_scale_power(x);
      else if (key == "loss_scale_window") options.loss_scale_window(static_cast<int64_t>(x));
      else if (key == "hysteresis") options.hysteresis(static_cast<int64_t>(x));
      else if (key == "loss_scale") options.loss_scale(x);
      else TORCH_CHECK(false, "zero_engine_crosscheck: unknown fp16 key ", key);
    }
  }
  std::shared_ptr<zeroplus::zero::ZeroOptimizer> opt;
  const std::string kind = cfg.at("optimizer").toStringRef();
  if (kind == "adamw") {
    opt = zeroplus::zero::initialize(model, pg, options,
                                     zeroplus::optim::ZeroAdamWOptions(cfg.num("lr"))
                                         .betas({cfg.num("beta1"), cfg.num("beta2")})
                                         .eps(cfg.num("eps"))
                                         .weight_decay(cfg.num("weight_decay")));
  } else {
    TORCH_CHECK(kind == "sgd", "zero_engine_crosscheck: optimizer must be adamw or sgd, got ", kind);
    opt = zeroplus::zero::initialize(model, pg, options,
                                     torch::optim::SGDOptions(cfg.num("lr"))
                                         .momentum(cfg.num("momentum"))
                                         .dampening(cfg.num("dampening"))
                                         .weight_decay(cfg.num("weight_decay"))
                                         .nesterov(cfg.at("nesterov").toBool()));
  }
  if (holder && opt->stage() == 3) {  // the partitioning the Python side is given (persistent_modules)
    const int64_t threshold = cfg.at("persistence_threshold").toInt();
    std::unordered_set<const void*> whole;
    for (const auto& b : opt->engine().sharded()->buckets()) {
      for (const auto& e : b.entries) {
        if (b.persistent) whole.insert(e.param.unsafeGetTensorImpl());
      }
    }
    for (const auto& item : model->named_parameters()) {
      const bool sharded = item.key().rfind("blocks.", 0) == 0 && item.value().numel() > threshold;
      TORCH_CHECK(whole.count(item.value().unsafeGetTensorImpl()) != sharded, "zero_engine_crosscheck: ", item.key(),
                  sharded ? " is kept whole" : " is sharded", " at stage 3");
    }
  }
  auto inputs = cfg.at("inputs").toList();
  auto targets = cfg.at("targets").toList();
  auto clip = cfg.at("clip").toList();
  std::vector<double> norms, scales;
  c10::Dict<std::string, at::Tensor> trace;  // where the two engines part: see the Python test
  for (size_t step = 0; step < inputs.size(); ++step) {
    at::Tensor x = inputs.get(step).toList().get(rank).toTensor().to(device);
    at::Tensor y = targets.get(step).toList().get(rank).toTensor().to(device);
    // the Python engine's forward pre-hook (precision.install_input_cast) casts floating inputs
    if (lowPrecision && x.is_floating_point()) x = x.to(precision == "bf16" ? at::kBFloat16 : at::kHalf);
    opt->zero_grad();
    const auto xs = x.chunk(micro), ys = y.chunk(micro);
    for (size_t m = 0; m < xs.size(); ++m) opt->backward(loss(xs[m], ys[m]));
    const auto shards = opt->gradient_shards();
    for (size_t b = 0; b < shards.size(); ++b) {
      trace.insert("grad." + std::to_string(step) + "." + std::to_string(b), shards[b].cpu().clone());
    }
    const c10::IValue c = clip.get(step);
    const double maxNorm = c.isDouble() ? c.toDouble() : static_cast<double>(c.toInt());
    norms.push_back(maxNorm > 0 ? opt->clip_grad_norm(maxNorm) : std::numeric_limits<double>::quiet_NaN());
    opt->step();
    scales.push_back(opt->loss_scale());
    // full_state_dict: at stage 3 the parameters are shards between uses
    for (const auto& item : zeroplus::zero::full_state_dict(model, *opt)) {
      trace.insert("param." + std::to_string(step) + "." + item.key(), item.value().cpu());
    }
  }
  c10::Dict<std::string, at::Tensor> params;
  for (const auto& item : zeroplus::zero::full_state_dict(model, *opt)) params.insert(item.key(), item.value().cpu());
  c10::Dict<std::string, at::Tensor> masters;  // fp32 shards: bf16 parameters could hide a last-bit difference
  const auto& own = opt->engine().params().masters();
  for (size_t b = 0; b < own.size(); ++b) {
    masters.insert(std::to_string(rank) + "." + std::to_string(b), own[b].cpu().clone());
  }
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("masters", masters);
  out.insert("params", params);
  out.insert("trace", trace);
  out.insert("norms", at::tensor(norms, at::kDouble));  // a tensor: torch.load's weights_only reads it
  out.insert("scales", at::tensor(scales, at::kDouble));
  return out;
}

zeroplus::pg::BackendConfig groupConfig() {
  zeroplus::pg::BackendConfig config;
  config.timeout = std::chrono::seconds(60);
  return config;
}

// Runs both ranks; returns rank 0's result after checking that rank 1 ended with the same bits.
c10::IValue runCase(const Config& cfg) {
  constexpr int kWorld = 2;
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(kWorld);
  std::vector<c10::IValue> results(kWorld);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        // OpenMP's thread count is per thread: main's setting does not reach this one.
        at::set_num_threads(1);
        auto pg = zeroplus::pg::makeProcessGroup(store, rank, kWorld, groupConfig());
        results[rank] = trainRank(cfg, rank, pg);
        pg->shutdown();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < kWorld; ++rank) {
    TORCH_CHECK(errors[rank].empty(), "zero_engine_crosscheck: rank ", rank, ": ", errors[rank]);
  }
  auto p0 = results[0].toGenericDict().at("params").toGenericDict();
  auto p1 = results[1].toGenericDict().at("params").toGenericDict();
  for (const auto& item : p0) {
    TORCH_CHECK(at::equal(item.value().toTensor(), p1.at(item.key()).toTensor()),
                "zero_engine_crosscheck: ranks ended with different values of ", item.key().toStringRef());
  }
  auto masters = results[0].toGenericDict().at("masters").toGenericDict();
  for (const auto& item : results[1].toGenericDict().at("masters").toGenericDict()) {
    masters.insert(item.key(), item.value());
  }
  return results[0];
}

}  // namespace

int main(int argc, char** argv) {
  int first = 1, rank = -1, world = 0;
  std::string storePath;
  if (argc > 1 && std::string(argv[1]) == "--rank") {
    if (argc < 7 || std::string(argv[3]) != "--world" || std::string(argv[5]) != "--store") first = argc;
    else {
      rank = std::atoi(argv[2]);
      world = std::atoi(argv[4]);
      storePath = argv[6];
      first = 7;
    }
  }
  if (argc - first < 2 || (argc - first) % 2 != 0 || (rank >= 0 && (world < 1 || rank >= world))) {
    std::cerr << "usage: " << argv[0] << " [--rank R --world W --store FILE] IN OUT [IN OUT ...]\n";
    return 2;
  }
  at::set_num_threads(1);
  try {
    // One process per rank: one group for every case (the cases run in the same order on every rank).
    c10::intrusive_ptr<c10d::ProcessGroup> pg;
    if (rank >= 0) pg = zeroplus::pg::makeProcessGroup(c10::make_intrusive<c10d::FileStore>(storePath, world), rank,
                                                       world, groupConfig());
    for (int i = first; i + 1 < argc; i += 2) {
      Config cfg{torch::pickle_load(readFile(argv[i])).toGenericDict()};
      writeFile(argv[i + 1], torch::pickle_save(rank >= 0 ? c10::IValue(trainRank(cfg, rank, pg)) : runCase(cfg)));
    }
    if (pg) pg->shutdown();
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
