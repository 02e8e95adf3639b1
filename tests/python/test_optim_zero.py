"""zeroplus.ZeroRedundancyOptimizer: the C++ partition equals torch's sorted-greedy policy, and
stage 1 with fused AdamW matches a plain torch.optim.AdamW (gloo, 2 ranks)."""

import random

import pytest
import torch

import zeroplus  # noqa: F401
from harness import run_pooled


def _torch_partition(group_numels, world_size):
    """torch's _partition_parameters, transcribed: (rank, flat index) in assignment order."""
    sizes, out, base = [0] * world_size, [], 0
    for numels in group_numels:
        for i in sorted(range(len(numels)), key=lambda k: numels[k], reverse=True):
            rank = sizes.index(min(sizes))
            out += [rank, base + i]
            sizes[rank] += numels[i]
        base += len(numels)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_partition_matches_torch_policy(world_size):
    rng = random.Random(world_size)
    for _ in range(50):
        groups = [[rng.choice([0, 1, 3, 7, 7, 64, 1000]) for _ in range(rng.randint(0, 9))]
                  for _ in range(rng.randint(1, 3))]
        flat = [n for g in groups for n in g]
        got = torch.ops.zeroplus.partition_params(flat, [len(g) for g in groups], world_size)
        assert got == _torch_partition(groups, world_size), groups


def test_partition_errors():
    with pytest.raises(RuntimeError, match="world_size must be >= 1"):
        torch.ops.zeroplus.partition_params([1], [1], 0)
    with pytest.raises(RuntimeError, match="group_sizes sum to 1 but numels has 2"):
        torch.ops.zeroplus.partition_params([1, 2], [1], 2)


def _zero_vs_torch(rank, world_size, bucket_view):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from zeroplus.optim import AdamW, ZeroRedundancyOptimizer

    torch.manual_seed(0)
    shapes = [(9,), (7, 3), (5,), (3,), (16, 4), (1,)]
    base = [torch.randn(s) for s in shapes]
    ours = [b.clone().requires_grad_() for b in base]
    theirs = [b.clone().requires_grad_() for b in base]
    plain = [b.clone().requires_grad_() for b in base]
    kw = dict(lr=1e-2, weight_decay=0.05)
    zo = ZeroRedundancyOptimizer(ours, torch.optim.AdamW, parameters_as_bucket_view=bucket_view, **kw)
    zt = TorchZero(theirs, torch.optim.AdamW, parameters_as_bucket_view=bucket_view, **kw)
    ref = torch.optim.AdamW(plain, **kw)
    assert isinstance(zo.optim, AdamW)
    io, it = {id(p): i for i, p in enumerate(ours)}, {id(p): i for i, p in enumerate(theirs)}
    same_partition = all(
        [io[id(p)] for p in go["params"]] == [it[id(p)] for p in gt["params"]]
        for ro, rt in zip(zo._partition_parameters(), zt._partition_parameters()) for go, gt in zip(ro, rt))
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(s, generator=g) for s in shapes]  # identical on all ranks ("averaged")
        for ps in (ours, theirs, plain):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        zo.step(), zt.step(), ref.step()
    err = max((a - b).abs().max().item() for a, b in zip(ours, plain))
    zo.consolidate_state_dict(to=0)
    loaded = True
    if rank == 0:
        fresh = torch.optim.AdamW([b.clone().requires_grad_() for b in base], **kw)
        fresh.load_state_dict(zo.state_dict())  # torch format
        loaded = len(fresh.state) == len(shapes)
    dist.barrier()
    return same_partition, err, loaded


@pytest.mark.parametrize("bucket_view", [False, True])
def test_stage1_fused_adamw_matches_plain_adamw(bucket_view):
    for same_partition, err, loaded in run_pooled(_zero_vs_torch, 2, bucket_view, backend="gloo"):
        assert same_partition
        assert err <= 1e-6
        assert loaded
