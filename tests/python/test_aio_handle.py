"""zeroplus.aio.AioHandle: round trips of random tensors (sizes 0, 1 byte, unaligned tails,
offsets, several files, concurrent handles) through both engines with O_DIRECT on and off,
the DeepSpeed-style API, and error paths with the file system left as expected (_checks)."""

import errno
import os
import resource
import signal
import subprocess
import sys
import threading

import pytest
import torch

import zeroplus  # noqa: F401  (loads libzeroplus.so)
import zeroplus.aio as aio

ENGINES = ["io_uring", "threads"]
DIRECT = ["auto", "off"]
# 0, 1 byte, sub-page, page+1, odd multi-block sizes: every tail/alignment case.
NBYTES = [0, 1, 511, 4095, 4097, (1 << 20) + 123, (3 << 20) + 4096]


def _handle(engine, direct, **kw):
    try:
        return aio.AioHandle(block_size=kw.pop("block_size", 256 << 10), queue_depth=kw.pop("queue_depth", 8),
                             threads=kw.pop("threads", 2), engine=engine, direct=direct,
                             staging_bytes=kw.pop("staging_bytes", 1 << 20), **kw)
    except OSError as e:  # only an io_uring request on a kernel/seccomp profile without it
        if engine == "io_uring" and e.errno in (errno.ENOSYS, errno.EPERM, errno.EACCES):
            pytest.skip(f"io_uring unavailable: {e}")
        raise


def _random_bytes(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct", DIRECT)
@pytest.mark.parametrize("locked", [True, False], ids=["locked", "pageable"])
def test_round_trip_sizes_basics(tmp_path, engine, direct, locked):
    h = _handle(engine, direct)
    assert h.get_engine() == engine
    for i, n in enumerate(NBYTES):
        for offset in (0, 4096):
            src = _random_bytes(n, 10 * i + offset)
            if locked:
                a = h.new_cpu_locked_tensor(n, torch.uint8)
                a.copy_(src)
                b = h.new_cpu_locked_tensor(n, src)  # example-tensor form, as in DeepSpeed
            else:
                a, b = src.clone(), torch.empty(n, dtype=torch.uint8)
            path = tmp_path / f"f{i}_{offset}"
            assert h.async_pwrite(a, path, offset) == 0
            assert h.wait() == 1
            assert os.path.getsize(path) == (offset + n if n else 0)
            assert h.sync_pread(b, str(path), offset) == 1
            assert torch.equal(a, b), (n, offset)


@pytest.mark.parametrize("engine", ENGINES)
def test_dtypes_and_shapes_basics(tmp_path, engine):
    h = _handle(engine, "auto")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8):
        src = torch.randn(37, 129, generator=g).to(dtype)
        dst = torch.empty_like(src)
        h.sync_pwrite(src, tmp_path / str(dtype))
        h.sync_pread(dst, tmp_path / str(dtype))
        assert torch.equal(src, dst)
    # A slice that starts at an unaligned address goes through staging.
    base = torch.arange(5000, dtype=torch.int16)
    view = base[3:]
    out = torch.zeros_like(view)
    h.sync_pwrite(view, tmp_path / "view")
    h.sync_pread(out, tmp_path / "view")
    assert torch.equal(view, out)


def test_unaligned_offset_auto_goes_buffered_basics(tmp_path):
    h = _handle("io_uring", "auto")
    src = _random_bytes(10001, 3)
    dst = torch.empty_like(src)
    h.sync_pwrite(src, tmp_path / "u", 7)
    h.sync_pread(dst, tmp_path / "u", 7)
    assert torch.equal(src, dst)
    assert os.path.getsize(tmp_path / "u") == 10008


@pytest.mark.parametrize("engine", ENGINES)
def test_many_files_in_flight_stress(tmp_path, engine):
    h = _handle(engine, "auto", queue_depth=16)
    srcs = [_random_bytes((256 << 10) * (i + 1) + i, i) for i in range(8)]
    for i, s in enumerate(srcs):
        h.async_pwrite(s, tmp_path / f"m{i}")
    assert h.pending() == 8
    assert h.wait() == 8
    outs = [torch.empty_like(s) for s in srcs]
    for i, o in enumerate(outs):
        h.async_pread(o, tmp_path / f"m{i}")
    assert h.wait() == 8
    assert h.wait() == 0
    for s, o in zip(srcs, outs):
        assert torch.equal(s, o)


def test_concurrent_handles_stress(tmp_path):
    errors = []

    def worker(k):
        try:
            h = _handle(ENGINES[k % 2], DIRECT[k % 2])
            for rep in range(5):
                src = _random_bytes((1 << 20) + 17 * k + rep, 100 * k + rep)
                dst = torch.empty_like(src)
                h.sync_pwrite(src, tmp_path / f"c{k}")
                h.sync_pread(dst, tmp_path / f"c{k}")
                assert torch.equal(src, dst)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_knobs_and_aliases_basics():
    h = aio.AioHandle(block_size=1 << 19, queue_depth=4, intra_op_parallelism=3, direct="off")
    assert (h.get_block_size(), h.get_queue_depth(), h.get_threads()) == (1 << 19, 4, 3)
    assert h.get_intra_op_parallelism() == 3 and h.get_direct() == "off"
    assert h.get_engine() in ("io_uring", "threads")
    assert aio.AioHandle(thread_count=2).get_thread_count() == 2
    assert "AioHandle(" in repr(h)


