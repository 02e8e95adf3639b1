"""Stage-2 gradient path: bucket, reduce-scatter during backward, keep only the owned shard.

Threading and ordering contract:
  * Hooks run on the autograd thread. Each managed parameter has a post-accumulate-grad hook: it
    copies the finished gradient into its bucket's communication buffer and frees it
    (`p.grad = None`), so a full gradient lives only until its bucket is sent.
  * Buckets are launched strictly in bucket order (DDP's rule): bucket i is sent only after
    buckets 0..i-1, so every rank issues the same collectives in the same order even when
    gradients arrive in a different order on different ranks. A bucket whose gradients are all in
    is sent asynchronously while backward continues.
  * A callback queued on the autograd engine runs when backward ends: it sends the buckets still
    open (a parameter that got no gradient contributes zeros, as with DDP's
    find_unused_parameters), waits for every reduce-scatter and adds the owned shards into the
    persistent accumulators. So after backward returns, `accum[b]` holds this rank's shard of the
    averaged gradient, summed over every backward since the last zero().
  * Under no_sync() the hooks leave gradients in `p.grad` (local accumulation, as DDP). The next
    backward outside no_sync sends the accumulated value; `flush()` sends what is pending when a
    step comes without such a backward.
Every rank must run the same backward passes (as with DDP); a collective failure raises from
backward (or flush) and leaves the accumulators as they were before that pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable

from . import comm
from .layout import Bucket

# Full-size bucket inputs allowed in flight at once (overlap needs two: one on the wire while the
# next fills).
MAX_INFLIGHT_INPUTS = 2


class GradientReducer:
    def __init__(self, buckets: list[Bucket], group, world_size: int, rank: int, accum_dtype: torch.dtype | None,
                 shard_gradients: bool = True):
        self.buckets = buckets
        self.group = group
        self.world_size = world_size
        # False is ZeRO stage 1 with mixed precision: buckets are all-reduced and every rank keeps
        # the full averaged gradient (the optimizer still steps only the owned shard).
        self.shard_gradients = shard_gradients
        self.slot = {}
        for b in buckets:
            for e_index, e in enumerate(b.entries):
                self.slot[e.param] = (b.index, e_index)
        # Persistent gradients (the "2Ψ/N" of the ZeRO formula at stage 2): this rank's slice of
        # every bucket, in the accumulation dtype; the whole bucket at stage 1.
        self.accum = [torch.zeros(b.shard_numel if shard_gradients else b.numel, dtype=accum_dtype or b.dtype,
                                  device=b.device) for b in buckets]
        # The owned shard of each bucket's gradient (views into accum).
        self.shards = (self.accum if shard_gradients else
                       [a[slice(*b.shard_range(rank))] for a, b in zip(self.accum, buckets)])
        self.no_sync = False
        self.has_grads = False      # something was reduced since the last zero()
        self.local_pending = False  # gradients accumulated under no_sync, not reduced yet
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.slot]
        self._reset_pass()

    # -- one backward pass ---------------------------------------------------------------------

    def _reset_pass(self) -> None:
        self._in_pass = False
        self._arrived = [[False] * len(b.entries) for b in self.buckets]
        self._remaining = [len(b.entries) for b in self.buckets]
        self._buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._next = 0
        self._inflight = []

    def communication_bytes(self) -> int:
        live = [t for t in self._buffers if t is not None]
        live += [t for _, _, out, buf in self._inflight for t in (out, buf) if t is not None]
        return sum(t.numel() * t.element_size() for t in live)

    def _buffer(self, b: int) -> torch.Tensor:
        buf = self._buffers[b]
        if buf is None:
            bucket = self.buckets[b]
            buf = self._buffers[b] = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        return buf

    def _take_grad(self, b: int, e_index: int) -> None:
        entry = self.buckets[b].entries[e_index]
        grad = entry.param.grad
        if grad is not None:
            self._buffer(b)[entry.offset:entry.offset + entry.numel].copy_(grad.reshape(-1))
            entry.param.grad = None
        if not self._arrived[b][e_index]:
            self._arrived[b][e_index] = True
            self._remaining[b] -= 1

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if self.no_sync:
            self.local_pending = True
            return
        if not self._in_pass:
            self._in_pass = True
            Variable._execution_engine.queue_callback(self._finish_pass)
        b, e_index = self.slot[param]
        if b < self._next:
            raise RuntimeError(
                f"zeroplus ZeRO-2: parameter of shape {tuple(param.shape)} received a second gradient after its "
                f"bucket was reduced in this backward pass (reentrant checkpointing or several backward calls "
                f"through one graph); use non-reentrant torch.utils.checkpoint or one backward per micro-step")
        self._take_grad(b, e_index)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._remaining[self._next] == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        buf = self._buffer(b)
        # Pre-divide (DDP and DeepSpeed do too): the sum of averaged gradients cannot overflow
        # fp16 where the sum of raw ones might.
        if self.world_size > 1:
            buf.div_(self.world_size)
        if self.shard_gradients:
            out = torch.empty(bucket.shard_numel, dtype=bucket.dtype, device=bucket.device)
            work = comm.reduce_scatter(out, buf, self.group, async_op=True)
        else:
            out = buf
            work = dist.all_reduce(buf, group=self.group, async_op=True)
        # The input stays referenced until the work is waited on (a backend may read it late).
        self._inflight.append([b, work, out, buf])
        self._buffers[b] = None
        self._next = b + 1
        self._retire_inputs()

    def _retire_inputs(self) -> None:
        """Keep at most MAX_INFLIGHT_INPUTS full-size bucket inputs alive: wait for older
        reduce-scatters and drop their inputs. Their outputs (1/world_size of a bucket) are kept
        and added to the accumulators only when the whole pass succeeded. Without this every
        bucket's full gradient would stay alive until backward ends: the full gradient size,
        transiently, which ZeRO-2/3 exist to avoid."""
        live = [entry for entry in self._inflight if entry[3] is not None]
        for entry in live[:max(0, len(live) - MAX_INFLIGHT_INPUTS)]:
            entry[1].wait()
            entry[3] = None

    def _finish_pass(self) -> None:
        try:
            for b in range(self._next, len(self.buckets)):
                for e_index in range(len(self.buckets[b].entries)):
                    if not self._arrived[b][e_index]:
                        self._take_grad(b, e_index)  # no gradient this pass: zeros, or a no_sync leftover
                self._launch(b)
            results = []
            for b, work, out, _ in self._inflight:
                work.wait()
                results.append((b, out))
            for b, out in results:  # all collectives succeeded: now update the accumulators
                self.accum[b].add_(out)
            self.has_grads = True
            self.local_pending = False
        finally:
            self._reset_pass()

    # -- outside backward ----------------------------------------------------------------------

    def flush(self) -> None:
        """Reduce gradients accumulated under no_sync (collective: every rank calls it)."""
        if self.local_pending and not self._in_pass:
            self._in_pass = True
            self._finish_pass()

    def zero(self) -> None:
        for acc in self.accum:
            acc.zero_()
        for p in self.slot:
            p.grad = None
        self.has_grads = False
        self.local_pending = False

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
