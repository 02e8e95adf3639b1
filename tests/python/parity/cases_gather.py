"""Parity cases: broadcast, allgather (list, into tensor, coalesced), gather, scatter,
all_to_all (single and list). Ported from test_c10d_gloo.py and distributed_test.py."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from parity import assert_equal, case, raises

STRESS = 200
DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool"]


def _dt(name):
    return getattr(torch, name)


def _filled(value, n, dtype):
    if dtype == torch.bool:
        return torch.full((n,), bool(value % 2), dtype=dtype)
    return torch.full((n,), value, dtype=dtype)


def _noncontig(t):
    # test_c10d_gloo: a column of a 2-D tensor, so the memory is not dense.
    return t.expand(2, 2).contiguous()[:, 0]


# ---- broadcast ---------------------------------------------------------------------------------

def _broadcast(ctx, dtype):
    for src in range(ctx.world_size):
        t = _filled(src + 1, src + 3, _dt(dtype)) if ctx.rank == src else _filled(0, src + 3, _dt(dtype))
        dist.broadcast(t, src)
        assert_equal(t, _filled(src + 1, src + 3, _dt(dtype)), f"src {src}")


for _dtype in DTYPES:
    case("broadcast", "tensor", _dtype)(partial(_broadcast, dtype=_dtype))
case("broadcast", "tensor", "int16", gloo=False)(partial(_broadcast, dtype="int16"))  # gloo: "Invalid scalar type"


@case("broadcast", "extreme values (distributed_test)", "float32,float64,int8,uint8,int32,int64")
def broadcast_values(ctx):
    for dtype, value in [(torch.float, -1e-10), (torch.double, -1e-100), (torch.int8, -2), (torch.uint8, 129),
                         (torch.int, -1e5), (torch.long, -1e15)]:
        for src in range(ctx.world_size):
            expected = torch.full((src + 1, src + 1), value, dtype=dtype)
            t = expected.clone() if ctx.rank == src else torch.full((src + 1, src + 1), -1, dtype=dtype)
            dist.broadcast(t, src)
            assert_equal(t, expected)


@case("broadcast", "complex", "complex64")
def broadcast_complex(ctx):
    t = torch.full((3,), complex(1, 2), dtype=torch.cfloat) if ctx.rank == 0 else torch.zeros(3, dtype=torch.cfloat)
    dist.broadcast(t, 0)
    assert_equal(t, torch.full((3,), complex(1, 2), dtype=torch.cfloat))


@case("broadcast", "async_op=True", "float32")
def broadcast_async(ctx):
    t = torch.full((5,), float(ctx.rank))
    dist.broadcast(t, ctx.world_size - 1, async_op=True).wait()
    assert_equal(t, torch.full((5,), float(ctx.world_size - 1)))


@case("broadcast", "inference_mode", "float32")
def broadcast_inference(ctx):
    with torch.inference_mode():
        t = torch.full((5,), float(ctx.rank))
        dist.broadcast(t, 0)
        dist.broadcast(t, 0, async_op=True).wait()
    assert_equal(t, torch.zeros(5))


@case("ProcessGroup.broadcast", "empty tensor", "float32")
def pg_broadcast_empty(ctx):
    xs = [torch.FloatTensor([])]
    fut = ctx.pg.broadcast(xs).get_future()
    fut.wait()
    assert fut.value()[0].numel() == 0


@case("ProcessGroup.broadcast", "root rank/tensor, 1 and 2 tensors per process", "int64,float32")
def pg_broadcast_basics(ctx):
    # test_c10d_gloo._test_broadcast_basics
    def broadcast(xs, root_rank, root_tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank = root_rank
        opts.rootTensor = root_tensor
        fut = ctx.pg.broadcast(xs, opts).get_future()
        fut.wait()
        return fut.value()

    for i in range(ctx.world_size):
        out = broadcast([torch.tensor([ctx.rank])], i, 0)
        assert_equal(out[0], torch.tensor([i]))
        num = 2
        for j in range(num):
            xs = [torch.tensor([ctx.rank * num + 0.0]), torch.tensor([ctx.rank * num + 1.0])]
            out = broadcast(xs, i, j)
            assert_equal(out[0], torch.tensor([i * num + j], dtype=torch.float32))
            assert_equal(out[1], torch.tensor([i * num + j], dtype=torch.float32))
            assert_equal(xs, out)
    fut = ctx.pg.broadcast(torch.tensor([ctx.rank + 1.0]), root=0).get_future()
    fut.wait()
    assert_equal(fut.value()[0], torch.tensor([1.0]))


@case("ProcessGroup.broadcast", "stress", "int64")
def pg_broadcast_stress(ctx):
    inputs = [torch.tensor([i * ctx.world_size + ctx.rank]) for i in range(STRESS)]
    works = [ctx.pg.broadcast(inputs[i], root=(i % ctx.world_size)) for i in range(STRESS)]
    for i, w in enumerate(works):
        w.wait()
        assert_equal(inputs[i], torch.tensor([i * ctx.world_size + i % ctx.world_size]), f"iteration {i}")


@case("ProcessGroup.broadcast", "checks", "-")
def pg_broadcast_checks(ctx):
    t1 = torch.zeros([1], dtype=torch.float32)
    t2 = torch.zeros([1], dtype=torch.float64)
    t3 = torch.zeros([2], dtype=torch.float32)
    for root, root_tensor, tensors in [(-1, 0, [t1]), (ctx.world_size, 0, [t1]), (ctx.rank, -1, [t1]),
                                       (ctx.rank, 1, [t1]), (ctx.rank, 0, []), (ctx.rank, 0, [t1, t2]),
                                       (ctx.rank, 0, [t1, t3])]:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = root_tensor
        raises(RuntimeError, ctx.pg.broadcast, tensors, opts)


@case("_broadcast_coalesced", "mixed dtypes", "float32,float64")
def broadcast_coalesced(ctx):
    # test_c10d_gloo.CommTest._test_broadcast_coalesced (CPU: no half)
    target = torch.arange(60, dtype=torch.float32).chunk(5)
    target += torch.arange(60, dtype=torch.float64).chunk(5)
    target += torch.arange(60, dtype=torch.float32).chunk(5)
    for root in range(ctx.world_size):
        tensors = [t.clone() for t in target] if ctx.rank == root else [torch.zeros_like(t) for t in target]
        dist._broadcast_coalesced(ctx.pg, tensors, buffer_size=256, src=root)
        assert_equal(tensors, list(target))


# ---- all_gather --------------------------------------------------------------------------------

def _pg_allgather_basics(ctx, fn):
    # test_c10d_gloo._test_allgather_basics: n tensors per process
    for n in [1, 2, 3]:
        inp = [fn(torch.tensor([n * ctx.rank + i])) for i in range(n)]
        output = [[fn(torch.tensor([-1])) for _ in range(n * ctx.world_size)] for _ in range(n)]
        expected = [[fn(torch.tensor([i])) for i in range(n * ctx.world_size)] for _ in range(n)]
        fut = ctx.pg.allgather(output, inp).get_future()
        fut.wait()
        result = fut.value()
        if n == 1:
            result = [result]
        assert_equal(result, expected, f"n={n}")
        assert_equal(output, expected, f"n={n}")


case("ProcessGroup.allgather", "1-3 tensors per process", "int64")(partial(_pg_allgather_basics, fn=lambda t: t.clone()))
case("ProcessGroup.allgather", "noncontiguous input", "int64")(partial(_pg_allgather_basics, fn=_noncontig))


@case("ProcessGroup.allgather", "inference_mode", "int64")
def pg_allgather_inference(ctx):
    with torch.inference_mode():
        _pg_allgather_basics(ctx, lambda t: t.clone())


@case("ProcessGroup.allgather", "stress", "int64")
def pg_allgather_stress(ctx):
    outputs = [[[torch.tensor([-1]) for _ in range(ctx.world_size)]] for _ in range(STRESS)]
    holder = {}
    futs = []
    for i in range(STRESS):
        holder[i] = [torch.tensor([i + ctx.rank])]
        futs.append(ctx.pg.allgather(outputs[i], holder[i]).get_future())
    for i, fut in enumerate(futs):
        fut.wait()
        assert_equal([fut.value()], [[torch.tensor([i + j]) for j in range(ctx.world_size)]], f"iteration {i}")


@case("ProcessGroup.allgather", "checks", "-")
def pg_allgather_checks(ctx):
    ws = ctx.world_size
    t1 = torch.zeros([1], dtype=torch.float32)
    t2 = torch.zeros([1], dtype=torch.float64)
    t3 = torch.zeros([2], dtype=torch.float32)
    for outputs, inputs in [([], []), ([], [t1]), ([[t1] * ws, [t1] * ws], [t1]), ([[t1] * (ws - 1)], [t1]),
                            ([[t1] * (ws + 1)], [t1]), ([[t1, t1] * ws, [t1, t1] * ws], [t1, t2]),
                            ([[t1, t1] * ws, [t1, t1] * ws], [t1, t3]), ([([t1, t2] * ws)[:ws]], [t1]),
                            ([([t1, t3] * ws)[:ws]], [t1])]:
        raises(RuntimeError, ctx.pg.allgather, outputs, inputs)


def _all_gather(ctx, dtype):
    t = _filled(ctx.rank + 1, 4, _dt(dtype))
    out = [_filled(0, 4, _dt(dtype)) for _ in range(ctx.world_size)]
    dist.all_gather(out, t)
    assert_equal(out, [_filled(r + 1, 4, _dt(dtype)) for r in range(ctx.world_size)])


for _dtype in DTYPES:
    case("all_gather", "tensor list", _dtype)(partial(_all_gather, dtype=_dtype))
case("all_gather", "tensor list", "int16", gloo=False)(partial(_all_gather, dtype="int16"))


@case("all_gather", "complex", "complex64")
def all_gather_complex(ctx):
    t = torch.full((2,), complex(ctx.rank, 1), dtype=torch.cfloat)
    out = [torch.zeros(2, dtype=torch.cfloat) for _ in range(ctx.world_size)]
    dist.all_gather(out, t)
    assert_equal(out, [torch.full((2,), complex(r, 1), dtype=torch.cfloat) for r in range(ctx.world_size)])


@case("all_gather", "noncontiguous input", "float32")
def all_gather_noncontig(ctx):
    t = torch.arange(12, dtype=torch.float32).view(3, 4).add(100 * ctx.rank).t()[1]  # stride 4
    out = [torch.zeros(3) for _ in range(ctx.world_size)]
    dist.all_gather(out, t)
    assert_equal(out, [torch.arange(12, dtype=torch.float32).view(3, 4).add(100 * r).t()[1] for r in range(ctx.world_size)])


@case("all_gather", "async_op=True, empty tensors", "float32")
def all_gather_empty(ctx):
    out = [torch.empty(0) for _ in range(ctx.world_size)]
    dist.all_gather(out, torch.empty(0), async_op=True).wait()
    assert all(o.numel() == 0 for o in out)


@case("all_gather_into_tensor", "concatenated output, async_op=True", "float32")
def all_gather_into_tensor(ctx):
    t = torch.full((2, 3), float(ctx.rank))
    cat_out = torch.empty(2 * ctx.world_size, 3)
    dist.all_gather_into_tensor(cat_out, t, async_op=True).wait()
    assert_equal(cat_out, torch.cat([torch.full((2, 3), float(r)) for r in range(ctx.world_size)]))


@case("all_gather_into_tensor", "stacked output", "float32", gloo=False)
def all_gather_into_tensor_stack(ctx):
    # distributed_test.test_all_gather_into_stack_tensor_cuda on CPU; gloo: "invalid tensor size".
    t = torch.full((2, 3), float(ctx.rank))
    stack_out = torch.empty(ctx.world_size, 2, 3)
    dist.all_gather_into_tensor(stack_out, t, async_op=True).wait()
    assert_equal(stack_out, torch.stack([torch.full((2, 3), float(r)) for r in range(ctx.world_size)]))


for _dtype in ["float64", "float16", "bfloat16", "int8", "int32", "int64", "bool"]:
    def _agit(ctx, dtype):
        t = _filled(ctx.rank + 1, 3, _dt(dtype))
        out = torch.empty(3 * ctx.world_size, dtype=_dt(dtype))
        dist.all_gather_into_tensor(out, t)
        assert_equal(out, torch.cat([_filled(r + 1, 3, _dt(dtype)) for r in range(ctx.world_size)]))

    case("all_gather_into_tensor", "concatenated output", _dtype)(partial(_agit, dtype=_dtype))


@case("ProcessGroup.allgather_into_tensor_coalesced", "tensor lists", "float32")
def allgather_into_tensor_coalesced(ctx):
    torch.manual_seed(42)
    in_shapes = [(5, 5), (10, 10), (15, 15)]
    outputs = [torch.empty((s[0] * ctx.world_size,) + s[1:]) for s in in_shapes]
    inputs = [torch.rand(s) for s in in_shapes]
    ctx.pg.allgather_into_tensor_coalesced(outputs, inputs).wait()
    for output, inp in zip(outputs, inputs):
        assert_equal(output, torch.cat([inp] * ctx.world_size))


def _all_gather_coalesced(ctx, dtype):
    # distributed_test._test_all_gather_coalesced_helper: [1], [2x2], [3x3x3] in one batch
    def build(tensor_id, value):
        return torch.full((tensor_id,) * tensor_id, value, dtype=dtype)

    for test_case_id in range(2, 5):
        inputs = [build(i, ctx.rank + i) for i in range(1, test_case_id)]
        outputs = [[build(i, -1) for i in range(1, test_case_id)] for _ in range(ctx.world_size)]
        expected = [[build(i, r + i) for i in range(1, test_case_id)] for r in range(ctx.world_size)]
        dist.all_gather_coalesced(outputs, inputs)
        assert_equal(outputs, expected)


case("all_gather_coalesced", "tensor lists", "float32")(partial(_all_gather_coalesced, dtype=torch.float32))
case("all_gather_coalesced", "complex", "complex64")(partial(_all_gather_coalesced, dtype=torch.cfloat))


@case("all_gather_coalesced", "with empty tensors", "float32")
def all_gather_coalesced_empty(ctx):
    shapes = [[2, 2], [0], [3, 3], [0], [0]]
    inputs = [ctx.rank * torch.ones([2, 2]), torch.ones([0]), (ctx.rank + 1) * torch.ones([3, 3]), torch.ones([0]),
              torch.ones([0])]
    outputs = [[-1 * torch.ones(s) for s in shapes] for _ in range(ctx.world_size)]
    expected = [[r * torch.ones([2, 2]), torch.ones([0]), (r + 1) * torch.ones([3, 3]), torch.ones([0]),
                 torch.ones([0])] for r in range(ctx.world_size)]
    dist.all_gather_coalesced(outputs, inputs)
    assert_equal(outputs, expected)


@case("all_gather_coalesced", "async_op=True", "int64")
def all_gather_coalesced_async(ctx):
    xxs = [2 * [torch.tensor([i + ctx.rank])] for i in range(2)]
    yys = [[[torch.zeros_like(x) for x in xx] for _ in range(ctx.world_size)] for xx in xxs]
    futs = [dist.all_gather_coalesced(yy, xx, async_op=True) for xx, yy in zip(xxs, yys)]
    torch.futures.wait_all(futs)
    for i, yy in enumerate(yys):
        assert_equal(yy, [2 * [torch.tensor([i + r])] for r in range(ctx.world_size)])


@case("all_gather_coalesced", "checks", "-")
def all_gather_coalesced_checks(ctx):
    dummy_input = [torch.zeros([1], dtype=torch.float32)]
    lists = [[torch.zeros([1], dtype=torch.float32)] for _ in range(ctx.world_size)]
    lists[0] = [torch.zeros([0], dtype=torch.float32)]
    raises(RuntimeError, dist.all_gather_coalesced, lists, dummy_input, ctx.pg)
    lists[0] = [torch.zeros([1], dtype=torch.float64)]
    raises(RuntimeError, dist.all_gather_coalesced, lists, dummy_input, ctx.pg)
    lists = [[torch.zeros([1], dtype=torch.float32)] for _ in range(ctx.world_size + 1)]
    raises(RuntimeError, dist.all_gather_coalesced, lists, dummy_input, ctx.pg)
    raises(TypeError, dist.all_gather_coalesced, [torch.zeros([0])], dummy_input, ctx.pg,
           match="Invalid function argument.*output_tensor_lists")


@case("all_gather_object", "python objects", "-")
def all_gather_object(ctx):
    out = [None] * ctx.world_size
    dist.all_gather_object(out, {"rank": ctx.rank, "payload": list(range(ctx.rank))})
    assert out == [{"rank": r, "payload": list(range(r))} for r in range(ctx.world_size)]


# ---- gather ------------------------------------------------------------------------------------

def _pg_gather_basics(ctx, fn):
    inp = [fn(torch.tensor([ctx.rank]))]
    outputs = [fn(torch.tensor([-1])) for _ in range(ctx.world_size)]
    futs = []
    for i in range(ctx.world_size):
        opts = dist.GatherOptions()
        opts.rootRank = i
        futs.append(ctx.pg.gather([outputs] if i == ctx.rank else [], inp, opts).get_future())
    for i, fut in enumerate(futs):
        fut.wait()
        if i == ctx.rank:
            assert_equal(fut.value(), [fn(torch.tensor([r])) for r in range(ctx.world_size)])
            assert_equal(outputs, [fn(torch.tensor([r])) for r in range(ctx.world_size)])


case("ProcessGroup.gather", "each rank root", "int64")(partial(_pg_gather_basics, fn=lambda t: t.clone()))
case("ProcessGroup.gather", "noncontiguous input", "int64")(partial(_pg_gather_basics, fn=_noncontig))


@case("ProcessGroup.gather", "stress", "int64")
def pg_gather_stress(ctx):
    futs = []
    outputs = [[[torch.tensor([-1]) for _ in range(ctx.world_size)]] for _ in range(STRESS // 4)]
    for i in range(STRESS // 4):
        for root in range(ctx.world_size):
            opts = dist.GatherOptions()
            opts.rootRank = root
            futs.append(ctx.pg.gather(outputs[i] if root == ctx.rank else [], [torch.tensor([i + ctx.rank])],
                                      opts).get_future())
    for k, fut in enumerate(futs):
        fut.wait()
        i, root = divmod(k, ctx.world_size)
        if root == ctx.rank:
            assert_equal([fut.value()], [[torch.tensor([i + j]) for j in range(ctx.world_size)]])


@case("ProcessGroup.gather", "checks", "-")
def pg_gather_checks(ctx):
    ws = ctx.world_size
    t1 = torch.zeros([1], dtype=torch.float32)
    t2 = torch.zeros([1], dtype=torch.float64)
    t3 = torch.zeros([2], dtype=torch.float32)
    for root, outputs, inputs in [(-1, [], [t1]), (ws, [], [t1]), (0, [], []), (0, [], [t1, t1]),
                                  (ctx.rank, [], [t1]), (ctx.rank, [[t1] * ws, [t1] * ws], [t1]),
                                  (ctx.rank, [[t1] * (ws - 1)], [t1]), (ctx.rank, [[t1] * (ws + 1)], [t1]),
                                  (ctx.rank, [[t2] * ws], [t1]), (ctx.rank, [[t3] * ws], [t1]),
                                  ((ctx.rank + 1) % ws, [[t1] * ws], [t1])]:
        opts = dist.GatherOptions()
        opts.rootRank = root
        raises(RuntimeError, ctx.pg.gather, outputs, inputs, opts)


def _gather(ctx, dtype):
    for dst in range(ctx.world_size):
        t = _filled(ctx.rank + 1, 3, _dt(dtype))
        out = [_filled(0, 3, _dt(dtype)) for _ in range(ctx.world_size)] if ctx.rank == dst else None
        dist.gather(t, out, dst=dst)
        if ctx.rank == dst:
            assert_equal(out, [_filled(r + 1, 3, _dt(dtype)) for r in range(ctx.world_size)])


for _dtype in ["float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "bool"]:
    case("gather", "tensor list", _dtype)(partial(_gather, dtype=_dtype))


@case("gather", "default dst, gather_list only on dst", "float32")
def gather_default_dst(ctx):
    # distributed_test.test_gather_checks
    one = torch.ones([1])
    if ctx.rank == 0:
        gather_list = [one.clone() for _ in range(ctx.world_size)]
        dist.gather(one * ctx.rank, gather_list=gather_list)
        assert_equal(gather_list, [one * i for i in range(ctx.world_size)])
    else:
        dist.gather(one * ctx.rank)


@case("gather", "noncontiguous input", "float32")
def gather_noncontig(ctx):
    t = torch.arange(6, dtype=torch.float32).view(2, 3).add(10 * ctx.rank).t()[2]
    out = [torch.zeros(2) for _ in range(ctx.world_size)] if ctx.rank == 0 else None
    dist.gather(t, out, dst=0)
    if ctx.rank == 0:
        assert_equal(out, [torch.arange(6, dtype=torch.float32).view(2, 3).add(10 * r).t()[2]
                           for r in range(ctx.world_size)])


@case("gather_object", "python objects", "-")
def gather_object(ctx):
    out = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(("rank", ctx.rank), out, dst=0)
    if ctx.rank == 0:
        assert out == [("rank", r) for r in range(ctx.world_size)]


# ---- scatter -----------------------------------------------------------------------------------

@case("ProcessGroup.scatter", "each rank root", "int64")
def pg_scatter_basics(ctx):
    inp = [torch.tensor([ctx.rank]) for _ in range(ctx.world_size)]
    outputs = [torch.tensor([-1]) for _ in range(ctx.world_size)]
    futs = []
    for i in range(ctx.world_size):
        opts = dist.ScatterOptions()
        opts.rootRank = i
        futs.append(ctx.pg.scatter([outputs[i]], [inp] if i == ctx.rank else [], opts).get_future())
    for i, fut in enumerate(futs):
        fut.wait()
        assert_equal(fut.value()[0], torch.tensor([i]))


@case("ProcessGroup.scatter", "stress", "int64")
def pg_scatter_stress(ctx):
    n = STRESS // 4
    inputs = [[torch.tensor([i + ctx.rank]) for _ in range(ctx.world_size)] for i in range(n)]
    outputs = [[torch.tensor([-1]) for _ in range(ctx.world_size)] for _ in range(n)]
    futs = []
    for i in range(n):
        for root in range(ctx.world_size):
            opts = dist.ScatterOptions()
            opts.rootRank = root
            futs.append(ctx.pg.scatter([outputs[i][root]], [[e.clone() for e in inputs[i]]] if root == ctx.rank else [],
                                       opts).get_future())
    for k, fut in enumerate(futs):
        fut.wait()
        i, root = divmod(k, ctx.world_size)
        assert_equal(fut.value()[0], torch.tensor([i + root]))


@case("ProcessGroup.scatter", "checks", "-")
def pg_scatter_checks(ctx):
    ws = ctx.world_size
    t1 = torch.zeros([1], dtype=torch.float32)
    t2 = torch.zeros([1], dtype=torch.float64)
    t3 = torch.zeros([2], dtype=torch.float32)
    for root, outputs, inputs in [(-1, [t1], []), (ws, [t1], []), (0, [], []), (0, [t1, t1], []),
                                  (ctx.rank, [t1], []), (ctx.rank, [t1], [[t1] * ws, [t1] * ws]),
                                  (ctx.rank, [t1], [[t1] * (ws - 1)]), (ctx.rank, [t1], [[t1] * (ws + 1)]),
                                  (ctx.rank, [t1], [[t2] * ws]), (ctx.rank, [t1], [[t3] * ws]),
                                  ((ctx.rank + 1) % ws, [t1], [[t1] * ws])]:
        opts = dist.ScatterOptions()
        opts.rootRank = root
        raises(RuntimeError, ctx.pg.scatter, outputs, inputs, opts)


def _scatter(ctx, dtype):
    for src in range(ctx.world_size):
        out = _filled(0, 3, _dt(dtype))
        lst = [_filled(r + 1, 3, _dt(dtype)) for r in range(ctx.world_size)] if ctx.rank == src else None
        dist.scatter(out, lst, src=src)
        assert_equal(out, _filled(ctx.rank + 1, 3, _dt(dtype)))


for _dtype in ["float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "bool"]:
    case("scatter", "tensor list", _dtype)(partial(_scatter, dtype=_dtype))


@case("scatter", "complex", "complex64")
def scatter_complex(ctx):
    out = torch.zeros(2, dtype=torch.cfloat)
    lst = [torch.full((2,), complex(r, 1), dtype=torch.cfloat) for r in range(ctx.world_size)] if ctx.rank == 0 else None
    dist.scatter(out, lst, src=0)
    assert_equal(out, torch.full((2,), complex(ctx.rank, 1), dtype=torch.cfloat))


@case("scatter", "default src, scatter_list only on src", "float32")
def scatter_default_src(ctx):
    one = torch.ones([1])
    output = one.clone() * -1
    if ctx.rank == 0:
        dist.scatter(output, scatter_list=[one.clone() * i for i in range(ctx.world_size)])
    else:
        dist.scatter(output)
    assert_equal(output, one * ctx.rank)


@case("scatter_object_list", "python objects", "-")
def scatter_object_list(ctx):
    out = [None]
    dist.scatter_object_list(out, [{"to": r} for r in range(ctx.world_size)] if ctx.rank == 0 else None, src=0)
    assert out[0] == {"to": ctx.rank}


@case("broadcast_object_list", "python objects", "-")
def broadcast_object_list(ctx):
    objs = [1, "two", {"three": 3}] if ctx.rank == 0 else [None, None, None]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [1, "two", {"three": 3}]


# ---- all_to_all --------------------------------------------------------------------------------

def _a2a_single_equal(ctx, dtype):
    size = ctx.world_size
    inp = torch.ones([size, size], dtype=dtype) * ctx.rank
    out = torch.ones([size, size], dtype=dtype) * -1
    dist.all_to_all_single(out, inp)
    assert_equal(out, torch.cat([torch.ones([1, size], dtype=dtype) * i for i in range(size)]))


def _a2a_single_unequal(ctx, dtype):
    size = ctx.world_size
    in_splits = [i + 1 for i in range(size)]
    out_splits = [ctx.rank + 1 for _ in range(size)]
    inp = torch.ones([sum(in_splits), size], dtype=dtype) * ctx.rank
    out = torch.ones([(ctx.rank + 1) * size, size], dtype=dtype)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    assert_equal(out, torch.cat([torch.ones([ctx.rank + 1, size], dtype=dtype) * i for i in range(size)]))


for _dtype in ["float32", "float64", "int32", "int64"]:
    case("all_to_all_single", "equal split", _dtype)(partial(_a2a_single_equal, dtype=_dt(_dtype)))
    case("all_to_all_single", "unequal split", _dtype)(partial(_a2a_single_unequal, dtype=_dt(_dtype)))
case("all_to_all_single", "equal split", "complex64")(partial(_a2a_single_equal, dtype=torch.cfloat))
case("all_to_all_single", "unequal split", "complex64")(partial(_a2a_single_unequal, dtype=torch.cfloat))


@case("all_to_all_single", "async_op=True", "float32")
def a2a_single_async(ctx):
    inp = torch.arange(ctx.world_size, dtype=torch.float32) + 10 * ctx.rank
    out = torch.empty(ctx.world_size)
    dist.all_to_all_single(out, inp, async_op=True).wait()
    assert_equal(out, torch.tensor([10.0 * r + ctx.rank for r in range(ctx.world_size)]))


@case("all_to_all_single", "transposed input (ValueError)", "float32")
def a2a_single_noncontig(ctx):
    inp = torch.ones(ctx.world_size, 4).t()
    out = torch.empty(4, ctx.world_size)
    raises(ValueError, dist.all_to_all_single, out, inp, match="Tensors must be contiguous")


@case("all_to_all_single", "empty splits", "float32")
def a2a_single_empty(ctx):
    inp = torch.empty(0, 3)
    out = torch.empty(0, 3)
    dist.all_to_all_single(out, inp, [0] * ctx.world_size, [0] * ctx.world_size)
    assert out.numel() == 0


@case("all_to_all_single", "checks", "-")
def a2a_single_checks(ctx):
    ws = ctx.world_size
    raises(RuntimeError, dist.all_to_all_single, torch.empty(ws), torch.empty(ws), [1] * (ws + 1), [1] * ws)
    raises(RuntimeError, dist.all_to_all_single, torch.empty(ws), torch.empty(ws), [1] * ws, [2] * ws)


def _a2a_list(ctx, dtype, unequal):
    size = ctx.world_size
    if unequal:
        in_splits = [i + 1 for i in range(size)]
        inp = [torch.ones([s, size], dtype=dtype) * ctx.rank for s in in_splits]
        out = [torch.ones([ctx.rank + 1, size], dtype=dtype) * -1 for _ in range(size)]
        expected = [torch.ones([ctx.rank + 1, size], dtype=dtype) * i for i in range(size)]
    else:
        inp = [torch.ones([2, 2], dtype=dtype) * ctx.rank * 10 + r for r in range(size)]
        out = [torch.ones([2, 2], dtype=dtype) * -1 for _ in range(size)]
        expected = [torch.ones([2, 2], dtype=dtype) * r * 10 + ctx.rank for r in range(size)]
    dist.all_to_all(out, inp)
    assert_equal(out, expected)


for _dtype in ["float32", "int64"]:
    case("all_to_all", "equal tensor lists", _dtype)(partial(_a2a_list, dtype=_dt(_dtype), unequal=False))
    # gloo: "invalid tensor size at index 1" (its list form needs equal sizes)
    case("all_to_all", "unequal tensor lists", _dtype, gloo=False)(partial(_a2a_list, dtype=_dt(_dtype), unequal=True))
case("all_to_all", "complex", "complex64")(partial(_a2a_list, dtype=torch.cfloat, unequal=False))


@case("all_gather_into_tensor", "strided input and output", "float32")
def all_gather_into_tensor_strided(ctx):
    # Gloo accepts non-contiguous tensors and gathers their logical values.
    inp = (torch.arange(4.0).reshape(2, 2) + ctx.rank).t().contiguous().t()  # values row-major, strides (1, 2)
    out = torch.empty(2, ctx.world_size * 2).t()  # (2 * world, 2), strides (1, 2 * world)
    dist.all_gather_into_tensor(out, inp)
    expected = torch.cat([torch.arange(4.0).reshape(2, 2) + r for r in range(ctx.world_size)])
    assert_equal(out, expected)


@case("reduce_scatter_tensor", "strided input and output", "float32")
def reduce_scatter_tensor_strided(ctx):
    world = ctx.world_size
    base = torch.arange(world * 4.0).reshape(world * 2, 2)
    inp = (base * (ctx.rank + 1)).t().contiguous().t()  # logical values of base x (rank + 1), strided
    out = torch.empty(2, 2).t()
    dist.reduce_scatter_tensor(out, inp)
    scale = sum(r + 1 for r in range(world))
    assert_equal(out, base[2 * ctx.rank:2 * ctx.rank + 2] * scale)


@case("reduce_scatter", "strided tensor list and output", "float32")
def reduce_scatter_list_strided(ctx):
    inputs = [(torch.arange(4.0).reshape(2, 2) + i + ctx.rank).t().contiguous().t() for i in range(ctx.world_size)]
    out = torch.empty(2, 2).t()
    dist.reduce_scatter(out, inputs)
    expected = sum(torch.arange(4.0).reshape(2, 2) + ctx.rank + r for r in range(ctx.world_size))
    assert_equal(out, expected)
