"""Stages 1 and 2: every rank holds every trainable parameter whole.

ReplicatedParams is the parameter placement of Stage1Optimizer and Stage2Optimizer (the engine,
engine.py, owns gradients, the step loop and state; a placement owns where parameters live).
Buckets are planned by size (layout.plan_buckets); each bucket's flat buffer holds the whole
parameters and every parameter's .data is a view into it; after each bucket's step the new
values of this rank's shard are all-gathered into the flat buffer (overlapping the next
bucket's step). Frozen parameters and buffers take rank 0's values, as DDP does. Tensor-parallel (DTensor)
parameters are their local tensors here (dtensor_params.py): the collectives run over the
data-parallel group, whose ranks hold the same piece.

Reads the engine's public attributes (process_group, rank, world_size, compute_dtype, module,
param_groups, buckets, masters, reducer); called by the engine only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm
from .dtensor_params import local, show_local
from .layout import plan_buckets


class ReplicatedParams:
    frozen_buckets = ()  # frozen parameters are not flattened at stages 1-2
    gatherer = None            # nothing is ever gathered
    target_device = None       # parameters stay where the user put them

    def __init__(self, engine):
        self.engine = engine

    def check_module(self, name: str, trainable) -> None:
        """Nothing beyond the engine's checks: stages 1-2 work with or without the module."""

    def dtype_of(self, p: torch.Tensor) -> torch.dtype:
        return self.engine.compute_dtype or p.dtype

    def plan_layout(self, trainable, reduce_bucket_elems: int):
        return plan_buckets(trainable, self.engine.world_size, reduce_bucket_elems, self.dtype_of)

    def build_flat_buffers(self) -> list[torch.Tensor]:
        """Flat buffers for the parameters (rank 0's values, broadcast) and this rank's fp32 masters.
        With mixed precision the master starts from the full-precision value, not the rounded one."""
        engine = self.engine
        src = comm.group_src_rank(engine.process_group, 0)
        masters = []
        for b in engine.buckets:
            staging_dtype = torch.float32 if engine.compute_dtype is not None else b.dtype
            flat = torch.zeros(b.numel, dtype=staging_dtype, device=b.device)
            for e in b.entries:
                flat[e.offset:e.offset + e.numel].copy_(local(e.param).detach().reshape(-1))
            dist.broadcast(flat, src=src, group=engine.process_group)
            lo, hi = b.shard_range(engine.rank)
            if engine.compute_dtype is not None or b.dtype != torch.float32:
                master = flat[lo:hi].to(torch.float32, copy=True)
                flat = flat.to(b.dtype)
            else:
                master = flat[lo:hi]  # fp32 training: the master IS this rank's slice of the parameters
            b.flat = flat
            b.show_full()
            for e in b.entries:
                e.param._zeroplus_managed = True
            masters.append(master)
        return masters

    def sync_unmanaged(self, trainable) -> None:
        """Frozen parameters and (with a module) buffers: cast, then take rank 0's values, as DDP does."""
        engine = self.engine
        seen = {id(p) for grp in trainable for p in grp}
        frozen = []
        candidates = [p for g in engine.param_groups for p in g["params"]]
        if engine.module is not None:
            candidates += list(engine.module.parameters())
        for p in candidates:
            if id(p) not in seen:
                seen.add(id(p))
                frozen.append(p)
        src = comm.group_src_rank(engine.process_group, 0)
        for p in frozen:  # a tensor-parallel one: its local piece, from the data-parallel rank 0
            if engine.compute_dtype is not None and p.is_floating_point():
                show_local(p, local(p).detach().to(engine.compute_dtype))
            dist.broadcast(local(p).detach(), src=src, group=engine.process_group)
        if engine.module is not None:
            for buf in engine.module.buffers():
                dist.broadcast(local(buf), src=src, group=engine.process_group)

    def attach(self) -> None:
        """After the engine's reducer and backward pass exist: nothing to add."""

    def before_publish(self) -> None:
        """Before any parameter changes: nothing is gathered, nothing to release."""

    def before_bucket_step(self, i: int) -> bool:
        return True  # masters are in memory (or in the optimizer store, which fetch handles)

    def end_step(self) -> None:
        pass

    def gradient_shard(self, i: int, reducer):
        return reducer.shard(i)

    def publish(self, i: int):
        """Bucket i's new master values into its parameters on every rank: the all-gather's work."""
        engine = self.engine
        b = engine.buckets[i]
        lo, hi = b.shard_range(engine.rank)
        shard = b.flat[lo:hi]
        engine.write_master_into(i, shard)
        if engine.reducer.owner_collectives:  # gloo, 2 ranks: in place, one broadcast per owner
            return comm.broadcast_from_owners(b.flat, b.shard_numel, engine.process_group, engine.world_size)
        return comm.all_gather(b.flat, comm.gather_input(shard, engine.process_group), engine.process_group,
                               async_op=True)

    def add_memory(self, out: dict[str, int]) -> dict[str, int]:
        return out
