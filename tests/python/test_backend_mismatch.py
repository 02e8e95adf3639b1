"""Mismatched collectives across ranks (issue 12, defect 2): every rank raises DistBackendError at
the mismatched call, naming what differs and both ranks' values, on the shared-memory path (the
default on one host, fused or not) and on TCP. Before the fix, 1000 vs 2000 floats on shared
memory reduced only the first 1000 and both ranks carried on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed

SHM = {}  # the defaults: shared memory, fusion, inline sync
TCP = {"ZEROPLUS_SHM": "off"}


def _mismatched(rank, world, spec, async_op):
    kind, a, b = spec
    mine = a if rank == 0 else b
    if kind == "numel":
        t, op = torch.ones(mine), dist.ReduceOp.SUM
    elif kind == "dtype":
        t, op = torch.ones(64, dtype=mine), dist.ReduceOp.SUM
    else:
        t, op = torch.ones(64), mine
    before = t.clone()
    try:
        work = dist.all_reduce(t, op=op, async_op=async_op)
        if async_op:
            work.wait()
    except dist.DistBackendError as e:
        return str(e), torch.equal(t, before)
    return None, torch.equal(t, before)


CASES = [
    (("numel", 1000, 2000), ["1000 elements", "2000 elements"]),
    (("numel", 1 << 20, 1 << 19), ["1048576 elements", "524288 elements"]),
    (("dtype", torch.float32, torch.float64), ["dtype differs", "float32", "float64"]),
    (("op", dist.ReduceOp.SUM, dist.ReduceOp.MAX), ["reduce op differs", "sum", "max"]),
]


@pytest.mark.parametrize("env", [SHM, TCP], ids=["shm", "tcp"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("spec,names", CASES, ids=["small", "large", "dtype", "op"])
def test_allreduce_mismatch_raises_on_every_rank(env, async_op, spec, names):
    results = run_distributed(_mismatched, 2, spec, async_op, env=env, timeout=90, pg_timeout=30)
    for rank, (message, untouched) in enumerate(results):
        assert message is not None, f"rank {rank} did not raise"
        assert "collective mismatch" in message and "reset" not in message, message
        for name in names:
            assert name in message, (name, message)
        assert untouched, f"rank {rank}: the tensor was modified by a failed all_reduce"


def _alltoall_bad_self_split(rank, world):
    # Issue 29 item 3: rank 1's own splits disagree (it sends itself 2 floats but expects 8);
    # rank 0's are fine. Every rank must fail at this call naming the cause.
    out_split, in_split = ([5, 5], [5, 5]) if rank == 0 else ([2, 8], [8, 2])
    out, inp = torch.zeros(10), torch.arange(10, dtype=torch.float32)
    try:
        dist.all_to_all_single(out, inp, out_split, in_split)
    except dist.DistBackendError as e:
        return str(e), torch.equal(out, torch.zeros(10))
    return None, torch.equal(out, torch.zeros(10))


@pytest.mark.parametrize("env", [SHM, TCP], ids=["shm", "tcp"])
def test_alltoall_with_a_rank_s_own_splits_inconsistent_fails_on_every_rank_naming_it(env):
    (m0, untouched0), (m1, untouched1) = run_distributed(_alltoall_bad_self_split, 2, env=env, timeout=90,
                                                         pg_timeout=30)
    assert m1 is not None and "sends 8 bytes to itself but expects 32" in m1, m1
    assert m0 is not None and "reset" not in m0 and "lost peer" not in m0, m0
    assert "rank 1 called alltoallv with inconsistent arguments of its own" in m0, m0
    assert "sends 8 bytes to itself but expects 32" in m0, m0
    assert untouched0 and untouched1
