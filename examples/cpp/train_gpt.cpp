// A small GPT trained from C++ at ZeRO stage 3 with bf16 and NVMe optimizer offload, through
// zeroplus.hpp only: a token embedding and a position embedding, a torch::nn::Sequential of pre-norm
// transformer blocks (causal self-attention written with basic ops, a GELU MLP), a final norm and
// a head, on `world_size` ranks (processes over a TCPStore).
//
// What zeroplus does with it (docs/cpp.md, "The ZeRO engine from C++"): the children of the
// Sequential (the blocks) are the stage-3 units, sharded across ranks and gathered around each
// block's forward and backward; the embeddings, the final norm and the head are called by this
// program's own forward, which LibTorch gives the engine no hook into, so they stay whole on every
// rank (their gradients reduce-scattered and their optimizer state sharded, as at stage 2).
// Parameters and gradients are bf16, the fp32 masters and AdamW's moments live in swap files under
// NVME_DIR between steps.
//
// The data is a toy language: every sequence counts up from a random token in steps of 3 (mod the
// vocabulary), so the next token is learnable. Each rank trains on its slice of every batch.
// Exits 1 unless the loss (averaged over the ranks) falls to below half of its first value.
//
//   cpp_train_gpt <rank> <world_size> <nvme_dir> [host=127.0.0.1] [port=29514] [steps=40]
//   for r in 0 1; do build-package/examples/cpp_train_gpt $r 2 /tmp/nvme 127.0.0.1 29514 & done; wait
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <string>

#include "zeroplus.hpp"

namespace {

// Tiny by default: scripts/package_check.sh runs it in a few seconds on 2 CPU ranks.
constexpr int64_t kVocab = 32, kContext = 16, kDim = 32, kHeads = 2, kLayers = 2, kBatch = 16, kStride = 3;

struct CausalSelfAttentionImpl : torch::nn::Module {
  CausalSelfAttentionImpl()
      : qkv(register_module("qkv", torch::nn::Linear(kDim, 3 * kDim))),
        proj(register_module("proj", torch::nn::Linear(kDim, kDim))) {}

