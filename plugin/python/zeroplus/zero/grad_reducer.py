"""Stage-2 gradient path: bucket, reduce-scatter during backward, keep only the owned shard.

Threading and ordering contract (the hooks and the end-of-backward callback belong to the
engine's BackwardPass, backward_pass.py; this class is its first participant):
  * on_grad runs on the autograd thread from each managed parameter's post-accumulate-grad
    hook: it copies the finished gradient into its bucket's communication buffer and frees it
    (`p.grad = None`), so a full gradient lives only until its bucket is sent.
  * Buckets are launched strictly in bucket order (DDP's rule): bucket i is sent only after
    buckets 0..i-1, so every rank issues the same collectives in the same order even when
    gradients arrive in a different order on different ranks. A bucket whose gradients are all in
    is sent asynchronously while backward continues.
  * end_backward (the pass's end-of-backward callback) sends the buckets still open (a parameter that got no gradient contributes zeros, as with DDP's
    find_unused_parameters), waits for every reduce-scatter and adds the owned shards into the
    accumulators. So after backward returns, `accum[b]` holds this rank's shard of the averaged
    gradient, summed over every backward since the last zero().
  * Accumulators exist only while gradients do, as torch's `.grad` tensors: zero(set_to_none=True)
    (zero_grad's default) frees them and a pass allocates each one (zeros) when its first result
    arrives, so the next forward runs without the 4Ψ/N bytes of gradient shards (FSDP2 does the
    same). zero(set_to_none=False) keeps them as zeros.
  * Under no_sync() the hooks leave gradients in `p.grad` (local accumulation, as DDP). The next
    backward outside no_sync sends the accumulated value; `flush()` sends what is pending when a
    step comes without such a backward.
  * Averaging: fp32/bf16 buckets are summed and the 1/N is folded into the add into the
    accumulator (one pass over the shard instead of a division pass over the whole bucket);
    fp16 buckets are divided before the sum, as DDP and DeepSpeed do, so the sum cannot overflow.
    For N a power of two both orders give the same bits.
  * On gloo with 2 ranks the reduce-scatter is one `reduce` per owner (comm.owner_collectives).
  * Stage 3 (`gated`, set by the placement): a complete bucket is not launched from on_grad. The
    gatherer's collectives share the group, and when a parameter gets a gradient on some ranks
    only (a module some ranks skip) its bucket completes at different times on different ranks,
    so launches would interleave differently with the gathers and the ranks' collective
    sequences would no longer pair up. Instead each unit gather's agreement
    (gather_agreement.py) carries `ready_prefix()` and launches, via `launch_agreed(n)`, the
    buckets every rank has ready; end_backward launches the rest, in order, on every rank.
  * Stage 1 (gradients kept whole) with zero accumulators in the bucket dtype: gradients are
    written straight into the accumulator, already multiplied by 1/N (DDP's copy into its bucket
    is the same mul_out), and all-reduced in place: no bucket buffer, no pass after the sum, and
    the same bits as DDP.
  * A bucket's input buffer, once its collective is done, goes to a BufferPool and is reused by
    the next pass (buffer_pool.py: no page faults per step, never more than the peak in use).
  * Which parameters had a gradient in a pass is committed to `usage` (usage.py) when the pass
    succeeds; the optimizer steps only parameters some rank used (torch skips a None grad).
Gradient spill (offload_param "nvme": CPU training, and CUDA training with offload_optimizer;
zeroplus.offload.grad_spill): the buckets it spills get no accumulator. Their result is handed to
the spill as soon as their collective is waited on (added, where it was reduced, to the previous
gradient read back from it, when accumulating), written as a pending
generation, and committed with the pass (after earlier gradients, before the other buckets'
accumulators change: a failed write leaves them as they were), so at most a few buckets'
gradients are in memory.
`shard(b)` reads one back for the step; `scale_(coef)` and `local_terms(p)` serve clipping and
unscaling without reading them.
Observer (the host tier of ZeRO-Offload, zeroplus.offload.host_tier, attached by the engine):
a bucket's result is added into its accumulator ("settled") as soon as its collective is waited
on when the pass starts from no gradient (has_grads False: a failed pass frees the accumulators
anyway, so nothing is lost by not waiting for the whole pass), else at the end of the pass (the
previous gradients must survive a failed pass). Then `observer.ready(b, shard)` is told: the
shard holds what the step would read, and the observer's host copy is the gradient's home
from then on: the device accumulator is freed ("released"; the observer's copy
keeps its memory until it has been read), after the two terms clipping and the fp16 overflow
check need (2-norm and max |g|, clipping.local_term on the device shard: the bits a later
local_terms would compute) were kept. A released gradient is read back through
`observer.fetch(b)` (a device tensor: another norm, a term made stale by a scaling, `shard(b)`)
and taken back as the accumulator when a later pass adds to it or `shards` hands it to a user.
A later pass adds to every released gradient it settles before any replaces its home copy (each
read back beside it, with the result added): a failure there (out of memory) leaves them all as
they were before the pass, not some with the pass added.
The observer hears of every change first: `scaling(b, coef)` before scale_ multiplies a shard
(in place on the device; a released one is multiplied only there), `changing(b)` before a later
pass adds into it, `discard()` when a pass after a successful one is abandoned (released
gradients stay), `clear()` when zero() clears the gradients or a first pass is abandoned.
Spilled buckets are not announced (the step reads them back). In backward the buckets are
waited on two launches behind the newest (MAX_INFLIGHT_INPUTS), so most are announced (and
released) while backward goes on; the last ones at its end. Whether a backward is the last
before step() cannot be known here (a user may run several without no_sync): every pass
announces its buckets, and a later pass takes each back (fetch, changing) before adding to it.
Every rank must run the same backward passes (as with DDP); a collective failure raises from
backward (or flush) and leaves the accumulators as they were before that pass. A backward that
raised for any reason (autograd then drops the queued end-of-pass callback) leaves its pass open;
the BackwardPass closes it (abandon_backward) at the next backward, forward, flush or zero.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import clipping, comm
from .buffer_pool import BufferPool
from .dtensor_params import local_grad
from .layout import Bucket
from .usage import ParamUsage


def _kept_terms(shard: torch.Tensor) -> dict:
    """What a released gradient keeps for clipping and the fp16 check: its 2-norm and inf-norm
    terms (clipping.local_term on the device shard, the bits a later local_terms computes)."""
    return {"2": clipping.local_term(shard, 2.0), "inf": clipping.local_term(shard, float("inf"))}


def _term_key(norm_type: float) -> str | None:
    """Which kept term serves this norm (GradientReducer._release keeps the 2-norm's and max |g|)."""
    return "inf" if norm_type == float("inf") else ("2" if norm_type == 2.0 else None)

class GradientHome(enum.Enum):
    """Where bucket b's reduced gradient shard lives between backward and step: GradientReducer.home(b)
    is the one answer (the step, clipping, unscaling, grad_views and checkpoints ask it)."""
    NONE = "no gradient since the last zero_grad(set_to_none=True)"
    ACCUMULATOR = "the reducer's accumulator, in the training device's memory"
    HOST = "the host tier's copy only (ZeRO-Offload on CUDA: released once its clipping terms were kept)"
    SPILL = "a gradient swap file (offload_param nvme: GradSpill)"


@dataclass
class InFlight:
    """One launched bucket collective of the open pass."""
    bucket: int                  # bucket index
    work: object | None          # the async work; None once waited on
    out: torch.Tensor | None     # where this rank's result lands (the accumulator, a shard-sized tensor, or a view of buf)
    buf: torch.Tensor | None     # the full-size input while it may still be read; None once recycled
    staged: bool = False         # a spilled bucket's result was handed to the spill
    summed: bool = False         # out is a released bucket's previous gradient + this result (_sum_released)
    settled: bool = False        # the result is in the accumulator (or the spill); buffers recycled


# Full-size bucket inputs allowed in flight at once (overlap needs two: one on the wire while the
# next fills).
MAX_INFLIGHT_INPUTS = 2


class GradientReducer:
    def __init__(self, buckets: list[Bucket], group, world_size: int, rank: int, accum_dtype: torch.dtype | None,
                 shard_gradients: bool = True):
        self.buckets = buckets
        self.group = group
        self.world_size = world_size
        self.rank = rank
        # False is ZeRO stage 1 with mixed precision: buckets are all-reduced and every rank keeps
        # the full averaged gradient (the optimizer still steps only the owned shard).
        self.shard_gradients = shard_gradients
        self.slot = {}
        for b in buckets:
            for e_index, e in enumerate(b.entries):
                self.slot[e.param] = (b.index, e_index)
        # Gradients (the "2Ψ/N" of the ZeRO formula at stage 2): this rank's slice of every
        # bucket, in the accumulation dtype; the whole bucket at stage 1. None while no gradient
        # exists (see the module doc); _accum(b) allocates.
        self.accum_dtypes = [accum_dtype or b.dtype for b in buckets]
        self.accum: list[torch.Tensor | None] = [None] * len(buckets)
        self.owner_collectives = comm.owner_collectives(group)
        self.pool = BufferPool()  # full-size bucket inputs, reused by the next bucket of that size
        # Where each bucket's communication buffer is not covered by a parameter (alignment gaps,
        # padding to the world size): zeroed when the buffer is taken, the rest is overwritten.
        self._gaps = [self._gaps_of(b) for b in buckets]
        self.usage = ParamUsage([len(b.entries) for b in buckets], buckets[0].device)
        self.no_sync = False
        self.gated = False          # stage 3: launches wait for launch_agreed (see the module doc)
        self.has_grads = False      # something was reduced since the last zero()
        self.local_pending = False  # gradients accumulated under no_sync, not reduced yet
        self._buffers: list[torch.Tensor | None] = []
        self._inflight = []
        self.spill = None  # zeroplus.offload.GradSpill, or None
        self.observer = None  # told when a gradient shard is final or about to change (module doc)
        # released[b]: bucket b's gradient lives only in the observer's host copy (accum[b] None);
        # kept_terms[b]: its clipping terms, computed before the release ({"2", "inf"}; None: stale).
        self.released = [False] * len(buckets)
        self.kept_terms: list[dict | None] = [None] * len(buckets)
        self._reset_pass()

    def attach_observer(self, observer) -> None:
        """observer.ready / fetch / scaling / changing / discard / clear are called as the module doc says."""
        self.observer = observer

    def attach_spill(self, spill) -> None:
        """Gradients of the buckets `spill.spills(b)` go to it (see the module doc)."""
        self.spill = spill

    def _spilled(self, b: int) -> bool:
        """Bucket b's gradients go to the spill (whether or not one is there now)."""
        return self.spill is not None and self.spill.spills(b)

    def home(self, b: int) -> GradientHome:
        """Where bucket b's gradient lives now (GradientHome)."""
        if self._spilled(b):
            return GradientHome.SPILL
        if self.released[b]:
            return GradientHome.HOST
        return GradientHome.ACCUMULATOR if self.accum[b] is not None else GradientHome.NONE

    def _scale_of(self, b: int) -> float:
        return 1.0 if self._direct or self.buckets[b].dtype == torch.float16 else 1.0 / self.world_size

    def _stage(self, entry) -> None:
        """A spilled bucket's result: added to its previous gradient (read back) or alone, with
        the same operations as the in-memory accumulation, and written as pending."""
        b, out, scale = entry.bucket, entry.out, self._scale_of(entry.bucket)
        old = self.spill.load(b) if self.has_grads and self.spill.has(b) else None
        if old is not None:
            # The add where the in-memory accumulator is (CUDA: the loaded host shard goes up
            # first; on CPU .to is the loaded tensor itself), for its bits.
            value = old.to(out.device).add_(out, alpha=scale)
        elif self.accum_dtypes[b] == out.dtype:
            value = out.mul_(scale) if scale != 1.0 else out  # bitwise 0 + scale * sum
        else:
            value = torch.zeros(out.numel(), dtype=self.accum_dtypes[b], device=out.device).add_(out, alpha=scale)
        self.spill.stage(b, value)  # copies value into its record
        if old is not None:
            self.spill.give_back(b)
        entry.out, entry.staged = None, True

    def shard(self, b: int) -> torch.Tensor:
        """Bucket b's gradient shard: the accumulator, or a spilled or released one read back (a
        copy: write changes through scale_). A spilled one is a host tensor, zeros included (CUDA
        training: the host tier's step reads it there); a released one a device tensor."""
        home = self.home(b)
        if home is GradientHome.SPILL:
            value = self.spill.load(b)
            return value if value is not None else torch.zeros(self.buckets[b].shard_numel, dtype=self.accum_dtypes[b],
                                                                device="cpu")
        if home is GradientHome.HOST:
            return self.observer.fetch(b)
        if self.shard_gradients:
            return self._accum(b)
        return self._accum(b)[slice(*self.buckets[b].shard_range(self.rank))]

    def _owned_shard(self, b: int) -> torch.Tensor:
        """shard(b), owned by the caller: a spilled one is cloned out of the store's buffer and
        the buffer given back at once (a view of it would show another gradient once the buffer
        is reused, race the store's seal when written to, and dangle after close)."""
        value = self.shard(b)
        if self.home(b) is not GradientHome.SPILL:
            return value
        try:
            return value.clone()
        finally:
            del value
            self.release_shard(b)

    def release_shard(self, b: int) -> None:
        """The caller is done with the tensor shard(b) returned (a spilled one's buffer is reused)."""
        if self.home(b) is GradientHome.SPILL:
            self.spill.give_back(b)

    def read_ahead_shards(self, indices, depth: int) -> None:
        """Spilled gradients of the first `depth` of these buckets start coming back from disk."""
        if self.spill is not None:
            self.spill.read_ahead([b for b in indices if self._spilled(b)], depth)

    def scale_(self, coef) -> None:
        """Multiply every gradient shard by coef (a 0-d tensor or a float), in place."""
        for b in range(len(self.buckets)):
            home = self.home(b)
            if home is GradientHome.SPILL:
                continue  # scale_all below
            if home is GradientHome.HOST:  # multiplied where it lives (the observer's copy), when read
                self.observer.scaling(b, coef)
                self.kept_terms[b] = None
                continue
            g = self.shard(b)
            if self.observer is not None:
                self.observer.scaling(b, coef)
            g.mul_(coef.to(g.dtype) if isinstance(coef, torch.Tensor) else coef)
        if self.spill is not None:
            self.spill.scale_all(coef if isinstance(coef, torch.Tensor) else torch.tensor(coef))

    def local_terms(self, norm_type: float, term_of):
        """Each bucket's clipping term in bucket order (term_of(shard) for resident ones; a
        spilled or released one's kept term, or its gradient read back one at a time)."""
        for b in range(len(self.buckets)):
            home = self.home(b)
            if home is GradientHome.SPILL:
                t = self.spill.term(b, norm_type)
                if t is None:
                    t = term_of(self.shard(b))
                    self.release_shard(b)
                yield t
            elif home is GradientHome.HOST:
                key = _term_key(norm_type)
                kept = self.kept_terms[b]
                yield kept[key] if kept is not None and key is not None else term_of(self.shard(b))
            else:
                yield term_of(self.shard(b))

    def all_finite(self) -> bool:
        for b in range(len(self.buckets)):
            home = self.home(b)
            known = self.spill.finite(b) if home is GradientHome.SPILL else None
            if home is GradientHome.HOST and self.kept_terms[b] is not None:
                inf = self.kept_terms[b]["inf"]  # max |g|: finite exactly when every element is
                known = inf is None or bool(torch.isfinite(inf))
            if known is None:
                g = self.shard(b)
                known = clipping.all_finite(g)
                del g
                self.release_shard(b)
            if not known:
                return False
        return True

    def _accum(self, b: int) -> torch.Tensor:
        if self.home(b) is GradientHome.HOST:
            raise RuntimeError(f"GradientReducer: bucket {b}'s gradient was released to the host tier; take it back first")
        acc = self.accum[b]
        if acc is None:
            bucket = self.buckets[b]
            acc = self.accum[b] = torch.zeros(bucket.shard_numel if self.shard_gradients else bucket.numel,
                                              dtype=self.accum_dtypes[b], device=bucket.device)
        return acc

    def _accum_to_overwrite(self, b: int) -> torch.Tensor:
        """The accumulator of bucket b for a caller that writes every element of it (a direct
        collective result, or a direct stage-1 bucket once its gaps are zeroed): a fresh one is
        not zero-filled first. That fill costs a memory pass per bucket per step after
        zero_grad(set_to_none=True), measured at 2-5 % of a stage-2 step on the bench model.
        Only called while has_grads is False: a failed pass frees what it allocated here."""
        acc = self.accum[b]
        if acc is None:
            bucket = self.buckets[b]
            acc = self.accum[b] = torch.empty(bucket.shard_numel if self.shard_gradients else bucket.numel,
                                              dtype=self.accum_dtypes[b], device=bucket.device)
        return acc

    @property
    def shards(self) -> list[torch.Tensor]:
        """The owned shard of each bucket's gradient (views into the accumulators, allocated as
        zeros where no gradient exists; released ones taken back into accumulators first;
        spilled ones read back: copies, all at once)."""
        for b in range(len(self.buckets)):
            if self.home(b) is GradientHome.HOST:
                self._take_back(b)
        if self.spill is not None:
            return [self._owned_shard(b) for b in range(len(self.buckets))]
        if self.shard_gradients:
            return [self._accum(b) for b in range(len(self.buckets))]
        return [self._accum(b)[slice(*bucket.shard_range(self.rank))] for b, bucket in enumerate(self.buckets)]

    # -- one backward pass ---------------------------------------------------------------------

    def _reset_pass(self) -> None:
        # A pass that failed left bucket inputs behind: they are dropped, not pooled.
        for b, buf in enumerate(self._buffers):
            if buf is not None and buf is not self.accum[b]:
                self.pool.forget(buf)
        for entry in self._inflight:
            if entry.buf is not None:
                self.pool.forget(entry.buf)
        self._in_pass = False  # a pass with collectives is open (not under no_sync)
        self._direct = None    # this pass all-reduces in place in the accumulators (decided at its first bucket)
        self._arrived = [[False] * len(b.entries) for b in self.buckets]
        self._pass_used: list[int] = []  # usage flags of the gradients this pass took
        self._remaining = [len(b.entries) for b in self.buckets]
        self._buffers = [None] * len(self.buckets)
        self._next = 0
        self._inflight = []

    def communication_bytes(self) -> int:
        live = [t for b, t in enumerate(self._buffers) if t is not None and t is not self.accum[b]]
        live += [t for e in self._inflight for t in (e.out, e.buf)
                 if t is not None and t is not self.accum[e.bucket]]  # an accumulator is not a buffer
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live}
        return sum(storages.values())  # `out` may be a view of `buf` (gloo's per-owner reduce)

    @staticmethod
    def _gaps_of(bucket: Bucket) -> list[tuple[int, int]]:
        gaps, pos = [], 0
        for e in sorted(bucket.entries, key=lambda e: e.offset):
            if e.offset > pos:
                gaps.append((pos, e.offset))
            pos = max(pos, e.offset + e.numel)
        if pos < bucket.numel:
            gaps.append((pos, bucket.numel))
        return gaps

    def _direct_pass(self) -> bool:
        if self._direct is None:
            self._direct = (not self.shard_gradients and not self.has_grads
                            and all(d == b.dtype for d, b in zip(self.accum_dtypes, self.buckets)))
        return self._direct

    def _buffer(self, b: int) -> torch.Tensor:
        buf = self._buffers[b]
        if buf is None and self._direct_pass():
            # Every element is written this pass (gradients, zeros for absent ones, the gaps here).
            buf = self._buffers[b] = self._accum_to_overwrite(b)
            for lo, hi in self._gaps[b]:
                buf[lo:hi].zero_()
        if buf is None:
            bucket = self.buckets[b]
            # Every element is written once per pass: by its gradient, by zeros for a parameter
            # without one (_take_grad), or here for the gaps. No full-bucket memset.
            buf = self._buffers[b] = self.pool.take(bucket.numel, bucket.dtype, bucket.device)
            for lo, hi in self._gaps[b]:
                buf[lo:hi].zero_()
        return buf

    def _take_grad(self, b: int, e_index: int) -> None:
        entry = self.buckets[b].entries[e_index]
        grad = local_grad(entry.param)  # a tensor-parallel parameter's local piece (dtensor_params.py)
        region = self._buffer(b)[entry.offset:entry.offset + entry.numel]
        if grad is not None:
            if self._direct_pass() and self.world_size > 1:
                torch.mul(grad.reshape(-1), 1.0 / self.world_size, out=region)
            else:
                region.copy_(grad.reshape(-1))
            entry.param.grad = None
            self._pass_used.append(self.usage.flag(b, e_index))
        elif not self._arrived[b][e_index]:
            region.zero_()
        if not self._arrived[b][e_index]:
            self._arrived[b][e_index] = True
            self._remaining[b] -= 1

    # -- BackwardPass participant ----------------------------------------------------------------

    def begin_backward(self) -> None:
        """Nothing to set up: a pass opens with its first gradient outside no_sync."""

    def end_backward(self) -> None:
        if self._in_pass:
            self._finish_pass()

    def abandon_backward(self) -> None:
        if self._in_pass:
            self._abandon_pass()

    def on_grad(self, param: torch.nn.Parameter) -> None:
        if self.no_sync:
            self.local_pending = True
            return
        self._in_pass = True
        b, e_index = self.slot[param]
        if b < self._next:
            raise RuntimeError(
                f"zeroplus ZeRO-2: parameter of shape {tuple(param.shape)} received a second gradient after its "
                f"bucket was reduced in this backward pass (reentrant checkpointing or several backward calls "
                f"through one graph); use non-reentrant torch.utils.checkpoint or one backward per micro-step")
        self._take_grad(b, e_index)
        if not self.gated:
            self._launch_ready()

    def ready_prefix(self) -> int:
        """The number of leading buckets this rank could launch now (launched or complete; 0
        outside a pass with collectives)."""
        if not self._in_pass or self.no_sync:
            return 0
        k = self._next
        while k < len(self.buckets) and self._remaining[k] == 0:
            k += 1
        return k

    def launch_agreed(self, n: int) -> None:
        """Launch the buckets before n, which every rank has complete (n is the minimum of every
        rank's ready_prefix, so all ranks launch the same buckets at the same point)."""
        while self._in_pass and not self.no_sync and self._next < n:
            self._launch(self._next)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._remaining[self._next] == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        buf = self._buffer(b)
        if self._direct_pass():
            work = dist.all_reduce(buf, group=self.group, async_op=True)
            self._inflight.append(InFlight(b, work, buf, None))  # the accumulator: not a pooled input
            self._buffers[b] = None
            self._next = b + 1
            if self.observer is not None:
                self._retire_inputs()  # settle the older buckets, so their copies start in backward
            return
        # fp16: pre-divide (DDP and DeepSpeed do too), the sum of averaged gradients cannot
        # overflow where the sum of raw ones might. Others: 1/N is applied when accumulating.
        if self.world_size > 1 and bucket.dtype == torch.float16:
            buf.div_(self.world_size)
        # Accumulators that are zero (no gradients since zero()) take the result directly: no
        # second shard-sized output per bucket alive until the pass ends.
        direct = (self.shard_gradients and not self.has_grads and self.accum_dtypes[b] == bucket.dtype
                  and not self._spilled(b))
        if self.shard_gradients and self.owner_collectives:
            lo, hi = bucket.shard_range(self.rank)
            out = buf[lo:hi]
            work = comm.reduce_to_owners(buf, bucket.shard_numel, self.group, self.world_size)
        elif self.shard_gradients:
            out = self._accum_to_overwrite(b) if direct else torch.empty(bucket.shard_numel, dtype=bucket.dtype, device=bucket.device)
            work = comm.reduce_scatter(out, buf, self.group, async_op=True)
        else:
            out = buf
            work = dist.all_reduce(buf, group=self.group, async_op=True)
        # The input stays referenced until the work is waited on (a backend may read it late).
        self._inflight.append(InFlight(b, work, out, buf))
        self._buffers[b] = None
        self._next = b + 1
        self._retire_inputs()

    def _retire_inputs(self) -> None:
        """Keep at most MAX_INFLIGHT_INPUTS full-size bucket inputs alive: wait for older
        reduce-scatters and drop their inputs. Their outputs (1/world_size of a bucket) go into the
        accumulators at once when the pass started from no gradient (a failed pass frees them
        anyway; the observer then hears of them during backward), else they are kept and added
        only when the whole pass succeeded. Without this every bucket's full gradient would stay
        alive until backward ends: the full gradient size, transiently, which ZeRO-2/3 exist to
        avoid. (A stage-1 pass that all-reduces in place has no inputs to drop: it comes here only
        with an observer, to settle its older buckets.)"""
        live = [entry for entry in self._inflight if entry.work is not None]
        for entry in live[:max(0, len(live) - MAX_INFLIGHT_INPUTS)]:
            entry.work.wait()
            entry.work = None  # the work references the input
            if not self.has_grads:
                self._settle(entry)  # a failed pass frees the accumulators: no need to wait for the pass
                continue
            if self._spilled(entry.bucket):
                self._stage(entry)  # before the input is recycled: the result may be a view of it
            elif entry.out.untyped_storage().data_ptr() == entry.buf.untyped_storage().data_ptr():
                # Per-owner reduce: the shard is a view of the input. Into a zero accumulator
                # it goes directly, else it is kept aside until the pass succeeds.
                b = entry.bucket
                entry.out = (self._accum_to_overwrite(b).copy_(entry.out)
                             if not self.has_grads and self.accum_dtypes[b] == entry.out.dtype else entry.out.clone())
            self._recycle_input(entry)

    def _recycle_input(self, entry) -> None:
        buf, entry.buf = entry.buf, None
        self.pool.give(buf)  # pooled only if nothing (the work, a view) still references it

    def _finish_pass(self) -> None:
        try:
            for b in range(self._next, len(self.buckets)):
                for e_index in range(len(self.buckets[b].entries)):
                    if not self._arrived[b][e_index]:
                        self._take_grad(b, e_index)  # no gradient this pass: zeros, or a no_sync leftover
                self._launch(b)
            for entry in self._inflight:
                if entry.work is not None:
                    entry.work.wait()
                    entry.work = None
            # All collectives succeeded. The released gradients come back with this pass's result
            # added first, beside their home copies (an allocation each: out of memory there must
            # leave every gradient as it was, not some buckets with this pass added); then the
            # accumulators are updated.
            for entry in self._inflight:
                if not entry.settled and self.released[entry.bucket]:
                    self._sum_released(entry)
            # The spill's writes may fail (commit raises): with earlier gradients, before any
            # other bucket's changes, which a failed pass must leave as they were. (Without, a
            # failure frees every accumulator, and the spill's pass must not be committed first.)
            commit_first = self.spill is not None and self.has_grads
            if commit_first:
                for entry in self._inflight:
                    if not entry.settled and self._spilled(entry.bucket):
                        self._settle(entry)
                self.spill.commit()  # the pass's spilled gradients become the gradients
            for entry in self._inflight:
                if not entry.settled:
                    self._settle(entry)
            if self.spill is not None and not commit_first:
                self.spill.commit()
            self.usage.commit(self._pass_used)
            self.has_grads = True
            self.local_pending = False
        except BaseException:
            self._abandon_pass()
            raise
        finally:
            self._reset_pass()

    def _settle(self, entry) -> None:
        """A waited-on result into its accumulator (or the spill), its input recycled; then the
        observer hears that the shard is final for this pass (module doc)."""
        b = entry.bucket
        entry.settled = True
        if self._spilled(b):
            if not entry.staged:
                self._stage(entry)
            entry.out = None
            if entry.buf is not None:
                self._recycle_input(entry)
            return
        if self.released[b] and not entry.summed:
            self._sum_released(entry)  # (the end of a pass made every sum first)
        if entry.summed:
            # The previous passes' sum + this result: the gradient from now on, replacing the
            # observer's home copy; no allocation here (stage 1 needs no whole bucket when the
            # observer keeps it again).
            shard, entry.out = entry.out, None
            terms = _kept_terms(shard)  # before the observer takes it: nothing may fail after
            self.observer.ready(b, shard)  # (replaces its home copy)
            self._release(b, terms)
            return
        if self.observer is not None:
            self.observer.changing(b)  # a copy of the previous passes' sum is being overwritten
        scale = self._scale_of(b)
        if (entry.out is not self.accum[b] and not self.has_grads
                and self.accum_dtypes[b] == entry.out.dtype):
            # No gradient yet: the accumulator is the scaled result, no zero fill + add.
            entry.out = self._accum_to_overwrite(b).copy_(entry.out)
        if entry.out is self.accum[b]:  # the result is in an accumulator that was zero
            if scale != 1.0:
                self.accum[b].mul_(scale)  # bitwise 0 + scale * sum, as add_ gives
        else:
            self._accum(b).add_(entry.out, alpha=scale)
        entry.out = None
        if entry.buf is not None:
            self._recycle_input(entry)
        if self.observer is not None:
            shard = self.shard(b)
            terms = _kept_terms(shard)  # before the observer takes it: nothing may fail after
            self.observer.ready(b, shard)
            self._release(b, terms)

    def _release(self, b: int, terms: dict) -> None:
        """The observer holds bucket b's gradient from now on: keep its clipping terms, free the
        device accumulator (the observer's copy keeps the memory until it has read it)."""
        self.kept_terms[b] = terms
        self.accum[b] = None
        self.released[b] = True

    def _sum_released(self, entry) -> None:
        """A released bucket's gradient read back (a new device tensor) with this pass's result
        added as _settle adds it into an accumulator (the same add: the same bits; stage 1 adds
        the owned part only, the only part read), becoming entry.out. The observer's home copy
        stays the gradient until _settle takes this sum as the accumulator: a failure before
        (this allocation, a later bucket's) leaves the previous gradient in place."""
        b = entry.bucket
        value = self.observer.fetch(b)
        out = entry.out if self.shard_gradients else entry.out[slice(*self.buckets[b].shard_range(self.rank))]
        value.add_(out, alpha=self._scale_of(b))
        entry.out, entry.summed = value, True
        if entry.buf is not None:
            self._recycle_input(entry)  # the result may have been a view of it

    def _take_back(self, b: int) -> None:
        """A released gradient back into a device accumulator (the observer forgets its copy)."""
        self.accum[b] = self._whole(b, self.observer.fetch(b))
        self.released[b], self.kept_terms[b] = False, None
        self.observer.changing(b)

    def _whole(self, b: int, shard: torch.Tensor) -> torch.Tensor:
        """Bucket b's accumulator holding this gradient shard. Stage 1 keeps whole buckets: the
        shard goes into its place in a zero bucket (the other ranks' parts are never read here)."""
        if self.shard_gradients:
            return shard
        bucket = self.buckets[b]
        whole = torch.zeros(bucket.numel, dtype=shard.dtype, device=shard.device)
        whole[slice(*bucket.shard_range(self.rank))].copy_(shard)
        return whole

    def _abandon_pass(self) -> None:
        """End a pass that failed: wait for what it launched, put the accumulators back as they
        were (no gradient: freed, where results went straight into them) and forget its buffers."""
        self._drain()
        if self.observer is not None:
            if self.has_grads:
                self.observer.discard()  # copies of this pass's results; released gradients stay
            else:
                self.observer.clear()  # no gradient before this pass: every copy goes
        if self.spill is not None:
            self.spill.discard()  # the previous gradients (other files) stay
        if not self.has_grads:
            self.accum = [None] * len(self.buckets)
            self._forget_released()
        self._reset_pass()

    def _forget_released(self) -> None:
        self.released = [False] * len(self.buckets)
        self.kept_terms = [None] * len(self.buckets)

    def _drain(self) -> None:
        """Wait for every collective this pass launched, ignoring their errors (the failure that
        ended the pass is what the caller sees): one still running may write into an accumulator."""
        for entry in self._inflight:
            if entry.work is not None:
                try:
                    entry.work.wait()
                except Exception:
                    pass
                entry.work = None

    # -- outside backward ----------------------------------------------------------------------

    def flush(self) -> None:
        """Reduce gradients accumulated under no_sync (collective: every rank calls it). The
        engine closes a stale backward pass first (BackwardPass.close_stale)."""
        if self._in_pass:
            self._abandon_pass()  # a backward that raised left it open
        if self.local_pending:
            self._in_pass = True
            self._finish_pass()

    def zero(self, set_to_none: bool = True) -> None:
        """zero_grad: free the accumulators (set_to_none) or keep them as zeros."""
        if self._in_pass:
            self._abandon_pass()  # a backward that raised left it open
        if self.observer is not None:
            self.observer.clear()
        self._forget_released()  # zero: accum None (a released bucket has none) is zeros
        if self.spill is not None:
            self.spill.clear()
        if set_to_none:
            self.accum = [None] * len(self.buckets)
        else:
            for acc in self.accum:
                if acc is not None:
                    acc.zero_()
        for p in self.slot:
            p.grad = None
        self.has_grads = False
        self.local_pending = False
