"""Gradient shards of NVMe-offloaded stage-3 parameters, kept in files between backward and step.

With offload_param "nvme" the gradient reducer (zero/grad_reducer.py) hands each offloaded
bucket's reduced gradient shard to this spill as soon as its collective is done, instead of
keeping it as an accumulator; the step reads it back one bucket at a time. So no more than a few
buckets' gradients are in memory at once, never the model's (4 bytes x parameters / ranks in
fp32). On CPU training always; on CUDA training when offload_optimizer puts the step on the host
(host_params.py says why not otherwise). There a staged shard is a device tensor: its statistics
(below) are computed on the device, as the in-GPU-memory run computes them, and it is copied
device -> host into the record's page-locked buffer (a synchronous copy: the record is sealed and
written from that buffer next); a loaded one is a host tensor, which the host tier's step reads
directly. `device` is where the gradients are reduced.

Per bucket two record files, `grad-bNNNNN-0.swp` and `-1.swp` (record.py: generation and
checksums), used alternately: a backward pass writes its results as the *pending* generation
into the file the committed one is not in, and only when the whole pass succeeded (commit) does
the pending generation become the gradient. A pass that fails (discard) leaves the previous
gradient, and its file, untouched: the reducer's "accumulators as before the pass" contract.

What the engine needs without reading every shard back is computed when a shard is staged: the
per-bucket clipping terms (sum of squares for the 2-norm, max |g| for the inf-norm, exactly as
clipping.local_term computes them on the in-memory shard) and whether it is finite (fp16's
overflow check). Scaling the gradients (clipping, unscaling) is recorded as a list of factors
applied, in order and with the same in-place multiply, when a shard is loaded: the bits are those
of the in-memory run (a multiply by one rounded factor gives the same bits on host and device).
Terms computed before a scaling are stale after it: term() then loads the shard, moves it to
`device` and computes the term there (the bits of the in-memory run's term on that device).
Finiteness is kept as a 0-d tensor and read (a device sync) only when asked for.

Errors are OSError naming the file, the bucket and the rank: a failed write raises from commit()
(the backward pass fails and is abandoned, the previous gradient intact), a failed read or a bad
record from load(). Not thread-safe: the autograd thread stages and commits, the training thread
loads; they never overlap (backward and step alternate).
"""

from __future__ import annotations

import math
import time

import torch

from . import record
from .io_lanes import IoLanes
from .nvme_store import SwapDirectory
from .policy import OffloadPolicy

_KEY = (-3, "grad")


class _Bucket:
    def __init__(self, index: int, layout: record.Layout):
        self.index = index
        self.layout = layout
        self.io_paths: list[str | None] = [None, None]
        self.generation = 0            # the last committed generation (monotonic: names the record)
        self.valid = False             # a gradient is committed (False: zeros, e.g. after zero_grad)
        self.pending: int | None = None
        self.stats: dict | None = None     # of the committed gradient, before `scales`
        self.pending_stats: dict | None = None
        self.scales: list[torch.Tensor] = []  # applied in order at load
        self.ahead: tuple | None = None    # (generation, buffer, lane) of a read ahead of its load
        self.loaned: torch.Tensor | None = None  # the buffer the last load() returned a view of

    def name(self, generation: int) -> str:
        return f"grad-b{self.index:05d}-{generation % 2}.swp"


def local_term(shard: torch.Tensor, norm_type: float) -> torch.Tensor | None:
    """One shard's contribution to the global norm (zero/clipping.local_term's, bit for bit; it
    is repeated here because imports point from zero/ to offload/, not back)."""
    if not shard.numel():
        return None
    if math.isinf(norm_type):
        lo, hi = torch.aminmax(shard.detach())  # max |g| in one pass (clipping.max_abs)
        return torch.maximum(-lo, hi).to(torch.float32)
    return torch.linalg.vector_norm(shard.detach(), norm_type, dtype=torch.float32) ** norm_type


