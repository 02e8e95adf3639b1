"""Reading a checkpoint: resolve the directory, parse the manifest, read verified element ranges.

CheckpointReader(path) accepts a checkpoint directory (it holds manifest.json) or a root whose
`latest` file names one. Reads are by value: read(name, key, lo, hi) returns the flat elements
[lo, hi) of one value of one tensor, assembled from every chunk overlapping the range, after
checking the CRC-32 of every block of every file it touched. Only the blocks that overlap the
requested ranges are read (a rank loading its shard reads its shard, plus at most one partial
block at each end of each range).

Shard files are opened right after the manifest is read, relative to the same directory
descriptor, and kept open: a save that replaces the checkpoint while it is being read cannot take
them away (the reader goes on reading the checkpoint whose manifest it read). A checkpoint of more
shard files than a quarter of the free descriptors (RLIMIT_NOFILE; saved by ~1,000 ranks or more)
is read with at most that many open at once, the least recently used closed first; a shard missing
then because the checkpoint was replaced meanwhile is reported as that, never as a corrupt one, and
running out of descriptors (EMFILE) is an OSError of its own, never corruption.

Errors (all OSError subclasses naming the file): FileNotFoundError for a missing manifest or
shard file, CheckpointCorruptError for a wrong size (truncated), a checksum mismatch (of a block,
or of the manifest itself: format.py) or a range no chunk covers, CheckpointVersionError for a
newer format, CheckpointError for a malformed manifest, a `latest` pointer that names anything but
a plain sibling directory, or a checkpoint replaced during the read. A path (or the directory
`latest` names) that is a symbolic link of this user or root is followed; another user's is
refused (files.open_directory).
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import resource
import threading
import zlib
from collections import OrderedDict, defaultdict

import torch

from .. import files
from . import fsutil
from .checksum import crc32
from .format import (DTYPE_BYTES, LATEST, MANIFEST, CheckpointCorruptError, CheckpointError, check_dir_name,
                     parse_manifest)

_MAX_RUN_BLOCKS = 16  # one read call of verify_file covers at most this many checksum blocks
# A load's read tasks cover about this many bytes each (whole blocks, at least one): several
# threads each reading a few MiB and checking it while the others' reads are in flight kept the
# disk busier than 64 MiB tasks (two ranks reading 300 MB each with the page cache dropped: 8-16
# MiB tasks 0.15-0.31 s, 64 MiB 0.38-0.67 s, bench notes in docs/checkpoints.md).
_RUN_BYTES = 8 << 20
_MAX_BOUNCE_BYTES = 64 << 20  # and verify_file's buffer at most this (or one block, at most 64 MiB)


def resolve(path) -> str:
    """The checkpoint directory `path` denotes (itself, or what its `latest` names)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not path:
        raise ValueError("checkpoint: path must not be empty")
    if os.path.isfile(os.path.join(path, MANIFEST)) or not os.path.lexists(os.path.join(path, LATEST)):
        return path
    dir_fd = files.open_directory(path)
    try:
        fd = files.open_regular_at(dir_fd, LATEST)
        try:
            name = fsutil.read_exact(fd, min(os.fstat(fd).st_size, 4096), 0, LATEST).decode(errors="replace").strip()
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    return os.path.join(path, check_dir_name(name, f"{os.path.join(path, LATEST)}"))


