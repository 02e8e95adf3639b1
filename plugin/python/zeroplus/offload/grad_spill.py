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

The records are the C++ swap store's (record.open_store: a 4 KiB header with generation and
CRC-32s, pooled page-locked buffers, sealed and written by the store's thread, checked there as
they are read back). The spill has a store of its own, beside the parameter swapper's in the same
directory: its pool is buffer_count buffers of the largest gradient record, and it caches nothing
after a write (a gradient is read back once, by the step, which must see what the file holds).
Per bucket b two records, ids 2b and 2b + 1 (`grad-bNNNNN.swp` with NNNNN the id), used
alternately: a backward pass writes its results as the *pending* generation into the record the
committed one is not in, and only when the whole pass succeeded (commit) does the pending
generation become the gradient. A pass that fails (discard) leaves the previous gradient, and
its file, untouched: the reducer's "accumulators as before the pass" contract.

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
loads; they never overlap (backward and step alternate), as the store's one-owner contract asks.
"""

from __future__ import annotations

import math

import torch

from . import record
from .nvme_store import SwapDirectory
from .policy import OffloadPolicy

_STEM = "grad-b"  # file names: grad-bNNNNN.swp (the store's stem + 5-digit record id 2b or 2b + 1)
_KEY = (-3, "grad")


class _Bucket:
    def __init__(self, index: int, layout: record.Layout):
        self.index = index
        self.layout = layout
        self.generation = 0            # the last committed generation (monotonic: names the record)
        self.valid = False             # a gradient is committed (False: zeros, e.g. after zero_grad)
        self.pending: int | None = None
        self.stats: dict | None = None     # of the committed gradient, before `scales`
        self.pending_stats: dict | None = None
        self.scales: list[torch.Tensor] = []  # applied in order at load
        self.loaned: int | None = None  # the record id held for the tensor the last load() returned

    def rid(self, generation: int) -> int:
        """The store's record id of this generation (two records per bucket, used alternately)."""
        return 2 * self.index + generation % 2

    def key(self, generation: int) -> tuple[int, int, int, int]:
        return self.rid(generation), generation, self.layout.payload_bytes, self.layout.digest

    def name(self, generation: int) -> str:
        return f"{_STEM}{self.rid(generation):05d}.swp"


def local_term(shard: torch.Tensor, norm_type: float) -> torch.Tensor | None:
    """One shard's contribution to the global norm (zero/clipping.local_term's, bit for bit; it
    is repeated here because imports point from zero/ to offload/, not back)."""
    if not shard.numel():
        return None
    if math.isinf(norm_type):
        lo, hi = torch.aminmax(shard.detach())  # max |g| in one pass (clipping.max_abs)
        return torch.maximum(-lo, hi).to(torch.float32)
    return torch.linalg.vector_norm(shard.detach(), norm_type, dtype=torch.float32) ** norm_type


