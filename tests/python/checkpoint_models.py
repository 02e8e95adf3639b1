"""The small model and training helpers of the checkpoint tests (tied weights, a frozen parameter,
a persistent buffer: every kind of entry a checkpoint holds)."""

from __future__ import annotations

import resource
import signal

import torch
from torch import nn

VOCAB = 16


class CkptNet(nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.lin1 = nn.Linear(8, width)
        self.lin2 = nn.Linear(width, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, two state_dict keys
        self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x):
        h = self.emb(x) + self.frozen
        h = self.lin2(nn.functional.gelu(self.lin1(h))) * self.scale
        return self.head(h)


def make(seed: int, width: int = 24) -> CkptNet:
    torch.manual_seed(seed)
    return CkptNet(width)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (4, 5), generator=g)


def loss_of(model, x):
    out = model(x)
    return nn.functional.cross_entropy(out.float().reshape(-1, VOCAB), x.reshape(-1))


def build(kind, stage, precision, group, seed, lr=1e-2, width=24, model=None, persist=None):
    """kind "engine": zeroplus.initialize(stage); "zro": DDP + zeroplus.ZeroRedundancyOptimizer.
    persist (stage 3): stage3_param_persistence_threshold, the largest parameter kept whole on
    every rank. The default (1e5 elements) keeps every parameter of CkptNet whole, so a stage-3
    test that means to save or load sharded parameters passes 0 (all sharded, the frozen one
    too) or PERSIST_SOME (both kinds of bucket), and checks it with sharded_names().
    Returns (module to checkpoint, module to call, optimizer)."""
    import zeroplus

    model = make(seed, width) if model is None else model
    if kind == "zro":
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        opt = zeroplus.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                               process_group=group, lr=lr, weight_decay=0.1)
        return model, ddp, opt
    config = None
    if persist is not None and stage == 3:
        config = {"zero_optimization": {"stage3_param_persistence_threshold": persist}}
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, lr=lr, weight_decay=0.1,
                                     mixed_precision=precision, process_group=group, config=config)
    return model, model, opt


# stage3_param_persistence_threshold that keeps CkptNet's 8-element parameters (lin2.bias and the
# frozen one) whole and shards the others
PERSIST_SOME = 8


def sharded_names(model, opt) -> list[str]:
    """The parameters in a stage-3 engine's non-persistent buckets (what a checkpoint saves and
    loads as shards, also at world size 1), sorted; [] for other optimizers. Whether a rank really
    holds only a piece is sharding.assert_sharded's question."""
    from sharding import nonpersistent_names

    return nonpersistent_names(model, opt)


def train(call, opt, steps, rank, first_step=0):
    for step in range(first_step, first_step + steps):
        loss = loss_of(call, batch(step, rank))
        if hasattr(opt, "backward"):
            opt.backward(loss)  # the engines: scaled by the loss scale under fp16
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()


def full_params(kind, model):
    import zeroplus

    if kind == "zro":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return zeroplus.full_state_dict(model, rank0_only=False)


def consolidated_optimizer(opt, rank):
    opt.consolidate_state_dict(to=0)
    return opt.state_dict() if rank == 0 else None


def fsize_limited(fn, limit: int):
    """fn() with RLIMIT_FSIZE at `limit` bytes (writes past it fail with EFBIG, as a full disk
    fails with ENOSPC) and SIGXFSZ ignored, both restored after."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed rank
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        return fn()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
