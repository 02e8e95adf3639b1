"""Bucketing, fusion, inline sync ops and the shared-memory transport: results with the fast
paths on and off, option forwarding, segment hygiene (permissions, stale names, crashes)."""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed, run_pooled
from test_backend_collectives import check_every_collective

SHM_ON = {"ZEROPLUS_SHM": "on"}
SHM_OFF = {"ZEROPLUS_SHM": "off"}
NO_FAST = {"ZEROPLUS_SHM": "off", "ZEROPLUS_FUSE": "0", "ZEROPLUS_BUCKET_BYTES": "0", "ZEROPLUS_INLINE_SYNC": "0"}
SMALL = {"ZEROPLUS_SHM": "on", "ZEROPLUS_BUCKET_BYTES": "20K", "ZEROPLUS_SHM_CHUNK_BYTES": "8K"}


@pytest.mark.parametrize("env", [SHM_OFF, NO_FAST, SMALL], ids=["shm_off", "all_off", "tiny_buckets"])
def test_every_collective_with_fast_paths_toggled(env):
    # test_backend_collectives runs the same matrix with the defaults (shared memory on).
    for numel in [1001, 70000]:
        check_every_collective(2, numel, timeout=240, env=env)


def _fused_stream(rank, world):
    """Async allreduces of mixed dtypes, ops and sizes, issued with rank-dependent pauses (so the
    ranks queue different numbers of ops and must agree on what to fuse), plus other ops."""
    g = torch.Generator().manual_seed(7)
    specs = []
    for i in range(300):
        dtype = [torch.float32, torch.float32, torch.bfloat16, torch.int64][int(torch.randint(4, (1,), generator=g))]
        op = ["SUM", "SUM", "MAX", "AVG"][int(torch.randint(4, (1,), generator=g))]
        if op == "AVG" and not dtype.is_floating_point:
            op = "SUM"
        numel = int(torch.randint(0, 3000, (1,), generator=g)) if i % 50 else 300_000  # some exceed the bucket
        specs.append((dtype, op, numel))
    tensors, works = [], []
    for i, (dtype, op, numel) in enumerate(specs):
        t = torch.arange(numel).remainder(13).add(rank + i % 5).to(dtype)
        tensors.append(t)
        works.append(dist.all_reduce(t, op=getattr(dist.ReduceOp, op), async_op=True))
        if rank == i % world and i % 7 == 0:
            time.sleep(0.002)
        if i % 97 == 0:
            b = torch.full((5,), float(rank))
            dist.broadcast(b, src=0)  # a sync op between async ones: issue order must hold
            assert torch.equal(b, torch.zeros(5))
    for w in works:
        w.wait()
    out = []
    for i, ((dtype, op, numel), t) in enumerate(zip(specs, tensors)):
        base = torch.arange(numel).remainder(13).add(i % 5).double()
        vals = [base + r for r in range(world)]
        if op == "MAX":
            exp = torch.stack(vals).max(0).values
        else:
            exp = torch.stack(vals).sum(0) / (world if op == "AVG" else 1)
        out.append((t, exp.to(dtype)))
    return out


@pytest.mark.parametrize("world_size,env", [(2, {}), (3, {}), (2, SHM_OFF)], ids=["2_shm", "3_shm", "2_tcp"])
def test_fused_async_allreduces_match_reference(world_size, env):
    results = run_pooled(_fused_stream, world_size, timeout=180, env=dict(env, ZEROPLUS_BUCKET_BYTES="256K"))
    for out in results:
        for i, (mine, exp) in enumerate(out):
            tol = 2e-2 * world_size if mine.dtype == torch.bfloat16 else 1e-6
            if mine.dtype.is_floating_point:
                torch.testing.assert_close(mine.double(), exp.double(), rtol=tol, atol=tol, msg=str(i))
            else:
                assert torch.equal(mine, exp), i
    for i in range(len(results[0])):
        assert torch.equal(results[0][i][0], results[-1][i][0]), i


