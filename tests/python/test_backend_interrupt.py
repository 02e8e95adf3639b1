"""Ctrl-C in a blocked collective (issue 12, defect 5): SIGINT to a rank waiting in all_reduce for a
peer that never comes raises KeyboardInterrupt at once (not at the op timeout), the op is aborted
and the other ranks waiting in it fail promptly. Timings are hang guards only: the group timeout
is 60 s, the bounds are far below it and far above what the fix needs."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed

TIMEOUT_S = 60


def _blocked(rank, world, async_op, flag_dir):
    t = torch.ones(1000)
    if rank == world - 1:
        # Never joins, and stays alive (its exit would end the others' wait) until the others
        # are done or well past their bounds.
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and len(os.listdir(flag_dir)) < world - 1:
            time.sleep(0.1)
        return None
    try:
        return _blocked_rank(rank, async_op)
    finally:
        open(os.path.join(flag_dir, str(rank)), "w").close()


def _blocked_rank(rank, async_op):
    t = torch.ones(1000)
    if rank != 0:
        start = time.monotonic()
        try:
            dist.all_reduce(t)
        except dist.DistBackendError as e:
            return "DistBackendError", time.monotonic() - start, str(e)
        return "completed", time.monotonic() - start, ""
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    raised = ""
    try:
        try:
            work = dist.all_reduce(t, async_op=async_op)
            if async_op:
                work.wait()  # raises the abort; the KeyboardInterrupt follows at the next call
        except dist.DistBackendError:
            raised = "DistBackendError then "
            time.sleep(1)
    except KeyboardInterrupt:
        raised += "KeyboardInterrupt"
    return raised or "nothing", time.monotonic() - start, ""


@pytest.mark.parametrize("env", [{}, {"ZEROPLUS_SHM": "off"}], ids=["shm", "tcp"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_sigint_in_blocked_allreduce_raises_keyboard_interrupt_promptly(env, async_op, tmp_path):
    results = run_distributed(_blocked, 3, async_op, str(tmp_path), env=env, timeout=TIMEOUT_S + 30,
                              pg_timeout=TIMEOUT_S)
    raised, elapsed, _ = results[0]
    if async_op:
        assert raised in ("KeyboardInterrupt", "DistBackendError then KeyboardInterrupt"), raised
    else:
        assert raised == "KeyboardInterrupt", raised
    assert elapsed < 15, f"rank 0 took {elapsed:.1f} s to react to SIGINT (op timeout {TIMEOUT_S} s)"
    kind, elapsed, message = results[1]
    assert kind == "DistBackendError", (kind, message)
    assert elapsed < 20, f"rank 1 learnt of the abort after {elapsed:.1f} s: {message}"


def _own_handler(rank, world):
    # A program with its own SIGINT handler keeps its ops: nothing is aborted.
    got = []
    signal.signal(signal.SIGINT, lambda *_: got.append(1))
    pg = dist.new_group(backend="zeroplus")
    t = torch.ones(10)
    if rank == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    else:
        time.sleep(2)
    dist.all_reduce(t, group=pg)
    return t, got


def test_own_sigint_handler_is_left_alone():
    out = run_distributed(_own_handler, 2, backend="gloo", timeout=60)
    assert torch.equal(out[0][0], torch.full((10,), 2.0)) and out[0][1] == [1]
