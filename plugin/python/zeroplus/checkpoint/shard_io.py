"""Writing one rank's shard file: bytes, block checksums, durability.

write_shard(dir_fd, dir_path, rank, pieces, io) lays the pieces out back to back in
rankNNNNN.bin (each coalesced group starting at a 4 KiB-aligned offset, each large piece on the
page after it, at its address's place in a page for io="aio", see below; the gaps zero), computing
the CRC-32 of every `block_bytes` block as the bytes go out, and makes the file durable under its
final name (temp name -> fdatasync -> rename; the staging directory is fsynced once, by rank 0,
before the commit; fsutil.py, commit.py).
Returns the file record and the chunk table the manifest needs.

Bulk bytes go through zeroplus.aio.AioHandle (io="aio": io_uring, several requests in flight,
O_DIRECT where the file system takes it, the CRC of a piece computed while the engine writes it) into the temporary file this module
created exclusively inside the checkpoint's private 0700 staging directory (nobody else can plant
a link there); small pieces are coalesced into one buffer first. io="posix" uses pwrite on the
same descriptor. Either way the file is fdatasync'ed through our own descriptor, and its inode is
checked to be the one we created before it is renamed into place.

Zero-copy O_DIRECT (io="aio"): O_DIRECT needs the memory address aligned as well as the file
offset, and a live tensor's data rarely starts on a page (torch aligns to 64 bytes), so the engine
would copy every such byte through its staging buffers first. Instead a large piece is placed at a
file offset congruent to its address modulo 4 KiB (a few zero bytes of padding before it): its
first partial page goes out through a 4 KiB aligned bounce buffer (the padding zeros plus the
piece's first bytes), the rest straight from the tensor's memory at an aligned offset (the engine
writes a final partial page buffered). The tensor must not change until the write is done: the
writer waits for it before returning, and its callers hold either a snapshot or a training
thread that is blocked in the save.
"""

from __future__ import annotations

import errno
import os

import torch

from .. import files
from . import fsutil
from .checksum import crc32
from .format import BLOCK_BYTES, shard_file_name  # noqa: F401  (the default block size)

_COALESCE_BYTES = 1 << 20   # pieces smaller than this are packed into one write
# Through the page cache, a large piece goes out in segments of this size: each segment's writes
# (and its checksum, computed meanwhile) are waited for, then its write-back to the disk started
# (fsutil.start_writeback), so the disk writes segment k while the cache takes k + 1, instead of
# everything waiting for the final fdatasync (0.6 GB over 2 ranks: 0.08 s into the cache, then
# 0.13 s fdatasync, one after the other).
_SEGMENT_BYTES = 32 << 20
_FLUSH_BYTES = 8 << 20      # the coalescing buffer is written out at this size
# Writes start at multiples of this, so the aio engine can send them with O_DIRECT: buffered
# writes followed by fdatasync ran at a fifth of the disk's O_DIRECT bandwidth here (fio, 1 GiB:
# 0.26 vs 1.37 GB/s). 4 KiB covers every STATX_DIOALIGN offset alignment of common devices; where
# a file system wants more, the engine writes that request buffered (correct, only slower).
_ALIGN = 4096
_ZEROS = bytes(_ALIGN)


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A CPU uint8 tensor of nbytes whose data starts on a 4 KiB boundary (a view into a
    slightly larger allocation, which the view keeps alive)."""
    raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % _ALIGN
    return raw[skip:skip + nbytes]


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
            self.cur = crc32(data[pos:pos + take], self.cur)
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

    def __init__(self, fd: int, path: str, io: str, direct: str = "auto"):
        self.fd, self.path = fd, path
        self.buffered = io != "aio" or direct == "off"  # through the page cache (then fdatasync)
        self.handle = None
        if io == "aio":
            from ..aio import AioHandle

            self.handle = AioHandle(block_size=1 << 20, queue_depth=16, threads=1, direct=direct)
        self.keep = []

    def write(self, data: torch.Tensor, offset: int) -> None:
        if self.handle is not None:
            self.keep.append(data)
            self.handle.async_pwrite(data, self.path, offset)
        else:
            fsutil.write_all(self.fd, data.numpy(), offset)

    def skew(self, data: torch.Tensor) -> int:
        """Where in a 4 KiB page the piece should start in the file: its address's place in its
        page for the aio engine (zero-copy O_DIRECT), 0 for pwrite."""
        return data.data_ptr() % _ALIGN if self.handle is not None else 0

    def write_skewed(self, data: torch.Tensor, page_at: int, skew: int) -> None:
        """data at file offset page_at + skew (page_at aligned, skew its address's place in its
        page): the first partial page through an aligned bounce page holding `skew` zeros, the
        rest from data's own memory, which is then page-aligned at a page-aligned offset."""
        if skew == 0:
            self.write(data, page_at)
            return
        head = min(_ALIGN - skew, data.numel())
        page = aligned_empty(_ALIGN if head == _ALIGN - skew else skew + head)
        page[:skew].zero_()
        page[skew:skew + head].copy_(data[:head])
        self.write(page, page_at)
        if head < data.numel():
            self.write(data[head:], page_at + _ALIGN)

    def finish(self) -> None:
        if self.handle is not None:
            try:
                self.handle.wait()
            finally:
                self.keep.clear()

    drain = finish  # every queued write done: the tensors written may be reused


