"""The first backend slice on CPU: broadcast, allreduce, allgather, barrier against the stock
gloo backend as oracle, Work/future behaviour, and argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_pooled

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]


def _inputs(rank, dtype, numel):
    g = torch.Generator().manual_seed(17 + rank)
    if dtype.is_floating_point:
        return (torch.rand(numel, generator=g) * 2 + 0.5).to(dtype)
    return torch.randint(1, 4, (numel,), generator=g).to(dtype)


def _collectives(rank, world_size, numel):
    """Runs the slice's collectives on zeroplus and on a gloo group over the same ranks."""
    gloo = dist.new_group(backend="gloo")
    out = {}
    for dtype in DTYPES:
        for op in OPS:
            if op == "AVG" and not dtype.is_floating_point:
                continue
            mine, ref = _inputs(rank, dtype, numel), _inputs(rank, dtype, numel)
            dist.all_reduce(mine, op=getattr(dist.ReduceOp, op))
            dist.all_reduce(ref, op=getattr(dist.ReduceOp, op), group=gloo)
            out[("allreduce", str(dtype), op)] = (mine, ref)
        for root in range(world_size):
            mine, ref = _inputs(rank, dtype, numel), _inputs(rank, dtype, numel)
            dist.broadcast(mine, src=root)
            dist.broadcast(ref, src=root, group=gloo)
            out[("broadcast", str(dtype), root)] = (mine, ref)
        x = _inputs(rank, dtype, numel)
        mine = [torch.empty_like(x) for _ in range(world_size)]
        ref = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(mine, x)
        dist.all_gather(ref, x, group=gloo)
        out[("allgather", str(dtype))] = (torch.stack(mine), torch.stack(ref))
        flat = torch.empty(world_size * numel, dtype=dtype)
        dist.all_gather_into_tensor(flat, x)
        out[("all_gather_into_tensor", str(dtype))] = (flat, torch.cat(ref))
    dist.barrier()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("numel", [0, 1, 1001])
def test_collectives_match_gloo(world_size, numel):
    results = run_pooled(_collectives, world_size, numel, timeout=180)
    for rank_out in results:
        for key, (mine, ref) in rank_out.items():
            assert mine.dtype == ref.dtype, key
            if key[0] == "allreduce" and mine.dtype in (torch.float16, torch.bfloat16) and key[2] in ("SUM", "AVG", "PRODUCT"):
                # Gloo reduces half types in a different association order.
                torch.testing.assert_close(mine, ref, rtol=2e-2, atol=1e-2, msg=str(key))
            elif key[0] == "allreduce" and mine.dtype.is_floating_point and key[2] in ("SUM", "AVG", "PRODUCT"):
                torch.testing.assert_close(mine, ref, msg=str(key))
            else:
                assert torch.equal(mine, ref), key
    # Every rank holds the bitwise-identical allreduce result.
    for key in results[0]:
        if key[0] == "allreduce":
            for other in results[1:]:
                assert torch.equal(results[0][key][0], other[key][0]), key


