"""Models and helpers of the tensor-parallel tests (test_tensor_parallel*.py), importable by the ranks.

TinyGPT: a two-block causal transformer with Llama-style projection names (q/k/v/o, up/down) on
nn.Linear, a vocabulary of 64 and width 32: the smallest model that has every kind of parameter a
tensor-parallel plan touches (column- and row-parallel weights and biases, a vocabulary-parallel
embedding and LM head, replicated norms and position embeddings).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, SEQ = 64, 32, 4, 8


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.ln1 = nn.LayerNorm(d)
        # No q/k/v biases (Llama's choice): a key bias has a zero gradient in exact arithmetic, and
        # Adam turns the rounding noise of such a gradient into lr-sized steps of either sign.
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        y = self.ln1(x)
        # Shapes from the projections' outputs: under tensor parallelism each rank has its share of
        # the heads (-1), under sequence parallelism x holds only this rank's part of the sequence.
        q, k, v = (z.view(*z.shape[:2], -1, self.head_dim).transpose(1, 2)
                   for z in (self.q_proj(y), self.k_proj(y), self.v_proj(y)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        a = a.reshape(*a.shape[:2], -1)
        x = x + self.o_proj(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = WIDTH, heads: int = HEADS, layers: int = 2, seq: int = SEQ):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def manual_plan(model: TinyGPT) -> dict:
    """The tensor-parallel plan of TinyGPT written by hand (torch's styles)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.blocks)):
        for name in ("q_proj", "k_proj", "v_proj", "up"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("o_proj", "down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def mesh_2x2():
    """The 2 x 2 ("dp", "tp") mesh over the 4 ranks: dp groups {0, 2}, {1, 3}; tp groups {0, 1}, {2, 3}."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def run_cases(cases: dict) -> dict:
    """Every case of `cases` ({name: (fn, *args)}, fn(mesh, *args)) on this rank of a 2x2 mesh:
    {name: ("ok", result, seconds) or ("error", traceback, seconds)}, so one case's failure is
    reported by its own test and the others still run in the same launch."""
    import time
    import traceback

    mesh = mesh_2x2()
    out = {}
    for key, (fn, *args) in cases.items():
        start = time.monotonic()
        try:
            out[key] = ("ok", fn(mesh, *args), time.monotonic() - start)
        except Exception:  # noqa: BLE001 - reported per case
            out[key] = ("error", traceback.format_exc(), time.monotonic() - start)
    return out


def batches(steps: int, dp_size: int, per_rank: int = 2, seq: int = SEQ, vocab: int = VOCAB, seed: int = 1):
    """[step][dp rank] -> (inputs, targets): the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        out.append([])
        for _ in range(dp_size):
            ids = torch.randint(0, vocab, (per_rank, seq + 1), generator=g)
            out[-1].append((ids[:, :-1], ids[:, 1:]))
    return out


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def full(t):
    """A DTensor's global value (a collective over its mesh), or t."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def sequence_parallel_plan(model: TinyGPT) -> dict:
    """manual_plan with sequence parallelism (torch's SequenceParallel) on the norms: between blocks
    each tp rank holds its half of the sequence; the norms' weights are Replicate DTensors whose
    gradients arrive as Partial sums over the tp ranks (the engine redistributes them)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                           use_local_output=True),
            "ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.ln1"] = SequenceParallel()
        plan[f"blocks.{i}.ln2"] = SequenceParallel()
        for name in ("q_proj", "k_proj", "v_proj", "up"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel(input_layouts=Shard(1))
        for name in ("o_proj", "down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan
