"""Gradients of parameters that no param group names: averaged across ranks, as DDP does.

A user's optimizer may leave trainable parameters out (requires_grad=True, in no group): the
engine never steps them and does not flatten their gradients into its buckets. Under DDP their
`.grad` is still the average over ranks (DDP reduces every parameter that requires a gradient),
and code that reads it (a hand-written update, a second optimizer stepping them locally) relies
on every rank seeing the same value; a local gradient would let the ranks' copies drift apart.

This participant of the engine's BackwardPass (backward_pass.py; attached last) averages them at
the end of every backward outside no_sync(): one all-reduce over the data-parallel group of a
flat fp32 buffer holding each such parameter's `.grad` (zeros where a rank has none) and one
flag per parameter; a parameter no rank has a gradient for keeps `.grad = None`. Under
no_sync() gradients accumulate locally, and the next synchronised backward averages the sum, as
DDP's does. Their `.grad` is left to the user's zero_grad (the engine's opt.zero_grad clears only
the groups' parameters, as torch's optimizer does; model.zero_grad() clears them too).

Threading: on_grad and end_backward run on the autograd thread (BackwardPass's contract).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.tensor

from .dtensor_params import local


class UnoptimizedGrads:
    def __init__(self, params, shapes: dict, reducer, process_group, world_size: int):
        """shapes: id(param) -> full (local, for a tensor-parallel one) shape of stage-3 frozen
        parameters (their gradient has the full shape; the engine reads shapes from its buckets,
        never from a parameter between uses)."""
        self.params = list(params)
        self.shapes = [shapes.get(id(p), local(p).shape) for p in self.params]
        self.reducer = reducer  # its no_sync flag says whether this backward synchronises
        self.process_group = process_group
        self.world_size = world_size

    @staticmethod
    def left_out(module, param_groups) -> list:
        """The module's parameters that require a gradient and are in no group."""
        if module is None:
            return []
        grouped = {id(p) for g in param_groups for p in g["params"]}
        return [p for p in module.parameters() if p.requires_grad and id(p) not in grouped]

    def on_grad(self, param) -> None:
        """Nothing per gradient: the average is taken once, at the end of the backward."""

    def begin_backward(self) -> None:
        pass

    def abandon_backward(self) -> None:
        pass  # nothing was changed before end_backward

    @torch.no_grad()
    def end_backward(self) -> None:
        if not self.params or self.reducer.no_sync:
            return
        grads = [None if p.grad is None else local(p.grad) for p in self.params]
        device = next((g.device for g in grads if g is not None), local(self.params[0]).device)
        numels = [shape.numel() for shape in self.shapes]
        flat = torch.zeros(sum(numels) + len(self.params), dtype=torch.float32, device=device)
        offset = 0
        for i, (g, n) in enumerate(zip(grads, numels)):
            if g is not None:
                flat[offset:offset + n].copy_(g.reshape(-1))
                flat[sum(numels) + i] = 1.0
            offset += n
        dist.all_reduce(flat, group=self.process_group)
        used = (flat[sum(numels):] > 0).tolist()
        offset = 0
        for p, g, n, shape, u in zip(self.params, grads, numels, self.shapes, used):
            if u:
                average = (flat[offset:offset + n] / self.world_size).view(shape)
                if g is not None:
                    g.copy_(average)
                elif not isinstance(p, torch.distributed.tensor.DTensor):  # (a DTensor's would need its placements)
                    p.grad = average.to(local(p).dtype)
            offset += n