def _async_work_and_future(rank, world_size):
    t = torch.full((1000,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    work.wait()
    assert work.is_completed() and work.is_success()
    assert torch.equal(work.result()[0], t)
    assert torch.equal(fut.value()[0], t)
    return chained.wait()


def test_work_future_and_result():
    results = run_pooled(_async_work_and_future, 2)
    for r in results:
        assert torch.equal(r, torch.full((1000,), 2.0))


def _many_in_flight(rank, world_size):
    works, tensors = [], []
    for i in range(200):
        t = torch.full((17,), float(i + rank))
        tensors.append(t)
        works.append(dist.all_reduce(t, async_op=True))
    for w in works:
        w.wait()
    return torch.stack(tensors)


def test_many_ops_in_flight_complete_in_order():
    world = 3
    results = run_pooled(_many_in_flight, world)
    expected = torch.stack([torch.full((17,), float(world * i + sum(range(world)))) for i in range(200)])
    for r in results:
        assert torch.equal(r, expected)


def _argument_checks(rank, world_size):
    errors = {}

    def expect(name, fn, pattern):
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            import re

            assert re.search(pattern, str(e)), f"{name}: {e}"
            errors[name] = str(e).splitlines()[0]
            return
        raise AssertionError(f"{name}: no error raised")

    expect("broadcast root", lambda: dist.broadcast(torch.ones(2), src=5), r"root|rank")
    expect("bitwise on float", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND), "bitwise reduce op .* floating")
    expect("avg on int", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG), "AVG needs a floating")
    # Strided tensors are staged for most ops (as Gloo); the flat alltoall buffers must be contiguous.
    expect("non contiguous", lambda: dist.all_to_all_single(torch.empty(2, 2), torch.ones(2, 2).t()),
           "Tensors must be contiguous")
    expect("uint32 dtype", lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint32)), "unsupported dtype")
    expect("allgather list length", lambda: dist.all_gather([torch.empty(2)], torch.ones(2)), "invalid output tensor list")
    expect("allgather numel", lambda: dist.all_gather([torch.empty(3), torch.empty(3)], torch.ones(2)), "has 3 elements, expected 2")
    expect("allgather dtype", lambda: dist.all_gather([torch.empty(2, dtype=torch.int64)] * 2, torch.ones(2)), "dtype")
    expect("all_gather_into_tensor size", lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)), "expected world size")
    expect("premul on int", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist._make_nccl_premul_sum(2.0)),
           "PREMUL_SUM needs a floating")
    expect("sparse", lambda: dist.all_reduce(torch.ones(2).to_sparse(), op=dist.ReduceOp.MAX), "sparse|layout")
    expect("reduce root", lambda: dist.reduce(torch.ones(2), dst=7), r"root|rank")
    if rank == 1:  # a rank-local check: no communication happens, so rank 0 need not match it
        expect("gather list on non-root", lambda: dist.gather(torch.ones(2), [torch.empty(2)] * 2, dst=0),
               "gather_list must be empty|must NOT be specified")
    expect("gather list length", lambda: dist.gather(torch.ones(2), [torch.empty(2)] * 3, dst=rank), "expected one per rank|gather_list")
    expect("scatter list dtype", lambda: dist.scatter(torch.empty(2), [torch.ones(2, dtype=torch.int64)] * 2, src=rank),
           "dtype")
    expect("reduce_scatter input count", lambda: dist.reduce_scatter(torch.empty(2), [torch.ones(2)] * 3), "expected one per rank")
    expect("reduce_scatter_tensor size", lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(5)),
           "expected world size")
    expect("alltoall split sum", lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), [2, 2], [1, 2]),
           "split sizes sum to 3")
    expect("alltoall split count", lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), [2, 2], [4]),
           "split sizes have 1 entries")
    expect("alltoall rows", lambda: dist.all_to_all_single(torch.empty(3), torch.ones(3)), "not divisible by world size")
    expect("all_to_all list length", lambda: dist.all_to_all([torch.empty(1)] * 3, [torch.ones(1)] * 3),
           "one input and one output tensor per rank")
    expect("send to self", lambda: dist.send(torch.ones(2), dst=rank), "is this rank|same as the rank")
    expect("send peer range", lambda: dist.send(torch.ones(2), dst=9), r"rank|peer")
    expect("allreduce_coalesced dtype mix", lambda: dist.all_reduce_coalesced([torch.ones(2), torch.ones(2, dtype=torch.float64)]),
           r"tensors\[1\] has dtype|same dtype|dtype")
    dist.barrier()  # the group still works after rejected calls
    return errors


def test_bad_arguments_are_rejected_with_clear_errors():
    results = run_pooled(_argument_checks, 2)
    assert len(results[0]) >= 23, sorted(results[0])
    assert len(results[1]) >= 24, sorted(results[1])
