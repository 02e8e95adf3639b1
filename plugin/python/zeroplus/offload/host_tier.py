"""The host tier of ZeRO-Offload: fp32 masters and optimizer state in host memory, the step on the CPU.

With offload_optimizer on CUDA training (device "cpu" or "nvme"), every bucket's fp32 master is a
host tensor made here, and the engine builds its bucket optimizers (zero/bucket_optimizer.py)
over those host tensors: their state is created on the host and zeroplus's fused CPU kernels step
them. With "nvme" the NVMe swapper (swapper.py) sits under this tier: the host masters and the
host state are what it swaps.

Gradients down, during backward, and kept there. The tier is the gradient reducer's observer
(grad_reducer.py, "Observer"): the reducer calls

    ready(b, shard)      bucket b's gradient shard holds what the step would read (its
                         reduce-scatter was waited on and its result accumulated; the work that
                         produced it is queued on the compute stream): the copy stream waits for
                         the compute stream and the shard starts down, device -> bucket b's own
                         pinned host buffer, non_blocking, one event. During backward this is as
                         soon as the bucket's reduction was retired (two buckets behind the
                         newest launched one); the last buckets at the end of backward. From
                         now on the host buffer is the gradient's home (the reducer
                         frees its device accumulator; the copy keeps the device memory from
                         being reused until it has read it), so the device holds no gradient
                         shards between backward and step (DeepSpeed's ZeRO-Offload keeps its
                         gradient partitions on the CPU likewise).
    fetch(b)             a device tensor with the gradient's current value (the host copy up, on
                         the copy stream, the compute stream waiting for it, then the scalings the
                         host copy has not had yet, applied on the device as the reducer would
                         have): the reducer reads it (a clipping term it has not kept, the fp16
                         overflow check after an unscale) or takes it back as its accumulator (a
                         later backward adds to it)
    scaling(b, coef)     the shard is about to be multiplied in place (clipping, an external
                         unscale; for a gradient that lives here only, the reducer skips the
                         device multiply): the compute stream waits for the copy that reads it,
                         and the host copy gets the same multiplication when the step takes it
                         (the same operation in the same dtype: the same bits)
    changing(b)          the shard is about to be written otherwise (a later backward adds to it,
                         gradient accumulation, after taking it back with fetch): the compute
                         stream waits for the copy, which is forgotten (a new ready follows)
    discard()            a backward that raised after an earlier one succeeded, engine.gradient_
                         shards: every copy in flight is waited for on the host, and those that
                         are not a gradient's home are forgotten
    clear()              zero_grad, a skipped fp16 step, a first backward that raised: the
                         gradients are zero; every copy is waited for and forgotten

Per step the engine (zero/engine.py, _step_buckets) calls

    begin_step(order, source)  buckets with a copy from backward need nothing; for the others
                               (an accumulation leftover reduced by step()'s flush, a second step
                               without backward) the copy stream waits for the compute stream and
                               the first DEPTH of them in `order` start down as before: source(i)
                               is bucket i's gradient shard (a device tensor). Buckets whose
                               gradients are spilled to files (offload_param "nvme",
                               grad_spill.py) are not in `order`: the engine steps them on the
                               spill's read-back host tensor, which needs no copy and no buffer
                               here
    gradient(i)                starts the copies of the DEPTH buckets after i that have none,
                               waits for bucket i's event, applies the pending scalings and
                               returns its host buffer (the CPU step reads it)
    upload(i, dst)             the updated master, cast on the host into a pinned upload buffer
                               in dst's dtype, then copied into dst (this rank's shard of the
                               parameters on the device: non_blocking, copy stream, an event;
                               the copy stream follows the compute stream first, whose queued
                               work may still use dst);
                               the compute stream waits for that event, so the all-gather (stages
                               1-2) or the next gather (stage 3) that reads dst comes after it,
                               while the CPU goes on with the next bucket's step
    end_step()                 waits for every gradient copy still in flight and forgets those
                               that are not a gradient's home (a step that raised must not leave a
                               copy reading a shard that zero_grad then frees; a second step
                               copies again); the homes stay, already scaled: a second step
                               without backward reads them

Everything CUDA (streams, events, page-locked allocation) goes through DeviceCopier, the one
place that knows the device; with "device" and "host" both the CPU a copy is a plain copy_ and an
event is None. force_on_cpu_for_tests() (a private test hook, not a user knob) makes CPU training
take this path, so the tests run the same code, bit for bit, against the in-memory engine; it also
takes a copier factory, so a test can record the order of copies and waits.

Memory: the fp32 masters (page-locked when pin_memory is set: transfers never read them directly,
they go through the buffers below, so pinning only keeps them out of the OS's swap) and the
optimizer state on the host; one gradient buffer per bucket (its gradient shard in the
accumulation dtype: in all the gradient-shard bytes of this rank, as DeepSpeed's CPU gradient
partition; bounded, allocated at a bucket's first copy and reused every step: `grad_bytes`; none
for a spilled bucket, whose gradient is in its files and the spill's few record buffers) and
UPLOAD_SLOTS upload buffers (one bucket's shard in the compute dtype), always page-locked on CUDA
(asynchronous copies need it; where page-locking fails a buffer is pageable and its copies block
the CPU). torch's pinned allocator rounds each allocation up to a power of two: up to twice a
buffer's bytes. On the device stay the parameters; a gradient shard only from its reduction until
its copy down has read it (and while a later backward adds to it); a spilled one until it is
copied into its record.

Not thread-safe: the training thread calls it (the reducer's calls come from the autograd thread
while the training thread is inside backward).
"""

