"""Writing one rank's shard file: bytes, block checksums, durability.

write_shard(dir_fd, dir_path, rank, pieces, io) lays the pieces out back to back in
rankNNNNN.bin (each large piece and each coalesced group starting at a 4 KiB-aligned offset, the
gap before it zero), computing the CRC-32 of every `block_bytes` block as the bytes go out, and makes the
file durable under its final name (temp name -> fdatasync -> rename -> fsync dir; fsutil.py).
Returns the file record and the chunk table the manifest needs.

ShardWriter does the work (write_shard is its one-call form). An item of `pieces` may also be a LazyPieces (adapters.py: a bucket whose values live in swap
files): its pieces are written inside its `resident()` context, and every write of them has
completed (and the coalescing buffer is flushed) before the context is left, so the swapper can
reuse their buffers: at most one such bucket is resident at a time.

Bulk bytes go through zeroplus.aio.AioHandle (io="aio": io_uring, several requests in flight,
O_DIRECT where the file system takes it, the CRC of a piece computed while the engine writes it) into the temporary file this module
created exclusively inside the checkpoint's private 0700 staging directory (nobody else can plant
a link there); small pieces are coalesced into one buffer first. io="posix" uses pwrite on the
same descriptor. Either way the file is fdatasync'ed through our own descriptor, and its inode is
checked to be the one we created before it is renamed into place.
"""

from __future__ import annotations

import errno
import os
import zlib

import torch

from .. import files
from . import fsutil
from .format import BLOCK_BYTES, shard_file_name  # noqa: F401  (the default block size)

_COALESCE_BYTES = 1 << 20   # pieces smaller than this are packed into one write
_FLUSH_BYTES = 8 << 20      # the coalescing buffer is written out at this size
# Writes start at multiples of this, so the aio engine can send them with O_DIRECT: buffered
# writes followed by fdatasync ran at a fifth of the disk's O_DIRECT bandwidth here (fio, 1 GiB:
# 0.26 vs 1.37 GB/s). 4 KiB covers every STATX_DIOALIGN offset alignment of common devices; where
# a file system wants more, the engine writes that request buffered (correct, only slower).
_ALIGN = 4096
_ZEROS = bytes(_ALIGN)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A CPU uint8 view of a contiguous 1-D tensor's bytes (bf16 has no numpy twin: view first)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().view(torch.uint8)


