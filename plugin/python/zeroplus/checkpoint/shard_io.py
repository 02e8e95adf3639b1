"""Writing one rank's shard file: a thin driver over the C++ writer.

write_shard(dir_fd, dir_path, rank, pieces, io) goes through the items (tuples, LazyPieces, the
`live` callback of an async save), hands each piece's bytes to torch.classes.zeroplus.ShardFileWriter
(optimizers/core/checkpoint/shard_file_writer.hpp, the same writer the LibTorch engine's
checkpoints use) and builds the chunk table the manifest needs. The writer owns how the bytes go
out: the layout (small pieces coalesced into 4 KiB-aligned groups, a large piece at a file offset
congruent to its address modulo 4 KiB for io="aio", so O_DIRECT takes it straight from the
tensor's memory; zero gaps), the block CRC-32s computed as the bytes go out, the I/O (io="aio":
io_uring through the page cache with each large piece's write-back started segment by segment,
direct="off", or O_DIRECT, direct="auto"; io="posix": pwrite) and durability (fdatasync, the
temporary name still the inode written and of the size placed, then rankNNNNN.bin, never
replacing anything; the staging directory is fsynced once, by rank 0, before the commit:
commit.py). Its methods run with the GIL released, so an async save's writer thread leaves the
training thread alone while bytes move.

A placed tensor the writer still reads after place() returned (a large piece queued through aio
with O_DIRECT possible: ShardFileWriter::readsAfterPlace) must not change until the writer's next
drain(): this driver holds each such one until then (drain() before a LazyPieces bucket is left
and before the `live` callback, finish() at the end), and its callers hold either a snapshot or a
training thread that is blocked in the save. Any other piece's memory (a host copy of a CUDA
piece, for one) is let go as soon as place() returns: a save holds one such copy at a time.
"""

from __future__ import annotations

import torch

from ..files import call_op
from .format import BLOCK_BYTES, shard_file_name  # noqa: F401  (the default block size)

# Through the page cache, a large piece goes out in segments of this size: each segment's writes
# (and its checksum, computed meanwhile) are waited for, then its write-back to the disk started
# (sync_file_range, in the writer), so the disk writes segment k while the cache takes k + 1, instead of
# everything waiting for the final fdatasync (0.6 GB over 2 ranks: 0.08 s into the cache, then
# 0.13 s fdatasync, one after the other). Read at every write_shard call.
_SEGMENT_BYTES = 32 << 20
_ALIGN = 4096  # the writer's page: aligned_empty's buffers start on one



def aligned_empty(nbytes: int) -> torch.Tensor:
    """A CPU uint8 tensor of nbytes whose data starts on a 4 KiB boundary (a view into a
    slightly larger allocation, which the view keeps alive)."""
    raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % _ALIGN
    return raw[skip:skip + nbytes]


class ShardFile:
    """One rank's shard file being written through the C++ writer: place(tensor) -> its byte
    offset, drain() (every write so far done: placed memory may change), finish() -> the file
    record {name, bytes, block_crc32} (the file published as rankNNNNN.bin), abandon() (writes
    waited for, the temporary file removed; also safe after finish). Holds each placed tensor
    only while the writer still reads it (module doc). Errors: OSError naming the file."""

    def __init__(self, dir_fd: int, dir_path: str, rank: int, io: str = "aio", direct: str = "auto",
                 block_bytes: int = BLOCK_BYTES):
        self.rank = rank
        self._writer = call_op(torch.classes.zeroplus.ShardFileWriter, dir_fd, dir_path, rank, io, direct, block_bytes,
                             _SEGMENT_BYTES)
        self._held = []  # tensors the writer still reads, until its next drain

    def place(self, tensor: torch.Tensor) -> int:
        data = tensor.detach().reshape(-1)
        if data.device.type != "cpu":
            data = data.to("cpu")
        data = data.contiguous()
        offset, reads = call_op(self._writer.place, data)
        if reads:  # a large piece queued O_DIRECT from data's memory (a host copy of a CUDA piece too)
            self._held.append(data)
        return int(offset)

    def drain(self) -> None:
        call_op(self._writer.drain)
        self._held.clear()

    def finish(self) -> dict:
        nbytes, crcs = call_op(self._writer.finish)
        self._held.clear()
        return {"name": shard_file_name(self.rank), "bytes": int(nbytes), "block_crc32": [int(c) for c in crcs]}

    def abandon(self) -> None:
        self._writer.abandon()  # waits for the queued writes first: the held memory may go after
        self._held.clear()


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
    writer = ShardFile(dir_fd, dir_path, rank, io, direct, block_bytes)
    chunks = []

    def place(name, key, lo, hi, tensor):
        chunks.append([name, key, lo, hi, str(tensor.dtype).replace("torch.", ""), 0, writer.place(tensor)])

    try:
        for i, item in enumerate(pieces):
            if isinstance(item, tuple):
                place(*item)
                if live is not None and i == live[0]:
                    writer.drain()  # a buffered write has returned once its bytes are in the page cache
                    live[1]()
                continue
            # LazyPieces (adapters.py): a bucket whose values live in swap files, resident
            # only inside its context: every write of it is done before the context is left.
            with item.resident() as resident:
                try:
                    for piece in resident:
                        place(*piece)
                    writer.drain()
                except BaseException:
                    writer.abandon()  # its writes are waited for before the bucket's memory goes
                    raise
        record = writer.finish()
    except BaseException:
        writer.abandon()  # waits for queued writes, removes the temporary file
        raise
    return record, chunks
