"""State dicts of the stage-2/3 optimizers.

Two formats:
  * sharded (what state_dict() returns by default): this rank's optimizer state, one entry per
    segment (a parameter's piece of this rank's shard, bucket_optimizer.Segment) numbered in
    bucket order, each in the format of the user's optimizer class; the user's hyperparameters, the loss scaler, and a layout signature. Loading needs the same world size
    and model (checked: a mismatch raises ValueError, nothing is changed). Version 1 (one flat
    state per bucket shard, written before parameters had their own step counts) still loads.
  * consolidated (consolidate_state_dict(to) then state_dict() on rank `to`): the plain
    torch.optim format of the unsharded model: state indexed by parameter position, each tensor
    in the parameter's shape, exactly what the user's optimizer class would save. Every rank can
    load it at any world size: each keeps its own slices. Tensor-parallel (DTensor) parameters'
    elementwise state is a DTensor there, with the parameter's mesh and placements (torch.optim's
    own format for them); the sharded format holds local pieces (one tensor-parallel rank's).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm, dtensor_params

FORMAT = "zeroplus-zero-sharded"
VERSION = 2


def _param_index(opt) -> dict[int, int]:
    out, i = {}, 0
    for g in opt.param_groups:
        for p in g["params"]:
            out[id(p)] = i
            i += 1
    return out


def layout_signature(opt) -> list:
    index = _param_index(opt)
    return [[b.group, b.numel, [[index[id(e.param)], e.offset, e.numel] for e in b.entries]] for b in opt.buckets]


def _hyperparameters(opt) -> list[dict]:
    index = _param_index(opt)
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
            for g in opt.param_groups]


def _inner_order(opt) -> list[tuple[int, object]]:
    """(bucket index, segment) of every segment, in the order the sharded state numbers them."""
    return [(b, s) for b, bo in enumerate(opt.bucket_optimizers) for s in bo.segments]


def _segment_states(opt) -> list[dict]:
    return [opt.bucket_optimizers[b].segment_state(s) for b, s in _inner_order(opt)]


def _is_elementwise(value, numel: int) -> bool:
    """State with one value per parameter element (exp_avg, momentum_buffer, ...), as opposed
    to per-parameter scalars (step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def sharded_state_dict(opt) -> dict:
    return {
        "state": {i: st for i, st in enumerate(_segment_states(opt)) if st},
        "param_groups": _hyperparameters(opt),
        "zeroplus": {"format": FORMAT, "version": VERSION, "stage": opt.stage, "world_size": opt.world_size,
                     "rank": opt.rank, "layout": layout_signature(opt), "loss_scaler": opt.scaler.state_dict(),
                     "skipped_steps": opt.skipped_steps},
    }


def _check_groups(opt, state_dict) -> list[dict]:
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
        raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups'")
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"load_state_dict: state_dict has {len(groups)} param groups, the optimizer has "
                         f"{len(opt.param_groups)}")
    for i, (saved, mine) in enumerate(zip(groups, opt.param_groups)):
        if len(saved["params"]) != len(mine["params"]):
            raise ValueError(f"load_state_dict: param group {i} has {len(saved['params'])} parameters in the "
                             f"state_dict, {len(mine['params'])} in the optimizer")
    return groups


@dataclass
class StagedLoad:
    """A load of the sharded or plain state, validated and prepared (stage_load): every bucket's
    new state staged (swap records written to side files), the scaler's state checked."""
    groups: list[dict]                  # the loaded hyperparameters, per user param group
    buckets: list = field(default_factory=list)  # per bucket optimizer: its StagedBucket (or None)
    scaler_state: dict | None = None
    skipped_steps: int | None = None
    committed: bool = False


def load_state_dict(opt, state_dict) -> None:
    """Loads `state_dict` into the engine: stage_load, then commit_load; on any error nothing has
    changed (discard_load removes what was staged)."""
    staged = stage_load(opt, state_dict)
    try:
        commit_load(opt, staged)
    finally:
        discard_load(opt, staged)