class GradSpill:
    def __init__(self, policy: OffloadPolicy, rank: int, directory: SwapDirectory, buckets: dict,
                 device: torch.device | str = "cpu"):
        """buckets: {reducer bucket index: (dtype, shard_numel)} of the spilled buckets; device:
        where the staged gradients are reduced (the statistics are computed there)."""
        self.policy = policy
        self.device = torch.device(device)
        self.rank = rank
        self.directory = directory
        self._io = policy.aio.new_handle()
        self._lanes = IoLanes(policy.aio)
        self._buckets = {b: _Bucket(b, record.Layout.build([(*_KEY, dtype, numel)]))
                         for b, (dtype, numel) in buckets.items()}
        self._writing: list[tuple[_Bucket, torch.Tensor]] = []  # (bucket, buffer) of writes in flight
        self._errors: list[OSError] = []
        self.bytes_read = 0
        self.bytes_written = 0
        self.peak_buffer_bytes = 0
        self._buffer_bytes = 0
        self._free: list[torch.Tensor] = []  # pooled record buffers (at most buffer_count kept)
        self.read_wait_s = 0.0
        self.write_wait_s = 0.0
        self.checksum_s = 0.0
        self.reads_ahead = 0

    def spills(self, b: int) -> bool:
        return b in self._buckets

    def has(self, b: int) -> bool:
        return self._buckets[b].valid

    # -- backward: stage, then commit or discard ---------------------------------------------------

    def stage(self, b: int, value: torch.Tensor) -> None:
        """The pass's new gradient of bucket b (written as the pending generation); value may be
        a device tensor (CUDA training): statistics there, then copied down (module doc)."""
        h = self._buckets[b]
        inf = local_term(value, math.inf)
        # Finite exactly when max |g| is (NaN and inf propagate through it): no pass of its own.
        # Kept as a tensor: reading it would make the CPU wait for the device here.
        h.pending_stats = {"2": local_term(value, 2.0), "inf": inf,
                           "finite": True if inf is None else torch.isfinite(inf)}
        if len(self._writing) >= self.policy.buffer_count:
            self._drain()
        generation = h.generation + 1
        buf = self._take(h.layout.record_bytes)
        h.layout.view(buf, h.layout.slots[0]).copy_(value.reshape(-1))  # device -> host: synchronous
        t0 = time.perf_counter()
        record.seal(buf, h.layout, h.index, self.rank, generation)
        self.checksum_s += time.perf_counter() - t0
        h.pending = generation
        slot = generation % 2
        try:
            if h.io_paths[slot] is None:
                h.io_paths[slot] = self.directory.create(h.name(generation), h.layout.record_bytes)
            self._io.async_pwrite(buf[:h.layout.record_bytes], h.io_paths[slot])
        except OSError as e:
            self._give(buf)
            self._errors.append(self._named(e, h, generation, "writing"))
            return
        self._writing.append((h, buf))

    def commit(self) -> None:
        """The pass succeeded everywhere: pending generations become the gradients. Raises the
        pass's write errors (then nothing is committed: call discard)."""
        self._drain()
        errors, self._errors = self._errors, []
        record.raise_collected(errors)
        for h in self._buckets.values():
            if h.pending is not None:
                h.generation, h.pending, h.valid = h.pending, None, True
                h.stats, h.pending_stats, h.scales = h.pending_stats, None, []

    def discard(self) -> None:
        try:
            self._drain()
        except OSError:
            pass
        self._errors = []
        for h in self._buckets.values():
            h.pending, h.pending_stats = None, None
            self._drop_ahead(h)

    def clear(self) -> None:
        """zero_grad: every gradient is zero again (the files stay, for the next pass)."""
        self.discard()
        for h in self._buckets.values():
            h.valid, h.stats, h.scales = False, None, []

    # -- the step: read back, one bucket at a time --------------------------------------------------

    def read_ahead(self, indices, depth: int) -> None:
        """Start reading the gradients of the first `depth` of these buckets (the step's next
        ones) into pooled buffers, as far as the pool's budget goes (never waiting)."""
        for b in list(indices)[:depth]:
            h = self._buckets.get(b)
            if h is None or not h.valid or h.ahead is not None:
                continue
            buf = self._take(h.layout.record_bytes, wait=False)
            if buf is None:
                return
            try:
                lane = self._lanes.read(buf[:h.layout.record_bytes], h.io_paths[h.generation % 2],
                                        self._checker(h, buf, h.generation))
            except OSError:
                self._give(buf)  # refused at the call: load() reads again and reports it
                continue
            h.ahead = (h.generation, buf, lane)
            self.reads_ahead += 1

    def load(self, b: int) -> torch.Tensor | None:
        """Bucket b's gradient shard (scalings applied), or None when it has none (zeros).
        The tensor is the caller's until it calls give_back(b) (then the buffer is reused);
        a caller that never gives it back just owns it. Raises OSError naming the file."""
        h = self._buckets[b]
        if not h.valid:
            return None
        path = h.io_paths[h.generation % 2]
        ahead, h.ahead = h.ahead, None
        if ahead is not None and ahead[0] != h.generation:  # read before a newer pass: stale
            self._lanes.wait_quietly(ahead[2])
            self._give(ahead[1])
            ahead = None
        t0 = time.perf_counter()
        try:
            if ahead is not None:
                buf = ahead[1]
                try:
                    self._lanes.wait(ahead[2])
                finally:
                    self.read_wait_s += time.perf_counter() - t0
            else:
                buf = self._take(h.layout.record_bytes)
                try:
                    self._lanes.wait(self._lanes.read(buf[:h.layout.record_bytes], path,
                                                      self._checker(h, buf, h.generation)))
                finally:
                    self.read_wait_s += time.perf_counter() - t0
        except (OSError, record.RecordError) as e:
            self._give(buf)
            raise self._named(e, h, h.generation, "reading") from None
        self.bytes_read += h.layout.record_bytes
        value = h.layout.view(buf, h.layout.slots[0])
        for coef in h.scales:  # a device coefficient (CUDA clipping) is read once per factor
            value.mul_(coef.to(device=value.device, dtype=value.dtype))
        h.loaned = buf
        return value

    def give_back(self, b: int) -> None:
        """The caller of load(b) no longer uses the tensor it got: its buffer is reused."""
        h = self._buckets.get(b)
        if h is not None and h.loaned is not None:
            buf, h.loaned = h.loaned, None
            self._give(buf)

    def term(self, b: int, norm_type: float) -> torch.Tensor | None:
        """The clipping term of bucket b's gradient (on `device`), or None when it has none
        (zeros). Without reading it where the staged statistics still hold; else (scaled since,
        another norm type) read back and computed on `device` (raises OSError like load)."""
        h = self._buckets[b]
        if not h.valid:
            return None
        key = "inf" if math.isinf(norm_type) else ("2" if norm_type == 2.0 else None)
        if h.stats is not None and not h.scales and key is not None:
            return h.stats[key]
        value = self.load(b)
        try:
            return local_term(value.to(self.device), norm_type)
        finally:
            del value
            self.give_back(b)

    def finite(self, b: int) -> bool | None:
        h = self._buckets[b]
        if not h.valid or h.stats is None or h.scales:
            return None
        return bool(h.stats["finite"])

    def scale_all(self, coef: torch.Tensor) -> None:
        for h in self._buckets.values():
            if h.valid:
                h.scales.append(coef.detach().clone())

    # -- internals ----------------------------------------------------------------------------------

    def _checker(self, h: _Bucket, buf: torch.Tensor, generation: int):
        layout, index, rank = h.layout, h.index, self.rank
        return lambda: record.check(buf, layout, index, rank, generation)

    @property
    def background_check_s(self) -> float:
        """Seconds spent checking records read, on the lanes' thread (not the training thread's)."""
        return self._lanes.check_s

    def _take(self, nbytes: int, wait: bool = True) -> torch.Tensor | None:
        """A pooled page-locked buffer for one record; beyond buffer_count buffers a new one
        when `wait` (after draining the writes in flight), else None."""
        nbytes = -(-nbytes // 4096) * 4096
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes:
                return self._free.pop(i)
        if self._in_use() >= self.policy.buffer_count:
            if not wait:
                return None
            self._drain()
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
        buf = self._io.new_cpu_locked_tensor(nbytes, torch.uint8)
        self._buffer_bytes += buf.numel()
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._buffer_bytes)
        return buf

    def _in_use(self) -> int:
        return len(self._writing) + sum((h.ahead is not None) + (h.loaned is not None) for h in self._buckets.values())

    def _give(self, buf: torch.Tensor | None) -> None:
        if buf is None:
            return
        if len(self._free) + self._in_use() >= self.policy.buffer_count:
            self._buffer_bytes -= buf.numel()  # over the pool's size: let it go
            return
        self._free.append(buf)

    def _drop_ahead(self, h: _Bucket) -> None:
        if h.ahead is not None:
            _, buf, lane = h.ahead
            h.ahead = None
            self._lanes.wait_quietly(lane)
            self._give(buf)

    def _drain(self) -> None:
        if not self._writing:
            return
        writing, self._writing = self._writing, []
        t0 = time.perf_counter()
        try:
            self._io.wait()
        except OSError as e:
            by_path = {h.io_paths[(h.pending or 0) % 2]: h for h, _ in writing}
            h = by_path.get(e.filename, writing[0][0])
            g = h.pending or h.generation + 1
            self._errors.append(self._named(e, h, g, "writing"))
        else:
            self.bytes_written += sum(h.layout.record_bytes for h, _ in writing)
        finally:
            self.write_wait_s += time.perf_counter() - t0
            for _, buf in writing:
                self._give(buf)

    def _named(self, e: BaseException, h: _Bucket, generation: int, doing: str) -> OSError:
        path = self.directory.display_path(h.name(generation))
        return record.swap_error(e, path, f"offload_param: {doing} gradient file {path!r} (gradient bucket "
                                          f"{h.index}, rank {self.rank})")
