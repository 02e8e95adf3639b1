"""NVMe parameter swapper (stage 3, offload_param device "nvme"): parameter shards live in files.

Every non-persistent stage-3 bucket's shard (this rank's slice of the bucket's parameters, in
the compute dtype) is one record of the C++ swap store (record.open_store: a 4 KiB header with
generation and CRC-32s, then the shard; pooled page-locked buffers, a pump thread that reads
planned records ahead and checks and seals them off the training thread, write-behind, records
cached after their write) in `param-bNNNNN.swp` in this rank's private swap directory
(nvme_store.py). This swapper has a store of its own (the gradient spill and the optimizer
swapper have theirs: each pool is sized by its own setting, and only this one caches records).
Between uses the bucket's `shard` tensor is empty (its identity is kept: the gatherer and, in
fp32 training, the optimizer's master hold that one tensor object) and the module's parameters
are resting views (zero/layout.py: full shape, no values), as without offload. The swapper makes
a shard resident only while someone uses it:

    read_ahead(buckets)  the gatherer's prediction of the buckets it gathers next (this pass's
                         rest, then the next pass's: across steps, issue 41) or the step's next
                         ones: the store reads their records in that order as buffers free up;
                         end_step plans the gatherer's list again (the next forward's records
                         are read while the step's writes finish);
    pin(bucket)          takes the record from the store (read ahead, cached, or read now) and
                         points `shard` at it; returns the shard (a view of a pooled buffer);
    unpin(bucket)        the user is done (its all-gather finished): `shard` is emptied and the
                         record goes back to the store unchanged (cached: the next pin needs no
                         read while its buffer is not needed for another);
    write(bucket, src)   after the step: the new shard (src: the fp32 master, cast; None: the
                         pinned shard itself holds it, fp32 training where the master IS the
                         shard, so the bytes are written once, here, and never by the optimizer
                         swapper) is stored as the next generation (write-behind); `defer` holds
                         it until end_step, so the step's reads have the disk to themselves.

Replacing shards (load_checkpoint: change nothing until every rank has read everything):

    stage_replacement(bucket, src)  writes `src` as the bucket's next record (sealed in the
                         store's format) into a side file (`param-bNNNNN.new`), synchronously;
                         the live record, its cached copy and the module are untouched;
    commit_replacements()  renames every side file over its live file and has the store adopt
                         it (the new generation is current; a cached copy of the old is dropped);
    discard_replacements()  removes the side files (an error anywhere: nothing changed).
So a load holds one bucket's shard in memory at a time, and needs the disk space of the
replaced records twice until the commit.

Memory: DeepSpeed's buffer_count x buffer_size (elements of the shards' dtype; a buffer is never
smaller than the largest record) is the budget (`budget_bytes`); the store holds as many buffers
of the largest record as fit in it (at most one per record). Pins beyond that (more shards in
use at once than the budget holds) allocate above the budget rather than fail;
peak_buffer_bytes reports it.

Faults (docs/offload.md "Faults"): a record that fails its checks (torn or lost write, flipped
bit, another bucket's file) or a failed read raises OSError (EBADMSG for a bad record) naming the
file, the bucket and the rank from pin(), i.e. from the forward/backward that needed the
parameters; half-written data is never used. A failed write (ENOSPC, EIO, the file removed)
keeps the new record in memory (the store keeps its buffer, beyond the budget if need be: it is
the only copy) and is raised by end_step() or drain() after it; the next write of that bucket
writes it again, so training continues once space is freed.
Not thread-safe: the engine's training thread calls it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import record
from .nvme_store import SwapDirectory
from .policy import OffloadPolicy

_STEM = "param-b"  # file names: param-bNNNNN.swp (the store's stem + 5-digit bucket index)
_KEY = (-2, "param")  # the shard's slot in a record (segment -2: not an optimizer segment)
_KEPT = ("; the new parameter shard is kept in memory and written again at the bucket's next step "
         "(free space, then continue training)")


@dataclass
class _Home:
    index: int
    name: str
    layout: record.Layout
    shard: torch.Tensor | None = None  # the bucket's shard tensor (identity kept; .data swapped)
    generation: int = 0                # of the record on disk (0: none yet)
    payload: torch.Tensor | None = None  # the record held from the store (a view without ownership)
    lingering: bool = False            # stored while pinned: the shard still reads its payload
    queued: bool = False               # held with a new shard, stored at end_step (defer)
    pins: int = 0
    updated: bool = False              # pinned for an in-place change (update=True), not written since
    staged: str | None = None          # the side file holding a replacement record (stage_replacement)

    def key(self) -> tuple[int, int, int, int]:
        return self.index, self.generation, self.layout.payload_bytes, self.layout.digest


class ParamSwapper(record.StoreCounters):
    spills_gradients = True     # offloaded buckets' gradient shards go to files (grad_spill.py)
    keeps_master_apart = False  # in fp32 the master is the shard (pinned for the step)

    def __init__(self, policy: OffloadPolicy, rank: int, directory: SwapDirectory, buckets: list):
        if not isinstance(policy, OffloadPolicy) or policy.device != "nvme" or policy.what != "offload_param":
            raise ValueError("ParamSwapper: needs an offload_param OffloadPolicy with device 'nvme'")
        self.policy = policy
        self.rank = rank
        self.directory = directory
        self._homes: dict[int, _Home] = {}
        for i, b in enumerate(buckets):
            layout = record.Layout.build([(*_KEY, b.dtype, b.shard_numel)])
            self._homes[id(b)] = _Home(i, f"{_STEM}{i:05d}.swp", layout)
            directory.track(self._homes[id(b)].name)  # created by the store: counted by disk_bytes, removed by close
        records = [h.layout.record_bytes for h in self._homes.values()]
        # DeepSpeed's meaning: buffer_count buffers of buffer_size elements each (of the shards'
        # dtype); a buffer is never smaller than the largest record.
        itemsize = max((b.dtype.itemsize for b in buckets), default=4)
        largest = -(-max(records, default=4096) // 4096) * 4096
        self.buffer_size = -(-max(largest, policy.buffer_size * itemsize) // 4096) * 4096
        self.budget_bytes = policy.buffer_count * self.buffer_size
        # The store's buffers are all of the largest record's size: as many as the budget holds,
        # never more than one per record (a pool that holds every record caches them all).
        self._count = max(policy.buffer_count, min(self.budget_bytes // largest, len(records)))
        self._store = record.open_store(directory, _STEM, largest, self._count, policy.aio, True)
        self._writer = policy.aio.new_handle()  # side files of a staged replacement
        self._stage_buf: torch.Tensor | None = None
        self._queued: list[_Home] = []  # held with a new shard, stored at end_step (write(..., defer=True))
        self._plan: list[_Home] = []    # the gatherer's last prediction (planned again by end_step)
        self._errors: list[OSError] = []
        self._staged_bytes = 0
        self.checksum_s = 0.0  # the training thread's sealing (stage_replacement); the store's is background_check_s

    def offloads(self, bucket) -> bool:
        return id(bucket) in self._homes

    # -- construction: the first record of every bucket ------------------------------------------

    def put_initial(self, bucket, values: torch.Tensor) -> None:
        """The bucket's first shard (at construction); `bucket.shard` is emptied. Raises OSError
        naming the file (nothing else to keep: the engine is not built)."""
        h = self._homes[id(bucket)]
        h.shard = bucket.shard
        self._raise_errors()
        self._hold_new(h)
        self._view(h).copy_(values.reshape(-1))
        self._store_record(h)
        h.shard.data = torch.empty(0, dtype=h.shard.dtype)

    def finish_initial(self) -> None:
        self.drain()

    # -- the gather path ----------------------------------------------------------------------------

    def read_ahead(self, buckets, depth: int | None = None, then=()) -> None:
        """The store reads these buckets' records (in this order; only the first `depth` of them
        when given: the step's next ones), then those of `then` (the next pass's), as buffers free
        up, never evicting a record read ahead. Without `depth` the list is the gatherer's
        prediction, planned again by end_step."""
        homes = [self._homes[id(b)] for b in [*buckets, *then] if id(b) in self._homes]
        if depth is None:
            self._plan = homes
        else:
            homes = homes[:depth]
        self._plan_reads(homes)

    def _plan_reads(self, homes: list[_Home]) -> None:
        keys = []
        for h in homes:
            if h.generation and h.payload is None and not h.lingering:
                keys.extend(h.key())
        self._store.plan_reads(keys)

    def pin(self, bucket, update: bool = False) -> torch.Tensor:
        """The bucket's shard, resident and checked (see the module doc). `update`: the caller
        changes it in place (the step's fp32 master), so a write of it still in flight is waited
        for first (a gather only reads it). Raises OSError."""
        h = self._homes[id(bucket)]
        if h.payload is None and (update or not h.lingering):
            self._make_room()
            payload, code, what = self._store.fetch(*h.key())  # a lingering record: held again after its write
            if code:
                raise self._fault(h, code, what, "reading")
            h.payload, h.lingering = payload, False
        h.pins += 1
        h.updated = h.updated or update
        if h.payload is not None:
            h.shard.data = self._view(h)
        return h.shard

    def pinned(self, bucket) -> bool:
        return self._homes[id(bucket)].pins > 0

    def unpin(self, bucket) -> None:
        h = self._homes[id(bucket)]
        if h.pins <= 0:
            return
        h.pins -= 1
        if h.pins == 0:
            h.shard.data = torch.empty(0, dtype=h.shard.dtype)
            if h.lingering:
                h.lingering = False
                self._store.release(h.index)
            elif h.payload is not None and not h.queued:
                h.payload = None
                self._store.release(h.index)  # unchanged: cached in its buffer
                if h.updated:
                    # Changed in place and never written (the step raised before write): the
                    # cached copy would stay under the old generation with the changed bytes, so
                    # the next pin would see values the file does not hold. The file is the truth.
                    h.updated = False
                    self._store.forget(h.index)

    # -- after the step -----------------------------------------------------------------------------

    def write(self, bucket, src: torch.Tensor | None, defer: bool = False) -> None:
        """Writes the bucket's new shard: `src` cast into the record, or (None) the pinned
        shard as it is. `defer` (the step's publish): stored at end_step, so the step's reads have
        the disk to themselves; the record stays held in its buffer until then. Errors are kept
        for end_step()."""
        h = self._homes[id(bucket)]
        if src is None:
            if h.pins <= 0 or (h.payload is None and not h.lingering):
                raise RuntimeError(f"offload_param: bucket {h.index} written in place while not pinned")
            if h.payload is None:  # stored already while pinned: held again (after its write)
                self.pin(bucket, update=True)
                h.pins -= 1
        else:
            if h.payload is None:
                if h.pins > 0:  # the pinned shard shows the new values too
                    self.pin(bucket, update=True)
                    h.pins -= 1
                else:
                    self._hold_new(h)
            self._view(h).copy_(src.reshape(-1))
            if h.pins > 0:
                h.shard.data = self._view(h)
        h.updated = False  # the changed shard is the next generation now
        if defer:
            if not h.queued:
                h.queued = True
                self._queued.append(h)
        else:
            self._store_record(h)

    def end_step(self) -> None:
        """This step's (deferred) writes start and go on while the next forward computes, the
        gatherer's prediction is planned again (the next forward's records), and the write errors
        reported so far are raised: a write that failed is raised by the first end_step (or
        drain) after it ended (its record is kept in memory meanwhile)."""
        self._start_queued()
        self._collect(self._store.poll())
        self._plan_reads(self._plan)
        self._raise_errors()

    def _start_queued(self) -> None:
        queued, self._queued = self._queued, []
        for h in queued:
            if h.queued:
                self._store_record(h)

    def drain(self) -> None:
        """Waits for every write in flight; raises the errors collected so far."""
        self._start_queued()
        self._collect(self._store.drain())
        self._raise_errors()

    # -- replacing records (load_checkpoint) ------------------------------------------------------------

    def stage_replacement(self, bucket, src: torch.Tensor) -> None:
        """Writes `src` (the bucket's whole new shard) as its next record into a side file; the
        live record stays current until commit_replacements(). Raises OSError naming the file
        (the side file is removed then). Not while the bucket is pinned."""
        h = self._homes[id(bucket)]
        if h.pins:
            raise RuntimeError(f"offload_param: bucket {h.index} replaced while pinned (in use)")
        if src.numel() != h.layout.slots[0].numel:
            raise ValueError(f"offload_param: replacement shard of bucket {h.index} has {src.numel()} elements, "
                             f"expected {h.layout.slots[0].numel}")
        self.drain()  # the generation of a record being written is settled first
        side = h.name[:-len(".swp")] + ".new"
        if h.staged is not None:
            self.directory.remove(h.staged)
            h.staged = None
        nbytes = h.layout.record_bytes
        buf = self._staging(nbytes)
        buf[:nbytes].zero_()
        h.layout.view(buf[record.HEADER_BYTES:nbytes], h.layout.slots[0]).copy_(src.reshape(-1))
        t0 = time.perf_counter()
        self._store.seal(buf, h.index, h.generation + 1, h.layout.payload_bytes, h.layout.digest)
        self.checksum_s += time.perf_counter() - t0
        try:
            io_path = self.directory.create(side, nbytes)
        except OSError as e:
            raise self._named(e, h, "creating the replacement for") from None
        h.staged = side
        try:
            self._writer.sync_pwrite(buf[:nbytes], io_path)
        except OSError as e:
            self.directory.remove(side)
            h.staged = None
            raise self._named(e, h, "writing the replacement for") from None
        self._staged_bytes += nbytes

    def _staging(self, nbytes: int) -> torch.Tensor:
        """One page-aligned buffer for staged records, kept at the largest size until the load ends."""
        if self._stage_buf is None or self._stage_buf.numel() < nbytes:
            self._stage_buf = None
            self._stage_buf = self._writer.new_cpu_locked_tensor(-(-nbytes // 4096) * 4096, torch.uint8)
        return self._stage_buf

    def commit_replacements(self) -> None:
        """Every staged record becomes its bucket's current one (see the module doc)."""
        self.drain()  # no write may still go to a file about to be replaced
        self._stage_buf = None
        done = []
        for h in self._homes.values():
            if h.staged is None:
                continue
            try:
                self.directory.replace(h.staged, h.name)
                h.staged = None
                if h.queued:  # a new shard not written yet is superseded by the loaded one
                    h.queued = False
                if h.payload is not None or h.lingering:
                    # The store keeps a buffer its owner still reads (adopt: EBUSY); a shard
                    # pinned across the load reads nothing rather than a buffer about to be reused.
                    if h.lingering and h.shard is not None:
                        h.shard.data = torch.empty(0, dtype=h.shard.dtype)
                    h.payload, h.lingering = None, False
                    self._store.release(h.index)
                code, what = self._store.adopt(h.index)  # the new file; the old record's copy is dropped
                if code:
                    raise record.fault(code, what, self.directory.display_path(h.name), "opening the new file")
            except OSError as e:
                raise record.replacement_failed(self._named(e, h, "replacing"), done, "parameter buckets") from None
            h.generation += 1
            done.append(h.index)

    def discard_replacements(self) -> None:
        self._stage_buf = None
        for h in self._homes.values():
            if h.staged is not None:
                self.directory.remove(h.staged)
                h.staged = None

    # -- accounting ---------------------------------------------------------------------------------

    @property
    def peak_buffer_bytes(self) -> int:
        return self._stats()["peak_buffer_bytes"]

    @peak_buffer_bytes.setter
    def peak_buffer_bytes(self, value: int) -> None:
        """Starts a new peak window at the bytes allocated now (only `buffer_bytes` may be
        assigned: the store cannot invent a peak)."""
        if value != self.buffer_bytes:
            raise ValueError(f"ParamSwapper.peak_buffer_bytes: only buffer_bytes ({self.buffer_bytes}) can be "
                             f"assigned (a new peak window), got {value}")
        self._store.reset_peak()

    def resident_bytes(self) -> int:
        return self.buffer_bytes

    def disk_bytes(self) -> int:
        return self.directory.disk_bytes()

    def close(self) -> None:
        """Waits for I/O, then removes the swap files and the directory. The shards are gone."""
        for h in self._homes.values():
            if h.shard is not None and (h.payload is not None or h.lingering):
                h.shard.data = torch.empty(0, dtype=h.shard.dtype)
            h.payload, h.lingering, h.queued, h.pins, h.updated = None, False, False, 0, False
        self._store.close()  # waits for its transfers; no view of its buffers is left
        self.directory.close()

    # -- records ------------------------------------------------------------------------------------

    @staticmethod
    def _view(h: _Home) -> torch.Tensor:
        return h.layout.view(h.payload, h.layout.slots[0])

    def _make_room(self) -> None:
        """Records held for end_step fill the pool: store them now (the store then frees their
        buffers as their writes end) rather than grow the pool past the budget."""
        if len(self._queued) >= self._count - 1:
            self._start_queued()

    def _hold_new(self, h: _Home) -> None:
        """Holds a zero-filled buffer for h's next record (no read: it is replaced whole)."""
        self._make_room()
        payload, code, what = self._store.overwrite(h.index, h.layout.payload_bytes)
        if code:
            raise self._fault(h, code, what, "holding a buffer for")
        h.payload = payload

    def _store_record(self, h: _Home) -> None:
        """Hands the held record to the store as the next generation (sealed and written by its
        thread); a pinned shard keeps reading it (linger) until unpin."""
        h.queued = False
        h.generation += 1
        h.lingering = h.pins > 0
        h.payload = None
        self._store.store(*h.key(), h.lingering)

    # -- errors -------------------------------------------------------------------------------------

    def _collect(self, faults: list) -> None:
        """Write faults the store reported ((id, path, errno, what)) join the errors to raise."""
        for index, _path, code, what in faults:
            h = next(h for h in self._homes.values() if h.index == index)
            doing = "creating" if what.startswith("create failed") else "writing"
            self._errors.append(self._fault(h, code, what, doing, _KEPT))

    def _fault(self, h: _Home, code: int, what: str, doing: str, consequence: str = "") -> OSError:
        err = record.fault(code, what, self.directory.display_path(h.name), self._context(h, doing))
        if consequence:
            err.strerror += consequence
        return err

    def _raise_errors(self) -> None:
        errors, self._errors = self._errors, []
        record.raise_collected(errors)

    def _context(self, h: _Home, doing: str) -> str:
        path = self.directory.display_path(h.name)
        return f"offload_param: {doing} swap file {path!r} (parameter bucket {h.index}, rank {self.rank})"

    def _named(self, e: BaseException, h: _Home, doing: str) -> OSError:
        return record.swap_error(e, self.directory.display_path(h.name), self._context(h, doing))
