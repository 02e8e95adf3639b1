"""NVMe parameter swapper (stage 3, offload_param device "nvme"): parameter shards live in files.

Every non-persistent stage-3 bucket's shard (this rank's slice of the bucket's parameters, in
the compute dtype) is one record (record.py: 4 KiB header with generation and checksums, then
the shard) in `param-bNNNNN.swp` in this rank's private swap directory (nvme_store.py). Between
uses the bucket's `shard` tensor is empty (its identity is kept: the gatherer and, in fp32
training, the optimizer's master hold that one tensor object) and the module's parameters are
resting views (zero/layout.py: full shape, no values), as without offload. The swapper makes a shard resident only while someone uses it:

    read_ahead(buckets)  the gatherer, in its recorded prefetch order: start reading the next
                         buckets' records into free pool buffers (never evicting anything);
    pin(bucket)          wait for (or start) the read, check the record, point `shard` at it;
                         returns the shard (a view into a pooled, page-locked buffer);
    unpin(bucket)        the user is done (its all-gather finished): `shard` is emptied and the
                         buffer goes back to the pool;
    write(bucket, src)   after the step: the new shard (src: the fp32 master, cast; None: the
                         pinned shard itself holds it, fp32 training where the master IS the
                         shard, so the bytes are written once, here, and never by the optimizer
                         swapper) is sealed as the next generation and written asynchronously;
                         the buffer stays busy until the write completes.

Replacing shards (load_checkpoint: change nothing until every rank has read everything):

    stage_replacement(bucket, src)  writes `src` as the bucket's next record into a side file
                         (`param-bNNNNN.new`), through one pooled buffer, synchronously; the live
                         record, its cached copy and the module are untouched;
    commit_replacements()  renames every side file over its live file (the new generation is
                         current from now on; a cached copy of the old record is dropped);
    discard_replacements()  removes the side files (an error anywhere: nothing changed).
So a load holds one bucket's shard in memory at a time, and needs the disk space of the
replaced records twice until the commit.

Memory: pooled buffers, each one record (page-rounded), at most `buffer_count` x the largest
record in bytes (`budget_bytes`). Pins beyond that (more shards in use at once than the budget
holds) allocate above the budget rather than fail; peak_buffer_bytes reports it. So the resident
parameter bytes are about buffer_count x the largest shard, not the model's.

Faults (docs/offload.md "Faults"): a record that fails its checks (torn or lost write, flipped
bit, another bucket's file) or a failed read raises OSError (EBADMSG for a bad record) naming the
file, the bucket and the rank from pin(), i.e. from the forward/backward that needed the
parameters; half-written data is never used. A failed write (ENOSPC, EIO, the file removed)
keeps the new record in memory (its buffer stays, beyond the budget if need be: it is the only
copy) and is raised by end_step(), after the step's last collective; the next write of that
bucket writes it again, so training continues once space is freed.
Not thread-safe: the engine's training thread calls it.
"""

from __future__ import annotations

import errno as errno_mod
import time
from dataclasses import dataclass

import torch

from . import record
from .io_lanes import IoLanes
from .nvme_store import SwapDirectory
from .policy import OffloadPolicy

_KEY = (-2, "param")  # the shard's slot in a record (segment -2: not an optimizer segment)
_KEPT = ("; the new parameter shard is kept in memory and written again at the bucket's next step "
         "(free space, then continue training)")


@dataclass
class _Home:
    index: int
    name: str
    layout: record.Layout
    shard: torch.Tensor | None = None  # the bucket's shard tensor (identity kept; .data swapped)
    io_path: str | None = None
    generation: int = 0
    buffer: torch.Tensor | None = None
    lane: object | None = None     # the read into `buffer` in flight (io_lanes.IoLanes)
    checked: bool = False          # `buffer` holds this generation's record, verified
    writing: bool = False
    write_epoch: int = 0           # the step (ParamSwapper._epoch) whose writer holds the write
    dirty: bool = False            # `buffer` holds a record not (yet) on disk
    pins: int = 0
    staged: str | None = None      # the side file holding a replacement record (stage_replacement)
    last_used: int = 0             # the pool's clock at the last pin/write (LRU eviction)

    def busy(self) -> bool:
        return self.lane is not None or self.writing or self.dirty or self.pins > 0


