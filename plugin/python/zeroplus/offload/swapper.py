"""NVMe optimizer-state swapper: each bucket's optimizer state lives in its own swap file.

The engine steps bucket after bucket (fetch -> step -> store, bucket_optimizer.py). For each
bucket this swapper

    fetch:  waits for the bucket's record (read ahead while the previous bucket stepped),
            checks it (record.py) and points the optimizer's state tensors at it;
            then starts reading the next bucket into another pooled buffer;
    store:  copies any state tensor that is not already in the record (state the optimizer
            created or replaced), seals the record (generation + checksums) and starts its
            write; the state tensors are emptied, the buffer stays busy until the write ends.

So the read of bucket i+1, the step of bucket i and the write of bucket i-1 overlap. Buffers
come from a pool of at most `buffer_count` page-locked buffers, each one record (4 KiB header +
the bucket's state); a fetch that finds none free waits for the oldest writes. Between steps
the optimizer holds only its per-parameter scalars (Adam's `step`) and empty state tensors.

State tensors keep their identity: the optimizer's state dicts always hold the same tensor
objects (their `.data` is pointed at the record on fetch and emptied on store), so the fused
optimizers' cached plans stay valid and nothing else sees a swap.

Faults (docs/offload.md "Faults"): errors never leave the step half done on one rank only
(the other ranks would hang in the next collective), so they are collected during the step
and raised by end_step(), after the step's last collective, as OSError naming the file, the
bucket and the rank:
  * a write that fails (ENOSPC, EIO, the file removed): the bucket's record stays in memory
    (its buffer is kept, beyond buffer_count if need be) and is written again at its next
    store, so no state is lost and training continues from this step once space is freed;
  * a read that fails or a record that fails its checks: that bucket is not stepped (its
    parameters and state keep their values); its state on disk is unusable, and every later
    step raises again until load_state_dict replaces it.
Not thread-safe: the engine calls it from the training thread only.
"""

from __future__ import annotations

import errno as errno_mod
from dataclasses import dataclass, field

import torch

from . import record
from .nvme_store import SwapDirectory
from .policy import OffloadPolicy

_NOT_LOADED = 0  # generation of a bucket with nothing on disk yet
_KEPT = ("; the step completed and the bucket's state is kept in memory until a later step writes it "
         "(free space, then continue training)")
_LOST = ("; the bucket was not stepped (its parameters and optimizer state keep their values); the state in "
         "this file is unusable: load a checkpoint (load_state_dict) to replace it")


@dataclass
class _Home:
    """Where one bucket's state is right now."""
    index: int
    name: str
    io_path: str | None = None   # None until the file exists
    layout: record.Layout | None = None
    generation: int = _NOT_LOADED
    buffer: torch.Tensor | None = None  # holds the record: reading, bound, writing or dirty
    reading: bool = False
    writing: bool = False
    bound: bool = False          # the optimizer's state tensors point into `buffer`
    dirty: bool = False          # buffer holds the newest record, not (yet) on disk
    handles: dict = field(default_factory=dict)  # (segment, key) -> the optimizer's state tensor


