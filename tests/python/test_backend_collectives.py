"""Every collective of the backend against the stock gloo backend (or, where gloo lacks an op
or dtype, against a direct computation), world sizes 1-4, sizes {0, 1, odd, large}."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_pooled

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
DTYPES = FLOATS + INTS + [torch.bool]
ARITH_OPS = ["SUM", "PRODUCT", "MIN", "MAX"]
BIT_OPS = ["BAND", "BOR", "BXOR"]


def _make(rank, dtype, numel, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + 17 * rank + numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(numel, generator=g) + 0.5).to(dtype)
    return torch.randint(1, 4, (numel,), generator=g).to(dtype)


def _reference_reduce(tensors, op):
    """Rank-order reduction in float64 (or int64/bool) for the ops gloo cannot check."""
    stack = torch.stack([t.double() if t.dtype.is_floating_point else t.long() for t in tensors])
    if op == "SUM":
        out = stack.sum(0)
    elif op == "PRODUCT":
        out = stack.prod(0)
    elif op == "MIN":
        out = stack.min(0).values
    elif op == "MAX":
        out = stack.max(0).values
    else:
        out = stack[0]
        for t in stack[1:]:
            out = {"BAND": out & t, "BOR": out | t, "BXOR": out ^ t}[op]
    return out.to(tensors[0].dtype)


def _ops_for(dtype):
    if dtype.is_floating_point:
        return ARITH_OPS + ["AVG"]
    return ARITH_OPS + BIT_OPS


def _run_all(rank, world, numel):
    """Returns {case: (zeroplus result, expected)} computed on this rank."""
    out = {}
    everyone = lambda dtype, salt=0: [_make(r, dtype, numel, salt) for r in range(world)]  # noqa: E731
    for dtype in DTYPES:
        for op in _ops_for(dtype):
            inputs = everyone(dtype)
            mine = inputs[rank].clone()
            dist.all_reduce(mine, op=getattr(dist.ReduceOp, op))
            if op == "AVG":
                expected = (_reference_reduce(inputs, "SUM").double() / world).to(dtype)
            elif dtype == torch.bool and op in ("SUM", "MAX"):
                expected = _reference_reduce(inputs, "BOR")
            elif dtype == torch.bool and op in ("PRODUCT", "MIN"):
                expected = _reference_reduce(inputs, "BAND")
            else:
                expected = _reference_reduce(inputs, op)
            out[("all_reduce", dtype, op)] = (mine, expected)

            root = world - 1
            mine = inputs[rank].clone()
            dist.reduce(mine, dst=root, op=getattr(dist.ReduceOp, op))
            out[("reduce", dtype, op)] = (mine, expected if rank == root else inputs[rank])

            chunks = [everyone(dtype, salt=5 + r) for r in range(world)]  # chunks[src][dst]
            mine_out = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter(mine_out, [chunks[rank][r][: numel].clone() for r in range(world)],
                                op=getattr(dist.ReduceOp, op))
            ref = [chunks[src][rank] for src in range(world)]
            exp = _reference_reduce(ref, "SUM" if op == "AVG" else op)
            if op == "AVG":
                exp = (exp.double() / world).to(dtype)
            elif dtype == torch.bool and op in ("SUM", "MAX"):
                exp = _reference_reduce(ref, "BOR")
            elif dtype == torch.bool and op in ("PRODUCT", "MIN"):
                exp = _reference_reduce(ref, "BAND")
            out[("reduce_scatter", dtype, op)] = (mine_out, exp)

            flat_in = torch.cat([chunks[rank][r] for r in range(world)])
            mine_out = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter_tensor(mine_out, flat_in, op=getattr(dist.ReduceOp, op))
            out[("reduce_scatter_tensor", dtype, op)] = (mine_out, exp)

        inputs = everyone(dtype, salt=2)
        for root in range(world):
            mine = inputs[rank].clone()
            dist.broadcast(mine, src=root)
            out[("broadcast", dtype, root)] = (mine, inputs[root])
        gathered = [torch.empty(numel, dtype=dtype) for _ in range(world)]
        dist.all_gather(gathered, inputs[rank])
        out[("all_gather", dtype)] = (torch.stack(gathered), torch.stack(inputs))
        flat = torch.empty(world * numel, dtype=dtype)
        dist.all_gather_into_tensor(flat, inputs[rank])
        out[("all_gather_into_tensor", dtype)] = (flat, torch.cat(inputs))
        root = 0
        glist = [torch.empty(numel, dtype=dtype) for _ in range(world)] if rank == root else None
        dist.gather(inputs[rank], gather_list=glist, dst=root)
        if rank == root:
            out[("gather", dtype)] = (torch.stack(glist), torch.stack(inputs))
        sources = everyone(dtype, salt=3)  # root scatters sources[r] to rank r
        recv = torch.empty(numel, dtype=dtype)
        dist.scatter(recv, scatter_list=sources if rank == root else None, src=root)
        out[("scatter", dtype)] = (recv, sources[rank])
        # all_to_all_single with uneven splits: rank s sends (s + d) % 3 rows to rank d.
        splits = lambda s: [(s + d) % 3 for d in range(world)]  # noqa: E731
        send = torch.cat([_make(rank * world + d, dtype, splits(rank)[d], 9) for d in range(world)])
        recv_splits = [splits(s)[rank] for s in range(world)]
        got = torch.empty(sum(recv_splits), dtype=dtype)
        dist.all_to_all_single(got, send, output_split_sizes=recv_splits, input_split_sizes=splits(rank))
        expected = torch.cat([_make(s * world + rank, dtype, splits(s)[rank], 9) for s in range(world)])
        out[("all_to_all_single", dtype)] = (got, expected)
        outs = [torch.empty(numel, dtype=dtype) for _ in range(world)]
        dist.all_to_all(outs, [_make(rank * world + d, dtype, numel, 11) for d in range(world)])
        out[("all_to_all", dtype)] = (torch.stack(outs), torch.stack([_make(s * world + rank, dtype, numel, 11) for s in range(world)]))
    return out


def _close(case, mine, expected, world):
    dtype = mine.dtype
    assert mine.dtype == expected.dtype, case
    op = case[2] if len(case) > 2 else None
    if dtype.is_floating_point and op in ("SUM", "AVG", "PRODUCT"):
        tol = {torch.float16: 3e-3 * world, torch.bfloat16: 2e-2 * world}.get(dtype, 1e-6)
        torch.testing.assert_close(mine.double(), expected.double(), rtol=tol, atol=tol, msg=str(case))
    else:
        assert torch.equal(mine, expected), case


def _run_and_check(rank, world, numel):
    """_run_all checked on the rank itself, so the results (GBs at 1M elements: every dtype x op,
    both sides) never cross a pipe: returns the number of checked cases per op and a digest of
    every allreduce result, for the bitwise comparison across ranks."""
    import hashlib

    per_op, digests = {}, {}
    for case, (mine, expected) in _run_all(rank, world, numel).items():
        _close(case, mine, expected, world)
        per_op[case[0]] = per_op.get(case[0], 0) + 1
        if case[0] == "all_reduce":
            digests[case] = hashlib.sha256(mine.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return per_op, digests


def check_every_collective(world_size, numel, **kwargs):
    """Runs _run_and_check on pooled ranks; asserts every rank checked its cases and holds the
    bitwise-identical allreduce results. Returns the per-op counts summed over ranks."""
    results = run_pooled(_run_and_check, world_size, numel, **kwargs)
    per_op: dict[str, int] = {}
    for counts, _ in results:
        for op, n in counts.items():
            per_op[op] = per_op.get(op, 0) + n
    assert sum(per_op.values()) > 100 * world_size
    for _, digests in results[1:]:
        assert digests == results[0][1], [c for c in digests if digests[c] != results[0][1].get(c)]
    return per_op


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_dtype_and_op(world_size):
    sizes = [0, 1, 1001] if world_size != 2 else [0, 1, 1001, 1 << 20]
    per_op: dict[str, int] = {}
    for numel in sizes:
        for op, n in check_every_collective(world_size, numel, timeout=240).items():
            per_op[op] = per_op.get(op, 0) + n
    print(f"world size {world_size}, sizes {sizes}: checked (op: rank-results) {per_op}")


def _premul_and_p2p(rank, world):
    out = {}
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    out["premul_scalar"] = (t, torch.full((5,), 0.5 * sum(range(1, world + 1))))
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([2.0])))
    out["premul_tensor"] = (t, torch.full((5,), 2.0 * sum(range(1, world + 1))))
    # ring of send/recv with tags
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    payload = torch.arange(7, dtype=torch.int64) + 100 * rank
    got = torch.empty(7, dtype=torch.int64)
    if world > 1:
        reqs = [dist.isend(payload, nxt, tag=3), dist.irecv(got, prv, tag=3)]
        for r in reqs:
            r.wait()
        out["p2p"] = (got, torch.arange(7, dtype=torch.int64) + 100 * prv)
    # coalescing manager with all_reduce
    from torch.distributed.distributed_c10d import _coalescing_manager

    ts = [torch.full((3,), float(i + rank)) for i in range(4)]
    with _coalescing_manager(async_ops=True) as cm:
        for x in ts:
            dist.all_reduce(x)
    cm.wait()
    out["coalesced"] = (torch.stack(ts), torch.stack([torch.full((3,), float(world * i + sum(range(world)))) for i in range(4)]))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_premul_sum_p2p_and_coalescing(world_size):
    for out in run_pooled(_premul_and_p2p, world_size):
        for case, (mine, expected) in out.items():
            torch.testing.assert_close(mine, expected, msg=case)
