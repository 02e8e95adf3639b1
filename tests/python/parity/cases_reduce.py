"""Parity cases: allreduce (all forms), allreduce_coalesced, sparse allreduce, reduce,
reduce_scatter (list, tensor, coalesced), barrier. Ported from test_c10d_gloo.py
(ProcessGroupGlooTest *_checks / *_basics / *_stress) and distributed_test.py."""

from __future__ import annotations

import math
import operator
from functools import partial, reduce as fold

import torch
import torch.distributed as dist

from parity import assert_equal, case, raises

RO = dist.ReduceOp
FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["int8", "uint8", "int32", "int64"]  # gloo has no int16: see the int16 cases
STRESS = 200  # test_c10d_gloo uses 1000; 200 keeps the suite's wall time modest on 2 cores


def _dt(name):
    return getattr(torch, name)


def simple_reduce_tests(rank, world_size):
    """test_c10d_gloo.simple_reduce_tests."""
    tests = [
        (RO.SUM, torch.tensor([rank + 1.0]), torch.tensor([float(world_size * (world_size + 1) / 2)])),
        (RO.PRODUCT, torch.tensor([rank + 1.0]), torch.tensor([float(math.factorial(world_size))])),
        (RO.MIN, torch.tensor([rank + 1.0]), torch.tensor([1.0])),
        (RO.MAX, torch.tensor([rank + 1.0]), torch.tensor([float(world_size)])),
    ]
    for i in range(4):
        tests.append((RO.BAND, torch.tensor([rank | (1 << i)], dtype=torch.int32), torch.tensor([1 << i], dtype=torch.int32)))
    for i in range(1, 5):
        vin = fold(operator.or_, [rank * i + j for j in range(i)])
        vout = fold(operator.or_, range(world_size * i))
        tests.append((RO.BOR, torch.tensor([vin], dtype=torch.int32), torch.tensor([vout], dtype=torch.int32)))
    for i in range(1, 5):
        vin = fold(operator.xor, [rank * i + j for j in range(i)])
        vout = fold(operator.xor, range(world_size * i))
        tests.append((RO.BXOR, torch.tensor([vin], dtype=torch.int32), torch.tensor([vout], dtype=torch.int32)))
    return tests


def simple_sparse_reduce_tests(rank, world_size, num_inputs=1):
    """torch.testing._internal.common_distributed.simple_sparse_reduce_tests (copied: importing
    that module needs torch's test-only dependencies)."""

    def generate(rank, world_size, sparse_dims=1, dense_dims=0):
        indices = torch.reshape(torch.arange(rank + 1), (1, rank + 1))
        shape = [world_size] + [2 for _ in range(dense_dims)]
        for _ in range(sparse_dims - 1):
            indices = torch.cat((indices, torch.zeros(1, rank + 1)))
            shape.append(world_size)
        values = torch.ones([rank + 1] + [2 for _ in range(dense_dims)])
        return torch.sparse_coo_tensor(indices, values, shape)

    def compute_sum(fn, world_size):
        return fold(operator.add, [fn(r, world_size) for r in range(world_size)])

    return [
        ([fn(num_inputs * rank + i, num_inputs * world_size) for i in range(num_inputs)],
         [compute_sum(fn, num_inputs * world_size) for _ in range(num_inputs)])
        for fn in [partial(generate, sparse_dims=1), partial(generate, sparse_dims=2), partial(generate, sparse_dims=3),
                   partial(generate, dense_dims=1), partial(generate, dense_dims=2), partial(generate, dense_dims=3)]
    ]


def simple_multi_input_reduce_tests(rank, world_size):
    return [
        (RO.SUM, [torch.tensor([2 * rank + 0.0]), torch.tensor([2 * rank + 1.0])],
         torch.tensor([float(world_size * (2 * world_size - 1))])),
        (RO.PRODUCT, [torch.tensor([2 * rank + 1.0]), torch.tensor([2 * rank + 2.0])],
         torch.tensor([float(math.factorial(2 * world_size))])),
        (RO.MIN, [torch.tensor([2 * rank + 1.0]), torch.tensor([2 * rank + 2.0])], torch.tensor([1.0])),
        (RO.MAX, [torch.tensor([2 * rank + 1.0]), torch.tensor([2 * rank + 2.0])], torch.tensor([2.0 * world_size])),
    ]