def _coalesced_views(rank, world):
    flat = torch.arange(10_000, dtype=torch.float32) + rank
    views = [flat[0:1000], flat[1000:1001], flat[1001:5000], flat[5000:10_000]]
    dist.all_reduce_coalesced(views)  # back to back in one buffer: no copy on TCP
    scattered = [torch.full((n,), float(rank + i)) for i, n in enumerate([3, 0, 4096, 70_000, 5])]
    dist.all_reduce_coalesced(scattered, op=dist.ReduceOp.AVG)
    return flat, scattered


@pytest.mark.parametrize("env", [SHM_ON, SHM_OFF], ids=["shm", "tcp"])
def test_allreduce_coalesced_buckets(env):
    world = 2
    for flat, scattered in run_pooled(_coalesced_views, world, env=dict(env, ZEROPLUS_BUCKET_BYTES="16K")):
        torch.testing.assert_close(flat, (torch.arange(10_000, dtype=torch.float32) * 2 + 1))
        for i, t in enumerate(scattered):
            torch.testing.assert_close(t, torch.full_like(t, i + 0.5))


def _with_options(rank, world, fields):
    import zeroplus

    pg = dist.new_group(backend="zeroplus", pg_options=zeroplus.BackendOptions(**fields))
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)
    return t


def test_backend_options_are_forwarded_and_validated():
    out = run_pooled(_with_options, 2, {"shm": "off", "bucket_bytes": 1 << 16, "fuse": False}, backend="gloo")
    assert torch.equal(out[0], torch.full((3,), 2.0))
    with pytest.raises(AssertionError, match="BackendOptions.shm='bogus' is invalid, expected auto, on or off"):
        run_pooled(_with_options, 2, {"shm": "bogus"}, backend="gloo", timeout=60)


def _mismatched_tuning(rank, world):
    try:
        dist.new_group(backend="zeroplus")
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None


def test_ranks_with_different_tuning_fail_at_creation():
    # Only rank 1 sets the variable: the harness env applies to every rank, so set it inside.
    out = run_pooled(_tuning_rank_dependent, 2, backend="gloo", timeout=60)
    assert any(m and "tuning" in m for m in out), out


def _tuning_rank_dependent(rank, world):
    if rank == 1:
        os.environ["ZEROPLUS_BUCKET_BYTES"] = "1M"
    return _mismatched_tuning(rank, world)


def _segments_of(pid):
    return glob.glob(f"/dev/shm/zeroplus-{pid}-*")


def _shm_hygiene(rank, world, stale_pid):
    t = torch.ones(1000)
    dist.all_reduce(t)
    maps = open("/proc/self/maps").read()
    mapped = sorted({line.split()[-2] for line in maps.splitlines() if "/dev/shm/zeroplus-" in line})
    named = _segments_of(os.getpid())  # unlinked right after set-up
    return {"mapped": mapped, "named": named, "stale_left": os.path.exists(f"/dev/shm/zeroplus-{stale_pid}-00-r0"),
            "sum": float(t[0])}


def test_segments_are_private_unlinked_and_stale_ones_removed():
    # A name left by a "crashed" run: its pid is a reaped child, so it surely no longer exists.
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    stale = f"/dev/shm/zeroplus-{pid}-00-r0"
    with open(stale, "w") as f:
        f.write("x")
    os.chmod(stale, 0o600)
    try:
        out = run_distributed(_shm_hygiene, 2, pid, env=SHM_ON)
    finally:
        if os.path.exists(stale):
            os.unlink(stale)
    for r in out:
        assert r["sum"] == 2.0
        assert len(r["mapped"]) == 2, r  # own segment and the peer's, both already deleted
        assert r["named"] == [], r
        assert not r["stale_left"]


def _crash_mid_allreduce(rank, world):
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(7)
    start = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - start
    return None


def test_peer_crash_during_shm_allreduce_is_an_error_not_a_hang():
    out = run_distributed(_crash_mid_allreduce, 2, env=SHM_ON, expected_exits={1: 7}, pg_timeout=60, timeout=90)
    name, message, elapsed = out[0]
    assert name == "DistBackendError", out[0]
    assert "peer 1" in message or "rank 1" in message, message
    assert elapsed < 30  # well before the 60 s op timeout: detected through the pid
