"""The host tier of ZeRO-Offload: fp32 masters and optimizer state in host memory, the step on the CPU.

With offload_optimizer on CUDA training (device "cpu" or "nvme"), every bucket's fp32 master is a
host tensor made here, and the engine builds its bucket optimizers (zero/bucket_optimizer.py)
over those host tensors: their state is created on the host and zeroplus's fused CPU kernels step
them. With "nvme" the NVMe swapper (swapper.py) sits under this tier: the host masters and the
host state are what it swaps. Per step the engine (zero/engine.py, _step_buckets) calls

    begin_step(order, source)  the copy stream waits for the compute stream (backward, the
                               reduce-scatters, clipping and unscaling ran there), then the
                               gradient shards of the first DEPTH buckets of `order` start down:
                               device -> a pinned host staging buffer, non_blocking, on the copy
                               stream, one event each. source(i) is bucket i's gradient shard.
    gradient(i)                starts the copies of the DEPTH buckets after i, waits for bucket
                               i's event and returns its host staging buffer (the CPU step reads
                               it), so bucket i+1's copy runs while bucket i steps
    upload(i, dst)             the updated master, cast on the host into a pinned upload buffer
                               in dst's dtype, then copied into dst (this rank's shard of the
                               parameters on the device: non_blocking, copy stream, an event);
                               the compute stream waits for that event, so the all-gather (stages
                               1-2) or the next gather (stage 3) that reads dst comes after it,
                               while the CPU goes on with the next bucket's step
    end_step()                 waits for every gradient copy still in flight (a step that raised
                               must not leave a copy reading a shard that zero_grad then frees)

Everything CUDA (streams, events, page-locked allocation) goes through DeviceCopier, the one
place that knows the device; with "device" and "host" both the CPU a copy is a plain copy_ and an
event is None. force_on_cpu_for_tests() (a private test hook, not a user knob) makes CPU training take this
path, so the tests run the same code, bit for bit, against the in-memory engine.

Memory: the fp32 masters (page-locked when pin_memory is set: transfers never read them directly,
they go through the staging buffers, so pinning only keeps them out of the OS's swap) and the
optimizer state on the host; DEPTH + 1 gradient staging buffers (one bucket's gradient shard each)
and UPLOAD_SLOTS upload buffers (one bucket's shard in the compute dtype), always page-locked on
CUDA (asynchronous copies need it), grown to the largest bucket at first use and reused every
step. torch's pinned allocator rounds each allocation up to a power of two: up to twice a
master's bytes when pin_memory is set. On the device stay the parameters and the gradient shards.

Not thread-safe: the training thread calls it.
"""

from __future__ import annotations

import contextlib

import torch

DEPTH = 2         # gradient shards copied down ahead of the bucket stepping
UPLOAD_SLOTS = 2  # one upload on the wire while the next bucket's is cast

_forced = False


@contextlib.contextmanager
def force_on_cpu_for_tests():
    """Engines built inside this block take the host tier on CPU training too (offload_optimizer
    "cpu" or "nvme"), as CUDA training does. For tests only: on CPU the tier only adds copies."""
    global _forced
    old, _forced = _forced, True
    try:
        yield
    finally:
        _forced = old


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


class HostTier:
    def __init__(self, device: torch.device, masters: list[torch.Tensor], pin_memory: bool,
                 copier: DeviceCopier | None = None):
        """masters: the engine's fp32 masters (on `device`); `self.masters` are their host copies,
        which the engine uses from now on (never aliases of the parameters, even on CPU).
        copier: DeviceCopier(device) unless given (tests give one that records the ordering)."""
        self._copier = DeviceCopier(device) if copier is None else copier
        self.device = device
        self.masters = []
        for m in masters:
            host = self._copier.host_empty(m.numel(), m.dtype, pin_memory)
            host.copy_(m.detach())
            self.masters.append(host)
        self._grad_slots: list[torch.Tensor | None] = [None] * (DEPTH + 1)  # uint8 staging buffers
        self._slot_owner: list[int | None] = [None] * (DEPTH + 1)
        self._upload_slots: list[torch.Tensor | None] = [None] * UPLOAD_SLOTS
        self._upload_events: list = [None] * UPLOAD_SLOTS
        self._next_upload = 0
        self._order: list[int] = []
        self._position: dict[int, int] = {}
        self._source = None
        self._issued = 0                 # positions of _order whose gradient copy has started
        self._inflight: dict[int, tuple] = {}  # bucket -> (host staging view, event)

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() for t in self._grad_slots + self._upload_slots if t is not None)

    def _buffer(self, slots: list, k: int, nbytes: int) -> torch.Tensor:
        """Slot k's staging buffer with at least nbytes (grown at first use; the caller made sure
        no copy still uses the old one)."""
        if slots[k] is None or slots[k].numel() < nbytes:
            slots[k] = None
            slots[k] = self._copier.host_empty(max(nbytes, 1), torch.uint8, pin=True)
        return slots[k]

    @staticmethod
    def _typed(buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return buf[:numel * dtype.itemsize].view(dtype)

    # -- gradients down ---------------------------------------------------------------------------

    def begin_step(self, order: list[int], source) -> None:
        self.end_step()
        self._copier.follow_compute()
        self._order = list(order)
        self._position = {b: k for k, b in enumerate(self._order)}
        self._source = source
        self._issued = 0
        self._issue_through(DEPTH - 1)

    def _issue_through(self, position: int) -> None:
        last = min(position, len(self._order) - 1)
        while self._issued <= last:
            k = self._issued
            self._issued += 1
            b = self._order[k]
            src = self._source(b)
            slot = k % (DEPTH + 1)
            # The slot's previous bucket (k - DEPTH - 1) has stepped (the engine asked for a later
            # one since), or was skipped: its copy was issued on the same stream, before this one.
            previous = self._slot_owner[slot]
            if previous is not None:
                self._inflight.pop(previous, None)
            nbytes = src.numel() * src.element_size()
            buf = self._buffer(self._grad_slots, slot, nbytes)
            staged = self._typed(buf, src.numel(), src.dtype)
            self._inflight[b] = (staged, self._copier.copy(staged, src, src))
            self._slot_owner[slot] = b

    def gradient(self, i: int) -> torch.Tensor:
        """Bucket i's gradient shard on the host (valid until the engine asks for DEPTH + 1 more)."""
        k = self._position[i]
        self._issue_through(k + DEPTH)
        staged, event = self._inflight.pop(i)
        self._copier.host_wait(event)
        return staged

    def end_step(self) -> None:
        for _staged, event in self._inflight.values():
            self._copier.host_wait(event)
        self._inflight.clear()
        self._slot_owner = [None] * (DEPTH + 1)
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
        event = self._copier.copy(dst, staged, dst)
        self._copier.compute_waits(event)
        self._upload_events[slot] = event
