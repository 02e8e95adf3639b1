"""NVMe optimizer-state swapper: each bucket's fp32 master and optimizer state live in a swap file.

The engine steps bucket after bucket (fetch -> step -> store, bucket_optimizer.py). For each
bucket this swapper

    fetch:  waits for the bucket's record (read ahead while the previous bucket stepped),
            checks it (record.py) and points the optimizer's state tensors at it;
            then starts reading the next bucket into another pooled buffer;
    store:  copies any state tensor that is not already in the record (state the optimizer
            created or replaced), seals the record (generation + checksums) and starts its
            write; the state tensors are emptied, the buffer stays busy until the write ends.

The record holds the bucket's fp32 master shard too when it is a copy of its own (mixed
precision, or the host tier's copy on CUDA training, host_tier.py); in fp32 CPU training the
master IS this rank's slice of the parameters, which stay in memory. The master stays readable after store until the engine has written it into the
parameters (its publish), i.e. until the next bucket's fetch or the end of the step.

So the read of bucket i+1, the step of bucket i and the write of bucket i-1 overlap. Buffers
come from a pool of at most `buffer_count` page-locked buffers, each one record (4 KiB header +
the bucket's state); a fetch that finds none free waits for the oldest writes. Between steps
the optimizer holds only its per-parameter scalars (Adam's `step`) and empty state tensors.

State tensors and masters keep their identity: the optimizer's state dicts and parameter lists
always hold the same tensor objects (their `.data` is pointed at the record on fetch and emptied
afterwards), so the fused optimizers' cached plans stay valid and nothing else sees a swap.

Loading (ZeroEngine.load_state_dict, load_checkpoint) never changes a record in place:

    stage_load(bo, state, master)  writes the bucket's record as the load leaves it into a side
                         file (`optimizer-bNNNNN.new`), synchronously, through one pooled buffer;
                         the live record, the optimizer and the master are untouched;
    commit_records(...)  renames every side file over its record (a lost record is simply
                         created by the rename: loading is its repair), before any state changes;
    commit_load(bo, ...) points the bucket's bookkeeping at the new record (in memory only);
    discard_load(...)    removes a side file (an error anywhere: nothing changed).

Faults (docs/offload.md "Faults"): errors never leave the step half done on one rank only
(the other ranks would hang in the next collective), so they are collected during the step
and raised by end_step(), after the step's last collective, as OSError naming the file, the
bucket and the rank:
  * a write that fails (ENOSPC, EIO, the file removed): the bucket's record stays in memory
    (its buffer is kept, beyond buffer_count if need be) and is written again at its next
    store, so no state is lost and training continues from this step once space is freed;
  * a read that fails or a record that fails its checks: that bucket is not stepped (its
    parameters keep their values: a lost master is taken back from the parameters); its state
    on disk is unusable, and every later step raises again until a load replaces it.
Not thread-safe: the engine calls it from the training thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import record
from .io_lanes import IoLanes
from .nvme_store import SwapDirectory
from .policy import OffloadPolicy

_NOT_LOADED = 0  # generation of a bucket with nothing on disk yet
_KEPT = ("; the step completed and the bucket's state is kept in memory until a later step writes it "
         "(free space, then continue training)")
_KEPT_LOADED = "; the bucket's new values are kept in memory and written at its next step"
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
    buffer: torch.Tensor | None = None  # holds the record while reading, bound, writing, dirty or cached
    lane: object | None = None   # the read into `buffer` in flight (io_lanes.IoLanes)
    verified: bool = False       # `buffer` holds the current record as on disk (read and checked, or written)
    last_used: int = 0           # the pool's clock when the bucket was last stored (LRU eviction)
    writing: bool = False
    bound: bool = False          # the optimizer's state tensors point into `buffer`
    master_bound: bool = False   # the master (and the segments) point into `buffer` (or a stand-in)
    dirty: bool = False          # buffer holds the newest record, not (yet) on disk
    handles: dict = field(default_factory=dict)  # (segment, key) -> the optimizer's state tensor

    def busy(self) -> bool:
        return self.lane is not None or self.writing or self.bound or self.master_bound or self.dirty


_MASTER = (-1, "master")  # the master's slot in a record


@dataclass(frozen=True)
class StagedRecord:
    """A bucket's record as a load will leave it, written to a side file (stage_load)."""
    side: str | None              # the side file's name; None: the loaded state needs no record
    layout: record.Layout | None
    generation: int

    def handles(self) -> dict:
        """{(segment, key): a new, empty tensor of the slot's dtype}: the optimizer's state tensors
        for this record (bound to it at the bucket's next fetch)."""
        if self.layout is None:
            return {}
        return {(s.segment, s.key): torch.empty(0, dtype=s.dtype) for s in self.layout.slots if s.segment >= 0}


