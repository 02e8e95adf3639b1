"""What the Python swappers keep of a swap record: the layout of its payload, and the error policy.

The records themselves (a 4 KiB header with generation, layout tag and CRC-32s, then the payload;
sealed on write and checked on read) are the C++ swap store's (optimizers/core/swap_record.hpp,
optimizers/core/swap_store.hpp, torch.classes.zeroplus.SwapStore): every swapper, optimizer,
parameter and gradient, keeps its records there. Here:

    Layout     which tensors a payload holds (slots), where, each 64-byte aligned; its digest
               (a CRC-32 of the slots) is the record's layout tag, so a record of another layout
               is refused by the store's check;
    open_store the store of one swapper, in its swap directory;
    fault      a fault the store reported (errno, what) as the OSError a swapper raises;
    swap_error / raise_collected  the wording of those errors (file, bucket, rank, consequence).
"""

from __future__ import annotations

import errno
import os
import zlib
from dataclasses import dataclass

import torch

HEADER_BYTES = 4096
SLOT_ALIGN = 64  # slots start 64-byte aligned in the payload (vector loads)


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

    def view(self, payload: torch.Tensor, slot: Slot) -> torch.Tensor:
        """The slot's tensor inside `payload` (a uint8 view of a record's payload: the store's)."""
        return payload[slot.offset:slot.offset + slot.nbytes].view(slot.dtype)


class StoreCounters:
    """The swap store's counters as the swappers report them (bench/offload, memory_report):
    every swapper holds its store as `self._store`; `_staged_bytes` counts what it writes beside
    the store (staged loads' side files)."""

    _staged_bytes = 0

    def _stats(self) -> dict:
        return dict(self._store.stats())

    @property
    def bytes_read(self) -> int:
        return self._stats()["bytes_read"]

    @property
    def bytes_written(self) -> int:
        return self._stats()["bytes_written"] + self._staged_bytes

    @property
    def read_wait_s(self) -> float:
        """Seconds the training thread waited for reads."""
        return self._stats()["read_wait_ns"] * 1e-9

    @property
    def write_wait_s(self) -> float:
        """Seconds the training thread waited for writes (a full pool, drains)."""
        return self._stats()["write_wait_ns"] * 1e-9

    @property
    def background_check_s(self) -> float:
        """Seconds the store's thread spent checking records read and sealing records written."""
        return self._stats()["checksum_ns"] * 1e-9

    @property
    def reads_ahead(self) -> int:
        """Records read before they were asked for (planned)."""
        return self._stats()["reads_ahead"]

    @property
    def reads_on_demand(self) -> int:
        return self._stats()["reads_on_demand"]

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the pool's buffers allocated now."""
        return self._stats()["buffer_bytes"]

    @property
    def peak_buffer_bytes(self) -> int:
        return self._stats()["peak_buffer_bytes"]

    @property
    def engine(self) -> str:
        """The I/O engine in use: "io_uring" or "threads" (docs/aio.md "Fallbacks")."""
        return self._store.engine()


def open_store(directory, stem: str, buffer_bytes: int, buffer_count: int, aio, keep_written: bool):
    """A torch.classes.zeroplus.SwapStore working inside `directory` (a SwapDirectory: its files
    are stem + 5-digit record id + ".swp"), with `buffer_count` pooled buffers of `buffer_bytes`
    (page-locked, and registered with CUDA when CUDA is available: host-to-device copies from a
    record are asynchronous). keep_written: records stay cached in their buffer after their
    write (the store's keepWritten). The store's calls release the GIL while they block (a
    TorchScript method call from Python does), so other Python threads run meanwhile."""
    return torch.classes.zeroplus.SwapStore(directory.path, stem, -(-buffer_bytes // 4096) * 4096, buffer_count,
                                            aio.block_size, aio.queue_depth, aio.threads, keep_written,
                                            torch.cuda.is_available())


def replacement_failed(err: OSError, done: list, kind: str) -> OSError:
    """err (naming the record whose replacement failed) completed for a staged load's commit:
    nothing was loaded, which records of `kind` ("buckets", "parameter buckets") were already
    replaced (and are refused from now on), and what to do."""
    err.strerror += "; nothing was loaded"
    if done:
        err.strerror += f", but the records of {kind} {done} were already replaced and are refused from now on"
    err.strerror += ": load again once this is fixed"
    return err


def fault(code: int, what: str, path: str, context: str) -> OSError:
    """The OSError for a fault the store reported: errno `code`, its text `what` ("read
    refused: ..." for a record that failed its checks: EBADMSG). Other faults keep both the
    errno's text and the store's explanation (which call failed, at which offset)."""
    if code == errno.EBADMSG:
        why = "the record is invalid: " + what.split("refused: ", 1)[-1]
    else:
        why = os.strerror(code)
        if what and what != why:
            why += f" ({what})"
    return swap_error(OSError(code, why), path, context)


def swap_error(e: BaseException, path: str, context: str) -> OSError:
    """The error a swap-file failure raises: `context` (what was being done to which file, for
    which bucket and rank) + " failed: " + why, with e's OSError subclass and errno where it has
    them (anything without an errno: EIO) and the file's path."""
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
