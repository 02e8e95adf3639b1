"""Small models and data shared by the ZeRO stage tests and benchmarks (no downloads)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn


class TiedGPT(nn.Module):
    """A tiny decoder with the token embedding tied to the LM head (GPT-2 style), so tied
    parameters are exercised by every stage test."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, context: int = 16,
                 checkpoint: bool = False):
        super().__init__()
        self.checkpoint = checkpoint  # non-reentrant activation checkpointing of every block
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        # bias=False: attention's key bias has a mathematically zero gradient (softmax is shift
        # invariant); its rounding noise, normalised by Adam to +-lr steps, would make any two
        # correct implementations diverge on those elements.
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True,
                                           bias=False)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's init: a sane first loss (~log vocab)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        mask = self.causal_mask[:n, :n]
        if self.checkpoint:
            for layer in self.blocks.layers:
                x = torch.utils.checkpoint.checkpoint(layer, x, mask, None, True, use_reentrant=False)
        else:
            x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))


def make_model(seed: int = 0, **kw) -> TiedGPT:
    torch.manual_seed(seed)
    return TiedGPT(**kw)


def batch(step: int, rank: int, size: int = 4, context: int = 16, vocab: int = 64):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 5, (size, 1), generator=g)
    seq = (start + stride * torch.arange(context + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]


def loss_fn(model, tokens, targets):
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class ReuseAndBranch(nn.Module):
    """A block applied twice in one forward (parameters used twice) and a branch taken on odd
    steps only (the unit order changes between steps), plus a frozen projection."""

    def __init__(self, dim: int = 24, vocab: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                     for _ in range(3)])
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(dim, vocab)
        self.branch = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.layers[0](x)
        x = x + self.layers[0](x)          # the same block again
        if self.branch:
            x = x + self.layers[2](x)      # skipped on even steps
        x = x + self.layers[1](x)
        return self.head(self.frozen(x))


def make_reuse_model(seed: int = 0) -> ReuseAndBranch:
    torch.manual_seed(seed)
    return ReuseAndBranch()


class _InitBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        nn.init.xavier_uniform_(self.qkv.weight)   # nn.init on its own weight inside __init__
        self.gate = nn.Parameter(torch.randn(dim) * 0.1)  # a value given at creation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.gate * self.proj(a)
        return x + self.mlp(x)


class InitGPT(nn.Module):
    """A GPT written the way nanoGPT and Hugging Face models initialise: every module's default
    reset_parameters, nn.init inside a child's __init__, `self.apply(self._init_weights)` at the end
    of the top-level __init__ (with `.data.normal_` and a write through a view of a weight), a
    scaled re-init of the projections over named_parameters(), and the LM head tied to the
    embedding. The init_context tests build it with and without the context."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, context: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList([_InitBlock(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.embed.weight = self.head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * layers) ** 0.5)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.weight.data[0].zero_()  # a padding row, written through a view

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TensorCensus:
    """Bytes of the CPU tensor storages created since this census began, counted over every tensor
    Python's collector can reach: a measurement of what a rank holds that does not go through the
    engine's own accounting (memory_report). The tensors alive at the start are held until the
    census is dropped, so no new storage can reuse one of their addresses."""

    def __init__(self):
        self._before = self._live()

    @staticmethod
    def _live() -> dict[int, torch.Tensor]:
        import gc

        gc.collect()
        out = {}
        tensor = torch.Tensor
        for o in gc.get_objects():
            # type(), not isinstance(): the latter reads __class__, which some lazy modules compute.
            # Wrapper subclasses (ShardedGrad: p.grad at stages 2-3) own no storage; the tensor they
            # wrap is a view of an engine buffer, counted through that buffer.
            if issubclass(type(o), tensor) and o.device.type == "cpu" and not o.is_meta:
                try:
                    s = o.untyped_storage()
                    s.data_ptr()
                except RuntimeError:  # a storage-less wrapper (torch raises on its data pointer)
                    continue
                if s.nbytes():
                    out[s.data_ptr()] = o
        return out

    def new_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for ptr, t in self._live().items() if ptr not in self._before)


def held_bytes(model, report) -> int:
    """What memory_report says this rank holds in tensors: model state, pooled and in-flight
    buffers, parameters gathered right now, and the model's buffers (not model state)."""
    buffers = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()}
    return (report["model_state"] + report["pooled_buffers"] + report["communication_buffers"]
            + report.get("gathered_parameters", 0) + sum(buffers.values()))


# -- parity: parameters against a reference, relative to how far the reference moved -------------

def params_of(model) -> dict[str, torch.Tensor]:
    """A model's parameters by name (a DDP wrapper's: model.module), fp32 copies."""
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def full_masters(model, opt) -> dict[str, torch.Tensor]:
    """The engine's fp32 master parameters, full, by `model`'s parameter names (on every rank: a
    collective). With mixed precision the model's own parameters are rounded to bf16/fp16, which
    alone differs from an fp32 reference by about as much as a few steps move it; the masters are
    what the optimizer computed."""
    import torch.distributed as dist

    from sharding import engine_of

    engine = engine_of(opt)
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for b, master in zip(engine.buckets, engine.masters):
        full = torch.empty(b.numel, dtype=torch.float32, device=master.device)
        dist.all_gather_into_tensor(full, master.detach().float().contiguous(), group=engine.process_group)
        for e in b.entries:
            out[name_of[id(e.param)]] = full[e.offset:e.offset + e.numel].view(e.shape).cpu().clone()
    return out


def parity(ours: dict, ref: dict, start: dict) -> tuple[float, float]:
    """(how far `ours` is from `ref`, how far `ref` moved from `start`): L2 norms over every
    parameter of `ref` (fp32). A parity test asserts distance <= rel * moved with rel < 1, so that
    an engine that did not step (distance == moved) or stepped the wrong way fails."""
    dist2 = moved2 = 0.0
    for k, v in ref.items():
        dist2 += (ours[k].float() - v.float()).pow(2).sum().item()
        moved2 += (v.float() - start[k].float()).pow(2).sum().item()
    return dist2 ** 0.5, moved2 ** 0.5


def assert_parity(ours: dict, ref: dict, start: dict, rel: float, what="") -> float:
    """distance(ours, ref) <= rel * (how far ref moved), and ref moved (more than that tolerance,
    and measurably in fp32); returns distance / moved."""
    distance, moved = parity(ours, ref, start)
    assert moved > 1e-4, f"{what}: the reference moved {moved:.3g}: the comparison cannot fail"
    assert distance <= rel * moved, f"{what}: {distance:.4g} from the reference, which moved {moved:.4g} (rel {rel})"
    return distance / moved