def simple_coalesced_reduce_tests(rank, world_size):
    return [
        (RO.SUM, [torch.tensor([rank + 1.0]), torch.tensor([(rank + 1.0) ** 2])],
         [torch.tensor([float(world_size * (world_size + 1) / 2)]),
          torch.tensor([float(world_size * (world_size + 1) * (2 * world_size + 1) / 6)])]),
        (RO.PRODUCT, [torch.tensor([rank + 1.0]), torch.tensor([rank + 2.0])],
         [torch.tensor([float(math.factorial(world_size))]), torch.tensor([float(math.factorial(world_size + 1))])]),
        (RO.MIN, [torch.tensor([rank + x]) for x in [0.0, 1.0]], [torch.tensor([0.0]), torch.tensor([1.0])]),
        (RO.MAX, [torch.tensor([rank + x]) for x in [1.0, 2.0]],
         [torch.tensor([float(world_size)]), torch.tensor([world_size + 1.0])]),
    ]


def _values(ctx, dtype, n=5):
    """Rank-dependent small values that neither overflow int8/uint8 nor lose precision in half."""
    return (torch.arange(n) % 3 + ctx.rank + 1).to(dtype)


def _expected(ctx, dtype, op, n=5):
    all_values = [(torch.arange(n) % 3 + r + 1).to(torch.float64) for r in range(ctx.world_size)]
    stack = torch.stack(all_values)
    if op == "SUM":
        out = stack.sum(0)
    elif op == "PRODUCT":
        out = stack.prod(0)
    elif op == "MIN":
        out = stack.min(0).values
    elif op == "MAX":
        out = stack.max(0).values
    elif op == "AVG":
        out = stack.mean(0)
    else:
        ints = stack.long()
        out = ints[0]
        for t in ints[1:]:
            out = {"BAND": out & t, "BOR": out | t, "BXOR": out ^ t}[op]
    return out.to(dtype)


# ---- all_reduce: dist.all_reduce over dtype x reduce op ----------------------------------------

def _all_reduce_op(ctx, dtype, op):
    t = _values(ctx, _dt(dtype))
    dist.all_reduce(t, op=getattr(RO, op))
    assert_equal(t, _expected(ctx, _dt(dtype), op))


for _dtype in FLOATS + INTS:
    for _op in ("SUM", "PRODUCT", "MIN", "MAX"):
        case("all_reduce", f"tensor {_op}", _dtype)(partial(_all_reduce_op, dtype=_dtype, op=_op))
for _dtype in FLOATS:
    case("all_reduce", "tensor AVG", _dtype)(partial(_all_reduce_op, dtype=_dtype, op="AVG"))
for _op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
    # Gloo raises "Invalid scalar type" for int16.
    case("all_reduce", f"tensor {_op}", "int16", gloo=False)(partial(_all_reduce_op, dtype="int16", op=_op))
for _dtype in ["uint8", "int32", "int64"]:
    for _op in ("BAND", "BOR", "BXOR"):
        case("all_reduce", f"tensor {_op}", _dtype)(partial(_all_reduce_op, dtype=_dtype, op=_op))


@case("all_reduce", "tensor SUM", "bool")
def all_reduce_bool(ctx):
    # test_c10d_common._test_bool_tensors: SUM of bools is a logical or.
    t = torch.tensor([[0, 0, 1, 1]], dtype=torch.bool) if ctx.rank == 0 else torch.tensor([[1, 0, 0, 1]], dtype=torch.bool)
    dist.all_reduce(t)
    assert_equal(t, torch.tensor([[1, 0, 1, 1]], dtype=torch.bool))


def _premul(ctx, dtype):
    t = _values(ctx, _dt(dtype))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    assert_equal(t, (_expected(ctx, torch.float64, "SUM") * 0.5).to(_dt(dtype)))


for _dtype in ["float32", "float64"]:
    # Gloo has no PREMUL_SUM on CPU.
    case("all_reduce", "tensor PREMUL_SUM", _dtype, gloo=False)(partial(_premul, dtype=_dtype))