def stage_load(opt, state_dict, streamed=None, owned: bool = False) -> StagedLoad:
    """Validates `state_dict` and prepares every change without making one: each bucket's state
    goes through a scratch optimizer of the user's class (BucketOptimizer.stage_load), swapped
    buckets' records are written to side files, the loss scaler's state is loaded into a copy.
    streamed: {bucket index: callable returning (states, master)} for buckets whose state is not in
    `state_dict` but read one bucket at a time (load_checkpoint: bounded memory). owned=True: the
    tensors of `state_dict` belong to this load (load_checkpoint's reads), so they are not copied
    (a second pass over every byte of the state). Raises
    ValueError naming the field (or the store's OSError naming the file), with nothing changed."""
    groups = _check_groups(opt, state_dict)
    meta = state_dict.get("zeroplus")
    if meta is not None:
        if meta.get("format") != FORMAT:
            raise ValueError(f"load_state_dict: unknown zeroplus state format {meta.get('format')!r}")
        if meta.get("version") not in (1, VERSION):
            raise ValueError(f"load_state_dict: zeroplus sharded state version {meta.get('version')!r} is newer than "
                             f"this zeroplus reads ({VERSION}); upgrade zeroplus")
        if meta["world_size"] != opt.world_size:
            raise ValueError(f"load_state_dict: sharded state saved at world size {meta['world_size']}, loading at "
                             f"{opt.world_size}; save a consolidated state dict (consolidate_state_dict) to reshard")
        if meta["layout"] != layout_signature(opt):
            raise ValueError("load_state_dict: the sharded state was saved for another model or bucket layout "
                             "(parameters, shapes or reduce_bucket_size differ)")
        segment_state = (state_dict["state"] if meta["version"] == VERSION
                         else _segments_from_v1(opt, state_dict["state"]))
        scaler_state = meta.get("loss_scaler")
    else:
        segment_state = _shard_plain_state(opt, state_dict["state"])
        scaler_state = None
    # Check every segment's state before changing anything.
    order = _inner_order(opt)
    unknown = sorted(set(segment_state) - set(range(len(order))))
    if unknown:
        raise ValueError(f"load_state_dict: state has entries {unknown[:5]} beyond this rank's {len(order)} segments")
    for i, (b, seg) in enumerate(order):
        for key, value in (segment_state.get(i) or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != seg.hi - seg.lo:
                raise ValueError(f"load_state_dict: state[{i}][{key!r}] has {value.numel()} elements, segment {i} "
                                 f"(bucket {b}) has {seg.hi - seg.lo}")
    staged = StagedLoad(groups=[{k: v for k, v in saved.items() if k != "params"} for saved in groups])
    if scaler_state is not None:
        copy.deepcopy(opt.scaler).load_state_dict(scaler_state)  # raises here, not half-way through the commit
        staged.scaler_state = copy.deepcopy(scaler_state)
        staged.skipped_steps = int(meta.get("skipped_steps", 0))
    if not owned:
        segment_state = copy.deepcopy(segment_state)  # the caller's dict stays theirs
    streamed = streamed or {}
    try:
        start = 0
        for b, bo in enumerate(opt.bucket_optimizers):
            n = len(bo.segments)
            hyper = {**{k: v for k, v in opt.param_groups[bo.bucket.group].items() if k != "params"},
                     **staged.groups[bo.bucket.group]}
            if b in streamed:
                states, master = streamed[b]()
            else:
                states, master = [segment_state.get(i) for i in range(start, start + n)], None
            staged.buckets.append(bo.stage_load(states, hyper, master))
            del states, master  # one streamed bucket in memory at a time
            start += n
    except BaseException:
        discard_load(opt, staged)
        raise
    return staged


def commit_load(opt, staged: StagedLoad) -> None:
    """Applies a staged load: the swap records' side files are renamed into place first (the one
    step that can fail, with nothing else changed yet), then hyperparameters, every bucket's
    state and the loss scaler change in memory."""
    stores = {}
    for bo, sb in zip(opt.bucket_optimizers, staged.buckets):
        if sb is not None and sb.record is not None:
            stores.setdefault(id(bo.store_), (bo.store_, []))[1].append((bo, sb.record))
    for store, records in stores.values():
        store.commit_records(records)
    staged.committed = True
    for hyper, mine in zip(staged.groups, opt.param_groups):
        mine.update(hyper)
    for bo, sb in zip(opt.bucket_optimizers, staged.buckets):
        bo.commit_load(sb)
    if staged.scaler_state is not None:
        opt.scaler.load_state_dict(staged.scaler_state)
        opt.skipped_steps = staged.skipped_steps


def discard_load(opt, staged: StagedLoad) -> None:
    """Removes what stage_load wrote and commit_load did not take (a no-op after a commit)."""
    if staged.committed:
        return
    for bo, sb in zip(opt.bucket_optimizers, staged.buckets):
        bo.discard_load(sb)


def _segments_from_v1(opt, flat_state: dict) -> dict:
    """Version-1 sharded state (one flat state per bucket shard, in inner-group order of the
    buckets) -> one state per segment: elementwise tensors sliced, scalars copied."""
    # Version 1 had one inner optimizer over one master per bucket, listed group by group.
    bucket_order = [b for gi in range(len(opt.param_groups)) for b, bucket in enumerate(opt.buckets)
                    if bucket.group == gi]
    by_bucket = {b: flat_state[i] for i, b in enumerate(bucket_order) if i in flat_state}
    out = {}
    for i, (b, seg) in enumerate(_inner_order(opt)):
        saved = by_bucket.get(b)
        if saved:
            shard_numel = opt.buckets[b].shard_numel
            out[i] = {k: (v[seg.lo:seg.hi].clone() if _is_elementwise(v, shard_numel) else _copy(v))
                      for k, v in saved.items()}
    return out


def _shard_plain_state(opt, plain_state: dict) -> dict:
    """Plain torch.optim state (per parameter, full shapes) -> inner state (per segment)."""
    index = _param_index(opt)
    out = {}
    for i, (b, seg) in enumerate(_inner_order(opt)):
        bucket = opt.buckets[b]
        e = bucket.entries[seg.entry]
        pi = index[id(e.param)]
        saved = plain_state.get(pi)
        if not saved:
            continue
        pc = bucket.piece(e, opt.rank)
        st = {}
        for key, value in saved.items():
            if dtensor_params.is_dtensor(e.param) and isinstance(value, torch.Tensor) and value.dim() > 0:
                # A tensor-parallel parameter's state: DTensor (or plain) of the global shape -> local
                value = dtensor_params.local_state(value, e.param, f"state[{pi}][{key!r}]")
            if _is_elementwise(value, e.numel):
                if tuple(value.shape) != tuple(e.shape):
                    raise ValueError(f"load_state_dict: state[{pi}][{key!r}] has shape {tuple(value.shape)}, the "
                                     f"parameter has {tuple(e.shape)}")
                st[key] = value.reshape(-1)[pc.param_lo:pc.param_hi].to(torch.float32, copy=True)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                raise ValueError(f"load_state_dict: state[{pi}][{key!r}] has {value.numel()} elements, the "
                                 f"parameter has {e.numel}")
            else:
                st[key] = _copy(value)
        out[i] = st
    return out


def consolidated_state_dict(opt) -> dict:
    """Plain torch.optim state of the whole model, valid on every rank (collective).

    Every parameter whose state exists has it on every rank holding a piece of it (they stepped
    together), so: one object all-gather of what each rank knows per parameter (its keys, and
    the per-parameter scalars such as step), then per bucket and elementwise key one tensor
    all-gather of the shards, each parameter's slice reshaped to the parameter."""
    index = _param_index(opt)
    known: dict[int, dict] = {}  # parameter index -> {key: scalar value, or dtype for elementwise}
    for b, seg in _inner_order(opt):
        e = opt.buckets[b].entries[seg.entry]
        for key, value in opt.bucket_optimizers[b].segment_state(seg).items():
            known.setdefault(index[id(e.param)], {})[key] = (
                value.dtype if _is_elementwise(value, seg.hi - seg.lo) else _copy(value))
    everyone = [None] * opt.world_size
    dist.all_gather_object(everyone, known, group=opt.process_group)
    merged: dict[int, dict] = {}
    for per_rank in everyone:
        for pi, keys in per_rank.items():
            for key, value in keys.items():
                merged.setdefault(pi, {}).setdefault(key, value)
    plain: dict[int, dict] = {pi: {} for pi in merged}
    for b, bucket in enumerate(opt.buckets):
        entries = [(e, index[id(e.param)]) for e in bucket.entries if index[id(e.param)] in merged]
        keys: dict[str, torch.dtype] = {}
        for _e, pi in entries:
            for key, value in merged[pi].items():
                if isinstance(value, torch.dtype):
                    keys.setdefault(key, value)
        gathered = {}
        for key in sorted(keys):  # the same order on every rank
            shard = torch.zeros(bucket.shard_numel, dtype=keys[key], device=bucket.device)
            for seg in opt.bucket_optimizers[b].segments:
                value = opt.bucket_optimizers[b].segment_state(seg).get(key)
                if value is not None:
                    shard[seg.lo:seg.hi].copy_(value.reshape(-1))
            full = torch.empty(bucket.numel, dtype=keys[key], device=bucket.device)
            comm.all_gather(full, shard, opt.process_group, async_op=False)
            gathered[key] = full
        for e, pi in entries:
            for key, value in merged[pi].items():
                plain[pi][key] = (dtensor_params.as_dtensor_like(
                                      gathered[key][e.offset:e.offset + e.numel].view(e.shape).clone(), e.param)
                                  if isinstance(value, torch.dtype) else _copy(value))
    ordered = {i: plain[i] for i in sorted(plain)}
    return {"state": ordered, "param_groups": _hyperparameters(opt)}
