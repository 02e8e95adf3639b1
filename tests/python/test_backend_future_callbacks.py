"""Collectives issued from a Work future's callbacks (Future.then), on shared memory and TCP.

c10d runs a future's callbacks on the thread that completes it, which for zeroplus is the
group's worker (or the caller of an inline sync op). A callback that issues a collective and
waits for it used to wait on the very thread that had to run it: a self-deadlock (torch's
hook_with_zero_step_interleaved does exactly this). Each case runs under a short timeout so a
regression shows as a failure, not a hung suite.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed, run_pooled

TRANSPORTS = {"shm": {}, "tcp": {"ZEROPLUS_SHM": "off"}}


def _nested_from_then(rank, world_size):
    out = {}
    t = torch.full((8,), float(rank + 1))

    def wait_work(fut):  # async collective + Work.wait() inside the callback
        x = torch.full((4,), 10.0 * (rank + 1))
        dist.all_reduce(x, async_op=True).wait()
        return x

    def sync_op(fut):  # synchronous collective inside the callback
        x = torch.full((3,), float(rank))
        dist.broadcast(x, src=1)
        return x

    def future_wait(fut):  # the nested op's own future, waited on inside the callback
        x = torch.full((2,), 1.0)
        return dist.all_reduce(x, async_op=True).get_future().wait()[0]

    def depth_two(fut):  # a callback whose nested op has a callback that nests again
        x = torch.full((5,), float(rank + 1))
        inner = dist.all_reduce(x, async_op=True).get_future().then(lambda f: wait_work(f) + f.value()[0].sum())
        return inner.wait()

    cases = [("wait_work", wait_work), ("sync_op", sync_op), ("future_wait", future_wait), ("depth_two", depth_two)]
    for i, (name, callback) in enumerate(cases):
        # One rank comes late, so the other attaches its callback before the op completes and
        # runs it on the completing thread (a callback attached after completion runs at once on
        # the caller's thread, which never deadlocked); which rank alternates.
        if rank == i % 2:
            time.sleep(0.3)
        out[name] = dist.all_reduce(t.clone(), async_op=True).get_future().then(callback).wait()
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_collectives_nested_in_future_callbacks(transport):
    for out in run_pooled(_nested_from_then, 2, env=TRANSPORTS[transport], timeout=40, pg_timeout=20):
        assert torch.equal(out["wait_work"], torch.full((4,), 30.0))
        assert torch.equal(out["sync_op"], torch.full((3,), 1.0))
        assert torch.equal(out["future_wait"], torch.full((2,), 2.0))
        assert torch.equal(out["depth_two"], torch.full((4,), 30.0) + 15.0)


def _interleaved_with_main_thread(rank, world_size):
    # Many async allreduces, each with a callback that broadcasts from it, while the main thread
    # keeps issuing ops: every rank must run the same sequence (a mismatch would mix up data).
    results, futures, tails = [], [], []
    for i in range(40):
        t = torch.full((64 + i,), float(i + rank))

        def then(fut, i=i):
            b = torch.full((16,), float(100 * i + rank))
            dist.broadcast(b, src=i % world_size)
            return fut.value()[0].clone(), b

        futures.append(dist.all_reduce(t, async_op=True).get_future().then(then))
        tail = torch.full((32,), float(rank))
        tails.append((tail, dist.all_reduce(tail, async_op=True)))
    for fut in futures:
        results.append(fut.wait())
    for tail, work in tails:
        work.wait()
        assert torch.equal(tail, torch.full((32,), float(sum(range(world_size)))))
    return results


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_callbacks_keep_one_op_order_on_every_rank(transport):
    for per_rank in run_pooled(_interleaved_with_main_thread, 2, env=TRANSPORTS[transport], timeout=40,
                                    pg_timeout=20):
        for i, (reduced, broadcast) in enumerate(per_rank):
            assert torch.equal(reduced, torch.full((64 + i,), float(2 * i + 1)))
            assert torch.equal(broadcast, torch.full((16,), float(100 * i + i % 2)))


def _peer_dies_under_a_nested_op(rank, world_size):
    import os

    t = torch.ones(1000)
    if rank == 1:
        time.sleep(1)  # so rank 0 attaches its callback before the op completes (the phase path)
        dist.all_reduce(t)
        os._exit(7)  # gone before the op rank 0's callback issues

    def nested(fut):
        dist.all_reduce(torch.ones(1000), async_op=True).wait()

    try:
        dist.all_reduce(t, async_op=True).get_future().then(nested).wait()
    except Exception as e:  # the nested op's DistBackendError, through the callback's future
        return str(e)
    return None


def test_peer_lost_while_a_callback_waits_is_an_error_not_a_hang():
    message, _ = run_distributed(_peer_dies_under_a_nested_op, 2, env={"ZEROPLUS_SHM": "off"}, timeout=40,
                                 pg_timeout=10, expected_exits={1: 7})
    assert message is not None and "allreduce" in message, message