class OptimizerSwapper:
    def __init__(self, policy: OffloadPolicy, rank: int, directory: SwapDirectory, bucket_optimizers: list):
        if not isinstance(policy, OffloadPolicy) or policy.device != "nvme":
            raise ValueError("OptimizerSwapper: needs an OffloadPolicy with device 'nvme'")
        self.policy = policy
        self.rank = rank
        self.directory = directory
        self._lanes = IoLanes(policy.aio)
        self._writer = policy.aio.new_handle()
        self._bos = list(bucket_optimizers)
        self._homes = [_Home(i, f"optimizer-b{i:05d}.swp") for i in range(len(self._bos))]
        self._index = {id(bo): i for i, bo in enumerate(self._bos)}
        self._by_path: dict[str, int] = {}
        self._free: list[torch.Tensor] = []
        self._clock = 0
        self._order: list[int] = list(range(len(self._bos)))  # the step's bucket order (begin_step)
        self._position = {index: k for k, index in enumerate(self._order)}
        self._buffers = 0            # buffers allocated (free + in use)
        self.buffer_bytes = 0        # their bytes
        self.peak_buffer_bytes = 0
        self._errors: list[OSError] = []
        self._cache: tuple | None = None  # (index, generation, {segment: {key: tensor}}) for state_dict
        self.bytes_read = 0
        self.bytes_written = 0
        # Seconds the training thread spent waiting for reads / writes, and checksumming
        # (sealing and checking records): the swap's cost inside step() (bench/offload).
        self.cache_hits = 0  # records a step found in the pool (no read)
        self.read_wait_s = 0.0
        self.write_wait_s = 0.0
        self.checksum_s = 0.0

    # -- the step ----------------------------------------------------------------------------------

    def begin_step(self, order: list[int] | None = None) -> None:
        """A step starts; it visits the buckets in `order` (indices; None: 0, 1, ...), which the
        swapper reads ahead in. Records still in the pool from the last step (the last ones
        written) are used without a read: an engine that alternates the order gains them."""
        self._cache = None
        self._order = list(range(len(self._bos))) if order is None else list(order)
        self._position = {index: k for k, index in enumerate(self._order)}

    def fetch(self, bo) -> bool:
        """Makes the bucket's master and state resident; False: they are unreadable (the error
        is kept for end_step) and the bucket must not step."""
        h = self._home(bo)
        self._cache = None
        self._unbind_masters(except_=h)  # earlier buckets are published by now
        ok = self._make_resident(h)
        if ok and h.buffer is not None:
            self._bind(bo, h)
        elif not ok and bo.offloads_master:
            self._stand_in_master(bo, h)
        if self.policy.pipeline_read:
            k = self._position.get(h.index, h.index)
            window = self._order[k + 1:k + 1 + self._read_depth()]
            keep = set(window)
            for index in window:
                self._prefetch(self._homes[index], keep)
        return ok

    def store(self, bo) -> None:
        """Starts writing the bucket's record (after its step) and empties the state tensors;
        the master stays readable until the next fetch or end_step."""
        h = self._home(bo)
        self._cache = None
        if bo.inner is None or (h.generation != _NOT_LOADED and not h.bound):
            return  # nothing resident to store (its fetch failed)
        entries, tensors = self._entries(bo)
        if not entries:
            return  # nothing elementwise to keep (SGD without momentum in fp32 training)
        layout = record.Layout.build(entries)
        try:
            self._ensure_file(h, layout)
        except OSError as e:  # cannot create or grow the file: keep the record in memory
            self._gather(bo, h, layout, tensors)
            self._unbind_state(h)
            h.dirty = True
            self._errors.append(self._named(e, h, "creating", _KEPT))
            return
        buf = self._gather(bo, h, layout, tensors)
        h.generation += 1
        t0 = time.perf_counter()
        record.seal(buf, layout, h.index, self.rank, h.generation)
        self.checksum_s += time.perf_counter() - t0
        self._unbind_state(h)
        h.dirty = True
        self._clock += 1
        h.last_used = self._clock
        try:
            self._writer.async_pwrite(buf[:layout.record_bytes], h.io_path)
        except OSError as e:  # refused at the call (the file replaced by a directory, ...)
            self._errors.append(self._named(e, h, "writing", _KEPT))
            return
        h.writing = True
        if not self.policy.pipeline_write:
            self._drain_writes()

    def end_step(self) -> None:
        """Waits for the step's I/O; raises the step's swap errors (see the module doc)."""
        self._drain_writes()
        for h in self._homes:
            if h.lane is not None:  # a read ahead the step did not get to: read again when needed
                lane, h.lane = h.lane, None
                self._lanes.wait_quietly(lane)
                h.verified = False
                self._release_if_idle(h)
        for h in self._homes:
            if h.bound:  # fetched, never stored (the step raised): the buffer is the state
                self._unbind_state(h)
                h.dirty = True
        self._unbind_masters(except_=None)
        self._raise_errors()

    # -- state dicts and loading ---------------------------------------------------------------------

    def segment_states(self, bo) -> dict[int, dict]:
        """{segment index: {key: tensor}} of the bucket's swapped optimizer state (copies), read
        through the file when it is not resident. Raises OSError naming the file."""
        h = self._home(bo)
        if h.layout is None:
            return {}
        if self._cache is not None and self._cache[0] == h.index and self._cache[1] == h.generation:
            return self._cache[2]
        out = {}
        with self._record(h) as buf:
            for slot in h.layout.slots:  # the master (segment -1, when offloaded) too: master_copy
                out.setdefault(slot.segment, {})[slot.key] = h.layout.view(buf, slot).clone()
        self._cache = (h.index, h.generation, out)
        self._raise_errors()  # of writes drained on the way
        return out

    def master_copy(self, bo) -> torch.Tensor | None:
        """A copy of the bucket's fp32 master where this swapper holds it (mixed precision), read
        through the file when it is not resident (one read serves segment_states too); None: the
        master is not in a record (fp32 training, or nothing stored yet). Raises OSError."""
        if not bo.offloads_master or self._home(bo).layout is None:
            return None
        return self.segment_states(bo).get(_MASTER[0], {}).get(_MASTER[1])

    def swapped_keys(self, bo) -> dict[int, set]:
        """{segment index: the state keys whose tensors live in the bucket's record}."""
        out: dict[int, set] = {}
        for segment, key in self._home(bo).handles:
            out.setdefault(segment, set()).add(key)
        return out

    def write_master(self, bo, lo: int, hi: int, values: torch.Tensor) -> None:
        """master[lo:hi] = values (a model state dict being loaded), in the record if the master
        lives there. Raises OSError naming the file; the record is unchanged then."""
        h = self._home(bo)
        self._cache = None
        if not bo.offloads_master or h.layout is None:
            bo.master[lo:hi].copy_(values)  # still the in-memory master (no record yet)
            return
        with self._record(h) as buf:
            h.layout.view(buf, self._master_slot(h))[lo:hi].copy_(values)
            if h.buffer is not buf:  # the record was read from disk: write it back
                self._rewrite(h, buf)
            else:
                h.dirty = True  # resident: written with the bucket's next store
        self._raise_errors()

    def stage_load(self, bo, state: dict, master: torch.Tensor | None = None) -> "StagedRecord":
        """Writes the bucket's record as a load will leave it into a side file (`optimizer-bNNNNN.new`),
        synchronously, through one pooled buffer; changes nothing else: the live record, its cached
        copy, the optimizer and the master stay as they are until commit_load (discard_load: the
        side file goes). state: {segment master: {key: value}} as the optimizer class cast it (a
        scratch optimizer's load_state_dict); master: the bucket's new fp32 master (a checkpoint's),
        or None to keep the current one (read through the record; a record that is lost or refused,
        which this load repairs, gives way to the parameters, as loading a model sets it).
        Raises OSError naming the file; no side file is left then."""
        h = self._home(bo)
        self._drain_writes()  # nothing is in flight between steps; settles the generation
        if bo.offloads_master and master is None:
            master = self._current_master(bo, h)
        entries, tensors = self._entries(bo, state, master)
        if not entries:
            return StagedRecord(None, None, h.generation + 1)
        layout = record.Layout.build(entries)
        side = h.name[:-len(".swp")] + ".new"
        self.directory.remove(side)  # an earlier load's that was never committed
        buf = self._acquire(layout.record_bytes)
        try:
            for slot, t in zip(layout.slots, tensors):
                layout.view(buf, slot).copy_(t.reshape(-1))
            record.seal(buf, layout, h.index, self.rank, h.generation + 1)
            try:
                io_path = self.directory.create(side, layout.record_bytes)
            except OSError as e:
                raise self._named(e, h, "creating the replacement for") from None
            try:
                self._writer.sync_pwrite(buf[:layout.record_bytes], io_path)  # nothing in flight (drained)
            except OSError as e:
                self.directory.remove(side)
                raise self._named(e, h, "writing the replacement for") from None
            self.bytes_written += layout.record_bytes
        finally:
            self._free_buffer(buf)
        return StagedRecord(side, layout, h.generation + 1)

    def _current_master(self, bo, h: _Home) -> torch.Tensor:
        """A copy of the bucket's fp32 master as it is now (stage_load)."""
        if h.layout is None:
            return bo.master.detach().to("cpu", torch.float32, copy=True)  # not stored yet: in memory
        try:
            with self._record(h) as buf:
                return h.layout.view(buf, self._master_slot(h)).clone()
        except OSError:
            return bo.param_shard().to("cpu", torch.float32, copy=True)

    def commit_records(self, staged: list[tuple]) -> None:
        """Renames every staged side file over its bucket's record (staged: (bucket optimizer,
        StagedRecord) pairs), all before any bucket's state changes: a rename that fails leaves
        the optimizer as it was, and the records already replaced are refused from then on (their
        generation is not the one the swapper expects; a cached copy of the old one is dropped)
        until a load succeeds. Raises OSError."""
        done = []
        for bo, st in staged:
            if st.side is None:
                continue
            h = self._home(bo)
            if h.lane is not None:  # a read ahead of the old record: let it finish, then drop it
                lane, h.lane = h.lane, None
                self._lanes.wait_quietly(lane)
                self._free_buffer(h.buffer)
                h.buffer, h.verified = None, False
            try:
                self.directory.replace(st.side, h.name)
            except OSError as e:
                err = self._named(e, h, "replacing")
                err.strerror += "; nothing was loaded"
                if done:
                    err.strerror += (f", but the records of buckets {done} were already replaced and are refused "
                                     "from now on")
                err.strerror += ": load again once this is fixed"
                raise err from None
            done.append(h.index)
            if h.buffer is not None and not h.busy():  # a cached copy of the replaced record
                buf, h.buffer, h.verified = h.buffer, None, False
                self._free_buffer(buf)

    def commit_load(self, bo, st: "StagedRecord", handles: dict) -> None:
        """The bucket's staged record (already renamed into place by commit_records) is current:
        in-memory bookkeeping only, cannot fail. handles: {(segment, key): the optimizer's new,
        empty state tensor} the record's slots belong to."""
        h = self._home(bo)
        self._cache = None
        if h.bound:
            self._unbind_state(h)
        self._unbind_master(bo, h)
        buf, h.buffer = h.buffer, None
        self._free_buffer(buf)
        h.dirty = h.verified = h.writing = False
        self._errors = [e for e in self._errors if e.filename != self.directory.display_path(h.name)]
        if st.side is None:
            h.layout, h.generation, h.handles = None, _NOT_LOADED, {}
            if bo.offloads_master:
                self._point_master(bo, torch.empty(0, dtype=bo.master.dtype))
            return
        if h.io_path is None:
            h.io_path = self.directory.io_path(h.name)
            self._by_path[h.io_path] = h.index
        h.layout, h.generation, h.handles = st.layout, st.generation, handles
        if bo.offloads_master:
            self._point_master(bo, torch.empty(0, dtype=bo.master.dtype))  # in the record now

    def discard_load(self, st: "StagedRecord") -> None:
        if st is not None and st.side is not None:
            self.directory.remove(st.side)

    # -- accounting ---------------------------------------------------------------------------------

    @property
    def background_check_s(self) -> float:
        """Seconds spent checking records read, on the lanes' thread (not the training thread's)."""
        return self._lanes.check_s

    def disk_bytes(self) -> int:
        return self.directory.disk_bytes()

    @property
    def engine(self) -> str:
        """The I/O engine in use: "io_uring" or "threads" (docs/aio.md "Fallbacks")."""
        return self._writer.get_engine()

    def record_bytes(self) -> list[int]:
        return [h.layout.record_bytes if h.layout else 0 for h in self._homes]

    def close(self) -> None:
        """Waits for I/O, then removes the swap files and the directory. The state is gone."""
        try:
            self._drain_writes()
        except OSError:
            pass
        for h in self._homes:
            if h.lane is not None:
                lane, h.lane = h.lane, None
                self._lanes.wait_quietly(lane)
        self._lanes.close()
        self.directory.close()

    # -- records ------------------------------------------------------------------------------------

    def _home(self, bo) -> _Home:
        return self._homes[self._index[id(bo)]]

    def _entries(self, bo, state: dict | None = None, master: torch.Tensor | None = None):
        """(segment, key, dtype, numel) of the master (when offloaded) and of every elementwise
        state tensor, and the tensors, in record order. state: {segment master: {key: value}}
        (default: the inner optimizer's); master: the master's values (default: bo.master)."""
        state = bo.inner.state if state is None else state
        master = bo.master if master is None else master
        entries, tensors = [], []
        if bo.offloads_master:
            entries.append((*_MASTER, bo.master.dtype, master.numel()))
            tensors.append(master)
        for si, seg in enumerate(bo.segments):
            st = state.get(seg.master)
            if not st:
                continue
            n = seg.hi - seg.lo
            for key in sorted(st, key=str):
                v = st[key]
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == n and n > 0:
                    entries.append((si, key, v.dtype, n))
                    tensors.append(v)
        return entries, tensors

    def _master_slot(self, h: _Home) -> record.Slot:
        return next(s for s in h.layout.slots if (s.segment, s.key) == _MASTER)

    def _ensure_file(self, h: _Home, layout: record.Layout) -> None:
        if h.io_path is None:
            h.io_path = self.directory.create(h.name, layout.record_bytes)
            self._by_path[h.io_path] = h.index
        elif h.layout is None or layout.record_bytes > h.layout.record_bytes:
            self.directory.grow(h.name, layout.record_bytes)

    def _gather(self, bo, h: _Home, layout: record.Layout, tensors) -> torch.Tensor:
        """The record's buffer with every tensor copied in (tensors already bound to it are in
        place); the tensors become the bucket's handles, bound to it."""
        old = h.buffer
        buf = old
        if buf is None or buf.numel() < layout.record_bytes or layout != h.layout:
            # A new buffer when the layout changed: copying in place could overwrite tensors
            # of the old layout before they are copied.
            buf = self._acquire(layout.record_bytes)
        for slot, t in zip(layout.slots, tensors):
            view = layout.view(buf, slot)
            if t.numel() != slot.numel:
                raise RuntimeError(f"offload_optimizer: '{slot.key}' of bucket {h.index} is not resident")
            if t.data_ptr() != view.data_ptr():
                view.copy_(t.reshape(-1))
        h.buffer, h.layout = buf, layout
        h.handles = {(s.segment, s.key): t for s, t in zip(layout.slots, tensors) if s.segment >= 0}
        self._bind(bo, h)
        if old is not None and old is not buf:
            self._free_buffer(old)
        return buf

    class _Resident:
        """Context manager: the record of `h` in a buffer (resident, or read and checked)."""

        def __init__(self, swapper, h):
            self.s, self.h, self.buf = swapper, h, None

        def __enter__(self):
            s, h = self.s, self.h
            if h.writing:
                s._drain_writes()  # may release the buffer once its write is done
            if h.buffer is not None and h.lane is None:
                self.buf = h.buffer
                return self.buf
            try:
                if h.lane is not None:
                    lane, h.lane = h.lane, None
                    self.buf, h.buffer = h.buffer, None
                else:
                    self.buf = s._acquire(h.layout.record_bytes)
                    lane = s._read_into(h, self.buf)
                s._lanes.wait(lane)  # read and checked
            except (OSError, record.RecordError) as e:
                s._free_buffer(self.buf)
                raise s._named(e, h, "reading") from None
            return self.buf

        def __exit__(self, *exc):
            if self.buf is not self.h.buffer:
                self.s._free_buffer(self.buf)
            return False

    def _record(self, h: _Home):
        return self._Resident(self, h)

    def _rewrite(self, h: _Home, buf: torch.Tensor) -> None:
        """Writes a modified record (read from disk) back, synchronously, as a new generation."""
        self._drain_writes()
        h.generation += 1
        record.seal(buf, h.layout, h.index, self.rank, h.generation)
        try:
            self._writer.sync_pwrite(buf[:h.layout.record_bytes], h.io_path)
        except OSError as e:  # the file may be torn now: the new record stays in memory
            h.buffer, h.dirty = buf, True
            raise self._named(e, h, "writing", _KEPT_LOADED) from None

    def _raise_errors(self) -> None:
        errors, self._errors = self._errors, []
        record.raise_collected(errors)

    # -- binding ------------------------------------------------------------------------------------

    def _bind(self, bo, h: _Home) -> None:
        for slot in h.layout.slots:
            view = h.layout.view(h.buffer, slot)
            if slot.segment < 0:
                self._point_master(bo, view)
                h.master_bound = True
                continue
            t = h.handles[(slot.segment, slot.key)]
            if t.data_ptr() != view.data_ptr():
                t.data = view
            st = bo.inner.state[bo.segments[slot.segment].master]
            if st.get(slot.key) is not t:
                st[slot.key] = t
        h.bound = True

    @staticmethod
    def _point_master(bo, flat: torch.Tensor) -> None:
        bo.master.data = flat
        for s in bo.segments:
            s.master.data = flat[s.lo:s.hi]

    def _stand_in_master(self, bo, h: _Home) -> None:
        """The record is lost: the engine still publishes this bucket's master, so give it the
        parameters' own values (exact: the parameters are the master rounded)."""
        self._point_master(bo, bo.param_shard().to("cpu", torch.float32, copy=True))
        h.master_bound = True

    def _unbind_state(self, h: _Home) -> None:
        for t in h.handles.values():
            t.data = torch.empty(0, dtype=t.dtype)
        h.bound = False

    def _unbind_master(self, bo, h: _Home) -> None:
        if h.master_bound:
            self._point_master(bo, torch.empty(0, dtype=bo.master.dtype))
            h.master_bound = False

    def _unbind_masters(self, except_: _Home | None) -> None:
        for h in self._homes:
            if h.master_bound and h is not except_:
                self._unbind_master(self._bos[h.index], h)
                self._release_if_idle(h)

    # -- I/O and buffers ----------------------------------------------------------------------------

    def _make_resident(self, h: _Home) -> bool:
        if h.generation == _NOT_LOADED and h.buffer is None:
            return True  # nothing stored yet: the optimizer creates its state in this step
        if h.buffer is not None and h.lane is None:
            if h.writing:
                self._drain_writes()  # a bucket visited twice in one step: its write first
            if h.verified:
                self.cache_hits += 1
            return True  # dirty (a failed write), just stored or cached: the buffer is the record
        try:
            if h.lane is None:
                self._prefetch(h)
                if h.lane is None:  # refused at the call: read once more for the error
                    h.buffer = self._acquire(h.layout.record_bytes)
                    h.lane = self._read_into(h, h.buffer)
            t0 = time.perf_counter()
            lane, h.lane = h.lane, None
            try:
                self._lanes.wait(lane)
            finally:
                self.read_wait_s += time.perf_counter() - t0
            h.verified = True  # checked by the lanes' background thread
            return True
        except (OSError, record.RecordError) as e:
            h.lane = None
            self._free_buffer(h.buffer)
            h.buffer = None
            self._errors.append(self._named(e, h, "reading", _LOST))
            return False

    def _read_depth(self) -> int:
        """Records read ahead of the bucket stepping: the pool less that one and one being written."""
        return max(1, self.policy.buffer_count - 2)

    def _prefetch(self, h: _Home, keep=frozenset()) -> None:
        if h.lane is not None or h.buffer is not None or h.generation == _NOT_LOADED:
            return
        # Waiting here for older writes when the pool is full is the pipeline's back-pressure.
        buf = self._acquire(h.layout.record_bytes, keep)
        try:
            lane = self._read_into(h, buf)
        except OSError:
            self._free_buffer(buf)  # refused at the call (file gone, ...): fetch reads again, reports
            return
        h.buffer, h.lane, h.verified = buf, lane, False

    def _read_into(self, h: _Home, buf: torch.Tensor):
        """Starts reading h's record into buf, checked in the background; returns the read's
        ticket. Raises OSError if refused."""
        layout, index, generation = h.layout, h.index, h.generation
        lane = self._lanes.read(buf[:layout.record_bytes], h.io_path,
                                lambda: record.check(buf, layout, index, self.rank, generation))
        self.bytes_read += h.layout.record_bytes
        return lane

    def _drain_writes(self) -> None:
        writing = [h for h in self._homes if h.writing]
        if not writing:
            return
        t0 = time.perf_counter()
        try:
            self._writer.wait()
        except OSError as e:
            self.write_wait_s += time.perf_counter() - t0
            # wait() reports the first failure only: every write of the batch stays dirty (in
            # memory) and is written again at its bucket's next store.
            failed = self._by_path.get(e.filename)
            named = self._homes[failed] if failed is not None else writing[0]
            self._errors.append(self._named(e, named, "writing", _KEPT))
            for h in writing:
                h.writing = False
            return
        self.write_wait_s += time.perf_counter() - t0
        for h in writing:
            h.writing = h.dirty = False
            h.verified = True  # the buffer is what the file now holds: cached until evicted
            self.bytes_written += h.layout.record_bytes
            self._release_if_idle(h)

    def _release_if_idle(self, h: _Home) -> None:
        """An idle buffer goes back to the pool, unless it holds the current record (cached)."""
        if h.buffer is not None and not h.busy() and not h.verified:
            self._free_buffer(h.buffer)
            h.buffer = None

    def _acquire(self, nbytes: int, keep=frozenset()) -> torch.Tensor:
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
            cached = [h for h in self._homes if h.buffer is not None and not h.busy() and h.index not in keep]
            if cached:  # the least recently stored cached record gives its buffer up
                h = min(cached, key=lambda c: c.last_used)
                buf, h.buffer, h.verified = h.buffer, None, False
                self._free_buffer(buf)
                continue
            if any(h.writing for h in self._homes):
                self._drain_writes()
                continue
            # Every buffer holds a record that is not on disk (failed writes) or in use: go over
            # the budget rather than lose state (reported in peak_buffer_bytes).
            return self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        nbytes = -(-nbytes // 4096) * 4096
        buf = self._writer.new_cpu_locked_tensor(nbytes, torch.uint8)
        self._buffers += 1
        self.buffer_bytes += buf.numel()
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        return buf

    def _free_buffer(self, buf: torch.Tensor | None) -> None:
        if buf is None:
            return
        if self._buffers > self.policy.buffer_count:  # an over-budget buffer: give it back
            self._buffers -= 1
            self.buffer_bytes -= buf.numel()
            return
        self._free.append(buf)

    def _named(self, e: BaseException, h: _Home, doing: str, consequence: str = "") -> OSError:
        path = self.directory.display_path(h.name)
        err = record.swap_error(e, path, f"offload_optimizer: {doing} swap file {path!r} (bucket {h.index}, "
                                         f"rank {self.rank})")
        if consequence:
            err.strerror += consequence
        return err
