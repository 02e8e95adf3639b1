"""Parity cases: point-to-point (send/recv, tags, any source, isend/irecv, batch_isend_irecv),
subgroups and monitored_barrier. Ported from test_c10d_gloo.py and distributed_test.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parity import assert_equal, case, raises


@case("ProcessGroup.send/recv", "all to all", "int64")
def pg_send_recv_all_to_all(ctx):
    # test_c10d_gloo.test_send_recv_all_to_all
    inputs = [torch.tensor([ctx.rank]) for _ in range(ctx.world_size)]
    outputs = [torch.tensor([-1]) for _ in range(ctx.world_size)]
    sends = [ctx.pg.send([inputs[i]], i, 0) for i in range(ctx.world_size) if i != ctx.rank]
    recvs = [ctx.pg.recv([outputs[i]], i, 0) for i in range(ctx.world_size) if i != ctx.rank]
    for w in sends + recvs:
        w.wait()
        assert w.is_completed()
    for i in range(ctx.world_size):
        if i != ctx.rank:
            assert_equal(outputs[i], torch.tensor([i]))


@case("send/recv", "ring, several dtypes", "float32,float64,int64,bool")
def send_recv_ring(ctx):
    nxt, prv = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    for dtype in [torch.float32, torch.float64, torch.int64, torch.bool]:
        send = torch.full((7,), ctx.rank % 2, dtype=dtype)
        recv = torch.empty(7, dtype=dtype)
        # even ranks send first, odd ranks receive first: blocking send/recv cannot deadlock
        if ctx.rank % 2 == 0:
            dist.send(send, nxt)
            dist.recv(recv, prv)
        else:
            dist.recv(recv, prv)
            dist.send(send, nxt)
        assert_equal(recv, torch.full((7,), prv % 2, dtype=dtype))


@case("send/recv", "with tag", "float32")
def send_recv_with_tag(ctx):
    # distributed_test._test_send_recv_with_tag
    tensor = torch.full((10,), float(ctx.rank))
    for dst in range(ctx.world_size):
        if dst == ctx.rank:
            for src in range(ctx.world_size):
                if src == ctx.rank:
                    continue
                out = torch.full((10,), -1.0)
                dist.recv(out, src, tag=src)
                assert_equal(out, torch.full((10,), float(src)))
        else:
            dist.send(tensor, dst, tag=ctx.rank)


@case("send/recv", "checks", "-")
def send_recv_checks(ctx):
    # Sending to itself: torch's Python layer raises ValueError. Receiving from itself: gloo
    # raises RuntimeError (its pair to itself is not connected).
    raises(ValueError, dist.send, torch.ones(1), ctx.rank)
    raises(RuntimeError, dist.recv, torch.ones(1), ctx.rank)


@case("new_group", "all_reduce and all_gather in a subgroup", "float32")
def subgroup_collectives(ctx):
    # distributed_test *_group tests: a group of ranks [0, 1]; every rank creates it.
    group = dist.new_group([0, 1])
    if ctx.rank in (0, 1):
        t = torch.full((3,), float(ctx.rank + 1))
        dist.all_reduce(t, group=group)
        assert_equal(t, torch.full((3,), 3.0))
        out = [torch.empty(3) for _ in range(2)]
        dist.all_gather(out, torch.full((3,), float(ctx.rank)), group=group)
        assert_equal(out, [torch.zeros(3), torch.ones(3)])
    dist.destroy_process_group(group)


@case("monitored_barrier", "default group", "-", zeroplus=False)
def monitored_barrier(ctx):
    # torch's Python layer raises "monitored_barrier is only implemented for GLOO backend" for
    # every other backend before any backend code runs.
    dist.monitored_barrier()


def _batch_p2p(ctx, tags):
    ops, recvs = [], {}
    for src in range(ctx.world_size):
        if src == ctx.rank:
            continue
        recvs[src] = torch.full((src + 1,), -1.0)
        ops.append(dist.P2POp(dist.irecv, recvs[src], src, tag=src if tags else 0))
        ops.append(dist.P2POp(dist.isend, torch.full((ctx.rank + 1,), float(ctx.rank + 1)), src,
                              tag=ctx.rank if tags else 0))
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    for src, t in recvs.items():
        assert_equal(t, torch.full((src + 1,), float(src + 1)))


@case("batch_isend_irecv", "P2POp list", "float32")
def batch_isend_irecv(ctx):
    _batch_p2p(ctx, tags=False)


@case("batch_isend_irecv", "P2POp list with tags", "float32")
def batch_isend_irecv_tags(ctx):
    _batch_p2p(ctx, tags=True)


@case("isend/irecv", "all pairs", "float32")
def isend_irecv(ctx):
    # Every rank posts its receives before its sends. Registered near the end: a backend that runs
    # point-to-point ops strictly in issue order deadlocks here until the op timeout.
    works, outs = [], {}
    for peer in range(ctx.world_size):
        if peer == ctx.rank:
            continue
        outs[peer] = torch.empty(peer + 1)
        works.append(dist.irecv(outs[peer], peer))
        works.append(dist.isend(torch.full((ctx.rank + 1,), float(ctx.rank)), peer))
    for w in works:
        w.wait()
    for peer, t in outs.items():
        assert_equal(t, torch.full((peer + 1,), float(peer)))


@case("send/recv", "recv from any source", "float32")
def send_recv_any_source(ctx):
    # Registered last: on a backend without any-source receives the unreceived messages would
    # otherwise be taken by the next case's receives.
    # distributed_test._test_send_recv_any_source (recv and irecv without src)
    tensor = torch.full((10,), float(ctx.rank))
    recv_ranks = []
    for dst in range(ctx.world_size):
        if dst == ctx.rank:
            for _ in range(ctx.world_size - 1):
                out = torch.full((10,), -1.0)
                sender = dist.recv(out)
                assert_equal(out, torch.full((10,), float(sender)))
                recv_ranks.append(sender)
            for _ in range(ctx.world_size - 1):
                out = torch.full((10,), -1.0)
                work = dist.irecv(out)
                work.wait()
                sender = work._source_rank()
                assert_equal(out, torch.full((10,), float(sender)))
                recv_ranks.append(sender)
        else:
            dist.send(tensor, dst)
            dist.send(tensor, dst)
    assert sorted(recv_ranks) == sorted(2 * [r for r in range(ctx.world_size) if r != ctx.rank])
    # As distributed_test: a rank still receiving from any source would otherwise take the next
    # case's first message.
    dist.barrier()