@case("all_reduce", "async_op=True", "float32")
def all_reduce_async(ctx):
    # distributed_test.test_all_reduce_sum_async
    t = torch.full((10,), float(ctx.rank + 1))
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert_equal(t, torch.full((10,), float(ctx.world_size * (ctx.world_size + 1) // 2)))
    assert_equal(work.result(), [t])


@case("all_reduce", "complex SUM", "complex64")
def all_reduce_complex(ctx):
    # distributed_test.test_all_reduce_sum_complex
    t = torch.full((3,), complex(2, 3) if ctx.rank == 0 else complex(10, 11), dtype=torch.cfloat)
    dist.all_reduce(t)
    assert_equal(t, torch.full((3,), complex(2, 3) + complex(10, 11) * (ctx.world_size - 1), dtype=torch.cfloat))


@case("all_reduce", "complex unsupported ops (ValueError)", "complex64")
def all_reduce_complex_unsupported(ctx):
    for op in [RO.MAX, RO.MIN, RO.PRODUCT, RO.BAND, RO.BOR, RO.BXOR]:
        raises(ValueError, dist.all_reduce, torch.ones(1, dtype=torch.cfloat), op, match="all_reduce does not support")


@case("all_reduce", "empty tensor", "float32")
def all_reduce_empty(ctx):
    t = torch.empty(0)
    dist.all_reduce(t)
    assert t.numel() == 0


@case("all_reduce", "0-dim tensor", "float32")
def all_reduce_scalar(ctx):
    t = torch.tensor(float(ctx.rank + 1))
    dist.all_reduce(t)
    assert_equal(t, torch.tensor(float(ctx.world_size * (ctx.world_size + 1) // 2)))


@case("all_reduce", "inference_mode", "float32")
def all_reduce_inference(ctx):
    with torch.inference_mode():
        t = torch.full((4,), float(ctx.rank + 1))
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
    assert_equal(t, torch.full((4,), float(ctx.world_size * (ctx.world_size * (ctx.world_size + 1) // 2))))


@case("all_reduce", "noncontiguous tensor", "float32")
def all_reduce_noncontiguous(ctx):
    base = torch.arange(16, dtype=torch.float32).view(4, 4) + ctx.rank
    t = base.t()
    dist.all_reduce(t)
    ws = ctx.world_size
    assert_equal(t, (torch.arange(16, dtype=torch.float32).view(4, 4) * ws + ws * (ws - 1) // 2).t())
    assert_equal(base, (torch.arange(16, dtype=torch.float32).view(4, 4) * ws + ws * (ws - 1) // 2))


@case("all_reduce", "non-dense tensor (a column)", "float64", gloo=False)
def all_reduce_column(ctx):
    # Gloo accepts a tensor with gaps in its memory but reduces the wrong elements.
    ws = ctx.world_size
    col = (torch.arange(12, dtype=torch.float64).view(3, 4) + ctx.rank)[:, 1]
    dist.all_reduce(col, op=RO.MAX)
    assert_equal(col, torch.tensor([1.0, 5.0, 9.0], dtype=torch.float64) + ws - 1)


@case("ProcessGroup.allreduce", "simple_reduce_tests (future)", "float32,int32")
def pg_allreduce_basics(ctx):
    # test_c10d_gloo._test_allreduce_basics, single input
    for op, inp, expected in simple_reduce_tests(ctx.rank, ctx.world_size):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        fut = ctx.pg.allreduce([inp.clone()], opts).get_future()
        fut.wait()
        assert_equal(fut.value()[0], expected, str(op))
    # overloaded convenience function (defaults to sum)
    fut = ctx.pg.allreduce(torch.tensor([ctx.rank + 1.0])).get_future()
    fut.wait()
    assert_equal(fut.value()[0], torch.tensor([float(ctx.world_size * (ctx.world_size + 1) / 2)]))


@case("ProcessGroup.allreduce", "several tensors per process", "float32")
def pg_allreduce_multi_input(ctx):
    # test_c10d_gloo._test_allreduce_basics, multi input
    for op, inputs, output in simple_multi_input_reduce_tests(ctx.rank, ctx.world_size):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        tensors = [t.clone() for t in inputs]
        fut = ctx.pg.allreduce(tensors, opts).get_future()
        fut.wait()
        for t in fut.value():
            assert_equal(t, output, str(op))
        for t in tensors:
            assert_equal(t, output, str(op))


@case("ProcessGroup.allreduce", "several tensors per process, AVG", "float32")
def pg_allreduce_multi_input_avg(ctx):
    # Gloo sums every tensor of every rank and divides by the world size; the result lands in
    # tensors[0] (Gloo leaves the other tensors undivided; zeroplus writes the mean into all).
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    tensors = [torch.full((3,), float(ctx.rank + 1)), torch.full((3,), float(10 * (ctx.rank + 1)))]
    ctx.pg.allreduce(tensors, opts).wait()
    total = sum(11.0 * (r + 1) for r in range(ctx.world_size))
    assert_equal(tensors[0], torch.full((3,), total / ctx.world_size))


@case("ProcessGroup.allreduce", "fp16 numerics vs allgather sum", "float16")
def pg_allreduce_fp16(ctx):
    torch.manual_seed(ctx.rank)
    tensor = ((torch.rand(10, 1) * 2 - 1) * 65504 / ctx.world_size).to(torch.float16)
    output = [[torch.zeros_like(tensor) for _ in range(ctx.world_size)]]
    fut = ctx.pg.allgather(output, [tensor]).get_future()
    fut.wait()
    total = torch.stack(fut.value(), dim=0).float().sum(dim=0)
    fut = ctx.pg.allreduce([tensor]).get_future()
    fut.wait()
    # Summed in another order than the reference: a few fp16 roundings apart (gloo too, at 3 ranks).
    torch.testing.assert_close(fut.value()[0].float(), total, rtol=4e-3, atol=1e-2)


@case("ProcessGroup.allreduce", "stress (async, futures)", "int64")
def pg_allreduce_stress(ctx):
    inputs = [torch.tensor([i + ctx.rank]) for i in range(STRESS)]
    futs = [ctx.pg.allreduce(inputs[i]).get_future() for i in range(STRESS)]
    ws = ctx.world_size
    for i, fut in enumerate(futs):
        fut.wait()
        assert_equal(fut.value()[0], torch.tensor([i * ws + ws * (ws - 1) // 2]), f"iteration {i}")


@case("ProcessGroup.allreduce", "checks", "-")
def pg_allreduce_checks(ctx):
    t1 = torch.zeros([1], dtype=torch.float32)
    t2 = torch.zeros([1], dtype=torch.float64)
    t3 = torch.zeros([2], dtype=torch.float32)
    raises(RuntimeError, ctx.pg.allreduce, [], dist.AllreduceOptions())
    raises(RuntimeError, ctx.pg.allreduce, [t1, t2], dist.AllreduceOptions())
    raises(RuntimeError, ctx.pg.allreduce, [t1, t3], dist.AllreduceOptions())


@case("ProcessGroup.allreduce", "barrier implies wait", "float32")
def pg_barrier_implies_wait(ctx):
    tensors = [torch.full((100, 100), float(i)) for i in range(16)]
    for t in tensors:
        ctx.pg.allreduce(t)  # the Work is dropped on purpose
    ctx.pg.barrier().get_future().wait()
    for i, t in enumerate(tensors):
        assert_equal(t, torch.full((100, 100), float(i * ctx.world_size)))


# ---- allreduce_coalesced -----------------------------------------------------------------------

@case("ProcessGroup.allreduce_coalesced", "basics", "float32")
def pg_allreduce_coalesced_basics(ctx):
    for op, inputs, outputs in simple_coalesced_reduce_tests(ctx.rank, ctx.world_size):
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = op
        fut = ctx.pg.allreduce_coalesced([x.clone() for x in inputs], opts).get_future()
        fut.wait()
        for result, expected in zip(fut.value(), outputs):
            assert_equal(result, expected, str(op))


@case("ProcessGroup.allreduce_coalesced", "stress", "int64")
def pg_allreduce_coalesced_stress(ctx):
    inputs = [2 * [torch.tensor([i + ctx.rank])] for i in range(STRESS)]
    futs = [ctx.pg.allreduce_coalesced(x).get_future() for x in inputs]
    ws = ctx.world_size
    for i, fut in enumerate(futs):
        fut.wait()
        assert_equal(fut.value(), 2 * [torch.tensor([i * ws + ws * (ws - 1) // 2])], f"iteration {i}")


@case("all_reduce_coalesced", "async_op=True", "int64")
def all_reduce_coalesced_async(ctx):
    xs = [2 * [torch.tensor([i + ctx.rank])] for i in range(2)]
    futs = [dist.all_reduce_coalesced(x, async_op=True) for x in xs]
    torch.futures.wait_all(futs)
    ws = ctx.world_size
    for i, x in enumerate(xs):
        assert_equal(x, 2 * [torch.tensor([i * ws + ws * (ws - 1) // 2])])


@case("all_reduce_coalesced", "tensor list", "float32")
def all_reduce_coalesced_plain(ctx):
    tensors = [torch.ones(10, 10), torch.ones(3)]
    dist.all_reduce_coalesced(tensors, dist.ReduceOp.SUM)
    assert_equal(tensors, [torch.ones(10, 10) * ctx.world_size, torch.ones(3) * ctx.world_size])


@case("ProcessGroup.allreduce_coalesced", "checks", "-")
def pg_allreduce_coalesced_checks(ctx):
    t1 = torch.zeros(1, dtype=torch.float32)
    t2 = torch.zeros(1, dtype=torch.float64)
    t3 = torch.sparse_coo_tensor([[0]], [1], size=(1,))
    raises(RuntimeError, ctx.pg.allreduce_coalesced, [], dist.AllreduceCoalescedOptions())
    raises(RuntimeError, ctx.pg.allreduce_coalesced, [t1, t2], dist.AllreduceCoalescedOptions())
    raises(RuntimeError, ctx.pg.allreduce_coalesced, [t1, t3], dist.AllreduceCoalescedOptions())
    raises(RuntimeError, ctx.pg.allreduce_coalesced, [t3, t3.clone()], dist.AllreduceCoalescedOptions())


@case("_coalescing_manager", "all_reduce", "float32", gloo=False)
def coalescing_manager_all_reduce(ctx):
    # distributed_test.test_coalescing_manager, on CPU (gloo: "does not implement startCoalescing")
    small = [torch.ones(8) * (ctx.rank + 1) for _ in range(2)]
    try:
        with dist._coalescing_manager(device=torch.device("cpu")):
            for t in small:
                dist.all_reduce(t)
    finally:
        # A backend that raises inside the manager leaves torch's coalescing state behind, which
        # would turn every later collective of the group into an IllegalWork.
        dist.distributed_c10d._world.pg_coalesce_state.pop(ctx.pg, None)
    big = torch.ones(16) * (ctx.rank + 1)
    dist.all_reduce(big)
    for i in range(2):
        assert_equal(small[i], big[i * 8:(i + 1) * 8])


# ---- sparse allreduce --------------------------------------------------------------------------

@case("ProcessGroup.allreduce", "sparse COO (1 and 2 tensors per process)", "float32")
def pg_sparse_allreduce_basics(ctx):
    # test_c10d_gloo._test_sparse_allreduce_basics
    for num_inputs in [1, 2]:
        for inputs, outputs in simple_sparse_reduce_tests(ctx.rank, ctx.world_size, num_inputs=num_inputs):
            tensors = list(inputs)
            fut = ctx.pg.allreduce(tensors).get_future()
            fut.wait()
            assert_equal(tensors, outputs)
            assert_equal(fut.value(), outputs)


@case("all_reduce", "sparse COO", "float32")
def sparse_all_reduce_sum(ctx):
    # distributed_test._test_sparse_all_reduce_sum
    for inputs, outputs in simple_sparse_reduce_tests(ctx.rank, ctx.world_size, num_inputs=1):
        t = inputs[0]
        dist.all_reduce(t, dist.ReduceOp.SUM)
        assert_equal(t, outputs[0])


@case("ProcessGroup.allreduce", "sparse COO checks", "-")
def pg_sparse_allreduce_checks(ctx):
    t1 = torch.zeros([1])
    t2 = torch.sparse_coo_tensor([[0]], [1], size=(2,))
    t3 = torch.sparse_coo_tensor([[0]], [1], size=(4,))
    raises(RuntimeError, ctx.pg.allreduce, [t1, t2], dist.AllreduceOptions())
    raises(RuntimeError, ctx.pg.allreduce, [t2, t3], dist.AllreduceOptions())
    for op in [RO.PRODUCT, RO.MIN, RO.MAX]:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        raises(RuntimeError, ctx.pg.allreduce, [t3], opts)


# ---- reduce ------------------------------------------------------------------------------------

def _reduce_op(ctx, dtype, op):
    for root in range(ctx.world_size):
        t = _values(ctx, _dt(dtype))
        dist.reduce(t, dst=root, op=getattr(RO, op))
        if ctx.rank == root:
            assert_equal(t, _expected(ctx, _dt(dtype), op), f"root {root}")


for _dtype in ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]:
    for _op in ("SUM", "PRODUCT", "MIN", "MAX"):
        case("reduce", f"tensor {_op}", _dtype)(partial(_reduce_op, dtype=_dtype, op=_op))
for _op in ("BAND", "BOR", "BXOR"):
    case("reduce", f"tensor {_op}", "int32")(partial(_reduce_op, dtype="int32", op=_op))
case("reduce", "tensor AVG", "float32")(partial(_reduce_op, dtype="float32", op="AVG"))
case("reduce", "tensor SUM", "int16", gloo=False)(partial(_reduce_op, dtype="int16", op="SUM"))


@case("ProcessGroup.reduce", "simple_reduce_tests x root (future)", "float32,int32")
def pg_reduce_basics(ctx):
    for op, inp, output in simple_reduce_tests(ctx.rank, ctx.world_size):
        for root in range(ctx.world_size):
            opts = dist.ReduceOptions()
            opts.reduceOp = op
            opts.rootRank = root
            fut = ctx.pg.reduce([inp.clone()], opts).get_future()
            fut.wait()
            if root == ctx.rank:
                assert_equal(fut.value()[0], output, f"{op} root {root}")


@case("ProcessGroup.reduce", "stress", "int64")
def pg_reduce_stress(ctx):
    futs = []
    for i in range(STRESS // 4):
        for root in range(ctx.world_size):
            opts = dist.ReduceOptions()
            opts.rootRank = root
            futs.append(ctx.pg.reduce([torch.tensor([i + ctx.rank])], opts).get_future())
    ws = ctx.world_size
    for k, fut in enumerate(futs):
        fut.wait()
        i, root = divmod(k, ws)
        if root == ctx.rank:
            assert_equal(fut.value()[0], torch.tensor([i * ws + ws * (ws - 1) // 2]))


@case("ProcessGroup.reduce", "checks", "-")
def pg_reduce_checks(ctx):
    t1 = torch.zeros([1], dtype=torch.float32)
    for root, root_tensor, tensors in [(-1, 0, [t1]), (ctx.world_size, 0, [t1]), (ctx.rank, 1, [t1]),
                                       (ctx.rank, 0, [t1, t1])]:
        opts = dist.ReduceOptions()
        opts.rootRank = root
        opts.rootTensor = root_tensor
        raises(RuntimeError, ctx.pg.reduce, tensors, opts)


# ---- reduce_scatter ----------------------------------------------------------------------------

def _reduce_scatter_list(ctx, dtype, op):
    ws = ctx.world_size
    inputs = [_values(ctx, _dt(dtype), 5) + i for i in range(ws)]
    out = torch.empty(5, dtype=_dt(dtype))
    dist.reduce_scatter(out, [t.clone() for t in inputs], op=getattr(RO, op))
    per_rank = [[((torch.arange(5) % 3 + r + 1) + i).double() for i in range(ws)] for r in range(ws)]
    stack = torch.stack([per_rank[r][ctx.rank] for r in range(ws)])
    expected = {"SUM": stack.sum(0), "MAX": stack.max(0).values, "MIN": stack.min(0).values,
                "PRODUCT": stack.prod(0), "AVG": stack.mean(0)}[op]
    assert_equal(out, expected.to(_dt(dtype)))


for _dtype in ["float32", "float64", "float16", "bfloat16", "int32", "int64"]:
    for _op in ("SUM", "MAX", "MIN", "PRODUCT"):
        case("reduce_scatter", f"tensor list {_op}", _dtype)(partial(_reduce_scatter_list, dtype=_dtype, op=_op))
case("reduce_scatter", "tensor list AVG", "float32")(partial(_reduce_scatter_list, dtype="float32", op="AVG"))


@case("reduce_scatter", "uneven tensor list", "float32")
def reduce_scatter_uneven(ctx):
    # test_c10d_gloo.test_reduce_scatter: input i has i elements, rank r's output r elements.
    torch.manual_seed(42)
    inputs = [torch.rand(i) for i in range(ctx.world_size)]
    output = torch.empty(ctx.rank)
    work = dist.reduce_scatter(output, inputs, async_op=True)
    work.wait()
    assert_equal(output, inputs[ctx.rank] * ctx.world_size)


@case("reduce_scatter", "uneven tensor list, 2-d", "float64")
def reduce_scatter_uneven_2d(ctx):
    inputs = [torch.full((i + 1, 2), float(ctx.rank + i), dtype=torch.float64) for i in range(ctx.world_size)]
    output = torch.empty(ctx.rank + 1, 2, dtype=torch.float64)
    dist.reduce_scatter(output, inputs)
    expected = sum(float(r + ctx.rank) for r in range(ctx.world_size))
    assert_equal(output, torch.full((ctx.rank + 1, 2), expected, dtype=torch.float64))


def _reduce_scatter_tensor(ctx, dtype, op):
    ws = ctx.world_size
    out_shape = (4, 3)
    inp = torch.stack([_values(ctx, _dt(dtype), 12).view(out_shape) + i for i in range(ws)]).view(ws * 4, 3)
    out = torch.empty(out_shape, dtype=_dt(dtype))
    dist.reduce_scatter_tensor(out, inp, op=getattr(RO, op))
    stack = torch.stack([((torch.arange(12) % 3 + r + 1) + ctx.rank).double() for r in range(ws)])
    expected = {"SUM": stack.sum(0), "MAX": stack.max(0).values, "MIN": stack.min(0).values,
                "PRODUCT": stack.prod(0), "AVG": stack.mean(0)}[op]
    assert_equal(out, expected.view(out_shape).to(_dt(dtype)))


for _dtype in ["float32", "float64", "float16", "bfloat16", "int32", "int64"]:
    for _op in ("SUM", "MAX"):
        case("reduce_scatter_tensor", f"tensor {_op}", _dtype)(partial(_reduce_scatter_tensor, dtype=_dtype, op=_op))
case("reduce_scatter_tensor", "tensor AVG", "float32")(
    partial(_reduce_scatter_tensor, dtype="float32", op="AVG"))


@case("reduce_scatter_tensor", "async_op=True (test_c10d_gloo)", "float32")
def reduce_scatter_tensor_gloo(ctx):
    torch.manual_seed(42)
    out_shape = (20, 20)
    output = torch.empty(out_shape)
    inp = torch.rand((out_shape[0] * ctx.world_size,) + out_shape[1:])
    dist.reduce_scatter_tensor(output, inp, async_op=True).wait()
    assert_equal(output, inp.view(ctx.world_size, *out_shape).chunk(ctx.world_size)[ctx.rank][0] * ctx.world_size)


@case("ProcessGroup.reduce_scatter_tensor_coalesced", "tensor lists", "float32")
def reduce_scatter_tensor_coalesced(ctx):
    torch.manual_seed(42)
    out_shapes = [(5, 5), (10, 10), (15, 15)]
    outputs = [torch.empty(s) for s in out_shapes]
    inputs = [torch.rand((s[0] * ctx.world_size,) + s[1:]) for s in out_shapes]
    ctx.pg.reduce_scatter_tensor_coalesced(outputs, inputs).wait()
    for output, inp in zip(outputs, inputs):
        expected = inp.view(ctx.world_size, *output.shape).chunk(ctx.world_size)[ctx.rank][0] * ctx.world_size
        assert_equal(output, expected)


# ---- barrier -----------------------------------------------------------------------------------

@case("barrier", "sync and async", "-")
def barrier_forms(ctx):
    dist.barrier()
    dist.barrier(async_op=True).wait()
    ctx.pg.barrier().wait()
