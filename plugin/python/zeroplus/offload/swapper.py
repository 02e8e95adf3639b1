"""NVMe optimizer-state swapper: each bucket's fp32 master and optimizer state live in a swap file.

The bytes move through the C++ engine's swap substrate, torch.classes.zeroplus.SwapStore
(optimizers/core/swap_store.hpp, registered by registration/swap_registration.cpp): records with a
4 KiB header and CRC-32s, a pool of page-aligned, page-locked buffers (registered with CUDA on
CUDA training), a pump thread that reads the planned records ahead as buffers free up and checks
and seals records off the training thread, write-behind, and failed writes kept in memory. This
file keeps what is Python's: which tensors go in a record (the layout of slots: the master, then
each segment's elementwise state keys), pointing the optimizer's state tensors at views of the
held record, the swap directory (nvme_store.SwapDirectory: the store works inside it), loading,
and the error policy. The engine steps bucket after bucket (fetch -> step -> store):

    plan:       (the engine's zero_grad, and begin_step) the next step's records in its order:
                the store reads them during forward and backward, as buffers free up (issue 41);
    fetch:      takes the bucket's record from the store (read ahead, or read now) and points
                the optimizer's state tensors (and the master, when the record holds it) at it;
    store:      copies any state tensor that is not already in the record (state the optimizer
                created or replaced; a new layout gets a new buffer), hands the record back to be
                sealed (generation + CRC-32) and written; the state tensors are emptied. The
                master stays readable ("linger") until the engine has written it into the
                parameters (its publish): until the next bucket's fetch or the end of the step.

So the read of bucket i+1, the step of bucket i and the write of bucket i-1 overlap. The store
holds at most `buffer_count` buffers, each the largest record so far: a layout that grows (state
the optimizer creates after the first step, SGD's momentum) reserves the larger size first, and
the store replaces smaller free buffers as it reuses them. Records written last stay cached in the
pool, so a step in the reverse order starts without a read. Between steps the optimizer holds only
its per-parameter scalars (Adam's `step`) and empty state tensors.

State tensors and masters keep their identity: the optimizer's state dicts and parameter lists
always hold the same tensor objects (their `.data` is pointed at the record on fetch and emptied
afterwards), so the fused optimizers' cached plans stay valid and nothing else sees a swap. The
store's payloads are views without ownership: every view is emptied before its record is stored
(the master: released), released or the store closed.

Loading (ZeroEngine.load_state_dict, load_checkpoint) never changes a record in place:

    stage_load(bo, state, master)  writes the bucket's record as the load leaves it (sealed by the
                         store's format) into a side file (`optimizer-bNNNNN.new`), synchronously,
                         through this swapper's AioHandle; nothing else changes;
    commit_records(...)  renames every side file over its record (a lost record is simply
                         created by the rename: loading is its repair), before any state changes,
                         and has the store open the new file and drop its buffered old copy;
    commit_load(bo, ...) points the bucket's bookkeeping at the new record (in memory only);
    discard_load(...)    removes a side file (an error anywhere: nothing changed).

Faults (docs/offload.md "Faults"): errors never leave the step half done on one rank only
(the other ranks would hang in the next collective), so they are collected during the step
and raised by end_step(), after the step's last collective, as OSError naming the file, the
bucket and the rank:
  * a write that fails, or a file that cannot be created or reserved (ENOSPC, EFBIG, EIO): the
    bucket's record stays in memory (the store keeps its buffer, beyond buffer_count if need be)
    and is written again at its next store, so no state is lost and training continues from this
    step once space is freed;
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
from .nvme_store import SwapDirectory
from .policy import OffloadPolicy

_NOT_LOADED = 0  # generation of a bucket with nothing on disk yet
_STEM = "optimizer-b"  # file names: optimizer-bNNNNN.swp (the store's stem + 5-digit id)
_KEPT = ("; the step completed and the bucket's state is kept in memory until a later step writes it "
         "(free space, then continue training)")
_KEPT_LOADED = "; the bucket's new values are kept in memory and written at its next step"
_LOST = ("; the bucket was not stepped (its parameters and optimizer state keep their values); the state in "
         "this file is unusable: load a checkpoint (load_state_dict) to replace it")
_MASTER = (-1, "master")  # the master's slot in a record


@dataclass
class _Home:
    """Where one bucket's state is right now (the bytes: the store's)."""
    index: int
    name: str
    layout: record.Layout | None = None  # None until the bucket has a record
    generation: int = _NOT_LOADED
    payload: torch.Tensor | None = None  # the held record's payload (a view into the store's buffer)
    lingering: bool = False      # stored with its master still readable (released at the next fetch)
    stand_in: bool = False       # its fetch failed: the master is a copy of the parameters until then
    handles: dict = field(default_factory=dict)  # (segment, key) -> the optimizer's state tensor

    def key(self, layout: record.Layout | None = None) -> tuple[int, int, int, int]:
        layout = layout or self.layout
        return self.index, self.generation, layout.payload_bytes, _tag(layout)


def _tag(layout: record.Layout) -> int:
    return layout.digest  # crc32 of the slots (segment, key, dtype, numel, offset)


def _view(payload: torch.Tensor, slot: record.Slot) -> torch.Tensor:
    return payload[slot.offset:slot.offset + slot.nbytes].view(slot.dtype)


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


class OptimizerSwapper(record.StoreCounters):
    def __init__(self, policy: OffloadPolicy, rank: int, directory: SwapDirectory, bucket_optimizers: list):
        if not isinstance(policy, OffloadPolicy) or policy.device != "nvme":
            raise ValueError("OptimizerSwapper: needs an OffloadPolicy with device 'nvme'")
        self.policy = policy
        self.rank = rank
        self.directory = directory
        self._writer = policy.aio.new_handle()  # side files of a staged load (stage_load)
        self._bos = list(bucket_optimizers)
        self._homes = [_Home(i, f"{_STEM}{i:05d}.swp") for i in range(len(self._bos))]
        for h in self._homes:
            directory.track(h.name)  # created by the store: counted by disk_bytes, removed by close
        self._index = {id(bo): i for i, bo in enumerate(self._bos)}
        a = policy.aio
        # Buffers start at a header and grow to the largest record (reserve: module doc).
        self._store = torch.classes.zeroplus.SwapStore(
            directory.path, _STEM, record.HEADER_BYTES, policy.buffer_count, a.block_size, a.queue_depth, a.threads,
            True, torch.cuda.is_available())
        self._stage_buf: torch.Tensor | None = None
        self._errors: list[OSError] = []
        self._cache: tuple | None = None  # (index, generation, {segment: {key: tensor}}) for state_dict
        self._staged_bytes = 0  # written by stage_load (beside the store's)
        self.checksum_s = 0.0   # the training thread's sealing (stage_load); the store's is background_check_s

    # -- the step ----------------------------------------------------------------------------------

    def begin_step(self, order: list[int] | None = None) -> None:
        """A step starts; it visits the buckets in `order` (indices; None: 0, 1, ...). The store
        reads their records in that order as buffers free up; records still in the pool from the
        last step (the last ones written) are used without a read: an engine that alternates the
        order gains them."""
        self._cache = None
        self.plan(order)

    def plan(self, order: list[int] | None = None) -> None:
        """The next step will visit the buckets in `order`: the store starts reading their records
        now, into the buffers free now and as more free up (the engine calls this from zero_grad,
        so the reads run during forward and backward: issue 41). Replaces the last plan; never
        blocks."""
        order = list(range(len(self._bos))) if order is None else list(order)
        if not self.policy.pipeline_read:
            return
        keys = []
        for i in order:
            h = self._homes[i]
            if h.layout is not None and h.generation != _NOT_LOADED and h.payload is None:
                keys.extend(h.key())
        self._store.plan_reads(keys)

    def fetch(self, bo) -> bool:
        """Makes the bucket's master and state resident; False: they are unreadable (the error
        is kept for end_step) and the bucket must not step."""
        h = self._home(bo)
        self._cache = None
        self._unbind_masters(except_=h)  # earlier buckets are published by now
        if h.layout is None or h.payload is not None:
            return True  # nothing stored yet (the optimizer creates its state in this step), or held
        payload, code, what = self._store.fetch(*h.key())
        if code:
            self._errors.append(self._fault(h, code, what, "reading", _LOST))
            if bo.master_is_copy:  # the engine still publishes this bucket's master: the parameters' own
                bo.point_master(bo.param_shard().to("cpu", torch.float32, copy=True))
                h.stand_in = True
            return False
        h.lingering = False  # a record fetched again while lingering: held now
        h.payload = payload
        self._bind(bo, h)
        return True

    def store(self, bo) -> None:
        """Starts writing the bucket's record (after its step) and empties the state tensors;
        the master stays readable until the next fetch or end_step."""
        h = self._home(bo)
        self._cache = None
        if bo.inner is None or (h.layout is not None and h.payload is None):
            return  # nothing resident to store (its fetch failed)
        entries, tensors = self._entries(bo)
        if not entries:
            return  # nothing elementwise to keep (SGD without momentum in fp32 training)
        layout = record.Layout.build(entries)
        values = list(tensors)
        if (h.payload is None or layout != h.layout) and not self._relayout(bo, h, layout, tensors, values):
            return  # no buffer for the record: the state stays in memory (the error is end_step's)
        for slot, t in zip(layout.slots, values):
            view = _view(h.payload, slot)
            if t.numel() != slot.numel:
                raise RuntimeError(f"offload_optimizer: '{slot.key}' of bucket {h.index} is not resident")
            if t.data_ptr() != view.data_ptr():  # a new layout, or state the optimizer replaced
                view.copy_(t.reshape(-1))
        handles = {(s.segment, s.key): t for s, t in zip(layout.slots, tensors) if s.segment >= 0}
        for k, t in h.handles.items():  # state the optimizer dropped: no view of the record is left
            if handles.get(k) is not t:
                t.data = torch.empty(0, dtype=t.dtype)
        h.handles = handles
        self._unbind_state(h)
        if bo.master_is_copy:  # readable until published (the next fetch or end_step)
            bo.point_master(_view(h.payload, self._master_slot(h)))
        h.generation += 1
        h.lingering = bo.master_is_copy
        h.payload = None
        self._store.store(*h.key(), h.lingering)
        if not self.policy.pipeline_write:
            self._collect(self._store.drain(), "writing", _KEPT)

    def _relayout(self, bo, h: _Home, layout: record.Layout, tensors: list, values: list) -> bool:
        """Holds a zero-filled buffer of the new layout for the bucket (its first record, or state
        the optimizer created or dropped); values that are views of the old one become copies
        (the new buffer may be the old one). store() copies the values in. False: no buffer (the
        error joins the step's, raised by end_step: never mid-step); the optimizer's tensors then
        hold the values in memory, unswapped, until the next store writes them."""
        old = h.payload
        if old is not None:
            for i, t in enumerate(values):
                if _aliases(t, old):
                    values[i] = t.clone()
            self._store.release(h.index)
            # The step changed the held record in place: a copy cached under its old generation
            # would not be what the file holds (the file is the truth until the new record's write).
            self._store.forget(h.index)
            h.payload = None
        self._store.reserve(layout.record_bytes)
        payload, code, what = self._store.overwrite(h.index, layout.payload_bytes)
        if code:
            self._errors.append(self._fault(h, code, what, "holding a buffer for", _KEPT))
            if old is not None:  # no tensor may keep viewing the buffer given back
                kept = {id(t) for t in tensors}
                for t, v in zip(tensors, values):
                    if v is not t:
                        if t is bo.master:
                            bo.point_master(v)
                        else:
                            t.data = v
                for t in h.handles.values():
                    if id(t) not in kept:
                        t.data = torch.empty(0, dtype=t.dtype)
            # As before the bucket's first record: its state is the optimizer's, in memory.
            h.layout, h.handles, h.lingering = None, {}, False
            return False
        h.payload, h.layout = payload, layout
        return True

    def end_step(self) -> None:
        """Waits for the step's I/O; raises the step's swap errors (see the module doc)."""
        for h in self._homes:
            if h.payload is not None:  # fetched, never stored (the step raised): the buffer is the state
                bo = self._bos[h.index]
                self._unbind_state(h)
                if bo.master_is_copy:
                    bo.point_master(torch.empty(0, dtype=bo.master.dtype))
                h.payload = None
                h.generation += 1
                self._store.store(*h.key(), False)
        self._collect(self._store.drain(), "writing", _KEPT)
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
        with self._record(h) as payload:
            for slot in h.layout.slots:  # the master (segment -1, when offloaded) too: master_copy
                out.setdefault(slot.segment, {})[slot.key] = _view(payload, slot).clone()
        self._cache = (h.index, h.generation, out)
        self._collect(self._store.poll(), "writing", _KEPT)
        self._raise_errors()  # of writes that ended on the way
        return out

    def master_copy(self, bo) -> torch.Tensor | None:
        """A copy of the bucket's fp32 master where this swapper holds it (mixed precision), read
        through the file when it is not resident (one read serves segment_states too); None: the
        master is not in a record (fp32 training, or nothing stored yet). Raises OSError."""
        if not bo.master_is_copy or self._home(bo).layout is None:
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
        if not bo.master_is_copy or h.layout is None:
            bo.master[lo:hi].copy_(values)  # still the in-memory master (no record yet)
            return
        if h.payload is not None:  # held (during a step): written with the bucket's store
            _view(h.payload, self._master_slot(h))[lo:hi].copy_(values)
            return
        self._release_linger(h)
        payload, code, what = self._store.fetch(*h.key())
        if code:
            raise self._fault(h, code, what, "reading")
        _view(payload, self._master_slot(h))[lo:hi].copy_(values)
        del payload
        h.generation += 1
        self._store.store(*h.key(), False)
        faults = self._store.drain()  # synchronous: a failed write keeps the new values in memory
        mine = [f for f in faults if f[0] == h.index]
        self._collect([f for f in faults if f[0] != h.index], "writing", _KEPT)
        if mine:
            self._errors.insert(0, self._fault(h, mine[0][2], mine[0][3], self._doing(mine[0][3]), _KEPT_LOADED))
        self._raise_errors()

    def stage_load(self, bo, state: dict, master: torch.Tensor | None = None) -> "StagedRecord":
        """Writes the bucket's record as a load will leave it into a side file (`optimizer-bNNNNN.new`),
        synchronously; changes nothing else: the live record, its cached copy, the optimizer and
        the master stay as they are until commit_load (discard_load: the side file goes). state:
        {segment master: {key: value}} as the optimizer class cast it (a scratch optimizer's
        load_state_dict); master: the bucket's new fp32 master (a checkpoint's), or None to keep
        the current one (read through the record; a record that is lost or refused, which this
        load repairs, gives way to the parameters, as loading a model sets it).
        Raises OSError naming the file; no side file is left then."""
        h = self._home(bo)
        self._collect(self._store.drain(), "writing", _KEPT)  # nothing in flight between steps
        if bo.master_is_copy and master is None:
            master = self._current_master(bo, h)
        entries, tensors = self._entries(bo, state, master)
        if not entries:
            return StagedRecord(None, None, h.generation + 1)
        layout = record.Layout.build(entries)
        side = h.name[:-len(".swp")] + ".new"
        self.directory.remove(side)  # an earlier load's that was never committed
        buf = self._staging(layout.record_bytes)
        buf[:layout.record_bytes].zero_()
        payload = buf[record.HEADER_BYTES:layout.record_bytes]
        for slot, t in zip(layout.slots, tensors):
            _view(payload, slot).copy_(t.reshape(-1))
        t0 = time.perf_counter()
        self._store.seal(buf, h.index, h.generation + 1, layout.payload_bytes, _tag(layout))
        self.checksum_s += time.perf_counter() - t0
        try:
            io_path = self.directory.create(side, layout.record_bytes)
        except OSError as e:
            raise self._named(e, h, "creating the replacement for") from None
        try:
            self._writer.sync_pwrite(buf[:layout.record_bytes], io_path)
        except OSError as e:
            self.directory.remove(side)
            raise self._named(e, h, "writing the replacement for") from None
        self._staged_bytes += layout.record_bytes
        return StagedRecord(side, layout, h.generation + 1)

    def _staging(self, nbytes: int) -> torch.Tensor:
        """One page-aligned buffer for staged records, kept at the largest size (loads are rare)."""
        if self._stage_buf is None or self._stage_buf.numel() < nbytes:
            self._stage_buf = None
            self._stage_buf = self._writer.new_cpu_locked_tensor(-(-nbytes // 4096) * 4096, torch.uint8)
        return self._stage_buf

    def _current_master(self, bo, h: _Home) -> torch.Tensor:
        """A copy of the bucket's fp32 master as it is now (stage_load)."""
        if h.layout is None:
            return bo.master.detach().to("cpu", torch.float32, copy=True)  # not stored yet: in memory
        try:
            with self._record(h) as payload:
                return _view(payload, self._master_slot(h)).clone()
        except OSError:
            return bo.param_shard().to("cpu", torch.float32, copy=True)

    def commit_records(self, staged: list[tuple]) -> None:
        """Renames every staged side file over its bucket's record (staged: (bucket optimizer,
        StagedRecord) pairs), all before any bucket's state changes: a rename that fails leaves
        the optimizer as it was, and the records already replaced are refused from then on (their
        generation is not the one the swapper expects; the store's copy of the old one is dropped)
        until a load succeeds. Raises OSError."""
        done = []
        self._stage_buf = None  # the staging is over
        for bo, st in staged:
            if st.side is None:
                continue
            h = self._home(bo)
            self._release_linger(h)  # the store keeps a record its owner still reads (adopt: EBUSY)
            try:
                self.directory.replace(st.side, h.name)
                code, what = self._store.adopt(h.index)  # the new file; the old record's copy is dropped
                if code:
                    raise OSError(code, what.split(": ", 1)[-1], self.directory.display_path(h.name))
            except OSError as e:
                raise record.replacement_failed(self._named(e, h, "replacing"), done, "buckets") from None
            done.append(h.index)

    def commit_load(self, bo, st: "StagedRecord", handles: dict) -> None:
        """The bucket's staged record (already renamed into place by commit_records) is current:
        in-memory bookkeeping only, cannot fail. handles: {(segment, key): the optimizer's new,
        empty state tensor} the record's slots belong to."""
        h = self._home(bo)
        self._cache = None
        self._unbind_state(h)
        if bo.master_is_copy:
            bo.point_master(torch.empty(0, dtype=bo.master.dtype))  # in the record now (or none)
        self._release_linger(h)  # between steps nothing is held; a master still lingering goes back
        h.payload = None
        path = self.directory.display_path(h.name)
        self._errors = [e for e in self._errors if e.filename != path]
        if st.side is None:
            self._store.forget(h.index)
            h.layout, h.generation, h.handles = None, _NOT_LOADED, {}
            return
        self._store.reserve(st.layout.record_bytes)
        h.layout, h.generation, h.handles = st.layout, st.generation, handles

    def discard_load(self, st: "StagedRecord") -> None:
        if st is not None and st.side is not None:
            self.directory.remove(st.side)
        self._stage_buf = None

    # -- accounting (bench/offload, memory_report) ----------------------------------------------------

    @property
    def cache_hits(self) -> int:
        """Records a fetch found in a buffer (cached since their write, or still being written)."""
        st = self._stats()
        return st["cache_hits"] + st["fetches_in_buffer"]

    def disk_bytes(self) -> int:
        return self.directory.disk_bytes()

    def record_bytes(self) -> list[int]:
        return [h.layout.record_bytes if h.layout else 0 for h in self._homes]

    def close(self) -> None:
        """Waits for I/O, then removes the swap files and the directory. The state is gone."""
        for h in self._homes:
            bo = self._bos[h.index]
            self._unbind_state(h)
            if bo.master_is_copy and (h.payload is not None or h.lingering or h.stand_in):
                bo.point_master(torch.empty(0, dtype=bo.master.dtype))
            h.payload, h.lingering, h.stand_in = None, False, False
        self._store.close()  # waits for its transfers; no view of its buffers is left
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
        if bo.master_is_copy:
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

    class _Resident:
        """Context manager: the payload of h's record (held, or fetched for the block and released
        after it: the caller copies what it needs)."""

        def __init__(self, swapper, h):
            self.s, self.h, self.fetched = swapper, h, False

        def __enter__(self):
            s, h = self.s, self.h
            if h.payload is not None:
                return h.payload
            s._release_linger(h)
            payload, code, what = s._store.fetch(*h.key())
            if code:
                raise s._fault(h, code, what, "reading")
            self.fetched = True
            return payload

        def __exit__(self, *exc):
            if self.fetched:
                self.s._store.release(self.h.index)
            return False

    def _record(self, h: _Home):
        return self._Resident(self, h)

    # -- binding ------------------------------------------------------------------------------------

    def _bind(self, bo, h: _Home) -> None:
        for slot in h.layout.slots:
            view = _view(h.payload, slot)
            if slot.segment < 0:
                bo.point_master(view)
                continue
            t = h.handles[(slot.segment, slot.key)]
            if t.data_ptr() != view.data_ptr():
                t.data = view
            st = bo.inner.state[bo.segments[slot.segment].master]
            if st.get(slot.key) is not t:
                st[slot.key] = t

    @staticmethod
    def _unbind_state(h: _Home) -> None:
        for t in h.handles.values():
            t.data = torch.empty(0, dtype=t.dtype)

    def _release_linger(self, h: _Home) -> None:
        if h.stand_in:
            self._bos[h.index].point_master(torch.empty(0, dtype=self._bos[h.index].master.dtype))
            h.stand_in = False
        if h.lingering:
            bo = self._bos[h.index]
            if bo.master_is_copy:
                bo.point_master(torch.empty(0, dtype=bo.master.dtype))
            h.lingering = False
            self._store.release(h.index)

    def _unbind_masters(self, except_: _Home | None) -> None:
        for h in self._homes:
            if h is not except_:
                self._release_linger(h)

    # -- errors -------------------------------------------------------------------------------------

    @staticmethod
    def _doing(what: str) -> str:
        return "creating" if what.startswith("create failed") else "writing"

    def _collect(self, faults: list, doing: str, consequence: str) -> None:
        """Write faults the store reported ((id, path, errno, what)) join the step's errors."""
        for index, _path, code, what in faults:
            h = self._homes[index]
            self._errors.append(self._fault(h, code, what, self._doing(what) if doing == "writing" else doing,
                                            consequence))

    def _fault(self, h: _Home, code: int, what: str, doing: str, consequence: str = "") -> OSError:
        """A fault the store reported (errno, what) as the OSError the swapper raises."""
        err = record.fault(code, what, self.directory.display_path(h.name), self._context(h, doing))
        if consequence:
            err.strerror += consequence
        return err

    def _raise_errors(self) -> None:
        errors, self._errors = self._errors, []
        record.raise_collected(errors)

    def _context(self, h: _Home, doing: str) -> str:
        path = self.directory.display_path(h.name)
        return f"offload_optimizer: {doing} swap file {path!r} (bucket {h.index}, rank {self.rank})"

    def _named(self, e: BaseException, h: _Home, doing: str, consequence: str = "") -> OSError:
        path = self.directory.display_path(h.name)
        err = record.swap_error(e, path, self._context(h, doing))
        if consequence:
            err.strerror += consequence
        return err


def _aliases(t: torch.Tensor, payload: torch.Tensor) -> bool:
    """Whether t's bytes lie inside payload's (a view of the held record)."""
    lo, hi = payload.data_ptr(), payload.data_ptr() + payload.numel()
    return t.numel() > 0 and lo <= t.data_ptr() < hi
