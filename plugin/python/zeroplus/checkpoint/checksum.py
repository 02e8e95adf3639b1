"""The checkpoint format's block checksum: CRC-32, zlib's polynomial and contract.

crc32(data, crc=0) equals zlib.crc32(data, crc). Large writable buffers (a shard's blocks, read
into or written from tensor memory) go to the library's folded CRC-32 (common/core/crc32.hpp:
carry-less multiplication, about ten times zlib's byte-table speed on x86-64, without holding
the GIL); small or read-only ones stay with zlib, whose call costs less than wrapping them.
"""

from __future__ import annotations

import zlib

import torch

_NATIVE_MIN_BYTES = 64 << 10


def crc32(data, crc: int = 0) -> int:
    view = memoryview(data)
    if view.nbytes < _NATIVE_MIN_BYTES or view.readonly or not view.c_contiguous:
        return zlib.crc32(view, crc)
    return int(torch.ops.zeroplus.crc32(torch.frombuffer(view.cast("B"), dtype=torch.uint8), crc))