class _BlockCrc:
    """CRC-32 of consecutive `block` byte blocks of a byte stream fed in order."""

    def __init__(self, block: int):
        self.block, self.crcs, self.cur, self.fill = block, [], 0, 0

    def feed(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            take = min(self.block - self.fill, len(data) - pos)
            self.cur = zlib.crc32(data[pos:pos + take], self.cur)
            self.fill += take
            pos += take
            if self.fill == self.block:
                self.crcs.append(self.cur)
                self.cur, self.fill = 0, 0

    def finish(self) -> list[int]:
        if self.fill:
            self.crcs.append(self.cur)
            self.cur, self.fill = 0, 0
        return self.crcs


class _Sink:
    """Where the bytes go: AioHandle queued writes or pwrite. Keeps written tensors alive."""

    def __init__(self, fd: int, path: str, io: str):
        self.fd, self.path = fd, path
        self.handle = None
        if io == "aio":
            from ..aio import AioHandle

            self.handle = AioHandle(block_size=1 << 20, queue_depth=16, threads=1, direct="auto")
        self.keep = []

    def write(self, data: torch.Tensor, offset: int) -> None:
        if self.handle is not None:
            self.keep.append(data)
            self.handle.async_pwrite(data, self.path, offset)
        else:
            fsutil.write_all(self.fd, data.numpy(), offset)

    def finish(self) -> None:
        if self.handle is not None:
            try:
                self.handle.wait()
            finally:
                self.keep.clear()

    drain = finish  # every queued write done: the tensors written may be reused


class ShardWriter:
    """One shard file being written: add() pieces in file order (more than once: an async save
    writes its swapped buckets in the caller's thread and the snapshot later, on its writer
    thread), then finish() (durable under the final name) or abort() (the temporary file is
    removed). Owns a duplicate of dir_fd until finish/abort. Raises OSError (ENOSPC, EFBIG,
    EIO...); the caller aborts then."""

    def __init__(self, dir_fd: int, dir_path: str, rank: int, io: str = "aio", block_bytes: int = BLOCK_BYTES):
        self.final = shard_file_name(rank)
        self.dir_fd = os.dup(dir_fd)
        try:
            self.fd, self.tmp = files.create_temporary_at(self.dir_fd, fsutil.temp_prefix(self.final))
        except BaseException:
            os.close(self.dir_fd)
            raise
        self.sink = _Sink(self.fd, os.path.join(dir_path, self.tmp), io)
        self.crc = _BlockCrc(block_bytes)
        self.chunks, self.offset = [], 0
        self.pending, self.pending_at, self.pending_bytes = [], 0, 0

    def _align(self) -> None:
        pad = -self.offset % _ALIGN
        if pad:  # a hole in the file, zero when read; the checksums cover it as zeros
            self.crc.feed(memoryview(_ZEROS)[:pad])
            self.offset += pad

    def _flush(self) -> None:
        if self.pending:
            buf = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
            self.sink.write(buf, self.pending_at)
            self.pending, self.pending_bytes = [], 0

    def _place(self, name, key, lo, hi, tensor) -> None:
        data = as_bytes(tensor.detach().reshape(-1))
        n = data.numel()
        dtype = str(tensor.dtype).replace("torch.", "")
        if n == 0:  # nothing to place: no alignment either (a pad at the end would be a hole past EOF)
            self.chunks.append([name, key, lo, hi, dtype, 0, self.offset])
            return
        if n >= _COALESCE_BYTES:
            self._flush()
            self._align()
        elif not self.pending:
            self._align()
            self.pending_at = self.offset
        self.chunks.append([name, key, lo, hi, dtype, 0, self.offset])
        if n < _COALESCE_BYTES:
            self.pending.append(data.clone() if self.sink.handle is not None else data)
            self.pending_bytes += n
            if self.pending_bytes >= _FLUSH_BYTES:
                self._flush()
        else:
            self.sink.write(data, self.offset)  # queued first: the engine writes while we checksum
        self.crc.feed(memoryview(data.numpy()))
        self.offset += n

    def add(self, pieces) -> None:
        for item in pieces:
            if not isinstance(item, tuple):  # LazyPieces: resident only inside its context
                with item.resident() as resident:
                    for piece in resident:
                        self._place(*piece)
                    self._flush()
                    self.sink.drain()  # nothing in flight reads the swapper's buffers after this
                continue
            self._place(*item)
        if self.sink.handle is None:
            self._flush()  # posix: pending holds views of the caller's tensors, valid only now

    def finish(self) -> tuple[dict, list]:
        try:
            try:
                self._flush()
                self.sink.finish()
                os.fdatasync(self.fd)
                st = os.fstat(self.fd)
                here = os.stat(self.tmp, dir_fd=self.dir_fd, follow_symlinks=False)
                if (here.st_ino, here.st_dev) != (st.st_ino, st.st_dev) or st.st_size != self.offset:
                    raise OSError(errno.EIO, f"checkpoint: shard file changed under the writer (size {st.st_size}, "
                                             f"expected {self.offset})", self.tmp)
            finally:
                os.close(self.fd)
                self.fd = -1
            fsutil.publish(self.dir_fd, self.tmp, self.final)
        except BaseException:
            self.abort()
            raise
        os.close(self.dir_fd)
        self.dir_fd = -1
        return {"name": self.final, "bytes": self.offset, "block_crc32": self.crc.finish()}, self.chunks

    def abort(self) -> None:
        """Removes the temporary file (idempotent)."""
        if self.dir_fd < 0:
            return
        try:
            self.sink.finish()
        except OSError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        fsutil.remove_quietly(self.dir_fd, self.tmp)
        os.close(self.dir_fd)
        self.dir_fd = -1


def write_shard(dir_fd: int, dir_path: str, rank: int, pieces: list, io: str = "aio",
                block_bytes: int = BLOCK_BYTES, started: ShardWriter | None = None) -> tuple[dict, list]:
    """pieces: (name, key, lo, hi, tensor) or LazyPieces -> ({name, bytes, block_crc32}, [[name, key, lo, hi,
    dtype, 0, offset]]), appended to `started` (a ShardWriter given pieces already) when given.
    The file index (0) is filled in by the manifest builder. Raises OSError (ENOSPC, EFBIG, EIO...);
    the temporary file is removed then, and nothing is left under the final name."""
    writer = ShardWriter(dir_fd, dir_path, rank, io, block_bytes) if started is None else started
    try:
        writer.add(pieces)
    except BaseException:
        writer.abort()
        raise
    return writer.finish()


def write_swapped_first(root: str, staging: str, rank: int, pieces: list, io: str,
                        block_bytes: int) -> tuple[ShardWriter | None, list]:
    """An async save's swapped buckets (LazyPieces): written into the shard now, in the caller's
    thread, one bucket resident at a time (a copy of them in memory could exceed it, and training
    changes the swap files once it goes on); returns the started writer (None: nothing swapped)
    and the in-memory pieces, which the caller snapshots and writes later with write_shard(...,
    started=writer)."""
    lazy = [p for p in pieces if not isinstance(p, tuple)]
    if not lazy:
        return None, pieces
    root_fd = files.open_directory_at(None, root)
    try:
        staging_fd = files.open_directory_at(root_fd, staging, owned=True)
        try:
            writer = ShardWriter(staging_fd, os.path.join(root, staging), rank, io, block_bytes)
        finally:
            os.close(staging_fd)
    finally:
        os.close(root_fd)
    try:
        writer.add(lazy)
    except BaseException:
        writer.abort()
        raise
    return writer, [p for p in pieces if isinstance(p, tuple)]