def _descriptor_budget() -> int:
    """How many shard files a reader keeps open: a quarter of the descriptors this process has
    left under RLIMIT_NOFILE (others need some too), at least 4, at most 1024."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    free = (1 << 20) if soft == resource.RLIM_INFINITY else soft - in_use
    return max(4, min(1024, free // 4))


class CheckpointReader:
    def __init__(self, path):
        self.path = resolve(path)
        try:
            self.dir_fd = files.open_directory(self.path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "checkpoint: no such checkpoint directory", self.path) from None
        self._fds: OrderedDict[int, int] = OrderedDict()  # file index -> fd, least recently used first
        self._bounce: bytearray | None = None
        where = os.path.join(self.path, MANIFEST)
        try:
            fd = files.open_regular_at(self.dir_fd, MANIFEST)
        except FileNotFoundError:
            self.close()
            raise FileNotFoundError(errno.ENOENT, "checkpoint: no manifest (not a checkpoint, or one whose save did "
                                                  "not complete)", where) from None
        try:
            data = fsutil.read_exact(fd, os.fstat(fd).st_size, 0, where)
        finally:
            os.close(fd)
        self.manifest_crc32 = zlib.crc32(data)  # which manifest this is (ranks compare it)
        try:
            self.manifest = parse_manifest(bytes(data), where)
        except BaseException:
            self.close()
            raise
        self.block = self.manifest["block_bytes"]
        self._chunks = defaultdict(list)  # (name, key) -> [(lo, hi, dtype, file, offset)]
        for name, key, lo, hi, dtype, fi, off in self.manifest["chunks"]:
            self._chunks[(name, key)].append((lo, hi, dtype, fi, off))
        for lst in self._chunks.values():
            lst.sort()
        self._max_open = _descriptor_budget()
        self._missing: set[int] = set()  # shard files absent when the manifest was read
        try:
            for fi in range(min(len(self.manifest["files"]), self._max_open)):
                try:
                    self._fd(fi)
                except FileNotFoundError:
                    self._missing.add(fi)  # raised when it is read (inspect reports it per file)
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE):
                        break  # the rest are opened when read, a few at a time
                    # anything else (a wrong size, a link) is raised again when the file is read
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if getattr(self, "dir_fd", None) is not None:
            os.close(self.dir_fd)
            self.dir_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def file_path(self, fi: int) -> str:
        return os.path.join(self.path, self.manifest["files"][fi]["name"])

    def _replaced(self) -> bool:
        """The directory this reader opened is no longer the checkpoint at its path (a save
        replaced or removed it)."""
        try:
            mine = os.fstat(self.dir_fd)
            if mine.st_nlink == 0:
                return True
            now = os.stat(self.path)
        except OSError:
            return True
        return (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev)

    def _open(self, fi: int) -> int:
        name = self.manifest["files"][fi]["name"]
        try:
            return files.open_regular_at(self.dir_fd, name)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE) or not self._fds:
                raise
        while self._fds:  # out of descriptors: give back the ones this reader holds, then once more
            os.close(self._fds.popitem(last=False)[1])
        return files.open_regular_at(self.dir_fd, name)

    def _fd(self, fi: int) -> int:
        if fi in self._fds:
            self._fds.move_to_end(fi)
            return self._fds[fi]
        rec = self.manifest["files"][fi]
        try:
            if fi in self._missing:
                raise FileNotFoundError
            fd = self._open(fi)
        except FileNotFoundError:
            if self._replaced():
                raise CheckpointError(errno.ESTALE, "checkpoint: the checkpoint was replaced (or removed) by a save "
                                                    "while it was being read; read it again", self.path) from None
            raise FileNotFoundError(errno.ENOENT, "checkpoint: shard file listed in the manifest is missing",
                                    self.file_path(fi)) from None
        size = os.fstat(fd).st_size
        if size != rec["bytes"]:
            os.close(fd)
            raise CheckpointCorruptError(errno.EIO, f"checkpoint: shard file has {size} bytes, the manifest "
                                                    f"says {rec['bytes']} (truncated or torn)", self.file_path(fi))
        while len(self._fds) >= self._max_open:
            os.close(self._fds.popitem(last=False)[1])
        self._fds[fi] = fd
        return fd

    def verify_file(self, fi: int) -> None:
        """Every block of file fi against its checksum (inspect)."""
        blocks = -(-self.manifest["files"][fi]["bytes"] // self.block)
        self._fd(fi)  # the size check, also for an empty file
        run = max(1, min(_MAX_RUN_BLOCKS, _MAX_BOUNCE_BYTES // self.block))
        for first in range(0, blocks, run):
            self._read_blocks(fi, first, min(blocks, first + run))

    def _verify(self, fi: int, first: int, view) -> None:
        """view holds file fi's bytes from block `first` on, whole blocks (the file's last may be
        short): each must match its CRC-32."""
        rec = self.manifest["files"][fi]
        for i, a in enumerate(range(0, len(view), self.block)):
            b = first + i
            if crc32(view[a:a + self.block]) != rec["block_crc32"][b]:
                raise CheckpointCorruptError(errno.EIO, f"checkpoint: checksum mismatch in bytes [{b * self.block}, "
                                                        f"{min((b + 1) * self.block, rec['bytes'])}) (corrupt file)",
                                             self.file_path(fi))

    def _read_blocks(self, fi: int, first: int, last: int, into=None) -> memoryview:
        """Blocks [first, last) of file fi, each checked against its CRC-32: into `into` (a
        writable buffer of exactly their size) or a buffer reused by the next call."""
        rec = self.manifest["files"][fi]
        fd = self._fd(fi)
        lo = first * self.block
        hi = min(last * self.block, rec["bytes"])
        if into is None:
            if self._bounce is None or len(self._bounce) < hi - lo:
                self._bounce = bytearray(hi - lo)
            into = memoryview(self._bounce)[:hi - lo]
        fsutil.read_into(fd, into, lo, self.file_path(fi))
        self._verify(fi, first, into)
        return into

    def has(self, name: str, key: str) -> bool:
        return (name, key) in self._chunks

    def read_many(self, requests: list[tuple[str, str, int, int]]) -> list[torch.Tensor]:
        """For each (name, key, lo, hi): a CPU tensor of hi - lo elements in the saved dtype."""
        out = []
        by_file = defaultdict(list)  # file -> [(byte_lo, byte_hi, out tensor bytes view, out byte offset)]
        for name, key, lo, hi in requests:
            chunks = self._chunks.get((name, key), [])
            dtype = chunks[0][2] if chunks else "float32"
            pieces, covered = [], 0  # chunks do not overlap (parse_manifest): covered counts each element once
            for clo, chi, cdtype, fi, off in chunks if hi > lo else ():
                a, z = max(lo, clo), min(hi, chi)
                if a >= z:
                    continue
                if cdtype != dtype:
                    raise CheckpointError(f"checkpoint: {name}/{key} is stored in two dtypes ({dtype}, {cdtype})")
                es = DTYPE_BYTES[dtype]
                self._fd(fi)  # its real size is the manifest's: the bytes below exist on disk
                pieces.append((fi, off + (a - clo) * es, off + (z - clo) * es, (a - lo) * es))
                covered += z - a
            if hi > lo and covered != hi - lo:
                raise CheckpointCorruptError(errno.EIO, f"checkpoint: elements [{lo}, {hi}) of {name!r} ({key}) are not "
                                                        f"all in the shard files (the manifest is torn)",
                                             os.path.join(self.path, MANIFEST))
            # Allocated only now: its size is bounded by the shard files' real sizes, whatever
            # sizes a damaged manifest claims.
            t = torch.empty(hi - lo, dtype=getattr(torch, dtype))
            out.append(t)
            raw = t.view(torch.uint8)
            for fi, blo, bhi, at in pieces:
                by_file[fi].append((blo, bhi, raw, at))
        for fi, pieces in by_file.items():
            self._serve(fi, sorted(pieces, key=lambda p: p[0]))
        return out

    def _serve(self, fi: int, pieces) -> None:
        """Fill each piece (file bytes [lo, hi) -> raw[at:]). Planned first, then run as tasks on
        a few threads (preadv and the CRC release the GIL, so reads and checks of different
        blocks overlap): the blocks wholly inside a piece are read straight into the destination
        and checked there (no second copy); each block a piece covers only in part is read and
        checked once, into a buffer of its own, however many pieces (small tensors) share it,
        then copied to each of them."""
        size, bs = self.manifest["files"][fi]["bytes"], self.block
        run_blocks = max(1, _RUN_BYTES // bs)
        fd = self._fd(fi)  # opened here, in the calling thread (the descriptor cache is not shared)
        tasks, partial = [], defaultdict(list)  # partial: block -> [(from, to, raw, at)]
        for lo, hi, raw, at in pieces:
            b, last = lo // bs, (hi - 1) // bs
            while b <= last:
                start, end = b * bs, min((b + 1) * bs, size)
                if start >= lo and end <= hi:  # whole blocks: a run of them, read in place
                    k = b
                    while k < last and k + 1 - b < run_blocks and min((k + 2) * bs, size) <= hi:
                        k += 1
                    stop = min((k + 1) * bs, size)
                    dst = memoryview(raw[at + (start - lo):at + (stop - lo)].numpy())
                    tasks.append((start, self._read_run, (fd, fi, b, k + 1, dst)))
                    b = k + 1
                else:
                    a, z = max(lo, start), min(hi, end)
                    partial[b].append((a - start, z - start, raw, at + (a - lo)))
                    b += 1
        tasks += [(b * bs, self._read_partial, (fd, fi, b, copies)) for b, copies in partial.items()]
        tasks.sort(key=lambda t: t[0])  # in file order: the disk sees (mostly) sequential reads
        _run_tasks([(fn, args) for _at, fn, args in tasks])

    def _read_run(self, fd: int, fi: int, first: int, last: int, into) -> None:
        lo = first * self.block
        fsutil.read_into(fd, into, lo, self.file_path(fi))
        self._verify(fi, first, into)

    def _read_partial(self, fd: int, fi: int, b: int, copies) -> None:
        lo = b * self.block
        buf = bytearray(min(lo + self.block, self.manifest["files"][fi]["bytes"]) - lo)
        self._read_run(fd, fi, b, b + 1, memoryview(buf))
        src = torch.frombuffer(buf, dtype=torch.uint8)
        for a, z, raw, at in copies:
            raw[at:at + (z - a)].copy_(src[a:z])


_pool = None  # (pid, ThreadPoolExecutor): made on first use, made again in a forked child
_pool_lock = threading.Lock()
_READ_THREADS = max(1, min(4, os.cpu_count() or 1))


def _run_tasks(tasks) -> None:
    """Run (fn, args) tasks to completion, on the reader threads when there are several; the
    first failing task's exception (in task order) is raised once every task has ended, so no
    task still writes into a destination the caller is about to drop."""
    global _pool
    if len(tasks) <= 1 or _READ_THREADS == 1:
        for fn, args in tasks:
            fn(*args)
        return
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(_READ_THREADS,
                                                                         thread_name_prefix="zeroplus-ckpt-read"))
        executor = _pool[1]
    futures = [executor.submit(fn, *args) for fn, args in tasks]
    concurrent.futures.wait(futures)
    for f in futures:
        if f.exception() is not None:
            raise f.exception()
