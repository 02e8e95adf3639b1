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

import errno
import os
import resource
import zlib
from collections import OrderedDict, defaultdict

import torch

from .. import files
from . import fsutil
from .format import (DTYPE_BYTES, LATEST, MANIFEST, CheckpointCorruptError, CheckpointError, check_dir_name,
                     parse_manifest)

_MAX_RUN_BLOCKS = 16  # one read call of verify_file covers at most this many checksum blocks
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
        self._bounce: torch.Tensor | None = None  # verify_file's buffer
        self._crcs: dict[int, torch.Tensor] = {}  # file index -> its block CRCs, as the op takes them
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
        """Every block of file fi against its checksum (inspect), a run of blocks at a time into
        one buffer (a sparse file's apparent size never costs memory at once)."""
        size = self.manifest["files"][fi]["bytes"]
        self._fd(fi)  # the size check, also for an empty file
        run = max(1, min(_MAX_RUN_BLOCKS, _MAX_BOUNCE_BYTES // self.block)) * self.block
        for lo in range(0, size, run):
            hi = min(size, lo + run)
            if self._bounce is None or len(self._bounce) < hi - lo:
                self._bounce = torch.empty(hi - lo, dtype=torch.uint8)
            self._read(fi, [(lo, hi, self._bounce, 0)])

    def _read(self, fi: int, pieces) -> None:
        """File fi's bytes [lo, hi) into raw[at:] for each (lo, hi, raw, at), raw a uint8 tensor,
        every block touched checked against its CRC-32 (optimizers/core/checkpoint/verified_read:
        whole blocks in place, shared partial blocks read once, on its threads without the GIL);
        the errors name the file."""
        fd = self._fd(fi)  # opened here, in the calling thread (the descriptor cache is not shared)
        rec = self.manifest["files"][fi]
        crcs = self._crcs.get(fi)
        if crcs is None:
            crcs = self._crcs[fi] = torch.tensor(rec["block_crc32"], dtype=torch.int64)
        rc, corrupt, message = torch.ops.zeroplus.verified_read(
            fd, rec["bytes"], self.block, crcs, [p[0] for p in pieces], [p[1] for p in pieces],
            [p[2] for p in pieces], [p[3] for p in pieces])
        if rc != 0:
            raise (CheckpointCorruptError if corrupt else OSError)(-rc, message, self.file_path(fi))

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
            self._read(fi, pieces)
        return out
