"""DDP over "zeroplus" must train bit-for-bit like DDP over stock "gloo"."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_pooled


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
    )


def _train(rank, group, steps):
    model = torch.nn.parallel.DistributedDataParallel(_model(), process_group=group, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 8, (16,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_both_backends(rank, world_size, steps):
    gloo = dist.new_group(backend="gloo")
    mine = _train(rank, None, steps)  # default group: zeroplus
    ref = _train(rank, gloo, steps)
    return mine, ref


def test_ddp_20_steps_equal_to_gloo():
    results = run_pooled(_ddp_both_backends, 2, 20, timeout=180)
    for mine, ref in results:
        assert len(mine) == len(ref)
        for a, b in zip(mine, ref):
            assert torch.equal(a, b), (a - b).abs().max()
    # and the ranks agree with each other
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
