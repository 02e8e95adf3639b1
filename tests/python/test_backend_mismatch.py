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