class ParamSwapper:
    spills_gradients = True     # offloaded buckets' gradient shards go to files (grad_spill.py)
    keeps_master_apart = False  # in fp32 the master is the shard (pinned for the step)

    def __init__(self, policy: OffloadPolicy, rank: int, directory: SwapDirectory, buckets: list):
        if not isinstance(policy, OffloadPolicy) or policy.device != "nvme" or policy.what != "offload_param":
            raise ValueError("ParamSwapper: needs an offload_param OffloadPolicy with device 'nvme'")
        self.policy = policy
        self.rank = rank
        self.directory = directory
        self._lanes = IoLanes(policy.aio)
        # Writes of step e go through _writers[e % 2]: end_step waits for the previous step's
        # only, so a step's writes finish during the next forward instead of ending the step.
        self._writers = (policy.aio.new_handle(), policy.aio.new_handle())
        self._epoch = 0
        self._queued: list[_Home] = []  # written at end_step (write(..., defer=True))
        self._homes: dict[int, _Home] = {}
        for i, b in enumerate(buckets):
            layout = record.Layout.build([(*_KEY, b.dtype, b.shard_numel)])
            self._homes[id(b)] = _Home(i, f"param-b{i:05d}.swp", layout)
        self._by_path: dict[str, _Home] = {}
        records = [h.layout.record_bytes for h in self._homes.values()]
        # DeepSpeed's meaning: buffer_count buffers of buffer_size elements each (of the shards'
        # dtype); a buffer is never smaller than the largest record.
        itemsize = max((b.dtype.itemsize for b in buckets), default=4)
        largest = max(records, default=4096)
        self.buffer_size = -(-max(largest, policy.buffer_size * itemsize) // 4096) * 4096
        self.budget_bytes = policy.buffer_count * self.buffer_size
        self._free: list[torch.Tensor] = []
        self.buffer_bytes = 0    # allocated (free + in use)
        self.peak_buffer_bytes = 0
        self._errors: list[OSError] = []
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_wait_s = 0.0
        self.write_wait_s = 0.0
        self.checksum_s = 0.0
        self._clock = 0
        self.reads_ahead = 0   # records read ahead (issued before their pin)
        self.reads_on_demand = 0

    def offloads(self, bucket) -> bool:
        return id(bucket) in self._homes

    # -- construction: the first record of every bucket ------------------------------------------

    def put_initial(self, bucket, values: torch.Tensor) -> None:
        """The bucket's first shard (at construction); `bucket.shard` is emptied. Raises OSError
        naming the file (nothing else to keep: the engine is not built)."""
        h = self._homes[id(bucket)]
        h.shard = bucket.shard
        self._raise_errors()
        buf = self._acquire(h.layout.record_bytes)
        self._view(h, buf).copy_(values.reshape(-1))
        h.buffer, h.dirty = buf, True
        self._start_write(h)
        h.shard.data = torch.empty(0, dtype=h.shard.dtype)

    def finish_initial(self) -> None:
        self._drain_writes()
        self._raise_errors()

    # -- the gather path ----------------------------------------------------------------------------

    def read_ahead(self, buckets, depth: int | None = None) -> None:
        """Start reading these buckets' records (in this order; only the first `depth` of them
        when given) while a buffer is free."""
        buckets = list(buckets) if depth is None else list(buckets)[:depth]
        wanted = {id(b) for b in buckets}  # cached records these need are not evicted for them
        for b in buckets:
            h = self._homes.get(id(b))
            if h is None or h.buffer is not None or h.io_path is None:
                continue
            buf = self._try_acquire(h.layout.record_bytes, keep=wanted)
            if buf is None:
                return
            try:
                self._read_into(h, buf)
            except OSError:
                self._give(buf)  # refused at the call: pin reads again and reports
                continue
            self.reads_ahead += 1

    def pin(self, bucket, update: bool = False) -> torch.Tensor:
        """The bucket's shard, resident and checked (see the module doc). `update`: the caller
        changes it in place (the step's fp32 master), so a write of it still in flight is waited
        for first (a gather only reads it). Raises OSError."""
        h = self._homes[id(bucket)]
        if h.writing and update:
            self._drain_writes(h.write_epoch)
        if h.buffer is None:
            buf = self._acquire(h.layout.record_bytes)
            try:
                self._read_into(h, buf)
            except OSError as e:
                self._give(buf)
                raise self._named(e, h, "reading") from None
            self.reads_on_demand += 1
        if h.lane is not None:
            lane, h.lane = h.lane, None
            t0 = time.perf_counter()
            try:
                self._lanes.wait(lane)  # this record's read only (the ones ahead go on), checked
            except (OSError, record.RecordError) as e:
                buf, h.buffer = h.buffer, None
                self._give(buf)
                raise self._named(e, h, "reading") from None
            finally:
                self.read_wait_s += time.perf_counter() - t0
            h.checked = True  # by the lanes' background thread
        if not h.checked:
            t0 = time.perf_counter()
            try:
                record.check(h.buffer, h.layout, h.index, self.rank, h.generation)
            except record.RecordError as e:
                buf, h.buffer = h.buffer, None
                self._give(buf)
                raise self._named(e, h, "reading") from None
            finally:
                self.checksum_s += time.perf_counter() - t0
            h.checked = True
        h.pins += 1
        self._touch(h)
        h.shard.data = self._view(h, h.buffer)
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
            self._release_if_idle(h)

    # -- after the step -----------------------------------------------------------------------------

    def write(self, bucket, src: torch.Tensor | None, defer: bool = False) -> None:
        """Writes the bucket's new shard: `src` cast into a fresh buffer, or (None) the pinned
        shard as it is. `defer` (the step's publish): the write starts at end_step, so the step's
        reads have the disk to themselves; the record stays in its buffer (dirty) until then.
        Errors are kept for end_step()."""
        h = self._homes[id(bucket)]
        if h.writing:
            self._drain_writes(h.write_epoch)
        if src is None:
            if h.pins <= 0 or h.buffer is None:
                raise RuntimeError(f"offload_param: bucket {h.index} written in place while not pinned")
        else:
            if h.buffer is None:
                h.buffer = self._acquire(h.layout.record_bytes)
            self._view(h, h.buffer).copy_(src.reshape(-1))
            h.checked = True
        h.dirty = True
        self._touch(h)
        if defer:
            self._queued.append(h)
        else:
            self._start_write(h)

    def end_step(self) -> None:
        """The previous step's writes are waited for, this step's (deferred) ones start and go
        on while the next forward computes, and the errors collected so far are raised: a failed
        write is raised by the step after the one that issued it (its record is kept in memory
        meanwhile)."""
        self._drain_writes(self._epoch - 1)
        self._start_queued()
        self._epoch += 1
        self._raise_errors()

    def _start_queued(self) -> None:
        queued, self._queued = self._queued, []
        for h in queued:
            if h.dirty and not h.writing:
                self._start_write(h)

    def drain(self) -> None:
        """Waits for every write in flight; raises the errors collected so far."""
        self._drain_writes()
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
        self._drain_writes()  # the generation of a record being written is settled first
        self._raise_errors()
        side = h.name[:-len(".swp")] + ".new"
        if h.staged is not None:
            self.directory.remove(h.staged)
            h.staged = None
        buf = self._acquire(h.layout.record_bytes)
        try:
            self._view(h, buf).copy_(src.reshape(-1))
            record.seal(buf, h.layout, h.index, self.rank, h.generation + 1)
            try:
                io_path = self.directory.create(side, h.layout.record_bytes)
            except OSError as e:
                raise self._named(e, h, "creating the replacement for") from None
            h.staged = side
            try:
                self._writers[0].sync_pwrite(buf[:h.layout.record_bytes], io_path)  # none in flight (drained)
            except OSError as e:
                self.directory.remove(side)
                h.staged = None
                raise self._named(e, h, "writing the replacement for") from None
            self.bytes_written += h.layout.record_bytes
        finally:
            self._give(buf)

    def commit_replacements(self) -> None:
        """Every staged record becomes its bucket's current one (see the module doc)."""
        self._drain_writes()  # no write may still go to a file about to be replaced
        for h in self._homes.values():
            if h.staged is None:
                continue
            if h.lane is not None:  # a read ahead of the old record: let it finish, then drop it
                lane, h.lane = h.lane, None
                self._lanes.wait_quietly(lane)
            self.directory.replace(h.staged, h.name)
            h.staged = None
            if h.io_path is None:
                h.io_path = self.directory.io_path(h.name)
                self._by_path[h.io_path] = h
            h.generation += 1
            h.dirty = False  # a write that failed earlier is superseded by the new record
            if h.buffer is not None and h.pins == 0:
                buf, h.buffer, h.checked = h.buffer, None, False
                self._give(buf)

    def discard_replacements(self) -> None:
        for h in self._homes.values():
            if h.staged is not None:
                self.directory.remove(h.staged)
                h.staged = None

    # -- accounting ---------------------------------------------------------------------------------

    def disk_bytes(self) -> int:
        return self.directory.disk_bytes()

    @property
    def background_check_s(self) -> float:
        """Seconds spent checking records read, on the lanes' thread (not the training thread's)."""
        return self._lanes.check_s

    def resident_bytes(self) -> int:
        """Bytes of the pool's buffers (what parameter shards occupy in memory)."""
        return self.buffer_bytes

    def close(self) -> None:
        try:
            self._drain_writes()
        except OSError:
            pass
        for h in self._homes.values():
            if h.lane is not None:
                lane, h.lane = h.lane, None
                self._lanes.wait_quietly(lane)
        self._lanes.close()
        self.directory.close()

    # -- I/O ------------------------------------------------------------------------------------------

    @staticmethod
    def _view(h: _Home, buf: torch.Tensor) -> torch.Tensor:
        return h.layout.view(buf, h.layout.slots[0])

    def _start_write(self, h: _Home) -> None:
        """Seals h.buffer as the next generation and starts writing it."""
        if h.io_path is None:
            try:
                h.io_path = self.directory.create(h.name, h.layout.record_bytes)
            except OSError as e:
                self._errors.append(self._named(e, h, "creating", _KEPT))
                return
            self._by_path[h.io_path] = h
        h.generation += 1
        t0 = time.perf_counter()
        record.seal(h.buffer, h.layout, h.index, self.rank, h.generation)
        self.checksum_s += time.perf_counter() - t0
        try:
            self._writers[self._epoch % 2].async_pwrite(h.buffer[:h.layout.record_bytes], h.io_path)
        except OSError as e:
            self._errors.append(self._named(e, h, "writing", _KEPT))
            return
        h.writing, h.write_epoch = True, self._epoch

    def _read_into(self, h: _Home, buf: torch.Tensor) -> None:
        if h.io_path is None:
            raise OSError(errno_mod.ENOENT, "no record was written", self.directory.display_path(h.name))
        layout, index, generation = h.layout, h.index, h.generation
        h.lane = self._lanes.read(buf[:layout.record_bytes], h.io_path,
                                  lambda: record.check(buf, layout, index, self.rank, generation))
        self.bytes_read += h.layout.record_bytes
        h.buffer, h.checked = buf, False

    def _drain_writes(self, epoch: int | None = None) -> None:
        """Waits for the writes of step `epoch` (None: all, deferred ones started first)."""
        if epoch is None:
            self._start_queued()
            for e in sorted({h.write_epoch for h in self._homes.values() if h.writing}):
                self._drain_writes(e)
            return
        writing = [h for h in self._homes.values() if h.writing and h.write_epoch == epoch]
        if not writing:
            return
        t0 = time.perf_counter()
        try:
            self._writers[epoch % 2].wait()
        except OSError as e:
            failed = self._by_path.get(e.filename) or writing[0]
            self._errors.append(self._named(e, failed, "writing", _KEPT))
            for h in writing:
                h.writing = False  # all stay dirty: written again at their next write
            return
        finally:
            self.write_wait_s += time.perf_counter() - t0
        for h in writing:
            h.writing = h.dirty = False
            self.bytes_written += h.layout.record_bytes
            self._release_if_idle(h)

    def _touch(self, h: _Home) -> None:
        self._clock += 1
        h.last_used = self._clock

    def _release_if_idle(self, h: _Home) -> None:
        """An idle record stays in its buffer (cached: the next pin needs no read) while it is
        the current, verified one; the pool evicts it when it needs the buffer (_evict)."""
        if h.buffer is not None and not h.busy() and not h.checked:
            buf, h.buffer = h.buffer, None
            h.checked = False
            self._give(buf)

    def _try_acquire(self, nbytes: int, keep=frozenset()) -> torch.Tensor | None:
        """A pooled buffer of at least nbytes without waiting, or None (the budget is used by
        records in use). Evicts the least recently used cached records (never those of buckets
        whose ids are in `keep`)."""
        need = -(-nbytes // 4096) * 4096
        while True:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            while self._free and self.buffer_bytes + need > self.budget_bytes:
                self._drop(self._free.pop())  # too small for this record: make room
            if self.buffer_bytes + need <= self.budget_bytes:
                return self._allocate(need)
            if not self._evict(keep):
                return None

    def _evict(self, keep=frozenset()) -> bool:
        """Gives the least recently used cached record's buffer back to the pool; False: none."""
        cached = [h for key, h in self._homes.items() if h.buffer is not None and not h.busy() and key not in keep]
        if not cached:
            return False
        h = min(cached, key=lambda c: c.last_used)
        buf, h.buffer, h.checked = h.buffer, None, False
        self._give(buf)
        return True

    def _acquire(self, nbytes: int) -> torch.Tensor:
        while True:
            buf = self._try_acquire(nbytes)
            if buf is not None:
                return buf
            if self._queued or any(h.writing for h in self._homes.values()):
                self._drain_writes()  # back-pressure: the pool is full of records being written
                continue
            ahead = [h for h in self._homes.values() if h.buffer is not None and h.pins == 0 and not h.dirty
                     and not h.writing]
            if ahead:  # a record read ahead and not used yet gives its buffer up
                h = ahead[-1]
                if h.lane is not None:
                    lane, h.lane = h.lane, None
                    self._lanes.wait_quietly(lane)  # read again (and checked) when pinned
                self._release_if_idle(h)
                continue
            # Everything pinned or dirty: over the budget (peak_buffer_bytes shows it).
            return self._allocate(-(-nbytes // 4096) * 4096)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        buf = self._writers[0].new_cpu_locked_tensor(nbytes, torch.uint8)
        self.buffer_bytes += buf.numel()
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        return buf

    def _drop(self, buf: torch.Tensor) -> None:
        self.buffer_bytes -= buf.numel()

    def _give(self, buf: torch.Tensor | None) -> None:
        if buf is None:
            return
        if self.buffer_bytes > self.budget_bytes:  # an over-budget buffer: give it back
            self._drop(buf)
            return
        self._free.append(buf)

    def _raise_errors(self) -> None:
        errors, self._errors = self._errors, []
        record.raise_collected(errors)

    def _named(self, e: BaseException, h: _Home, doing: str, consequence: str = "") -> OSError:
        path = self.directory.display_path(h.name)
        err = record.swap_error(e, path, f"offload_param: {doing} swap file {path!r} (parameter bucket {h.index}, "
                                         f"rank {self.rank})")
        if consequence:
            err.strerror += consequence
        return err