def test_locked_tensor_is_exact_and_aligned_basics():
    h = aio.AioHandle()
    for n in (0, 1, 1000, (5 << 20) + 3):
        t = h.new_cpu_locked_tensor(n, torch.float32)
        assert t.shape == (n,) and t.dtype == torch.float32 and t.device.type == "cpu"
        if n:
            assert t.data_ptr() % 4096 == 0
    t = h.new_cpu_locked_tensor(10, torch.float16)
    del h  # memory outlives the handle
    t.fill_(1.5)
    assert float(t.sum()) == 15.0


# ---------------------------------------------------------------------------------------------
# _checks: argument errors name the argument; I/O errors are OSError with errno and path.


def test_argument_checks():
    with pytest.raises(ValueError, match="queue_depth"):
        aio.AioHandle(queue_depth=0)
    with pytest.raises(TypeError, match="block_size"):
        aio.AioHandle(block_size=1.5)
    with pytest.raises(ValueError, match="engine"):
        aio.AioHandle(engine="libaio")
    with pytest.raises(ValueError, match="direct"):
        aio.AioHandle(direct="yes")
    h = aio.AioHandle()
    with pytest.raises(TypeError, match="tensor"):
        h.async_pwrite([1, 2], "/tmp/x")
    with pytest.raises(TypeError, match="filename"):
        h.async_pwrite(torch.zeros(1), 3)
    with pytest.raises(ValueError, match="file_offset"):
        h.async_pwrite(torch.zeros(1), "/tmp/x", -1)
    with pytest.raises(ValueError, match="contiguous"):
        h.async_pwrite(torch.zeros(4, 4).t(), "/tmp/x")
    with pytest.raises(ValueError, match="numel"):
        h.new_cpu_locked_tensor(-1)


@pytest.mark.parametrize("engine", ENGINES)
def test_missing_file_checks(tmp_path, engine):
    h = _handle(engine, "auto")
    path = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as ei:
        h.async_pread(torch.empty(10), path)
    assert ei.value.errno == errno.ENOENT and ei.value.filename == str(path)
    assert str(path) in str(ei.value) and "offset 0" in str(ei.value)
    assert not path.exists()
    assert h.wait() == 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct", DIRECT)
def test_read_past_end_checks(tmp_path, engine, direct):
    h = _handle(engine, direct)
    h.sync_pwrite(_random_bytes(10000, 1), tmp_path / "short")
    ok = torch.empty(100, dtype=torch.uint8)
    h.async_pread(ok, tmp_path / "short")
    h.async_pread(torch.empty(300000, dtype=torch.uint8), tmp_path / "short")
    with pytest.raises(OSError) as ei:
        h.wait()
    assert ei.value.errno == errno.ENODATA
    assert "read" in str(ei.value) and str(tmp_path / "short") in str(ei.value)
    assert h.pending() == 0  # every op was waited for, the good one included
    assert os.path.getsize(tmp_path / "short") == 10000


_EFBIG_CHILD = r"""
import resource, signal, sys, torch
import zeroplus, zeroplus.aio as aio
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # else the kernel kills us instead of EFBIG
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
h = aio.AioHandle(engine=sys.argv[2])
try:
    h.sync_pwrite(torch.zeros(2 << 20, dtype=torch.uint8), sys.argv[1])
except OSError as e:
    print("ERRNO", e.errno, flush=True)
"""


@pytest.mark.parametrize("limit", [1 << 20, (1 << 20) + 1000])
@pytest.mark.parametrize("engine", ENGINES)
def test_file_size_limit_efbig_checks(tmp_path, engine, limit):
    # A child process: the rlimit must not leak into the test runner. An unaligned limit makes the
    # kernel refuse the O_DIRECT request crossing it with EINVAL (it would be cut to an unaligned
    # length): the engine must still report EFBIG, having written up to the limit.
    path = tmp_path / "big"
    _handle(engine, "auto")  # skips, with the reason, where this kernel refuses io_uring
    r = subprocess.run([sys.executable, "-c", _EFBIG_CHILD, str(path), engine, str(limit)], capture_output=True,
                       text=True, timeout=120, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    assert f"ERRNO {errno.EFBIG}" in r.stdout, r.stdout + r.stderr
    assert os.path.getsize(path) == limit  # up to the limit, nothing beyond


def test_permission_denied_checks(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"x" * 4096)
    path.chmod(0)
    os.chmod(tmp_path, 0o755)
    if os.geteuid() == 0:
        # root ignores mode bits: check from a child running as nobody.
        code = ("import torch, zeroplus, zeroplus.aio as aio, os, sys\n"
                "os.setgid(65534); os.setuid(65534)\n"
                "try:\n aio.AioHandle().sync_pread(torch.empty(4096, dtype=torch.uint8), sys.argv[1])\n"
                "except PermissionError as e:\n print('EACCES', e.errno)\n")
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
        if "Permission denied" in r.stderr and "EACCES" not in r.stdout and "zeroplus" not in r.stderr:
            pytest.skip(f"cannot run the child as nobody: {r.stderr[-300:]}")
        assert f"EACCES {errno.EACCES}" in r.stdout, r.stdout + r.stderr
    else:
        with pytest.raises(PermissionError):
            aio.AioHandle().sync_pread(torch.empty(4096, dtype=torch.uint8), path)
    assert path.stat().st_size == 4096  # untouched


def test_direct_on_rejects_unaligned_offset_checks(tmp_path):
    h = _handle("io_uring", "on")
    (tmp_path / "a").write_bytes(b"\0" * 8192)
    with pytest.raises(OSError) as ei:
        h.async_pwrite(torch.zeros(4096, dtype=torch.uint8), tmp_path / "a", 100)
    assert ei.value.errno == errno.EINVAL and "multiple of" in str(ei.value)
    assert (tmp_path / "a").read_bytes() == b"\0" * 8192