class GradSpill(record.StoreCounters):
    def __init__(self, policy: OffloadPolicy, rank: int, directory: SwapDirectory, buckets: dict,
                 device: torch.device | str = "cpu"):
        """buckets: {reducer bucket index: (dtype, shard_numel)} of the spilled buckets; device:
        where the staged gradients are reduced (the statistics are computed there)."""
        self.policy = policy
        self.device = torch.device(device)
        self.rank = rank
        self.directory = directory
        self._buckets = {b: _Bucket(b, record.Layout.build([(*_KEY, dtype, numel)]))
                         for b, (dtype, numel) in buckets.items()}
        for h in self._buckets.values():
            for g in (0, 1):
                directory.track(h.name(g))  # created by the store: counted by disk_bytes, removed by close
        largest = max((h.layout.record_bytes for h in self._buckets.values()), default=record.HEADER_BYTES)
        self._store = record.open_store(directory, _STEM, largest, policy.buffer_count, policy.aio, False)
        self._errors: list[OSError] = []
        self.checksum_s = 0.0  # the training thread's: none (the store's thread seals and checks)

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
        generation = h.generation + 1
        # A buffer without a read (the store waits for its oldest write when the pool is full).
        payload, code, what = self._store.overwrite(h.rid(generation), h.layout.payload_bytes)
        if code:
            self._errors.append(self._fault(h, generation, code, what, "writing"))
            return
        h.layout.view(payload, h.layout.slots[0]).copy_(value.reshape(-1))  # device -> host: synchronous
        del payload  # no view of the buffer outlives the store() below
        h.pending = generation
        self._store.store(*h.key(generation), False)

    def commit(self) -> None:
        """The pass succeeded everywhere: pending generations become the gradients. Raises the
        pass's write errors (then nothing is committed: call discard)."""
        self._collect(self._store.drain())
        errors, self._errors = self._errors, []
        record.raise_collected(errors)
        for h in self._buckets.values():
            if h.pending is not None:
                h.generation, h.pending, h.valid = h.pending, None, True
                h.stats, h.pending_stats, h.scales = h.pending_stats, None, []

    def discard(self) -> None:
        self._store.drain()
        self._store.plan_reads([])
        self._errors = []
        for h in self._buckets.values():
            if h.pending is not None:
                self._store.forget(h.rid(h.pending))  # a failed write's record is not kept in memory
            h.pending, h.pending_stats = None, None

    def clear(self) -> None:
        """zero_grad: every gradient is zero again (the files stay, for the next pass)."""
        self.discard()
        for h in self._buckets.values():
            h.valid, h.stats, h.scales = False, None, []

    # -- the step: read back, one bucket at a time --------------------------------------------------

    def read_ahead(self, indices, depth: int) -> None:
        """The store reads the gradients of the first `depth` of these buckets (the step's next
        ones) as its buffers free up (never waiting, never evicting a record read ahead)."""
        keys = []
        for b in list(indices)[:depth]:
            h = self._buckets.get(b)
            if h is not None and h.valid and h.loaned is None:
                keys.extend(h.key(h.generation))
        self._store.plan_reads(keys)

    def load(self, b: int) -> torch.Tensor | None:
        """Bucket b's gradient shard (scalings applied), or None when it has none (zeros).
        The tensor views the store's buffer: valid until give_back(b), the next load(b), discard
        or clear (then the buffer is reused). Raises OSError naming the file."""
        h = self._buckets[b]
        if not h.valid:
            return None
        self.give_back(b)
        payload, code, what = self._store.fetch(*h.key(h.generation))
        if code:
            raise self._fault(h, h.generation, code, what, "reading")
        value = h.layout.view(payload, h.layout.slots[0])
        for coef in h.scales:  # a device coefficient (CUDA clipping) is read once per factor
            value.mul_(coef.to(device=value.device, dtype=value.dtype))
        h.loaned = h.rid(h.generation)
        return value

    def give_back(self, b: int) -> None:
        """The caller of load(b) no longer uses the tensor it got: its buffer is reused."""
        h = self._buckets.get(b)
        if h is not None and h.loaned is not None:
            rid, h.loaned = h.loaned, None
            self._store.release(rid)

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

    # -- accounting: record.StoreCounters ---------------------------------------------------------------

    def close(self) -> None:
        """Waits for the store's transfers and removes its files (the directory is the parameter
        swapper's). The gradients are gone."""
        for h in self._buckets.values():
            h.loaned, h.valid, h.pending = None, False, None
        self._store.close()

    # -- errors -------------------------------------------------------------------------------------

    def _collect(self, faults: list) -> None:
        """Write faults the store reported ((id, path, errno, what)) join the pass's errors."""
        for rid, _path, code, what in faults:
            h = self._buckets[rid // 2]
            g = h.pending if h.pending is not None else h.generation + 1
            doing = "creating" if what.startswith("create failed") else "writing"
            self._errors.append(self._fault(h, g, code, what, doing))

    def _fault(self, h: _Bucket, generation: int, code: int, what: str, doing: str) -> OSError:
        path = self.directory.display_path(h.name(generation))
        return record.fault(code, what, path, f"offload_param: {doing} gradient file {path!r} (gradient bucket "
                                              f"{h.index}, rank {self.rank})")