from __future__ import annotations

import contextlib

import torch

DEPTH = 2         # gradient shards copied down ahead of the bucket stepping (those not copied in backward)
UPLOAD_SLOTS = 2  # one upload on the wire while the next bucket's is cast

_forced = False
_copier_factory = None


@contextlib.contextmanager
def force_on_cpu_for_tests(copier_factory=None):
    """Engines built inside this block take the host tier on CPU training too (offload_optimizer
    "cpu" or "nvme"), as CUDA training does; copier_factory(device), when given, makes their
    DeviceCopier (a recording one). For tests only: on CPU the tier only adds copies."""
    global _forced, _copier_factory
    old = _forced, _copier_factory
    _forced, _copier_factory = True, copier_factory
    try:
        yield
    finally:
        _forced, _copier_factory = old


def forced_on_cpu() -> bool:
    return _forced


class DeviceCopier:
    """The one place that calls CUDA: a copy stream, events, page-locked host memory. On a CPU
    device every copy is a plain copy_ and every event None."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    def host_empty(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        if pin and self.cuda:
            try:
                return torch.empty(numel, dtype=dtype, pin_memory=True)
            except RuntimeError:
                pass  # no more page-locked memory: pageable (copies then block the CPU; still correct)
        return torch.empty(numel, dtype=dtype)

    def follow_compute(self) -> None:
        """Copies issued from now on start after the work queued on the compute stream so far."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, device_side: torch.Tensor):
        """dst <- src, asynchronous on CUDA (the copy stream); returns its event (None on CPU).
        device_side (src or dst) is recorded on the copy stream so that the caching allocator
        does not hand its memory out while the copy may still use it."""
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        device_side.record_stream(self.stream)
        return event

    @staticmethod
    def host_wait(event) -> None:
        if event is not None:
            event.synchronize()

    def compute_waits(self, event) -> None:
        """The compute stream's later work (collectives, forward) waits for the copy; the CPU does not."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class _Copy:
    """One bucket's gradient shard on its way to (or on) the host."""
    __slots__ = ("staged", "event", "scales", "in_backward", "home")

    def __init__(self, staged: torch.Tensor, event, in_backward: bool):
        self.staged = staged          # a typed view of the bucket's host buffer
        self.event = event            # the last copy reading or writing `staged` (None on CPU or once waited for)
        self.scales: list = []        # coefficients the gradient got after the copy, in order, not yet applied here
        self.in_backward = in_backward
        self.home = False             # the gradient lives here only (ready: the device accumulator was freed)


