"""zeroplus.aio hardening (issue 12, defects 3, 7, 9, 10): sizes that overflow, one descriptor
per file however many operations are queued, FIFOs and special files, atomic whole-file writes
from Python and staging buffers that cannot be allocated. Each case failed before its fix.

Rlimits, hangs and mounts are exercised in child processes (a rlimit must not leak into the
test runner, and a regression that blocks must fail the test, not hang it)."""

import errno
import os
import subprocess
import sys

import pytest
import torch

import zeroplus  # noqa: F401  (loads libzeroplus.so)
import zeroplus.aio as aio

ENGINES = ["io_uring", "threads"]


def _handle(engine="threads", **kw):
    try:
        return aio.AioHandle(block_size=64 << 10, queue_depth=8, threads=1, engine=engine, **kw)
    except OSError as e:
        if engine == "io_uring" and e.errno in (errno.ENOSYS, errno.EPERM, errno.EACCES):
            pytest.skip(f"io_uring unavailable: {e}")
        raise


def _require_engine(engine):
    """Skips (with the reason) before a child is started when this kernel refuses io_uring, as
    _handle does in-process; a child that then fails is a failure, never a skip."""
    _handle(engine)


def _run_child(code, *args, timeout=60):
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env=os.environ.copy())
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _bytes(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _supports_direct(directory):
    probe = os.path.join(directory, ".odirect-probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


# ---------------------------------------------------------------------------------------------
# Defect 3: size arithmetic on user input never wraps around.


def test_locked_tensor_size_overflow_checks():
    h = aio.AioHandle()
    # 2**61 + 512 float64s used to return a 2.3e18-element tensor over a 4 KiB allocation.
    for numel, dtype in ((2**61 + 512, torch.float64), (2**62, torch.float32), (2**63 - 1, torch.int16),
                         (2**63 - 1, torch.complex128)):
        with pytest.raises(RuntimeError, match="new_cpu_locked_tensor: numel=") as ei:
            h.new_cpu_locked_tensor(numel, dtype)
        assert str(numel) in str(ei.value)
    with pytest.raises(ValueError, match="numel"):
        h.new_cpu_locked_tensor(2**63, torch.uint8)
    t = h.new_cpu_locked_tensor(3, torch.float64)  # ordinary sizes are unaffected
    assert t.numel() == 3 and t.nbytes == 24


def test_offset_plus_length_overflow_checks(tmp_path):
    h = aio.AioHandle()
    path = tmp_path / "o"
    with pytest.raises(RuntimeError, match="offset") as ei:
        h.async_pwrite(torch.zeros(8, dtype=torch.uint8), path, 2**63 - 4)
    assert str(2**63 - 4) in str(ei.value)
    with pytest.raises(ValueError, match="file_offset"):
        h.async_pread(torch.zeros(8, dtype=torch.uint8), path, 2**63)
    assert h.wait() == 0
    assert not path.exists()  # refused before the open that would have created it


def test_staging_bytes_larger_than_memory_checks():
    with pytest.raises(RuntimeError, match="staging_bytes=4611686018427387904"):
        aio.AioHandle(staging_bytes=2**62)


_STAGING_CHILD = r"""
import resource, sys, torch, zeroplus, zeroplus.aio as aio
h = aio.AioHandle(staging_bytes=1 << 30, engine="threads")
vm = int(open("/proc/self/statm").read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
t = torch.arange(8192, dtype=torch.uint8)[1:]   # odd address: O_DIRECT needs the staging path
for _ in range(2):
    try:
        h.sync_pwrite(t, sys.argv[1])
        print("OK")
    except BaseException as e:
        print("ERR", type(e).__name__, getattr(e, "errno", None), str(e).splitlines()[0])
"""


def test_staging_allocation_failure_names_staging_bytes_checks(tmp_path):
    if not _supports_direct(str(tmp_path)):
        pytest.skip("no O_DIRECT under TMPDIR: CPU tensors never take the staging path")
    out = _run_child(_STAGING_CHILD, tmp_path / "s")
    lines = out.splitlines()
    assert len(lines) == 2, out
    for line in lines:  # every write says what to change, not "std::bad_alloc"
        assert line.startswith(f"ERR OSError {errno.ENOMEM}") and "staging_bytes" in line, out


# ---------------------------------------------------------------------------------------------
# Defect 7: one open file per (file, mode) per handle, however many operations are queued.

_FD_CHILD = r"""
import os, resource, sys, torch, zeroplus, zeroplus.aio as aio
path, engine, n = sys.argv[1], sys.argv[2], 3000
h = aio.AioHandle(engine=engine, queue_depth=8, staging_bytes=4096)
fds = lambda: len(os.listdir("/proc/self/fd"))
base = fds()
resource.setrlimit(resource.RLIMIT_NOFILE, (base + 32, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
src = [torch.full((8,), i % 251, dtype=torch.uint8) for i in range(n)]
for i, t in enumerate(src):
    h.async_pwrite(t, path, 8 * i)
print("PENDING_FDS", fds() - base)
assert h.wait() == n
dst = [torch.empty(8, dtype=torch.uint8) for _ in range(n)]
for i, t in enumerate(dst):
    h.async_pread(t, path, 8 * i)
assert h.wait() == n
assert all(torch.equal(a, b) for a, b in zip(src, dst))
print("AFTER_FDS", fds() - base)
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_queued_ops_share_one_descriptor_stress(tmp_path, engine):
    # Before: every queued op held its own File (2 descriptors), EMFILE after ~16 ops here.
    _require_engine(engine)
    out = _run_child(_FD_CHILD, tmp_path / "f", engine)
    counts = dict(line.split() for line in out.splitlines())
    assert int(counts["PENDING_FDS"]) <= 4, out  # one File: buffered (+ O_DIRECT, + reopened buffered)
    assert int(counts["AFTER_FDS"]) == 0, out  # closed once wait() released the operations
    assert os.path.getsize(tmp_path / "f") == 8 * 3000


def test_open_error_names_the_operations_range_checks(tmp_path):
    h = aio.AioHandle()
    path = tmp_path / "missing"
    with pytest.raises(FileNotFoundError) as ei:
        h.async_pread(torch.empty(10), path, 4096)
    assert ei.value.filename == str(path)
    assert "offset 4096, length 40" in str(ei.value)  # was "offset 0, length 0"


# ---------------------------------------------------------------------------------------------
# Defect 9: FIFOs and special files are refused at the call, never block, never discard data.

_SPECIAL_CHILD = r"""
import os, sys, torch, zeroplus, zeroplus.aio as aio
fifo, directory, engine = sys.argv[1], sys.argv[2], sys.argv[3]
h = aio.AioHandle(engine=engine)
t = torch.arange(4096, dtype=torch.uint8)
for op, path in (("async_pwrite", fifo), ("async_pwrite", "/dev/null"), ("async_pread", "/dev/zero"),
                 ("async_pread", directory), ("async_pread", fifo)):
    try:
        getattr(h, op)(t, path)
        print("ACCEPTED", op, path, flush=True)
        h.wait()
    except OSError as e:
        print("REFUSED", op, path, type(e).__name__, e.errno, e.filename == path, flush=True)
print("DONE", h.pending())
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_fifo_and_special_files_are_refused_checks(tmp_path, engine):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # A hang (the old behaviour for a FIFO without a writer) fails through the timeout.
    _require_engine(engine)
    out = _run_child(_SPECIAL_CHILD, fifo, tmp_path, engine, timeout=60)
    assert "ACCEPTED" not in out, out
    assert f"REFUSED async_pwrite {fifo} OSError {errno.EINVAL} True" in out, out
    assert f"REFUSED async_pread {fifo} OSError {errno.EINVAL} True" in out, out
    assert f"REFUSED async_pwrite /dev/null OSError {errno.EINVAL} True" in out, out
    assert f"REFUSED async_pread /dev/zero OSError {errno.EINVAL} True" in out, out
    assert f"REFUSED async_pread {tmp_path} IsADirectoryError {errno.EISDIR} True" in out, out
    assert "DONE 0" in out, out


def test_special_file_error_names_the_type_checks(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file or block device.*FIFO") as ei:
        aio.AioHandle().async_pwrite(torch.zeros(4), fifo)
    assert ei.value.errno == errno.EINVAL and str(fifo) in str(ei.value)


# ---------------------------------------------------------------------------------------------
# Defect 10: atomic whole-file writes from Python; a failure never destroys the old file.


@pytest.mark.parametrize("engine", ENGINES)
def test_atomic_write_replaces_whole_file_basics(tmp_path, engine):
    h = _handle(engine)
    path = tmp_path / "ckpt"
    path.write_bytes(b"old" * 100000)
    for i, n in enumerate((0, 1, 4097, (1 << 20) + 3)):
        src = _bytes(n, i)
        assert h.atomic_write(src, path) == 1
        assert path.read_bytes() == bytes(src.numpy())  # exact size: the old tail is gone
    view = _bytes(10001, 9)[1:]  # unaligned address: the staging path
    h.atomic_write(view, str(path))
    assert path.read_bytes() == bytes(view.numpy())
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary left behind
    assert h.pending() == 0


_EFBIG_ATOMIC_CHILD = r"""
import os, resource, signal, sys, torch, zeroplus, zeroplus.aio as aio
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # else the kernel kills us instead of EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
h = aio.AioHandle(engine=sys.argv[2])
try:
    h.atomic_write(torch.ones(1 << 20, dtype=torch.uint8), sys.argv[1])
    print("WROTE")
except OSError as e:
    print("ERRNO", e.errno, flush=True)
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_atomic_write_failure_keeps_old_file_checks(tmp_path, engine):
    path = tmp_path / "ckpt"
    old = bytes(_bytes(4096, 1).numpy())
    path.write_bytes(old)
    _require_engine(engine)
    out = _run_child(_EFBIG_ATOMIC_CHILD, path, engine)
    assert f"ERRNO {errno.EFBIG}" in out, out
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["ckpt"]


def test_atomic_write_enospc_keeps_old_file_checks(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for ENOSPC: {r.stderr.strip()}")
    try:
        path = mnt / "ckpt"
        old = bytes(_bytes(256 << 10, 2).numpy())
        path.write_bytes(old)
        h = aio.AioHandle()
        with pytest.raises(OSError) as ei:
            h.atomic_write(torch.ones(2 << 20, dtype=torch.uint8), path)
        assert ei.value.errno == errno.ENOSPC, ei.value
        assert path.read_bytes() == old
        assert os.listdir(mnt) == ["ckpt"]
        # Contrast (why docs/aio.md warns): the in-place write destroys what it overwrote.
        with pytest.raises(OSError):
            h.sync_pwrite(torch.ones(2 << 20, dtype=torch.uint8), path)
        assert path.read_bytes() != old
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_atomic_write_argument_checks(tmp_path):
    h = aio.AioHandle()
    with pytest.raises(TypeError, match="tensor"):
        h.atomic_write([1, 2], tmp_path / "x")
    with pytest.raises(TypeError, match="filename"):
        h.atomic_write(torch.zeros(1), 3)
    with pytest.raises(FileNotFoundError):
        h.atomic_write(torch.zeros(1), tmp_path / "no-such-dir" / "x")
    assert os.listdir(tmp_path) == []


def test_atomic_write_keeps_mode_and_refuses_special_files_checks(tmp_path):
    h = aio.AioHandle()
    secret = tmp_path / "secret"
    secret.write_bytes(b"old")
    secret.chmod(0o600)
    h.atomic_write(torch.ones(10, dtype=torch.uint8), secret)
    assert secret.stat().st_mode & 0o7777 == 0o600
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="regular files only") as ei:
        h.atomic_write(torch.ones(10, dtype=torch.uint8), fifo)
    assert ei.value.errno == errno.EINVAL and ei.value.filename == str(fifo)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "secret"]


def test_block_device_is_accepted_basics(tmp_path):
    # Raw block devices (an NVMe namespace for swap) stay allowed; a loop device stands in.
    backing = tmp_path / "backing"
    backing.write_bytes(b"\0" * (1 << 20))
    r = subprocess.run(["losetup", "-f", "--show", str(backing)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot attach a loop device: {r.stderr.strip()}")
    dev = r.stdout.strip()
    try:
        h = aio.AioHandle()
        src = h.new_cpu_locked_tensor(64 << 10, torch.uint8)
        src.copy_(_bytes(64 << 10, 5))
        h.sync_pwrite(src, dev, 4096)
        dst = torch.empty(64 << 10, dtype=torch.uint8)
        h.sync_pread(dst, dev, 4096)
        assert torch.equal(src, dst)
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