def write_shard(dir_fd: int, dir_path: str, rank: int, pieces: list, io: str = "aio",
                block_bytes: int = BLOCK_BYTES, direct: str = "auto", live=None) -> tuple[dict, list]:
    """pieces: (name, key, lo, hi, tensor) -> ({name, bytes, block_crc32}, [[name, key, lo, hi, dtype, 0, offset]]).
    An item may also be a LazyPieces (adapters.py): its pieces are written inside its resident()
    context, and all of their writes have completed before it is left (one such bucket resident at
    a time).
    The file index (0) is filled in by the manifest builder. Raises OSError (ENOSPC, EFBIG, EIO...);
    the temporary file is removed then, and nothing is left under the final name.
    live: None, or (k, callback): pieces[0..k] include tensors training will change once callback()
    is called (an async save's live pieces, snapshot.py); it is called as soon as every write of
    them has completed and their checksums are computed, before the rest is written."""
    final = shard_file_name(rank)
    fd, tmp = files.create_temporary_at(dir_fd, fsutil.temp_prefix(final))
    try:
        try:
            sink = _Sink(fd, os.path.join(dir_path, tmp), io, direct)
            crc = _BlockCrc(block_bytes)
            chunks, offset = [], 0
            pending, pending_at = [], 0
            pending_bytes = 0

            def align():
                nonlocal offset
                pad = -offset % _ALIGN
                if pad:  # a hole in the file, zero when read; the checksums cover it as zeros
                    crc.feed(memoryview(_ZEROS)[:pad])
                    offset += pad

            def flush():
                nonlocal pending, pending_bytes
                if pending:  # one page-aligned buffer: the engine sends it O_DIRECT, no staging copy
                    buf, at = aligned_empty(pending_bytes), 0
                    for part in pending:
                        buf[at:at + part.numel()].copy_(part)
                        at += part.numel()
                    sink.write(buf, pending_at)
                    pending, pending_bytes = [], 0

            def place(name, key, lo, hi, tensor):
                nonlocal pending_at, pending_bytes, offset
                data = as_bytes(tensor.detach().reshape(-1))
                n = data.numel()
                if n == 0:  # nothing to place: no alignment either (a pad at the end would be a hole past EOF)
                    chunks.append([name, key, lo, hi, str(tensor.dtype).replace("torch.", ""), 0, offset])
                    return
                skew = 0
                if n >= _COALESCE_BYTES:
                    flush()
                    align()
                    skew = sink.skew(data)
                    if skew:  # the padding before the piece: zeros in the file and in the checksums
                        crc.feed(memoryview(_ZEROS)[:skew])
                        offset += skew
                elif not pending:
                    align()
                    pending_at = offset
                chunks.append([name, key, lo, hi, str(tensor.dtype).replace("torch.", ""), 0, offset])
                if n < _COALESCE_BYTES:
                    pending.append(data)  # copied by flush(), before this function returns
                    pending_bytes += n
                    if pending_bytes >= _FLUSH_BYTES:
                        flush()
                    crc.feed(memoryview(data.numpy()))
                elif not sink.buffered:  # queued first: the engine writes while we checksum
                    sink.write_skewed(data, offset - skew, skew)
                    crc.feed(memoryview(data.numpy()))
                else:  # segment by segment, each one's write-back started once it is in the cache
                    for a in range(0, n, _SEGMENT_BYTES):
                        part = data[a:a + _SEGMENT_BYTES]
                        if a == 0:  # with the padding before the piece
                            sink.write_skewed(part, offset - skew, skew)
                        else:
                            sink.write(part, offset + a)
                        crc.feed(memoryview(part.numpy()))
                        sink.drain()
                        fsutil.start_writeback(fd, offset + a - (skew if a == 0 else 0),
                                               part.numel() + (skew if a == 0 else 0))
                offset += n

            for i, item in enumerate(pieces):
                if isinstance(item, tuple):
                    place(*item)
                    if live is not None and i == live[0]:
                        flush()
                        sink.drain()  # a buffered write has returned once its bytes are in the page cache
                        live[1]()
                    continue
                # LazyPieces (adapters.py): a bucket whose values live in swap files, resident
                # only inside its context: every write of it is done before the context is left.
                with item.resident() as resident:
                    for piece in resident:
                        place(*piece)
                    flush()
                    sink.drain()
            flush()
            sink.finish()
            os.fdatasync(fd)
            st = os.fstat(fd)
            here = os.stat(tmp, dir_fd=dir_fd, follow_symlinks=False)
            if (here.st_ino, here.st_dev) != (st.st_ino, st.st_dev) or st.st_size != offset:
                raise OSError(errno.EIO, f"checkpoint: shard file changed under the writer (size {st.st_size}, "
                                         f"expected {offset})", tmp)
        finally:
            os.close(fd)
        # The staging directory's entry becomes durable with rank 0's one fsync of that directory
        # before the manifest commits it (commit.commit); until then the checkpoint is not visible.
        fsutil.publish(dir_fd, tmp, final, sync_dir=False)
    except BaseException:
        fsutil.remove_quietly(dir_fd, tmp)
        raise
    return {"name": final, "bytes": offset, "block_crc32": crc.finish()}, chunks
