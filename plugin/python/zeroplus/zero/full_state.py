"""Model state of the flat-bucket engines (stages 2 and 3) in the user's own format.

full_state_dict(model): what model.state_dict() returns on the unsharded model (same keys, tied
parameters under every name, full shapes), gathered unit by unit so the peak is one unit plus the
output. Collective: every rank calls it.

model.load_state_dict(full): works on a stage-3 model, whose parameters hold no values between
steps (layout.resting_view; this rank's slice is in its bucket's shard): a load pre-hook on each
module copies this rank's slice of a full-shape entry into the shard, writes the fp32 master
slice from the full-precision value, and hands torch the parameter itself as the entry, so
torch's param.copy_(entry) is a no-op (a post-hook takes the version bump it makes as the
resting parameter's new normal: layout.Bucket.rested_again). At stage 2 with
mixed precision the same hook keeps the fp32 masters in step with what was loaded (without it the
next step would overwrite the loaded weights from stale masters). A shard that lives in a
parameter swap file (offload_param nvme) is changed in its record instead: pinned (read and
checked), this rank's slice copied in, written back as the next generation, unpinned (one bucket
resident at a time; in fp32 that record is the master too). A read or write error raises OSError
naming the swap file.
"""

from __future__ import annotations

import torch

from . import dtensor_params, state_dict_guard
from .bucket_optimizer import MasterHome

_LOAD_HOOK_ATTR = "_zeroplus_load_hook"


def _engine(model: torch.nn.Module):
    ref = getattr(model, "_zeroplus_engine", None)
    return ref() if ref is not None else None


def full_state_dict(model: torch.nn.Module, rank0_only: bool = True, cpu: bool = True) -> dict:
    """The unsharded state dict of a model returned by zeroplus.initialize (any stage). With
    rank0_only, other ranks get {} (they still take part in the gathers)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"full_state_dict: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(rank0_only, bool):
        raise TypeError(f"full_state_dict: rank0_only must be a bool, got {rank0_only!r}")
    if not isinstance(cpu, bool):
        raise TypeError(f"full_state_dict: cpu must be a bool, got {cpu!r}")
    engine = _engine(model)
    keep = not rank0_only or engine is None or engine.rank == 0
    if engine is None or engine.placement.gatherer is None:
        # Stages 1-2 (or a plain model): parameters are whole on every rank.
        sd = model.state_dict()
        if not keep:
            return {}
        return {k: _copy(v.detach(), cpu) for k, v in sd.items()}
    gatherer = engine.placement.gatherer
    by_tensor = {}  # id(parameter) -> full value
    for st in gatherer.states:
        if not st.buckets:
            continue
        gatherer.gather_units([st.unit.index])
        try:
            if keep:
                for b in st.buckets:
                    for e in b.entries:
                        value = e.param.detach()
                        by_tensor[id(e.param)] = _copy(value, cpu)
        finally:
            gatherer.release_units([st.unit.index])
    if not keep:
        return {}
    out = {}
    with state_dict_guard.allowed():  # keys and identities only: values come from the gathers above
        live = model.state_dict(keep_vars=True)
    for key, value in live.items():
        if id(value) in by_tensor:
            out[key] = by_tensor[id(value)]
        else:
            out[key] = _copy(value.detach(), cpu)
    return out


def _copy(value: torch.Tensor, cpu: bool) -> torch.Tensor:
    """A copy the caller owns: never the live tensor (the next step would change it) and never a
    view of a gathered unit buffer (which is reused)."""
    return value.to("cpu", copy=True) if cpu else value.clone()


def _into_record(store, b, pc, values: torch.Tensor) -> None:
    """values -> this rank's slice [pc.shard_lo, pc.shard_hi) of bucket b's swapped shard."""
    if not pc.numel:
        return
    shard = store.pin(b, update=True)  # changed in place: a write of it in flight finishes first
    try:
        with torch.no_grad():
            shard[pc.shard_lo:pc.shard_hi].copy_(values)
        store.write(b, None)
    finally:
        store.unpin(b)
    store.drain()  # the write done (or its error raised, naming the file)


def install_load_hooks(engine) -> None:
    """Per module owning managed parameters: a load_state_dict pre-hook (see the module doc)."""
    slots = {}  # id(param) -> (bucket, entry, the bucket's BucketOptimizer or None: frozen)
    owners = {id(b): bo for b, bo in zip(engine.buckets, engine.bucket_optimizers)}
    for b in list(engine.buckets) + list(engine.placement.frozen_buckets):
        for e in b.entries:
            slots[id(e.param)] = (b, e, owners.get(id(b)))
    rank = engine.rank
    gatherer = engine.placement.gatherer
    store = getattr(engine.placement, "param_store", None)

    def hook(module, state_dict, prefix, _local_metadata, _strict, _missing, _unexpected, _errors):
        if gatherer is not None:
            gatherer.release_all()  # a held unit's full copy would take the values, not its shard
        for name, p in module._parameters.items():
            key = prefix + name
            if p is None or id(p) not in slots or key not in state_dict:
                continue
            b, e, owner = slots[id(p)]
            value = state_dict[key]
            if dtensor_params.is_dtensor(p) and isinstance(value, torch.Tensor):
                try:  # a tensor-parallel parameter: this rank's piece of the DTensor (or full tensor)
                    value = dtensor_params.local_state(value, p, key)
                except ValueError:
                    continue  # torch reports the mismatch
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(e.shape):
                continue  # torch reports the mismatch
            pc = b.piece(e, rank)
            flat_value = value.detach().reshape(-1)
            swapped = store is not None and store.offloads(b)
            # The master, wherever it lives (offload); in fp32 a swapped shard's record IS the master.
            if owner is not None and pc.numel and owner.master_home is not MasterHome.PARAM_RECORD:
                with torch.no_grad():
                    owner.write_master(pc.shard_lo, pc.shard_hi, flat_value[pc.param_lo:pc.param_hi])
            if swapped:
                _into_record(store, b, pc, flat_value[pc.param_lo:pc.param_hi])
            elif gatherer is not None and not b.persistent:  # stage 3, resting (released above): into the shard
                if pc.numel:
                    with torch.no_grad():
                        b.shard[pc.shard_lo:pc.shard_hi].copy_(flat_value[pc.param_lo:pc.param_hi])
            else:
                continue  # whole on every rank: torch copies the value into the parameter
            state_dict[key] = p  # torch's param.copy_(param): a no-op (is_same)

    def post_hook(module, _incompatible):
        for p in module._parameters.values():
            if p is not None and id(p) in slots:
                slots[id(p)][0].rested_again()

    for module in engine.module.modules():
        if any(p is not None and id(p) in slots for p in module._parameters.values()):
            if getattr(module, _LOAD_HOOK_ATTR, None) is None:
                handle = module._register_load_state_dict_pre_hook(hook, with_module=True)
                module.register_load_state_dict_post_hook(post_hook)
                object.__setattr__(module, _LOAD_HOOK_ATTR, handle)
