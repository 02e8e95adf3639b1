"""Stage 3: parameters sharded too; gathered unit by unit around forward and backward.

ShardedParams is the parameter placement of Stage3Optimizer (the engine, engine.py, owns
gradients, the step loop and state; a placement owns where parameters live). Its helpers:

    units.py           which submodules are gather units; who owns a tied parameter
    param_gatherer.py  forward/backward hooks, all-gather + release, prefetch by recorded order
    compile_boundary.py  the gatherer's hooks opaque to torch.compile (graph breaks at units)
    materialize.py     a model on the meta device becomes real one unit at a time
    sharded_init.py    (with deferred.py) a model built under zeroplus.init_context(): shards
                       from the start, gathered back one unit at a time by materialize.py
    full_state.py      full state dicts gathered unit by unit; loading a full dict into shards
    ../offload/param_swapper.py  offload_param "nvme": the shards live in files between uses
    ../offload/host_params.py    offload_param "cpu" on CUDA: the shards live in host memory

Layout: each unit's parameters form their own buckets (keys: unit, param group, dtype,
persistent, trainable), so a unit is gathered with one all-gather per bucket and its gradients
are reduce-scattered as soon as its backward is done. Parameters with at most
param_persistence_threshold elements are "persistent": kept whole on every rank (stage-2
style: reduce-scatter, then all-gather after the step), which saves a collective per tiny
tensor; so are the parameters of persistent_modules (a module some ranks skip is then never
gathered: gather_agreement.py). Between steps every other parameter's .data is its resting view (layout.resting_view:
full shape, dtype and device, no values; this rank's slice lives in the bucket's shard); inside
forward and backward it is the full tensor. After a step only persistent buckets
are all-gathered; the others are gathered at their next use.

Parameter offload (offload_param device "nvme", docs/offload.md): every non-persistent bucket's
shard is written to this rank's parameter store as it is built and is empty between uses (so are
the module's parameters); the gatherer pins a shard for its all-gather and reads the next
predicted ones ahead. The step pins a bucket's shard before its optimizer runs when the shard is
the fp32 master itself and writes the updated shard back at publish: once, in place (fp32), or
cast from the master (mixed precision). A shard that cannot be read (before_bucket_step) is not
stepped; its error is raised by end_step after the step's last collective.
With offload_param "cpu" or "nvme" on CUDA training (host_params.py, the same interface) the
shards live in host memory or its swapper's files, the master is never the shard
(keeps_master_apart: a host-tier or device fp32 copy) and publish casts it into the host shard;
gradients are spilled only with "nvme" and offload_optimizer (spills_gradients: the host tier's
step reads them on the host); with "cpu" and offload_optimizer the host tier holds them; without
offload_optimizer they stay on the device.

Reads the engine's public attributes (process_group, rank, world_size, compute_dtype, module,
param_groups, buckets, masters, backward_pass); called by the engine only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from . import materialize, sharded_init
from ..bucket_optimizer import MasterHome
from ...offload import make_grad_spill, make_param_store
from .heap import return_freed_memory
from ..layout import plan_segments
from .gather_agreement import GatherAgreement
from .param_gatherer import ParameterGatherer
from ..policies import Stage3Policy
from .units import build_units, kept_whole

STEP_READ_AHEAD = 2  # offloaded fp32 masters read ahead of the bucket stepping (offload_param nvme)

_NO_CAP = 1 << 60


class ShardedParams:
    def __init__(self, engine, policy: Stage3Policy):
        self.engine = engine
        self.policy = policy
        self.units = []
        self.frozen_buckets = []  # frozen parameters: sharded and gathered too, never stepped
        self.gatherer: ParameterGatherer | None = None  # made by attach()
        self.target_device = None
        self.param_store = None       # offload_param "nvme": the ParamSwapper (made by plan_layout)
        self._store_prepared = None
        self._step_errors: list[OSError] = []
        self.kept_whole: set[int] = set()  # ids of parameters of persistent_modules (check_module)

    def use_param_store(self, prepared) -> None:
        """zeroplus.offload.prepare_param_store's result (before plan_layout)."""
        self._store_prepared = prepared

    def check_module(self, name: str, trainable) -> None:
        engine = self.engine
        if not isinstance(engine.module, torch.nn.Module):
            raise TypeError(f"{name}: ZeRO stage 3 needs the model (module=), got {type(engine.module).__name__}; "
                            f"use zeroplus.initialize(model, ..., stage=3)")
        self.units = build_units(engine.module, self.policy.unit_classes)
        self.kept_whole = kept_whole(engine.module, self.policy.persistent_modules, name)
        in_module = {id(p) for p in engine.module.parameters()}
        for g in engine.param_groups:
            for p in g["params"]:
                if id(p) not in in_module:
                    raise ValueError(f"{name}: a parameter of shape {tuple(p.shape)} in params is not a parameter "
                                     f"of module; at stage 3 every optimized parameter must belong to the model")
        sharded_init.check_group(engine.module, engine.process_group, name)
        self.target_device = materialize.target_device(engine.module, engine.process_group)
        materialize.check_initializable(engine.module, self.policy.param_init_fn)

    def dtype_of(self, p: torch.Tensor) -> torch.dtype:
        compute = self.engine.compute_dtype
        return compute if (compute is not None and p.is_floating_point()) else p.dtype

    def plan_layout(self, trainable, reduce_bucket_elems: int):
        engine = self.engine
        group_of = {id(p): gi for gi, g in enumerate(engine.param_groups) for p in g["params"]}
        registration = {id(p): i for i, p in enumerate(engine.module.parameters())}
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
                persistent = id(p) in self.kept_whole or p.numel() <= self.policy.param_persistence_threshold
                key = (u.index, g, self.dtype_of(p), self.target_device, persistent, train)
                items.append((g, p, key))
        trainable_buckets, frozen = [], []
        for b, key in plan_segments(items, engine.world_size, _NO_CAP, self.dtype_of):
            b.unit, b.persistent, b.trainable = key[0], key[4], key[5]
            b.device = self.target_device
            (trainable_buckets if b.trainable else frozen).append(b)
        for i, b in enumerate(trainable_buckets):
            b.index = i
        self.frozen_buckets = frozen
        self.param_store = make_param_store(self._store_prepared,
                                            [b for b in trainable_buckets + frozen if not b.persistent])
        return trainable_buckets

    def build_flat_buffers(self) -> list[torch.Tensor]:
        """Unit by unit (a meta model is materialised one unit at a time): rank 0's values are
        broadcast, each rank keeps its shard (and, with mixed precision or fp32, its fp32
        master), and the full copy is dropped before the next unit."""
        engine = self.engine
        src = comm.group_src_rank(engine.process_group, 0)
        masters: dict[int, torch.Tensor] = {}
        by_unit: dict[int, list] = {}
        for b in list(engine.buckets) + self.frozen_buckets:
            by_unit.setdefault(b.unit, []).append(b)
        materializer = materialize.Materializer(engine.module, self.units, self.target_device,
                                                self.policy.param_init_fn)
        for u in self.units:
            materializer.materialize_unit(u.index)
            for b in by_unit.get(u.index, []):
                staging = (torch.float32 if (engine.compute_dtype is not None and b.dtype.is_floating_point)
                           else b.dtype)
                flat = torch.zeros(b.numel, dtype=staging, device=b.device)
                for e in b.entries:
                    flat[e.offset:e.offset + e.numel].copy_(e.param.detach().reshape(-1))
                dist.broadcast(flat, src=src, group=engine.process_group)
                lo, hi = b.shard_range(engine.rank)
                if b.persistent:
                    b.flat = flat if flat.dtype == b.dtype else flat.to(b.dtype)
                    b.show_full()
                    master_src = flat[lo:hi]
                    own = b.flat[lo:hi]
                else:
                    b.shard = flat[lo:hi].to(b.dtype, copy=True)
                    master_src = flat[lo:hi]
                    own = b.shard
                for e in b.entries:
                    e.param._zeroplus_managed = True
                if b.trainable:
                    apart = (not b.persistent and self.param_store is not None
                             and self.param_store.keeps_master_apart)  # offload_param "cpu" on CUDA
                    if own.dtype == torch.float32 and not apart:
                        masters[id(b)] = own  # fp32: the master is this rank's slice itself
                    else:
                        masters[id(b)] = master_src.to(torch.float32, copy=True)
                if not b.persistent:
                    if self.param_store is not None:
                        self.param_store.put_initial(b, b.shard)  # b.shard is empty from now on
                    b.show_resting()
                del flat, master_src, own
            return_freed_memory()
        materializer.finish()
        if self.param_store is not None:
            self.param_store.finish_initial()
        return [masters[id(b)] for b in engine.buckets]

    def sync_unmanaged(self, trainable) -> None:
        """Buffers take rank 0's values (frozen parameters are sharded like the others)."""
        engine = self.engine
        src = comm.group_src_rank(engine.process_group, 0)
        for buf in engine.module.buffers():
            dist.broadcast(buf, src=src, group=engine.process_group)

    def attach(self) -> None:
        """After the engine's reducer exists: the gatherer joins the backward pass after it."""
        engine, policy = self.engine, self.policy
        if self.param_store is not None and self.param_store.spills_gradients:
            # Gradients of offloaded buckets are spilled beside their parameter records.
            spilled = {i: (engine.reducer.accum_dtypes[i], b.shard_numel) for i, b in enumerate(engine.buckets)
                       if self.param_store.offloads(b)}
            engine.reducer.attach_spill(make_grad_spill(self.param_store, spilled, self.target_device))
        self.gatherer = ParameterGatherer(self.units, list(engine.buckets) + self.frozen_buckets,
                                          engine.process_group, engine.rank, engine.backward_pass,
                                          prefetch_elems=policy.prefetch_bucket_size,
                                          max_live_elems=policy.max_live_parameters,
                                          reshard_after_forward=policy.reshard_after_forward,
                                          shard_store=self.param_store)
        # Every unit gather is agreed across ranks first: rank-divergent execution fails fast.
        largest = [0] * len(self.units)
        for b in list(engine.buckets) + self.frozen_buckets:
            if not b.persistent:
                largest[b.unit] = max([largest[b.unit]] + [e.numel for e in b.entries])
        self.gatherer.agreement = GatherAgreement(self.units, largest, engine.process_group, engine.rank,
                                                  engine.world_size, self.target_device,
                                                  policy.param_persistence_threshold, reducer=engine.reducer)
        # The reducer's launches wait for those agreements (grad_reducer.py, `gated`).
        engine.reducer.gated = engine.world_size > 1

    def before_publish(self) -> None:
        # The shards change now. A unit still gathered (held by a forward whose backward never
        # came, with reshard_after_forward=False) would keep the old values: release it, so the
        # next use gathers the new ones.
        self.gatherer.release_all()

    def _master_is_offloaded_shard(self, i: int) -> bool:
        return self.engine.bucket_optimizers[i].master_home is MasterHome.PARAM_RECORD

    def before_bucket_step(self, i: int) -> bool:
        """Makes bucket i's master resident where it is an offloaded shard (fp32); False: it
        could not be read, the bucket must not step (the error is raised by end_step)."""
        if not self._master_is_offloaded_shard(i):
            return True
        b = self.engine.buckets[i]
        try:
            self.param_store.pin(b, update=True)  # the step changes it in place
        except OSError as e:
            self._step_errors.append(e)
            return False
        # The next buckets' masters are read while this one steps (a few ahead: their optimizer
        # records and gradients are read in the same order, through the same disk).
        buckets = self.engine.buckets
        self.param_store.read_ahead((buckets[j] for j in self._after(i) if self._master_is_offloaded_shard(j)),
                                    depth=STEP_READ_AHEAD)
        self.engine.bucket_optimizers[i].point_master(b.shard)
        return True

    def _after(self, i: int) -> list[int]:
        """The buckets the step visits after bucket i (the engine's order of this step)."""
        order = self.engine.step_order
        return order[order.index(i) + 1:]

    def gradient_shard(self, i: int, reducer):
        """Bucket i's gradient shard for its step, or None: a spilled one could not be read (the
        error is raised by end_step, after the step's last collective; the bucket does not step,
        and a master pinned for it is released unchanged)."""
        try:
            shard = reducer.shard(i)
            # The next buckets' spilled gradients are read while this one steps.
            reducer.read_ahead_shards(self._after(i), STEP_READ_AHEAD)
            return shard
        except OSError as e:
            self._step_errors.append(e)
            b = self.engine.buckets[i]
            if self._master_is_offloaded_shard(i) and self.param_store.pinned(b):
                self.param_store.unpin(b)
                self.engine.bucket_optimizers[i].point_master(b.shard)
            return None

    def end_step(self) -> None:
        """Waits for the step's shard writes; raises the step's parameter-store errors."""
        errors, self._step_errors = self._step_errors, []
        if self.param_store is not None:
            # A step that raised between before_bucket_step and publish left a master pinned:
            # released unchanged (its record on disk is still the current one).
            for i, b in enumerate(self.engine.buckets):
                if self._master_is_offloaded_shard(i) and self.param_store.pinned(b):
                    self.param_store.unpin(b)
                    self.engine.bucket_optimizers[i].point_master(b.shard)
            try:
                self.param_store.end_step()
            except OSError as e:
                errors.append(e)
        if errors:
            first = errors[0]
            more = "".join(f"\n  also: {e.strerror}" for e in errors[1:])
            raise type(first)(first.errno, f"{first.strerror}{more}", first.filename)

    def publish(self, i: int):
        """The new master into this rank's shard; only persistent buckets are all-gathered now
        (the others at their next use)."""
        engine = self.engine
        b, master = engine.buckets[i], engine.masters[i]
        if self.param_store is not None and self.param_store.offloads(b):
            if engine.bucket_optimizers[i].master_home is not MasterHome.PARAM_RECORD:
                self.param_store.write(b, master, defer=True)  # mixed precision: the master cast into a record
            elif self.param_store.pinned(b):  # fp32: the master is the pinned shard, written once
                self.param_store.write(b, None, defer=True)  # at end_step: the step's reads first
                self.param_store.unpin(b)
                engine.bucket_optimizers[i].point_master(b.shard)  # the segments let go of the buffer
            return None  # (an fp32 master not pinned was not stepped: its record is current)
        lo, hi = b.shard_range(engine.rank)
        own = b.flat[lo:hi] if b.persistent else b.shard
        engine.write_master_into(i, own)
        if b.persistent:
            return comm.all_gather(b.flat, comm.gather_input(own, engine.process_group), engine.process_group,
                                   async_op=True)
        return None

    def add_memory(self, out: dict[str, int]) -> dict[str, int]:
        # Resting parameters hold nothing (layout.resting_view): their values are these shards
        # (emptied while a parameter store holds them), so memory_report counts them as parameters.
        out["parameter_shards"] = sum(b.shard.numel() * b.shard.element_size()
                                      for b in list(self.engine.buckets) + self.frozen_buckets if b.shard is not None)
        out["gathered_parameters"] = self.gatherer.gathered_bytes()
        out["pooled_buffers"] += self.gatherer.pool.pooled_bytes
        out["peak_gathered_parameters"] = self.gatherer.peak_live_elems * max(
            (b.shard.element_size() for b in self.engine.buckets if b.shard is not None), default=4)
        if self.param_store is not None:
            out.update(offload_param_buffers=self.param_store.buffer_bytes,
                       offload_param_peak_buffers=self.param_store.peak_buffer_bytes,
                       offload_param_disk=self.param_store.disk_bytes())
        return out
