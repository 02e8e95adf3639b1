"""zeroplus.save_checkpoint / load_checkpoint across world sizes and stages (the reshard matrix).

Each case saves at world size N and stage s (a subgroup of a 4-rank pool) after 3 steps, then at
world size M and stage t:
  A: a fresh model (other seed, other lr) + load_checkpoint;
  B: the same fresh model given the same state in memory (full_state_dict + consolidated optimizer
     state, the plain torch.optim format) before/after zeroplus.initialize;
and checks that right after the load A's parameters equal the saved ones exactly, A's consolidated
optimizer state equals the saved one exactly (hyperparameters too: lr comes back), extra comes
back, and after 2 more steps at M, A equals B (exactly in fp32; to bf16 rounding in bf16, where B
starts from bf16 parameters while A has the saved fp32 masters).

Stage 3 really shards: its persistence threshold is 0 at even world sizes (every parameter
sharded, the frozen one too) and 8 elements at odd ones (the two 8-element parameters whole, the
rest sharded), and every stage-3 side asserts which parameters it holds sharded (the default
threshold, 1e5 elements, would keep every parameter of this model whole on every rank).

Sampled matrix: every stage pair (s, t) in {1,2,3}^2, directions 2->1, 1->2, 2->3, 3->1(via zro),
4->2, 3->4, 4->3, 2->4, 3->2, 2->2, plus bf16 twice, fp16 once (loss scaler state) and zeroplus.ZeroRedundancyOptimizer (torch's
stage-1 partition) on either side. All cases run in one launch of 4 ranks.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from checkpoint_models import PERSIST_SOME, build, consolidated_optimizer, full_params, make, sharded_names, train
from checkpoint_helpers import optimizer_state_diffs
from harness import run_pooled

# (N, save kind/stage, M, load kind/stage, precision)
CASES = [
    (2, 1, 1, 2, None),
    (1, 2, 2, 3, None),
    (2, 3, 3, 1, None),
    (4, 2, 2, 2, None),
    (3, 3, 4, 3, None),
    (2, 2, 2, 1, None),
    (4, 1, 3, 3, None),
    (1, 3, 2, 2, None),
    (3, 1, 2, 1, None),
    (2, 3, 4, 2, "bf16"),
    (2, 2, 1, 3, "bf16"),
    (2, 1, 3, 2, "fp16"),
    (2, "zro", 3, 2, None),
    (3, 3, 1, "zro", None),
    (2, "zro", 3, "zro", None),
]


def _split(stage):
    return ("zro", 1) if stage == "zro" else ("engine", stage)


def _persist(world: int) -> int:
    """Stage 3's persistence threshold at this world size: 0 (every parameter sharded, the frozen
    one too) at even world sizes, PERSIST_SOME (the 8-element ones whole) at odd ones, so
    sharded and whole buckets are both saved and both loaded. The default would keep all whole."""
    return 0 if world % 2 == 0 else PERSIST_SOME


def _sharded_expected(kind, stage, world) -> list[str]:
    if kind != "engine" or stage != 3:
        return []
    everything = ["emb.weight", "frozen", "lin1.bias", "lin1.weight", "lin2.bias", "lin2.weight"]
    return everything if _persist(world) == 0 else ["emb.weight", "lin1.bias", "lin1.weight", "lin2.weight"]


def _case_id(case) -> str:
    n, s, m, t, p = case
    return f"{n}x{s}->{m}x{t}" + (f"-{p}" if p else "")


def _run(rank, world, root, case):
    import torch.distributed as dist

    import zeroplus
    from zeroplus.checkpoint import CheckpointOptions

    n, s, m, t, precision = case
    (skind, sstage), (lkind, lstage) = _split(s), _split(t)
    save_group = dist.new_group(list(range(n)))
    load_group = dist.new_group(list(range(m)))
    path = os.path.join(root, _case_id(case))
    handover, sharded_save = [None], None
    if rank < n:
        model, call, opt = build(skind, sstage, precision, save_group, seed=0, persist=_persist(n))
        train(call, opt, 3, rank)
        sharded_save = sharded_names(model, opt)
        # 64-byte checksum blocks: reads span many blocks, chunk boundaries and runs (4 MiB in use)
        handle = zeroplus.save_checkpoint(os.path.join(path, "step3"), model, opt, extra={"step": 3, "tag": "x"},
                                          options=CheckpointOptions(block_bytes=64))
        assert handle.wait() == os.path.join(path, "step3")
        full = full_params(skind, model)
        plain = consolidated_optimizer(opt, rank)
        scaler = opt.scaler.state_dict() if precision == "fp16" else None  # fp16: the loss scale goes along
        if rank == 0:
            handover[0] = (full, plain, scaler)
    dist.broadcast_object_list(handover, src=0)
    full, plain, scaler = handover[0]
    out = {"sharded_save": sharded_save}
    if rank < m:
        model_a, call_a, opt_a = build(lkind, lstage, precision, load_group, seed=1, lr=1e-3, persist=_persist(m))
        out["sharded_load"] = sharded_names(model_a, opt_a)
        extra = zeroplus.load_checkpoint(path, model_a, opt_a)  # via `latest`
        out["extra"] = extra
        loaded = full_params(lkind, model_a)
        out["params_exact"] = sorted(k for k in full if not torch.equal(full[k], loaded[k].to(full[k].dtype)))
        loaded_opt = consolidated_optimizer(opt_a, rank)
        out["opt_diffs"] = optimizer_state_diffs(plain, loaded_opt) if rank == 0 else []
        fresh = make(1)
        fresh.load_state_dict({k: v.float() for k, v in full.items()})
        model_b, call_b, opt_b = build(lkind, lstage, precision, load_group, seed=1, lr=1e-3, model=fresh,
                                       persist=_persist(m))
        opt_b.load_state_dict(plain)
        if scaler is not None:
            opt_b.scaler.load_state_dict(scaler)
        train(call_a, opt_a, 2, rank, first_step=10)
        train(call_b, opt_b, 2, rank, first_step=10)
        pa, pb = full_params(lkind, model_a), full_params(lkind, model_b)
        tol = 0.0 if precision is None else 2e-2
        out["train_max_diff"] = max((pa[k].float() - pb[k].float()).abs().max().item() for k in pa)
        out["tol"] = tol
    dist.destroy_process_group(save_group)
    dist.destroy_process_group(load_group)
    return out


def _all(rank, world, root):
    import traceback

    res = {}
    for case in CASES:
        t0 = time.monotonic()
        try:
            res[_case_id(case)] = ("ok", _run(rank, world, root, case), time.monotonic() - t0)
        except Exception:  # noqa: BLE001 - reported per case
            res[_case_id(case)] = ("error", traceback.format_exc(), time.monotonic() - t0)
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    t0 = time.monotonic()
    out = run_pooled(_all, 4, root, timeout=600)
    print(f"\nreshard matrix: {len(CASES)} cases on 4 ranks in {time.monotonic() - t0:.1f} s")
    return out


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reshard(results, case):
    n, s, m, t, _p = case
    for rank in range(4):
        status, value, _secs = results[rank][_case_id(case)]
        assert status == "ok", f"rank {rank}:\n{value}"
        if rank < n:  # stage 3 saved (and below: loaded) sharded parameters, not only whole ones
            assert value["sharded_save"] == _sharded_expected(*_split(s), n), value["sharded_save"]
        if rank >= m:
            continue
        assert value["sharded_load"] == _sharded_expected(*_split(t), m), value["sharded_load"]
        assert value["extra"] == {"step": 3, "tag": "x"}
        assert value["params_exact"] == [], f"rank {rank}: loaded parameters differ from the saved ones"
        assert value["opt_diffs"] == [], f"rank {rank}: optimizer state differs: {value['opt_diffs'][:5]}"
        assert value["train_max_diff"] <= value["tol"], (
            f"rank {rank}: after 2 steps, load_checkpoint and the in-memory handover differ by "
            f"{value['train_max_diff']}")