class HostTier:
    def __init__(self, device: torch.device, masters: list[torch.Tensor], pin_memory: bool,
                 copier: DeviceCopier | None = None):
        """masters: the engine's fp32 masters (on `device`); `self.masters` are their host copies,
        which the engine uses from now on (never aliases of the parameters, even on CPU).
        copier: DeviceCopier(device) unless given (tests give one that records the ordering)."""
        if copier is None:
            copier = _copier_factory(device) if _forced and _copier_factory is not None else DeviceCopier(device)
        self._copier = copier
        self.device = device
        self.masters = []
        for m in masters:
            host = self._copier.host_empty(m.numel(), m.dtype, pin_memory)
            host.copy_(m.detach())
            self.masters.append(host)
        self._grad_buffers: list[torch.Tensor | None] = [None] * len(masters)  # uint8, one per bucket
        self._copies: dict[int, _Copy] = {}  # bucket -> its gradient copy (from backward or this step)
        self._upload_slots: list[torch.Tensor | None] = [None] * UPLOAD_SLOTS
        self._upload_events: list = [None] * UPLOAD_SLOTS
        self._next_upload = 0
        self._order: list[int] = []
        self._position: dict[int, int] = {}
        self._source = None
        self._host_coefs: dict = {}      # (id(coef), dtype) -> (coef, its host copy): one transfer per coefficient
        self._issued = 0                 # positions of _order checked for a copy to start
        # Buckets whose gradient the last step found copied (or on its way) from backward: all of
        # them unless accumulation leftovers or a dropped copy were copied by it.
        self.found_on_host = 0

    @property
    def grad_bytes(self) -> int:
        """The per-bucket host gradient buffers (allocated so far)."""
        return sum(t.numel() for t in self._grad_buffers if t is not None)

    @property
    def staging_bytes(self) -> int:
        return self.grad_bytes + sum(t.numel() for t in self._upload_slots if t is not None)

    def _buffer(self, slots: list, k: int, nbytes: int) -> torch.Tensor:
        """Slot k's buffer with at least nbytes (grown at first use; the caller made sure no copy
        still uses the old one)."""
        if slots[k] is None or slots[k].numel() < nbytes:
            slots[k] = None
            slots[k] = self._copier.host_empty(max(nbytes, 1), torch.uint8, pin=True)
        return slots[k]

    @staticmethod
    def _typed(buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return buf[:numel * dtype.itemsize].view(dtype)

    def _start(self, b: int, src: torch.Tensor, in_backward: bool) -> None:
        """Bucket b's shard starts down into its own buffer (no copy of b is in flight: callers
        forgot the previous one, after waiting for it where the host could still read it). The
        copy stream follows the compute stream first, for every copy: in backward the shard was
        just reduced, and at the step src may have been made just now (reducer.shard() allocates
        and zero-fills an accumulator a failed backward freed, on the compute stream)."""
        self._copier.follow_compute()
        buf = self._buffer(self._grad_buffers, b, src.numel() * src.element_size())
        staged = self._typed(buf, src.numel(), src.dtype)
        self._copies[b] = _Copy(staged, self._copier.copy(staged, src, src), in_backward)

    # -- the gradient reducer's observer (backward) ------------------------------------------------

    def ready(self, b: int, shard: torch.Tensor) -> None:
        self._forget(b)
        self._start(b, shard, in_backward=True)
        self._copies[b].home = True

    def fetch(self, b: int) -> torch.Tensor:
        copy = self._copies[b]
        staged = copy.staged
        value = torch.empty(staged.numel(), dtype=staged.dtype, device=self.device)
        # The copy stream writes memory the compute stream just allocated (it may have been read
        # by work still queued there): it follows the compute stream first. It is the stream of
        # the copy down, so the copy up starts after that; its event now covers both.
        self._copier.follow_compute()
        copy.event = self._copier.copy(value, staged, value)
        self._copier.compute_waits(copy.event)
        for coef in copy.scales:  # as GradientReducer.scale_ multiplies a device shard
            value.mul_(coef.to(value.dtype) if isinstance(coef, torch.Tensor) else coef)
        return value

    def scaling(self, b: int, coef) -> None:
        copy = self._copies.get(b)
        if copy is not None:
            self._copier.compute_waits(copy.event)  # the in-place multiply must not race the read
            copy.scales.append(coef)

    def changing(self, b: int) -> None:
        self._forget(b)

    def discard(self) -> None:
        for copy in self._copies.values():
            self._copier.host_wait(copy.event)
            copy.event = None
        self._copies = {b: copy for b, copy in self._copies.items() if copy.home}

    def clear(self) -> None:
        self.discard()
        self._copies.clear()

    def _forget(self, b: int) -> None:
        copy = self._copies.pop(b, None)
        if copy is not None:
            # The device shard's next write waits for the read; the buffer's next copy is queued
            # on the same stream after it, and the host does not read it any more.
            self._copier.compute_waits(copy.event)

    # -- gradients down (the step) ----------------------------------------------------------------

    def begin_step(self, order: list[int], source) -> None:
        self._order = list(order)
        self._position = {b: k for k, b in enumerate(self._order)}
        self._source = source
        self._issued = 0
        self.found_on_host = sum(1 for b in self._order if b in self._copies)
        self._issue_through(DEPTH - 1)  # each copy follows the compute stream (clipping, unscaling ran there)

    def _issue_through(self, position: int) -> None:
        """Start the copies of the buckets at positions up to `position` (counting only those
        without a copy from backward) that have none."""
        k = self._issued
        while k < len(self._order):
            b = self._order[k]
            if b not in self._copies:
                if k > position:
                    break
                self._start(b, self._source(b), in_backward=False)
            k += 1
        self._issued = k

    def gradient(self, i: int) -> torch.Tensor:
        """Bucket i's gradient shard on the host (valid until end_step)."""
        k = self._position[i]
        self._issue_through(k + DEPTH)
        if i not in self._copies:  # its copy was never started (asked for out of order)
            self._start(i, self._source(i), in_backward=False)
        copy = self._copies[i]
        self._copier.host_wait(copy.event)
        copy.event = None
        staged = copy.staged
        for coef in copy.scales:  # what the device shard got after the copy, in the same order
            staged.mul_(self._on_host(coef, staged.dtype))
        copy.scales.clear()
        return staged

    def _on_host(self, coef, dtype):
        """A device coefficient cast as the device casts it and brought to the host once per step
        (every bucket shares it: a transfer per bucket would wait for the compute stream, and so
        for the previous bucket's upload, each time)."""
        if not isinstance(coef, torch.Tensor):
            return coef
        key = (id(coef), dtype)
        if key not in self._host_coefs:
            self._host_coefs[key] = (coef, coef.to(device="cpu", dtype=dtype))  # coef kept: its id stays its own
        return self._host_coefs[key][1]

    def end_step(self) -> None:
        self.discard()
        self._host_coefs.clear()
        self._source = None

    # -- parameters up ----------------------------------------------------------------------------

    def upload(self, i: int, dst: torch.Tensor) -> None:
        """dst <- masters[i] cast to dst's dtype (see the module doc); the compute stream waits for it."""
        master = self.masters[i]
        if master.numel() != dst.numel():
            raise RuntimeError(f"HostTier.upload: bucket {i}'s master has {master.numel()} elements, its parameter "
                               f"shard {dst.numel()}")
        slot = self._next_upload
        self._next_upload = (slot + 1) % UPLOAD_SLOTS
        self._copier.host_wait(self._upload_events[slot])  # the copy that last read this buffer is done
        self._upload_events[slot] = None
        buf = self._buffer(self._upload_slots, slot, dst.numel() * dst.element_size())
        staged = self._typed(buf, dst.numel(), dst.dtype)
        staged.copy_(master)  # the cast on the host: round to nearest even, as on the device
        # dst is the parameter shard: work queued on the compute stream may still read or write
        # it (the previous step's all-gather, a step without backward before; user code between
        # backward and step). The copy waits for that work; when every gradient came down in
        # backward nothing else in the step makes the copy stream follow the compute stream.
        self._copier.follow_compute()
        event = self._copier.copy(dst, staged, dst)
        self._copier.compute_waits(event)
        self._upload_events[slot] = event
