"""Optimizer state of the ZeRO engines with per-parameter step counts (state.py, format version 2).

After steps in which some parameters got no gradient, each parameter's state is its own: the
sharded state dict round-trips, the consolidated one equals what torch.optim.AdamW holds for the
same training (a never-used parameter has no state, a sometimes-used one its own step count), and
a version-1 shard (one flat state per bucket, written before per-parameter step counts) still loads.
One 2-rank launch runs every case; a group per case keeps a failing case from breaking the next.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from harness import run_cases_in_own_groups, run_distributed
from sharding import assert_sharded
from test_zero_unused_params import BranchModel, _batch

LR, WD = 1e-3, 0.1


def _train(model, opt, steps, rank, branch_on=lambda step: step % 2 == 1):
    for step in range(steps):
        model.use_branch = branch_on(step)
        x, y = _batch(step, rank)
        opt.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()


def _engine(group, stage, bucket=None):
    """Stage 3 shards every parameter (asserted on this rank): BranchModel's are far below the
    default persistence threshold, which would keep them all whole."""
    import zeroplus

    torch.manual_seed(0)
    model = BranchModel()
    zero = {"reduce_bucket_size": bucket} if bucket else {}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, lr=LR, weight_decay=WD,
                                     process_group=group, config={"zero_optimization": zero} if zero else None)
    if stage == 3:
        assert_sharded(model, opt)
    return model, opt


def _inner_states(opt):
    return [{k: v.clone() for k, v in bo.segment_state(s).items()} for bo in opt.bucket_optimizers for s in bo.segments]


def _states_equal(a, b) -> bool:
    return len(a) == len(b) and all(sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
                                    for sa, sb in zip(a, b))


def _sharded_round_trip(rank, group, stage):
    model, opt = _engine(group, stage)
    _train(model, opt, 3, rank)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["zeroplus"]["version"] == 2
    model2, opt2 = _engine(group, stage)
    opt2.load_state_dict(saved)
    same_state = _states_equal(_inner_states(opt), _inner_states(opt2))
    import zeroplus
    model2.load_state_dict(zeroplus.full_state_dict(model, rank0_only=False) if stage == 3 else model.state_dict())
    _train(model, opt, 2, rank, branch_on=lambda s: True)
    _train(model2, opt2, 2, rank, branch_on=lambda s: True)
    a = zeroplus.full_state_dict(model, rank0_only=False) if stage == 3 else model.state_dict()
    b = zeroplus.full_state_dict(model2, rank0_only=False) if stage == 3 else model2.state_dict()
    return same_state, max((a[k] - b[k]).abs().max().item() for k in a)


def _consolidated_is_torch(rank, group, stage):
    """The consolidated dict equals torch.optim.AdamW's after the same (single-process,
    full-batch) training, and loads back into a fresh engine to continue identically."""
    model, opt = _engine(group, stage)
    torch.manual_seed(0)
    ref = BranchModel()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for step in range(3):
        ref.use_branch = step % 2 == 1
        xs, ys = zip(*(_batch(step, r) for r in range(2)))
        # The mean over both ranks' batches is what DDP's averaged gradient is.
        sum(nn.functional.mse_loss(ref(x), y) for x, y in zip(xs, ys)).div(2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _train(model, opt, 3, rank)
    opt.consolidate_state_dict(0)
    full = opt.state_dict() if rank == 0 else None
    mismatch = []
    if rank == 0:
        theirs = ref_opt.state_dict()["state"]
        if sorted(full["state"]) != sorted(theirs):
            mismatch.append(f"parameters with state: ours {sorted(full['state'])}, torch {sorted(theirs)}")
        for i in theirs:
            for key, value in theirs[i].items():
                ours = full["state"].get(i, {}).get(key)
                if ours is None or ours.shape != value.shape or (ours - value).abs().max().item() > 1e-6:
                    mismatch.append(f"state[{i}][{key!r}]")
    return mismatch


def _v1_loads(rank, group, stage):
    """A version-1 shard (every parameter used every step, one flat state per bucket) built from
    this engine's state loads into a fresh engine as the same per-segment state."""
    from zeroplus.zero import state as state_mod

    model, opt = _engine(group, stage, bucket=400)
    _train(model, opt, 3, rank, branch_on=lambda s: True)
    model.never.weight.data  # noqa: B018 - `never` is never used: no state, v1 zero-filled it
    v2 = opt.state_dict()
    order = state_mod._inner_order(opt)
    bucket_order = [b for gi in range(len(opt.param_groups)) for b, bk in enumerate(opt.buckets) if bk.group == gi]
    flat = {}
    for i, b in enumerate(bucket_order):
        n = opt.buckets[b].shard_numel
        st = {"step": None, "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
        for j, (bj, seg) in enumerate(order):
            if bj == b and j in v2["state"]:
                st["step"] = v2["state"][j]["step"].clone()
                st["exp_avg"][seg.lo:seg.hi] = v2["state"][j]["exp_avg"]
                st["exp_avg_sq"][seg.lo:seg.hi] = v2["state"][j]["exp_avg_sq"]
        if st["step"] is not None:
            flat[i] = st
    v1 = {"state": flat, "param_groups": v2["param_groups"],
          "zeroplus": {**v2["zeroplus"], "version": 1}}
    _m2, opt2 = _engine(group, stage, bucket=400)
    opt2.load_state_dict(v1)
    ours, loaded = _inner_states(opt), _inner_states(opt2)
    # v1 had no per-parameter "no state": `never` comes back with zero moments at the shared step.
    never = {id(p) for p in (model.never.weight, model.never.bias)}
    keep = [k for k, (b, seg) in enumerate(order) if id(opt.buckets[b].entries[seg.entry].param) not in never]
    return len(opt.buckets) > 1 and _states_equal([ours[k] for k in keep], [loaded[k] for k in keep])


CASES = {f"{fn.__name__[1:]}-stage{stage}": (fn, stage)
         for fn in (_sharded_round_trip, _consolidated_is_torch, _v1_loads) for stage in (1, 2, 3)}


def _all_cases(rank: int, world: int) -> dict:
    return run_cases_in_own_groups(rank, world, {name: functools.partial(fn, stage=stage)
                                                 for name, (fn, stage) in CASES.items()})


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_cases, 2, timeout=300)


def _value(results, name):
    for r, res in enumerate(results):
        assert res[name][0] == "ok", f"rank {r}:\n{res[name][1]}"
    return [res[name][1] for res in results]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_state_round_trips_with_per_parameter_steps(results, stage):
    for same_state, diff in _value(results, f"sharded_round_trip-stage{stage}"):
        assert same_state
        assert diff == 0.0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_consolidated_state_is_torch_adamw_state(results, stage):
    assert _value(results, f"consolidated_is_torch-stage{stage}")[0] == []


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_version_1_shards_still_load(results, stage):
    assert all(_value(results, f"v1_loads-stage{stage}"))
