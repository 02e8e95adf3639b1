"""ZeRO stage 3: parameters sharded too; gathered unit by unit around forward and backward.

Stage3Optimizer is what zeroplus.initialize(..., stage=3) returns. It is the stage-2 engine
(gradient reducer, loss scaler, clipping, state dicts, inner optimizer over flat fp32 master
shards) with a different layout and two more units:

    units.py           which submodules are gather units; who owns a tied parameter
    param_gatherer.py  forward/backward hooks, all-gather + release, prefetch by recorded order
    materialize.py     a model on the meta device becomes real one unit at a time
    sharded_init.py    (with deferred.py) a model built under zeroplus.init_context(): shards
                       from the start, gathered back one unit at a time by materialize.py
    full_state.py      full state dicts gathered unit by unit; loading a full dict into shards
    this file          layout (one bucket per unit and kind), building the shards, the post-step
                       write-back

Layout: each unit's parameters form their own buckets (keys: unit, param group, dtype,
persistent, trainable), so a unit is gathered with one all-gather per bucket and its gradients
are reduce-scattered as soon as its backward is done. Parameters with at most
param_persistence_threshold elements are "persistent": kept whole on every rank (stage-2
style: reduce-scatter, then all-gather after the step), which saves a collective per tiny
tensor. Between steps every other parameter's .data is this rank's slice of it (1-D, possibly
empty); inside forward and backward it is the full tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm, materialize, sharded_init
from .heap import return_freed_memory
from .layout import plan_segments
from .memory import optimizer_bytes
from .param_gatherer import ParameterGatherer
from .policies import EngineOptions
from .stage2 import Stage2Optimizer
from .units import build_units

_NO_CAP = 1 << 60


class Stage3Optimizer(Stage2Optimizer):
    stage = 3

    def __init__(self, params, optimizer_class, *, options: EngineOptions | None = None, module=None, **kwargs):
        name = type(self).__name__
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{name}: ZeRO stage 3 needs the model (module=), got {type(module).__name__}; use "
                            f"zeroplus.initialize(model, ..., stage=3)")
        options = EngineOptions() if options is None else options
        if not isinstance(options, EngineOptions):
            raise TypeError(f"{name}: options must be a zeroplus.zero.EngineOptions, got {type(options).__name__}")
        policy = options.stage3
        self._prefetch_elems = policy.prefetch_bucket_size
        self._max_live = policy.max_live_parameters
        self._persist_threshold = policy.param_persistence_threshold
        self._reshard_after_forward = policy.reshard_after_forward
        self._param_init_fn = policy.param_init_fn
        self._unit_classes = policy.unit_classes
        self.frozen_buckets = []
        self.gatherer = None
        super().__init__(params, optimizer_class, options=options, module=module, **kwargs)

    # -- construction --------------------------------------------------------------------------

    def _check_module(self, name: str, trainable) -> None:
        self.units = build_units(self.module, self._unit_classes)
        in_module = {id(p) for p in self.module.parameters()}
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) not in in_module:
                    raise ValueError(f"{name}: a parameter of shape {tuple(p.shape)} in params is not a parameter "
                                     f"of module; at stage 3 every optimized parameter must belong to the model")
        sharded_init.check_group(self.module, self.process_group, name)
        self._target_device = materialize.target_device(self.module, self.process_group)
        materialize.check_initializable(self.module, self._param_init_fn)

    def _dtype_of(self, p: torch.Tensor) -> torch.dtype:
        return self.compute_dtype if (self.compute_dtype is not None and p.is_floating_point()) else p.dtype

    def _plan_layout(self, trainable, reduce_bucket_elems: int):
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        registration = {id(p): i for i, p in enumerate(self.module.parameters())}
        # Gradients become ready roughly in reverse registration order, so units are laid out by
        # the reverse of where their parameters were registered (a positional embedding owned by
        # the root unit is reduced together with the embedding, not first).
        ordered_units = sorted((u for u in self.units if u.owned),
                               key=lambda u: min(registration[id(p)] for p in u.owned), reverse=True)
        items = []
        for u in ordered_units:
            for p in reversed(u.owned):
                g = group_of.get(id(p), -1)
                train = g >= 0 and p.requires_grad
                persistent = p.numel() <= self._persist_threshold
                key = (u.index, g, self._dtype_of(p), self._target_device, persistent, train)
                items.append((g, p, key))
        trainable_buckets, frozen = [], []
        for b, key in plan_segments(items, self.world_size, _NO_CAP, self._dtype_of):
            b.unit, b.persistent, b.trainable = key[0], key[4], key[5]
            b.device = self._target_device
            (trainable_buckets if b.trainable else frozen).append(b)
        for i, b in enumerate(trainable_buckets):
            b.index = i
        self.frozen_buckets = frozen
        return trainable_buckets

    def _build_flat_buffers(self) -> list[torch.Tensor]:
        """Unit by unit (a meta model is materialised one unit at a time): rank 0's values are
        broadcast, each rank keeps its shard (and, with mixed precision or fp32, its fp32
        master), and the full copy is dropped before the next unit."""
        src = comm.group_src_rank(self.process_group, 0)
        masters: dict[int, torch.Tensor] = {}
        by_unit: dict[int, list] = {}
        for b in list(self.buckets) + self.frozen_buckets:
            by_unit.setdefault(b.unit, []).append(b)
        materializer = materialize.Materializer(self.module, self.units, self._target_device, self._param_init_fn)
        for u in self.units:
            materializer.materialize_unit(u.index)
            for b in by_unit.get(u.index, []):
                staging = torch.float32 if (self.compute_dtype is not None and b.dtype.is_floating_point) else b.dtype
                flat = torch.zeros(b.numel, dtype=staging, device=b.device)
                for e in b.entries:
                    flat[e.offset:e.offset + e.numel].copy_(e.param.detach().reshape(-1))
                dist.broadcast(flat, src=src, group=self.process_group)
                lo, hi = b.shard_range(self.rank)
                if b.persistent:
                    b.flat = flat if flat.dtype == b.dtype else flat.to(b.dtype)
                    b.show_full()
                    master_src = flat[lo:hi]
                    own = b.flat[lo:hi]
                else:
                    b.shard = flat[lo:hi].to(b.dtype, copy=True)
                    b.show_shard(self.rank)
                    master_src = flat[lo:hi]
                    own = b.shard
                for e in b.entries:
                    e.param._zeroplus_managed = True
                if b.trainable:
                    if own.dtype == torch.float32:
                        masters[id(b)] = own  # fp32: the master is this rank's slice itself
                    else:
                        masters[id(b)] = master_src.to(torch.float32, copy=True)
                del flat, master_src, own
            return_freed_memory()
        materializer.finish()
        return [masters[id(b)] for b in self.buckets]

    def _sync_unmanaged(self, trainable) -> None:
        """Buffers take rank 0's values (frozen parameters are sharded like the others)."""
        src = comm.group_src_rank(self.process_group, 0)
        for buf in self.module.buffers():
            dist.broadcast(buf, src=src, group=self.process_group)

    def _finish_construction(self) -> None:
        self.gatherer = ParameterGatherer(self.units, list(self.buckets) + self.frozen_buckets, self.process_group,
                                          self.rank, self.backward_pass, prefetch_elems=self._prefetch_elems,
                                          max_live_elems=self._max_live,
                                          reshard_after_forward=self._reshard_after_forward)
        super()._finish_construction()

    # -- step ----------------------------------------------------------------------------------

    def _before_publish(self) -> None:
        # The shards change now. A unit still gathered (held by a forward whose backward never
        # came, with reshard_after_forward=False) would keep the old values: release it, so the
        # next use gathers the new ones.
        self.gatherer.release_all()

    def _publish(self, i: int):
        """The new master into this rank's shard; only persistent buckets are all-gathered now
        (the others at their next use)."""
        b, master = self.buckets[i], self.masters[i]
        lo, hi = b.shard_range(self.rank)
        own = b.flat[lo:hi] if b.persistent else b.shard
        if master.data_ptr() != own.data_ptr():
            own.copy_(master)
        if b.persistent:
            return comm.all_gather(b.flat, own.clone(), self.process_group, async_op=True)
        return None

    def memory_bytes(self) -> dict[str, int]:
        out = optimizer_bytes(self)
        out["gathered_parameters"] = self.gatherer.gathered_bytes()
        out["pooled_buffers"] += self.gatherer.pool.pooled_bytes
        out["peak_gathered_parameters"] = self.gatherer.peak_live_elems * max(
            (b.shard.element_size() for b in self.buckets if b.shard is not None), default=4)
        return out