class OptimizerSwapper:
    def __init__(self, policy: OffloadPolicy, rank: int, directory: SwapDirectory, bucket_optimizers: list):
        if not isinstance(policy, OffloadPolicy) or policy.device != "nvme":
            raise ValueError("OptimizerSwapper: needs an OffloadPolicy with device 'nvme'")
        from ..aio import AioHandle  # needs the loaded library; imported where it is used

        self.policy = policy
        self.rank = rank
        self.directory = directory
        knobs = dict(block_size=policy.aio.block_size, queue_depth=policy.aio.queue_depth,
                     threads=policy.aio.threads)
        self._reader = AioHandle(**knobs)
        self._writer = AioHandle(**knobs)
        self._bos = list(bucket_optimizers)
        self._homes = [_Home(i, f"optimizer-b{i:05d}.swp") for i in range(len(self._bos))]
        self._index = {id(bo): i for i, bo in enumerate(self._bos)}
        self._by_path: dict[str, int] = {}
        self._free: list[torch.Tensor] = []
        self._buffers = 0            # buffers allocated (free + in use)
        self.buffer_bytes = 0        # their bytes
        self.peak_buffer_bytes = 0
        self._errors: list[OSError] = []
        self._cache: tuple | None = None  # (index, generation, {segment: {key: tensor}}) for state_dict
        self.bytes_read = 0
        self.bytes_written = 0

    # -- the step ----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        self._cache = None
        self._errors.clear()

    def fetch(self, bo) -> bool:
        """Makes the bucket's state resident; False: it is unreadable (the error is kept for
        end_step) and the bucket must not step."""
        h = self._homes[self._index[id(bo)]]
        self._cache = None
        ok = self._make_resident(h)
        if ok and h.buffer is not None:
            self._bind(bo, h)
        if self.policy.pipeline_read and h.index + 1 < len(self._homes):
            self._prefetch(self._homes[h.index + 1])
        return ok

    def store(self, bo) -> None:
        """Starts writing the bucket's state (after its step) and empties the state tensors."""
        h = self._homes[self._index[id(bo)]]
        self._cache = None
        if bo.inner is None or (h.generation != _NOT_LOADED and not h.bound):
            return  # nothing resident to store (its fetch failed)
        entries, tensors = self._state_entries(bo)
        if not entries:
            return  # an optimizer without elementwise state (SGD without momentum)
        layout = record.Layout.build(entries)
        try:
            self._ensure_file(h, layout)
        except OSError as e:  # cannot create or grow the file: keep the state in memory
            self._keep_in_memory(bo, h, layout, tensors)
            self._errors.append(self._named(e, h, "creating"))
            return
        buf = self._gather(h, layout, tensors)
        h.generation += 1
        record.seal(buf, layout, h.index, self.rank, h.generation)
        self._unbind(h)
        h.dirty = True
        try:
            self._writer.async_pwrite(buf[:layout.record_bytes], h.io_path)
        except OSError as e:  # refused at the call (the file replaced by a directory, ...)
            self._errors.append(self._named(e, h, "writing", _KEPT))
            return
        h.writing = True
        if not self.policy.pipeline_write:
            self._drain_writes()

    def end_step(self) -> None:
        """Waits for the step's writes; raises the step's swap errors (see the module doc)."""
        self._drain_writes()
        if any(h.reading for h in self._homes):  # a read ahead the step did not get to
            try:
                self._reader.wait()
            except OSError:
                pass  # read again, and checked, at the next fetch
            for h in self._homes:
                if h.reading:
                    h.reading = False
                    self._release(h.buffer)
                    h.buffer = None
        for h in self._homes:
            if h.bound:  # fetched, never stored (the step raised): the buffer is the state
                self._unbind(h)
                h.dirty = True
        errors, self._errors = self._errors, []
        if errors:
            first = errors[0]
            more = "".join(f"\n  also: {e.strerror}" for e in errors[1:])
            raise type(first)(first.errno, f"{first.strerror}{more}", first.filename)

    # -- state dicts -------------------------------------------------------------------------------

    def segment_states(self, bo) -> dict[int, dict]:
        """{segment index: {key: tensor}} of the bucket's swapped state (copies), read through
        the file when it is not resident. Raises OSError naming the file."""
        h = self._homes[self._index[id(bo)]]
        if h.layout is None:
            return {}
        if self._cache is not None and self._cache[0] == h.index and self._cache[1] == h.generation:
            return self._cache[2]
        if h.buffer is not None:
            if h.writing:
                self._drain_writes()
            out = self._copies(h, h.buffer)
        else:
            buf = self._acquire(h.layout.record_bytes)
            try:
                self._read_into(h, buf)
                self._reader.wait()
                record.check(buf, h.layout, h.index, self.rank, h.generation)
                out = self._copies(h, buf)
            except (OSError, record.RecordError) as e:
                raise self._named(e, h, "reading") from None
            finally:
                self._release(buf)
        self._cache = (h.index, h.generation, out)
        return out

    def after_load(self, bo) -> None:
        """The optimizer's state was just replaced in memory (load_state_dict): write it out."""
        h = self._homes[self._index[id(bo)]]
        self._cache = None
        self._drain_writes()
        if h.buffer is not None:
            if h.bound:
                self._unbind(h)
            h.dirty = False
            self._release(h.buffer)
            h.buffer = None
        h.layout, h.generation, h.handles = None, _NOT_LOADED, {}  # the loaded state replaces it
        self.store(bo)
        self.end_step()

    # -- accounting ---------------------------------------------------------------------------------

    def disk_bytes(self) -> int:
        return self.directory.disk_bytes()

    def record_bytes(self) -> list[int]:
        return [h.layout.record_bytes if h.layout else 0 for h in self._homes]

    def close(self) -> None:
        """Waits for I/O, then removes the swap files and the directory. The state is gone."""
        try:
            self._drain_writes()
            self._reader.wait()
        except OSError:
            pass
        self.directory.close()

    # -- internals ----------------------------------------------------------------------------------

    def _state_entries(self, bo):
        """(segment, key, dtype, numel) of every elementwise state tensor, and the tensors."""
        entries, tensors = [], []
        for si, seg in enumerate(bo.segments):
            st = bo.inner.state.get(seg.master)
            if not st:
                continue
            n = seg.hi - seg.lo
            for key in sorted(st, key=str):
                v = st[key]
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == n and n > 0:
                    entries.append((si, key, v.dtype, n))
                    tensors.append(v)
        return entries, tensors

    def _ensure_file(self, h: _Home, layout: record.Layout) -> None:
        if h.io_path is None:
            h.io_path = self.directory.create(h.name, layout.record_bytes)
            self._by_path[h.io_path] = h.index
        elif h.layout is None or layout.record_bytes > h.layout.record_bytes:
            self.directory.grow(h.name, layout.record_bytes)

    def _gather(self, h: _Home, layout: record.Layout, tensors) -> torch.Tensor:
        """The record's buffer with every state tensor copied in (tensors already bound to it
        are in place). Makes the tensors the bucket's handles."""
        buf = h.buffer
        if buf is None or buf.numel() < layout.record_bytes or layout != h.layout:
            # A new buffer when the layout changed: copying in place could overwrite tensors
            # of the old layout before they are copied.
            buf = self._acquire(layout.record_bytes)
        for slot, t in zip(layout.slots, tensors):
            view = layout.view(buf, slot)
            if t.numel() == 0:
                raise RuntimeError(f"offload_optimizer: state '{slot.key}' of bucket {h.index} is not resident")
            if t.data_ptr() != view.data_ptr():
                view.copy_(t.reshape(-1))
        if h.buffer is not None and buf is not h.buffer:
            self._release(h.buffer)
        h.buffer, h.layout = buf, layout
        h.handles = {(s.segment, s.key): t for s, t in zip(layout.slots, tensors)}
        h.bound = True
        return buf

    def _keep_in_memory(self, bo, h: _Home, layout: record.Layout, tensors) -> None:
        """The file cannot hold the state: keep it in a buffer (dirty) for the next attempt."""
        self._gather(h, layout, tensors)
        self._unbind(h)
        h.dirty = True

    def _bind(self, bo, h: _Home) -> None:
        for slot in h.layout.slots:
            t = h.handles[(slot.segment, slot.key)]
            t.data = h.layout.view(h.buffer, slot)
            st = bo.inner.state[bo.segments[slot.segment].master]
            if st.get(slot.key) is not t:
                st[slot.key] = t
        h.bound = True

    def _unbind(self, h: _Home) -> None:
        for t in h.handles.values():
            t.data = torch.empty(0, dtype=t.dtype)
        h.bound = False

    def _make_resident(self, h: _Home) -> bool:
        if h.generation == _NOT_LOADED and h.buffer is None:
            return True  # nothing stored yet: the optimizer creates its state in this step
        if h.buffer is not None and not h.reading:
            if h.writing:
                self._drain_writes()  # a bucket visited twice in one step: its write first
            return True  # dirty (a failed write) or just stored: the buffer is the state
        try:
            if not h.reading:
                self._prefetch(h)
                if not h.reading:  # refused at the call: read once more for the error
                    h.buffer = self._acquire(h.layout.record_bytes)
                    h.reading = True
                    self._read_into(h, h.buffer)
            self._reader.wait()
            h.reading = False
            record.check(h.buffer, h.layout, h.index, self.rank, h.generation)
            return True
        except (OSError, record.RecordError) as e:
            h.reading = False
            self._release(h.buffer)
            h.buffer = None
            self._errors.append(self._named(e, h, "reading", _LOST))
            return False

    def _prefetch(self, h: _Home) -> None:
        if h.reading or h.buffer is not None or h.generation == _NOT_LOADED:
            return
        # Waiting here for older writes when the pool is full is the pipeline's back-pressure.
        buf = self._acquire(h.layout.record_bytes)
        try:
            self._read_into(h, buf)
        except OSError:
            self._release(buf)  # refused at the call (file gone, ...): fetch reads it again and reports
            return
        h.buffer = buf
        h.reading = True

    def _read_into(self, h: _Home, buf: torch.Tensor) -> None:
        self.bytes_read += h.layout.record_bytes
        self._reader.async_pread(buf[:h.layout.record_bytes], h.io_path)

    def _drain_writes(self) -> None:
        writing = [h for h in self._homes if h.writing]
        if not writing:
            return
        try:
            self._writer.wait()
        except OSError as e:
            # wait() reports the first failure only: every write of the batch is kept in
            # memory and written again at its next store.
            failed = self._by_path.get(e.filename)
            named = self._homes[failed] if failed is not None else writing[0]
            self._errors.append(self._named(e, named, "writing", _KEPT))
            for h in writing:
                h.writing = False
            return
        for h in writing:
            h.writing = h.dirty = False
            self.bytes_written += h.layout.record_bytes
            if not h.bound:
                self._release(h.buffer)
                h.buffer = None

    def _acquire(self, nbytes: int) -> torch.Tensor:
        while True:
            for i, b in enumerate(self._free):
                if b.numel() >= nbytes:
                    return self._free.pop(i)
            if self._free and self._buffers >= self.policy.buffer_count:
                small = self._free.pop()  # too small for this record: replace it
                self._buffers -= 1
                self.buffer_bytes -= small.numel()
                continue
            if self._buffers < self.policy.buffer_count:
                return self._allocate(nbytes)
            if any(h.writing for h in self._homes):
                self._drain_writes()
                continue
            # Every buffer holds state that is not on disk (failed writes) or in use: go over
            # the budget rather than lose state (reported in peak_buffer_bytes).
            return self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        nbytes = -(-nbytes // 4096) * 4096
        buf = self._reader.new_cpu_locked_tensor(nbytes, torch.uint8)
        self._buffers += 1
        self.buffer_bytes += buf.numel()
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        return buf

    def _release(self, buf: torch.Tensor | None) -> None:
        if buf is None:
            return
        if self._buffers > self.policy.buffer_count:  # an over-budget buffer: give it back
            self._buffers -= 1
            self.buffer_bytes -= buf.numel()
            return
        self._free.append(buf)

    def _copies(self, h: _Home, buf: torch.Tensor) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for slot in h.layout.slots:
            out.setdefault(slot.segment, {})[slot.key] = h.layout.view(buf, slot).clone()
        return out

    def _named(self, e: BaseException, h: _Home, doing: str, consequence: str = "") -> OSError:
        path = self.directory.display_path(h.name)
        if isinstance(e, record.RecordError):
            code, why = errno_mod.EBADMSG, f"the record is invalid: {e}"
        else:
            code = getattr(e, "errno", None) or errno_mod.EIO
            why = getattr(e, "strerror", None) or str(e)
        cls = type(e) if isinstance(e, OSError) else OSError
        msg = (f"offload_optimizer: {doing} swap file {path!r} (bucket {h.index}, rank {self.rank}) failed: "
               f"{why}{consequence}")
        try:
            return cls(code, msg, path)
        except TypeError:
            return OSError(code, msg, path)