  at::Tensor forward(const at::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), head = kDim / kHeads;
    const auto parts = qkv(x).split(kDim, /*dim=*/-1);
    auto heads = [&](const at::Tensor& m) { return m.reshape({b, t, kHeads, head}).transpose(1, 2); };  // (b, h, t, d)
    const at::Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    at::Tensor att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(head)));
    const at::Tensor future = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool)).triu(1);
    att = torch::softmax(att.masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
    return proj(torch::matmul(att, v).transpose(1, 2).reshape({b, t, kDim}));
  }

  torch::nn::Linear qkv, proj;
};
TORCH_MODULE(CausalSelfAttention);

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        attn(register_module("attn", CausalSelfAttention())),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        mlp(register_module("mlp", torch::nn::Sequential(torch::nn::Linear(kDim, 4 * kDim), torch::nn::GELU(),
                                                         torch::nn::Linear(4 * kDim, kDim)))) {}

  at::Tensor forward(at::Tensor x) {
    x = x + attn(ln1(x));
    return x + mlp->forward(ln2(x));
  }

  torch::nn::LayerNorm ln1;
  CausalSelfAttention attn;
  torch::nn::LayerNorm ln2;
  torch::nn::Sequential mlp;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptImpl()
      : tok_emb(register_module("tok_emb", torch::nn::Embedding(kVocab, kDim))),
        pos_emb(register_module("pos_emb", torch::nn::Embedding(kContext, kDim))),
        blocks(register_module("blocks", torch::nn::Sequential())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        head(register_module("head", torch::nn::Linear(kDim, kVocab))) {
    for (int64_t i = 0; i < kLayers; ++i) blocks->push_back(Block());
  }

  // ids: (batch, t) token ids -> (batch, t, vocab) logits. The blocks run through the Sequential's
  // forward: the engine's only way to see (and gather) them.
  at::Tensor forward(const at::Tensor& ids) {
    const at::Tensor positions = torch::arange(ids.size(1), torch::TensorOptions().dtype(torch::kLong));
    at::Tensor x = tok_emb(ids) + pos_emb(positions);
    return head(ln_f(blocks->forward(x)));
  }

  torch::nn::Embedding tok_emb, pos_emb;
  torch::nn::Sequential blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(Gpt);

// kBatch sequences of kContext + 1 tokens counting up by kStride from a random start; the same on
// every rank (each takes its rows).
at::Tensor sequences(int step) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  const at::Tensor start = at::randint(kVocab, {kBatch, 1}, gen, torch::TensorOptions().dtype(torch::kLong));
  return (start + torch::arange(kContext + 1, torch::TensorOptions().dtype(torch::kLong)) * kStride).remainder(kVocab);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: " << argv[0] << " <rank> <world_size> <nvme_dir> [host] [port] [steps]\n";
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int world = std::atoi(argv[2]);
  const std::string nvme = argv[3];
  const std::string host = argc > 4 ? argv[4] : "127.0.0.1";
  const int port = argc > 5 ? std::atoi(argv[5]) : 29514;
  const int steps = argc > 6 ? std::atoi(argv[6]) : 40;
  if (world < 1 || rank < 0 || rank >= world || kBatch % world != 0 || steps < 2) {
    std::cerr << "error: need 0 <= rank < world_size, world_size dividing " << kBatch << " and steps >= 2\n";
    return 2;
  }
  torch::set_num_threads(1);
  std::filesystem::create_directories(nvme);  // the engine makes its private directory inside

  c10d::TCPStoreOptions storeOptions;
  storeOptions.port = static_cast<uint16_t>(port);
  storeOptions.isServer = rank == 0;
  storeOptions.numWorkers = world;
  auto store = c10::make_intrusive<c10d::TCPStore>(host, storeOptions);
  zeroplus::pg::BackendConfig config;
  config.timeout = std::chrono::seconds(60);
  auto pg = zeroplus::pg::makeProcessGroup(store, rank, world, config);

  torch::manual_seed(0);
  Gpt model;
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  // Collective: rank 0's weights everywhere, the blocks sharded, parameters cast to bf16.
  auto opt = zeroplus::zero::initialize(model, pg,
                                        zeroplus::zero::Options()
                                            .stage(3)
                                            // the norms and biases stay whole (the default, DeepSpeed's
                                            // 100000 elements, would keep every weight of so small a
                                            // model whole too)
                                            .param_persistence_threshold(4 * kDim)
                                            .mixed_precision("bf16")
                                            .offload_optimizer("nvme")
                                            .nvme_path(nvme),
                                        zeroplus::optim::ZeroAdamWOptions(1e-2).weight_decay(0.01));

  const int64_t rows = kBatch / world;
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    const at::Tensor mine = sequences(step).narrow(0, rank * rows, rows);
    const at::Tensor ids = mine.narrow(1, 0, kContext), next = mine.narrow(1, 1, kContext);
    opt->zero_grad();
    const at::Tensor logits = model->forward(ids);
    const at::Tensor loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat).reshape({-1, kVocab}),
                                                                 next.reshape(-1));
    opt->backward(loss);
    opt->clip_grad_norm(1.0);  // the global norm across every rank's shard
    opt->step();
    std::vector<at::Tensor> global{loss.detach().clone()};
    pg->allreduce(global)->wait();
    const double mean = global[0].item<double>() / world;
    if (step == 0) first = mean;
    last = mean;
    if (rank == 0 && (step % 10 == 0 || step == steps - 1)) {
      std::cout << "step " << step << " loss " << mean << std::endl;
    }
  }
  const auto full = zeroplus::zero::full_state_dict(model, *opt);  // gathers the blocks (collective)
  if (rank == 0) {
    std::cout << "rank " << rank << "/" << world << ", ZeRO stage 3, bf16, optimizer state on NVMe under " << nvme
              << ": " << steps << " steps, loss " << first << " -> " << last << ", owns " << opt->owned_numel()
              << " of " << numel << " elements' optimizer state, full_state_dict: " << full.size() << " tensors"
              << std::endl;
  }
  pg->barrier()->wait();
  pg->shutdown();
  if (!(last < 0.5 * first)) {
    std::cerr << "error: rank " << rank << ": the loss did not fall to half (" << first << " -> " << last << ")\n";
    return 1;
  }
  return 0;
}
