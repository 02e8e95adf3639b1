"""One bucket's swap record: a 4 KiB header, then the payload (optimizer state tensors).

    bytes [0, 4096)      header: 10 little-endian 64-bit words, the rest zero
                           0 magic "ZPSWAP01"   1 format version   2 bucket index   3 rank
                           4 generation (how many times this bucket was written; the
                             swapper knows which one it expects)
                           5 payload bytes
                           6, 7 payload digest: S = sum of the blocks' sums and
                             W = sum of (block number + 1) x block sum, where a block sum
                             is the sum of one 4 KiB block's 64-bit words (all mod 2^64)
                           8 crc32 of the layout (which tensors, in which order)
                           9 crc32 of words 0-8
    bytes [4096, ...)    payload: the layout's slots back to back, each 64-byte aligned

A record is accepted only if every header word matches what the reader expects and the payload's
digest matches: a torn write (O_DIRECT requests complete in any order, so a stale 4 KiB block
changes S), a stale file (a write that never happened: the generation), a flipped bit (S), a
block written at the wrong place (W) or another bucket's file is refused, never read as state.
The digest is not CRC32 because it runs on every record read and written, inside the step:
numpy sums run at ~17 GB/s on one core here, zlib's CRC32 at ~4 (docs/offload.md); it is a
check against faults, not against someone who can write into the 0700 swap directory.
The header being page-sized keeps the payload page-aligned in the (page-aligned) pool buffer
and in the file, so one O_DIRECT transfer moves the whole record.
"""

from __future__ import annotations

import errno
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

HEADER_BYTES = 4096
SLOT_ALIGN = 64
MAGIC = int.from_bytes(b"ZPSWAP01", "little")
VERSION = 1
_WORDS = struct.Struct("<9qQ")
_HEAD = struct.Struct("<9q")
_BLOCK_WORDS = 512  # 4 KiB


class RecordError(ValueError):
    """A record that fails its checks (the swapper turns it into an OSError naming the file)."""


@dataclass(frozen=True)
class Slot:
    segment: int          # index into the bucket optimizer's segments
    key: str              # state key ("exp_avg", ...)
    dtype: torch.dtype
    numel: int
    offset: int           # bytes from the start of the payload

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Layout:
    slots: tuple[Slot, ...]
    payload_bytes: int

    @staticmethod
    def build(entries: list[tuple[int, str, torch.dtype, int]]) -> "Layout":
        """entries: (segment, key, dtype, numel) in payload order."""
        slots, offset = [], 0
        for segment, key, dtype, numel in entries:
            slot = Slot(segment, key, dtype, numel, offset)
            slots.append(slot)
            offset += -(-slot.nbytes // SLOT_ALIGN) * SLOT_ALIGN
        return Layout(tuple(slots), offset)

    @property
    def record_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    @property
    def digest(self) -> int:
        text = ";".join(f"{s.segment},{s.key},{s.dtype},{s.numel},{s.offset}" for s in self.slots)
        return zlib.crc32(text.encode())

    def view(self, buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
        """The slot's tensor inside `buffer` (a uint8 pool buffer holding the record)."""
        start = HEADER_BYTES + slot.offset
        return buffer[start:start + slot.nbytes].view(slot.dtype)


def _digest(buffer: torch.Tensor, start: int, length: int) -> tuple[int, int]:
    """(S, W) of the payload (see the module doc); length is a multiple of 8 (slots are 64-byte
    aligned). Unsigned numpy arithmetic wraps mod 2^64 by definition."""
    words = buffer.numpy()[start:start + length].view(np.uint64)
    full = words.size // _BLOCK_WORDS * _BLOCK_WORDS
    with np.errstate(over="ignore"):
        sums = words[:full].reshape(-1, _BLOCK_WORDS).sum(axis=1, dtype=np.uint64)
        if full < words.size:
            sums = np.append(sums, words[full:].sum(dtype=np.uint64))
        weights = np.arange(1, sums.size + 1, dtype=np.uint64)
        return int(sums.sum(dtype=np.uint64)), int((sums * weights).sum(dtype=np.uint64))


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def seal(buffer: torch.Tensor, layout: Layout, bucket: int, rank: int, generation: int) -> None:
    """Writes the header of the record held in `buffer` (payload already in place)."""
    s, w = _digest(buffer, HEADER_BYTES, layout.payload_bytes)
    words = [MAGIC, VERSION, bucket, rank, generation, layout.payload_bytes, _signed(s), _signed(w), layout.digest]
    words.append(zlib.crc32(_HEAD.pack(*words)))
    header = buffer[:HEADER_BYTES].numpy()
    header[:] = 0
    header[:_WORDS.size] = memoryview(_WORDS.pack(*words)).cast("B")


def check(buffer: torch.Tensor, layout: Layout, bucket: int, rank: int, generation: int) -> None:
    """Raises RecordError saying what is wrong with the record held in `buffer`."""
    words = list(_WORDS.unpack(bytes(buffer[:_WORDS.size].numpy())))
    if words[0] != MAGIC:
        raise RecordError("not a zeroplus swap record (bad magic): torn, overwritten or never written")
    if words[9] != zlib.crc32(_HEAD.pack(*words[:9])):
        raise RecordError("header checksum mismatch (torn or corrupted header)")
    if words[1] != VERSION:
        raise RecordError(f"record format version {words[1]}, expected {VERSION}")
    if words[2] != bucket or words[3] != rank:
        raise RecordError(f"record of bucket {words[2]} rank {words[3]}, expected bucket {bucket} rank {rank}")
    if words[4] != generation:
        raise RecordError(f"record generation {words[4]}, expected {generation} (a stale or lost write)")
    if words[5] != layout.payload_bytes or words[8] != layout.digest:
        raise RecordError("record layout differs from the optimizer state's")
    s, w = _digest(buffer, HEADER_BYTES, layout.payload_bytes)
    if (_signed(s), _signed(w)) != (words[6], words[7]):
        raise RecordError("payload checksum mismatch (torn write or corrupted data)")


def swap_error(e: BaseException, path: str, context: str) -> OSError:
    """The error a swap-file failure raises: `context` (what was being done to which file, for
    which bucket and rank) + " failed: " + why, with e's OSError subclass and errno where it has
    them (an invalid record is EBADMSG; anything else without an errno, EIO) and the file's path."""
    if isinstance(e, RecordError):
        code, why = errno.EBADMSG, f"the record is invalid: {e}"
    else:
        code = getattr(e, "errno", None) or errno.EIO
        why = getattr(e, "strerror", None) or str(e)
    cls = type(e) if isinstance(e, OSError) else OSError
    msg = f"{context} failed: {why}"
    try:
        return cls(code, msg, path)
    except TypeError:  # an OSError subclass with another constructor
        return OSError(code, msg, path)


def raise_collected(errors: list[OSError]) -> None:
    """Raise the first of the errors a step collected (its type, errno and file), the others'
    messages appended; nothing when there are none."""
    if errors:
        first = errors[0]
        more = "".join(f"\n  also: {e.strerror}" for e in errors[1:])
        raise type(first)(first.errno, f"{first.strerror}{more}", first.filename)
