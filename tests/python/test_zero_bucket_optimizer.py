"""BucketOptimizer (zeroplus/zero/bucket_optimizer.py) on one process, for both ranks' shards of a
2-rank layout: each parameter piece of the shard is its own segment with its own state, a
parameter that is not stepped keeps its values and gets no state, the update equals torch's on
the same pieces, and hyperparameters come from the user's group at every step."""

from __future__ import annotations

import pytest
import torch

import zeroplus  # noqa: F401  (loads the library: the bucket planner is a C++ op)
from zeroplus.zero.bucket_optimizer import BucketOptimizer
from zeroplus.zero.layout import plan_buckets

HYPER = {"lr": 0.1, "weight_decay": 0.1}


def _layout():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (20, 7, 13)]
    (bucket,) = plan_buckets([params], 2, 1 << 20, lambda p: p.dtype)
    flat = torch.zeros(bucket.numel)
    for e in bucket.entries:
        flat[e.offset:e.offset + e.numel].copy_(e.param.detach().reshape(-1))
    return params, bucket, flat


@pytest.mark.parametrize("rank", [0, 1])
def test_segments_step_like_torch_and_an_unstepped_parameter_is_untouched(rank):
    params, bucket, flat = _layout()
    lo, hi = bucket.shard_range(rank)
    master = flat[lo:hi].clone()
    bo = BucketOptimizer(bucket, master, rank, torch.optim.AdamW, HYPER)
    pieces = bucket.owned_pieces(rank)
    assert [s.entry for s in bo.segments] == [e for e, _, _ in pieces] and len(bo.segments) >= 1
    # Reference: torch AdamW over the same pieces, one parameter each.
    ref = [torch.nn.Parameter(master[a:b].clone()) for _, a, b in pieces]
    ref_opt = torch.optim.AdamW(ref, **HYPER)
    skip = bo.segments[0].entry  # the first piece's parameter gets no gradient
    stepped = [i != skip for i in range(len(bucket.entries))]
    grad_shard = torch.randn(hi - lo)
    for _ in range(3):
        bo.fetch()
        bo.step(grad_shard, stepped, 0, 1.0, HYPER)
        bo.store()
        for r, (e, a, b) in zip(ref, pieces):
            r.grad = None if e == skip else grad_shard[a:b].clone()
        ref_opt.step()
    for s, r in zip(bo.segments, ref):
        torch.testing.assert_close(s.master, r.detach(), rtol=0, atol=0)
        assert s.master.grad is None  # the gradient views do not outlive the step
    assert bo.segment_state(bo.segments[0]) == {}  # never stepped: no state, as in torch
    steps = [float(bo.segment_state(s)["step"]) for s in bo.segments[1:]]
    assert steps == [3.0] * len(steps)


def test_hyperparameters_are_read_from_the_users_group_each_step():
    params, bucket, flat = _layout()
    lo, hi = bucket.shard_range(0)
    master = flat[lo:hi].clone()
    bo = BucketOptimizer(bucket, master, 0, torch.optim.SGD, {"lr": 0.1})
    before = master.clone()
    grad = torch.ones(hi - lo)
    bo.step(grad, [True] * len(bucket.entries), 0, 1.0, {"lr": 0.0})  # an LR scheduler set lr to 0
    assert torch.equal(master, before)
    bo.step(grad, [True] * len(bucket.entries), 0, 0.5, {"lr": 1.0})  # inv_scale unscales the gradient
    owned = torch.zeros_like(master, dtype=torch.bool)
    for s in bo.segments:
        owned[s.lo:s.hi] = True
    torch.testing.assert_close(master[owned], before[owned] - 0.5, rtol=0, atol=0)
    assert torch.equal(master[~owned], before[~owned])  # padding and gaps are never written


def test_a_shard_without_pieces_has_no_inner_optimizer():
    param = torch.nn.Parameter(torch.randn(3))
    (bucket,) = plan_buckets([[param]], 2, 1 << 20, lambda p: p.dtype)
    empty_rank = next(r for r in (0, 1) if not bucket.owned_pieces(r))
    lo, hi = bucket.shard_range(empty_rank)
    bo = BucketOptimizer(bucket, torch.zeros(hi - lo), empty_rank, torch.optim.AdamW, HYPER)
    assert bo.inner is None and bo.state_tensors() == []
    bo.step(torch.zeros(hi - lo), [True], 0, 1.0, HYPER)  # nothing to do, nothing raised
