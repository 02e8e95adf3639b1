"""A /dev/shm too small for the shared-memory segments (issue 12, defect 1), end to end: 2 ranks in
a private mount namespace whose /dev/shm is a 6 MiB tmpfs (as in many containers). With
ZEROPLUS_SHM=auto every rank falls back to TCP and reduces correctly; with =on every rank's
init_process_group fails naming /dev/shm, its free space and the bytes needed. Before the fix a
rank died of SIGBUS. Needs root (mount namespace + tmpfs); skipped otherwise. The core cases
(1/3/6/64 MiB) are in tests/cpp/process_group/shm_space_test.cpp."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

_HERE = pathlib.Path(__file__).resolve().parent

_CHILD = """
import sys
from harness import run_distributed, DistributedTestError
import test_backend_small_devshm as m
try:
    print("RESULT", run_distributed(m.{fn}, 2, env={{"ZEROPLUS_SHM": "{mode}"}}, timeout=60, pg_timeout=20))
except DistributedTestError as e:
    print("ERROR", e)
"""


def _allreduce(rank, world):
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    return float(t.min()), float(t.max())


def _allreduce_in_two_groups(rank, world):
    first = _allreduce(rank, world)
    group = dist.new_group([0, 1])
    t = torch.ones(1 << 20)
    dist.all_reduce(t, group=group)
    return first, (float(t.min()), float(t.max()))


def _in_small_devshm(mode, fn="_allreduce"):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a small /dev/shm")
    inner = "mount --make-rprivate / && mount -t tmpfs -o size=6m,mode=1777 tmpfs /dev/shm && exec \"$0\" -c \"$1\""
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", inner, sys.executable, _CHILD.format(mode=mode, fn=fn)],
        cwd=_HERE, capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )
    if proc.returncode != 0 and "mount" in proc.stderr and "RESULT" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace: {proc.stderr.strip()[:200]}")
    return proc.stdout + proc.stderr


def test_auto_falls_back_to_tcp_when_devshm_is_small():
    out = _in_small_devshm("auto")
    assert "RESULT [(2.0, 2.0), (2.0, 2.0)]" in out, out


def test_on_fails_on_every_rank_naming_devshm():
    out = _in_small_devshm("on")
    assert "ERROR" in out, out
    for rank in (0, 1):
        assert f"--- rank {rank} raised" in out, out
    assert out.count("/dev/shm has ") >= 2 and str(4 * (1 << 20) + 4096) in out, out


def test_auto_says_once_per_process_why_it_fell_back():
    # Issue 29 item 6: the fallback used to be silent. Two groups per rank, one line per rank
    # process, naming /dev/shm's free space and how to silence it.
    out = _in_small_devshm("auto", "_allreduce_in_two_groups")
    assert "RESULT [((2.0, 2.0), (2.0, 2.0)), ((2.0, 2.0), (2.0, 2.0))]" in out, out
    notes = [line for line in out.splitlines() if "zeroplus: shared memory unavailable" in line]
    assert len(notes) == 2, out
    for line in notes:
        assert "/dev/shm has " in line and "ZEROPLUS_SHM=off" in line and "uses TCP" in line, line
