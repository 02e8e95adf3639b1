"""Stage-3 parameter shards in host memory while the model trains on a GPU (offload_param "cpu").

ZeRO-Infinity's CPU parameter offload (DeepSpeed's ZeRO-3 offload_param device "cpu"): every
non-persistent stage-3 bucket's shard (this rank's slice of one gather unit's bucket, in the
compute dtype) lives in host memory, page-locked with pin_memory. The device holds a shard only
while it is used: from the host->device copy that starts its unit's gather until the all-gather
has read it. Between uses the bucket's `shard` tensor (its identity is kept: the parameters, the
gatherer and the checkpoint code hold that one tensor object) is an empty device tensor, and so
are the module's parameters. The interface is ParamSwapper's (param_swapper.py), so the gatherer,
the step's publish, full state dicts and checkpoints drive both the same way:

    read_ahead(buckets)  the gatherer, in its recorded prefetch order: start the host->device
                         copies of the next buckets (a copy stream, non_blocking, an event each),
                         at most `buffer_count` shards ahead of their pins;
    pin(bucket)          the shard on the device: the read-ahead copy (or one started now); the
                         compute stream waits for its event, so the all-gather issued next reads
                         the copied bytes while the CPU goes on; `bucket.shard` points at it;
    unpin(bucket)        the user is done (its all-gather was waited for): `shard` is empty again
                         and the device buffer goes back to the caching allocator;
    write(bucket, src)   after the step: src, the bucket's fp32 master, cast into the host shard.
                         A host master (offload_optimizer on: the host tier steps on the CPU) is
                         cast on the host, with no device round trip; a device master (no
                         offload_optimizer: the step ran on the GPU) is cast there and copied down
                         on the copy stream. src None: the pinned device shard was changed in
                         place (a model load_state_dict) and is copied down.
    stage_replacement / commit_replacements / discard_replacements   load_checkpoint's
                         all-or-nothing replacement of frozen shards (held in memory until commit).

Ordering (CUDA): copies up and down go through one copy stream (in issue order); the copy stream
follows the compute stream before each copy up (its device buffer is allocated on the compute
stream, whose kernels queued so far may still use that memory) and before each copy down (the
step or the load that wrote the source ran there); a device-side tensor is recorded on the copy
stream so the caching allocator does not reuse it early; before the host writes a host shard
(write, commit) it waits for every copy still reading or writing it, and drops a read-ahead copy
of the old values. Without pin_memory the host shard is pageable, so each
copy up goes through a page-locked staging buffer (a ring, each buffer reused after its copy's
event), as asynchronous copies need.

NVMe (offload_param "nvme" on CUDA training): the host side is the NVMe parameter swapper
(param_swapper.py) over stand-in buckets whose `shard` is a host tensor: the shards live in its
records, read ahead (from disk, into its pooled page-locked buffers) in the gatherer's order; a pin
pins the record on the host, copies it up and waits for that copy (so the pool buffer can be
reused at once: the CPU, not the GPU, waits for the copy; as the copy follows the compute stream,
the CPU also waits for the work queued before it), and a write hands the new shard (cast on
the host, or copied down first) to the swapper, which writes it after the step. No shard is copied
up ahead of its pin in this mode (the disk reads run ahead instead); its errors are the swapper's
(docs/offload.md "Faults").

All CUDA calls go through host_tier.DeviceCopier; on a CPU "device" (the test hook
host_tier.force_on_cpu_for_tests) copies are plain copies and events None, so CPU tests run this
code bit for bit against the in-memory engine.

Gradients (`spills_gradients`, read by the stage-3 placement when it attaches the reducer):
  * NVMe mode with offload_optimizer (spill_gradients=True): the offloaded buckets' gradient
    shards go to files beside the parameter records as they are reduced (grad_spill.GradSpill,
    in the swapper's directory), exactly as on CPU training: the reducer copies each result down
    into the spill's page-locked record buffer once its collective is waited on, so neither the
    GPU nor host memory ever holds a whole model's gradient shards; the host tier's step reads
    each one back (a host tensor: used directly, not copied again).
  * NVMe mode without offload_optimizer: the step runs on the GPU and reads its gradient shards
    there, so spilling them would only add a round trip through the disk and the bus per step
    (down in backward, up at the step) without lowering the GPU's peak, which the step needs
    anyway: they stay on the device.
  * "cpu" mode: with offload_optimizer the host tier takes each gradient shard down as it is
    reduced and the device frees it (host_tier.py); without, they stay on the device.
Not thread-safe: the training thread calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .host_tier import DeviceCopier
from .policy import OffloadPolicy


@dataclass
class _Proxy:
    """What the NVMe swapper sees of a bucket (NVMe mode): a host `shard` tensor it points at its records."""
    shard: torch.Tensor
    dtype: torch.dtype
    shard_numel: int


@dataclass
class _Shard:
    index: int
    dtype: torch.dtype = torch.float32
    numel: int = 0
    proxy: _Proxy | None = None            # NVMe mode: the swapper's stand-in for the bucket
    shard: torch.Tensor | None = None      # the bucket's shard tensor (identity kept; .data swapped)
    host: torch.Tensor | None = None       # the shard's values, in host memory
    device: torch.Tensor | None = None     # resident copy on the device (read ahead or pinned)
    event: object = None                   # the copy into `device` (None: done, or CPU)
    pins: int = 0
    pending: list = field(default_factory=list)  # the last copy that reads or writes `host` (one stream)
    staged: torch.Tensor | None = None     # load_checkpoint's replacement, until commit


class HostParamStore:
    keeps_master_apart = True  # in fp32 the master is not the shard (the shard is on the host)

    def __init__(self, policy: OffloadPolicy, device: torch.device, buckets: list, copier: DeviceCopier | None = None,
                 swapper_for=None, spill_gradients: bool = False):
        """swapper_for: NVMe mode (policy device 'nvme'): called with the stand-in buckets, returns
        the ParamSwapper that holds their records. spill_gradients (NVMe mode only): the
        offloaded buckets' gradients go to files in its directory (the module doc: with
        offload_optimizer, whose step reads them on the host)."""
        if not isinstance(policy, OffloadPolicy) or policy.what != "offload_param" \
                or policy.device != ("nvme" if swapper_for is not None else "cpu"):
            raise ValueError("HostParamStore: needs an offload_param OffloadPolicy with device 'cpu' (or 'nvme' with "
                             "swapper_for)")
        if not isinstance(spill_gradients, bool):
            raise TypeError(f"HostParamStore: spill_gradients must be a bool, got {type(spill_gradients).__name__}")
        if spill_gradients and swapper_for is None:
            raise ValueError("HostParamStore: spill_gradients needs NVMe mode (swapper_for): the gradient files live "
                             "in the parameter swapper's directory")
        self.policy = policy
        self.spills_gradients = spill_gradients  # offloaded buckets' gradient shards go to files (module doc)
        self.device = torch.device(device)
        self.copier = DeviceCopier(self.device) if copier is None else copier
        self._homes: dict[int, _Shard] = {id(b): _Shard(i, b.dtype, b.shard_numel) for i, b in enumerate(buckets)}
        self.swapper = None
        if swapper_for is not None:
            for h in self._homes.values():
                h.proxy = _Proxy(torch.empty(0, dtype=h.dtype), h.dtype, h.numel)
            self.swapper = swapper_for([h.proxy for h in self._homes.values()])
        # shards copied up ahead of their pins (NVMe mode: none, the disk reads run ahead instead)
        self.read_ahead_limit = 0 if self.swapper is not None else policy.buffer_count
        self._staging: list[tuple[torch.Tensor, object]] = []  # (page-locked buffer, its last copy's event)
        self._next_staging = 0
        self.host_bytes = 0            # the host shards
        self.device_bytes = 0          # shards resident on the device now (pinned or read ahead)
        self.peak_device_bytes = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.reads_ahead = 0
        self.reads_on_demand = 0

    def offloads(self, bucket) -> bool:
        return id(bucket) in self._homes

    def host_shard(self, bucket) -> torch.Tensor:
        """The host tensor holding the bucket's shard (read it only between steps, after drain());
        NVMe mode: a copy of its record."""
        h = self._homes[id(bucket)]
        if self.swapper is None:
            return h.host
        try:
            return self.swapper.pin(h.proxy).clone()
        finally:
            self.swapper.unpin(h.proxy)

    # -- construction ----------------------------------------------------------------------------

    def put_initial(self, bucket, values: torch.Tensor) -> None:
        """The bucket's first shard (at construction) goes to host memory; `bucket.shard` is emptied."""
        h = self._homes[id(bucket)]
        h.shard = bucket.shard
        if self.swapper is not None:
            h.proxy.shard = values.detach().reshape(-1).to("cpu", copy=True)
            self.swapper.put_initial(h.proxy, h.proxy.shard)  # raises OSError naming the file
            h.shard.data = self._empty(h)
            return
        h.host = self.copier.host_empty(values.numel(), values.dtype, self.policy.pin_memory)
        h.host.copy_(values.detach().reshape(-1))  # synchronous: values may be freed next
        self.host_bytes += h.host.numel() * h.host.element_size()
        h.shard.data = self._empty(h)

    def finish_initial(self) -> None:
        if self.swapper is not None:
            self.swapper.finish_initial()  # the host copies above are synchronous

    def _empty(self, h: _Shard) -> torch.Tensor:
        return torch.empty(0, dtype=h.dtype, device=self.device)

    # -- host -> device --------------------------------------------------------------------------

    def _stage(self, h: _Shard) -> torch.Tensor:
        """The host-side source of a copy up: the shard itself when page-locked (or on CPU),
        else a page-locked staging buffer filled from it now."""
        if self.policy.pin_memory:
            return h.host  # (on a CPU "device" the ring only adds a copy: kept so tests run it)
        slots = max(2, self.read_ahead_limit + 1)
        if len(self._staging) < slots:
            self._staging += [(None, None)] * (slots - len(self._staging))
        k = self._next_staging
        self._next_staging = (k + 1) % slots
        buf, event = self._staging[k]
        self.copier.host_wait(event)  # the copy that last read this buffer is done
        for pending in h.pending:  # a copy down into the host shard is done
            self.copier.host_wait(pending)
        h.pending = []
        nbytes = h.host.numel() * h.host.element_size()
        if buf is None or buf.numel() < nbytes:
            buf = self.copier.host_empty(max(nbytes, 1), torch.uint8, pin=True)
        staged = buf[:nbytes].view(h.host.dtype)
        staged.copy_(h.host)
        self._staging[k] = (buf, None)
        return staged

    def _copy_up(self, h: _Shard) -> None:
        if self.swapper is not None:
            self._copy_up_record(h)
            return
        src = self._stage(h)
        dst = torch.empty(h.host.numel(), dtype=h.host.dtype, device=self.device)
        # dst comes from the compute stream's pool: its memory may have been freed there by a
        # tensor whose kernels (or a collective the compute stream waits for) are still queued,
        # and the copy stream runs beside them. The copy starts after them; the copies ahead of
        # the next units still overlap the forward or backward queued from now on.
        self.copier.follow_compute()
        event = self.copier.copy(dst, src, dst)
        if src is not h.host:
            k = (self._next_staging - 1) % len(self._staging)
            self._staging[k] = (self._staging[k][0], event)
        else:
            h.pending = [event]  # one copy stream: the latest copy's event covers the earlier ones
        h.device, h.event = dst, event
        self.device_bytes += dst.numel() * dst.element_size()
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        self.bytes_up += dst.numel() * dst.element_size()

    def _copy_up_record(self, h: _Shard) -> None:
        """NVMe mode: the record pinned on the host (read and checked; OSError naming the file),
        copied up, the copy waited for, the record unpinned (its buffer may be reused at once)."""
        src = self.swapper.pin(h.proxy)
        try:
            dst = torch.empty(h.numel, dtype=h.dtype, device=self.device)
            self.copier.follow_compute()  # (see _copy_up)
            event = self.copier.copy(dst, src, dst)
            self.copier.host_wait(event)
        finally:
            del src
            self.swapper.unpin(h.proxy)
        h.device, h.event = dst, None
        self.device_bytes += dst.numel() * dst.element_size()
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        self.bytes_up += dst.numel() * dst.element_size()

    def _drop_device(self, h: _Shard) -> None:
        if h.device is not None:
            self.device_bytes -= h.device.numel() * h.device.element_size()
            h.device, h.event = None, None  # recorded on the copy stream: not reused before the copy ends

    def read_ahead(self, buckets, depth: int | None = None, then=()) -> None:
        """then: the buckets of the pass after this one (the gatherer's prediction across steps):
        only the NVMe records are read that far ahead; the copies up stay within this pass."""
        if self.swapper is not None:  # the disk reads run ahead; the copies up are made at the pins
            wanted = [self._homes[id(b)].proxy for b in [*buckets, *then] if id(b) in self._homes]
            self.swapper.read_ahead(wanted, depth)
            return
        ahead = sum(1 for h in self._homes.values() if h.device is not None and h.pins == 0)
        limit = self.read_ahead_limit if depth is None else min(depth, self.read_ahead_limit)
        for b in buckets:
            if ahead >= limit:
                return
            h = self._homes.get(id(b))
            if h is None or h.device is not None:
                continue
            self._copy_up(h)
            self.reads_ahead += 1
            ahead += 1

    def pin(self, bucket, update: bool = False) -> torch.Tensor:
        """The bucket's shard on the device (see the module doc); `update` is accepted for
        ParamSwapper's interface (a copy down after an in-place change is write(bucket, None))."""
        h = self._homes[id(bucket)]
        if h.device is None:
            self._copy_up(h)
            self.reads_on_demand += 1
        self.copier.compute_waits(h.event)  # the all-gather (or whoever reads it) comes after the copy
        h.event = None
        h.pins += 1
        h.shard.data = h.device
        return h.shard

    def pinned(self, bucket) -> bool:
        return self._homes[id(bucket)].pins > 0

    def unpin(self, bucket) -> None:
        h = self._homes[id(bucket)]
        if h.pins <= 0:
            raise RuntimeError(f"HostParamStore.unpin: bucket {h.index} is not pinned")
        h.pins -= 1
        if h.pins == 0:
            h.shard.data = self._empty(h)
            self._drop_device(h)

    # -- device/host -> host ---------------------------------------------------------------------

    def _before_host_write(self, h: _Shard) -> None:
        for event in h.pending:
            self.copier.host_wait(event)
        h.pending = []
        if h.pins == 0:
            self._drop_device(h)  # a read-ahead copy holds the old values

    def write(self, bucket, src: torch.Tensor | None, defer: bool = False) -> None:
        """The bucket's new shard into host memory (see the module doc); `defer` is accepted for
        ParamSwapper's interface (nothing is deferred here)."""
        h = self._homes[id(bucket)]
        if src is None:
            if h.pins == 0:
                raise RuntimeError(f"HostParamStore.write: bucket {h.index} has no pinned shard to write")
            src = h.device
        elif src.numel() != h.numel:
            raise RuntimeError(f"HostParamStore.write: bucket {h.index}'s shard has {h.numel} elements, "
                               f"the new values {src.numel()}")
        self._before_host_write(h)
        src = src.detach().reshape(-1)
        if self.swapper is not None:
            # the new shard to the host (synchronous: after the compute stream's work), then the
            # swapper casts it into a record and writes it (at end_step when deferred)
            self.swapper.write(h.proxy, src if src.device.type == "cpu" else src.to("cpu"), defer=defer)
            return
        if src.device != self.device:
            # The host tier's master (a host tensor on CUDA training): the cast on the host, no
            # device round trip. On a CPU "device" (the test hook) every master takes the device
            # path below instead, so CPU tests run its copy and its waits.
            h.host.copy_(src)
            return
        # A device master (the step ran on the GPU) or the pinned shard: cast there, copied down
        # after the compute stream's work so far (the step, the load).
        down = src if src.dtype == h.host.dtype else src.to(h.host.dtype)
        self.copier.follow_compute()
        h.pending = [self.copier.copy(h.host, down, down)]
        self.bytes_down += h.host.numel() * h.host.element_size()

    def end_step(self) -> None:
        """After the step: nothing of it stays on the device (read-ahead copies of old values
        were dropped by write; the ones of frozen shards are dropped here). NVMe mode: the step's
        writes start (the swapper's end_step; raises its write errors)."""
        for h in self._homes.values():
            if h.pins == 0:
                self._drop_device(h)
        if self.swapper is not None:
            self.swapper.end_step()

    def drain(self) -> None:
        """Waits for every copy into or out of the host shards (NVMe mode: every record write)."""
        for h in self._homes.values():
            for event in h.pending:
                self.copier.host_wait(event)
            h.pending = []
        if self.swapper is not None:
            self.swapper.drain()

    # -- load_checkpoint ---------------------------------------------------------------------------

    def stage_replacement(self, bucket, src: torch.Tensor) -> None:
        h = self._homes[id(bucket)]
        if src.numel() != h.numel:
            raise RuntimeError(f"HostParamStore.stage_replacement: bucket {h.index}'s shard has {h.numel} "
                               f"elements, the replacement {src.numel()}")
        if self.swapper is not None:
            self.swapper.stage_replacement(h.proxy, src.detach().reshape(-1).to("cpu"))  # a side record
            return
        h.staged = src.detach().reshape(-1).to("cpu", h.host.dtype, copy=True)

    def commit_replacements(self) -> None:
        if self.swapper is not None:
            for h in self._homes.values():
                if h.pins == 0:
                    self._drop_device(h)
            self.swapper.commit_replacements()
            return
        for h in self._homes.values():
            if h.staged is not None:
                self._before_host_write(h)
                h.host.copy_(h.staged)
                h.staged = None

    def discard_replacements(self) -> None:
        if self.swapper is not None:
            self.swapper.discard_replacements()
        for h in self._homes.values():
            h.staged = None

    # -- reports -----------------------------------------------------------------------------------

    @property
    def buffer_bytes(self) -> int:
        """Host bytes of the shards: the host shards, or (NVMe mode) the swapper's pool."""
        return self.host_bytes if self.swapper is None else self.swapper.buffer_bytes

    @property
    def peak_buffer_bytes(self) -> int:
        return self.host_bytes if self.swapper is None else self.swapper.peak_buffer_bytes

    def disk_bytes(self) -> int:
        return 0 if self.swapper is None else self.swapper.disk_bytes()

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.close()  # waits for its writes and removes its directory
        else:
            self.drain()
