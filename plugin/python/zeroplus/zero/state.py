"""State dicts of the stage-2/3 optimizers.

Two formats:
  * sharded (what state_dict() returns by default): this rank's inner-optimizer state (flat
    shards), the user's hyperparameters, the loss scaler, and a layout signature. Loading needs
    the same world size and model (checked: a mismatch raises ValueError, nothing is changed).
  * consolidated (consolidate_state_dict(to) then state_dict() on rank `to`): the plain
    torch.optim format of the unsharded model: state indexed by parameter position, each tensor
    in the parameter's shape, exactly what the user's optimizer class would save. Every rank can
    load it at any world size: each keeps its own slices.
"""

from __future__ import annotations

import copy

import torch

from . import comm

FORMAT = "zeroplus-zero-sharded"
VERSION = 1


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


def sharded_state_dict(opt) -> dict:
    inner = opt.inner.state_dict()
    return {
        "state": inner["state"],
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


def _apply_hyperparameters(opt, groups) -> None:
    for saved, mine in zip(groups, opt.param_groups):
        for k, v in saved.items():
            if k != "params":
                mine[k] = v


def _inner_groups(opt) -> list[dict]:
    """The inner optimizer's param_groups as its state_dict would list them, with the user's
    current hyperparameters."""
    out, next_index = [], 0
    for gi, inner_group in zip(opt._inner_group_of, opt.inner.param_groups):
        n = len(inner_group["params"])
        out.append({**{k: v for k, v in opt.param_groups[gi].items() if k != "params"},
                    "params": list(range(next_index, next_index + n))})
        next_index += n
    return out


def load_state_dict(opt, state_dict) -> None:
    groups = _check_groups(opt, state_dict)
    meta = state_dict.get("zeroplus")
    if meta is not None:
        if meta.get("format") != FORMAT:
            raise ValueError(f"load_state_dict: unknown zeroplus state format {meta.get('format')!r}")
        if meta["world_size"] != opt.world_size:
            raise ValueError(f"load_state_dict: sharded state saved at world size {meta['world_size']}, loading at "
                             f"{opt.world_size}; save a consolidated state dict (consolidate_state_dict) to reshard")
        if meta["layout"] != layout_signature(opt):
            raise ValueError("load_state_dict: the sharded state was saved for another model or bucket layout "
                             "(parameters, shapes or reduce_bucket_size differ)")
        inner_sd = {"state": state_dict["state"], "param_groups": _inner_groups(opt)}
        scaler_state = meta.get("loss_scaler")
    else:
        inner_sd = {"state": _shard_plain_state(opt, state_dict["state"]), "param_groups": _inner_groups(opt)}
        scaler_state = None
    # Validate everything before changing anything: load into a copy of the inner optimizer's
    # state first (torch's load_state_dict raises on mismatched groups).
    inner_sd = copy.deepcopy(inner_sd)
    opt.inner.load_state_dict(inner_sd)
    _apply_hyperparameters(opt, groups)
    # The inner groups take the loaded hyperparameters too (they are copied before every step).
    if scaler_state is not None:
        opt.scaler.load_state_dict(scaler_state)
        opt.skipped_steps = int(meta.get("skipped_steps", 0))


def _shard_plain_state(opt, plain_state: dict) -> dict:
    """Plain torch.optim state (per parameter, full shapes) -> inner state (per bucket master,
    this rank's shard)."""
    index = _param_index(opt)
    out = {}
    for mi, b in enumerate(opt.buckets):
        lo, hi = b.shard_range(opt.rank)
        shard_state: dict = {}
        for e in b.entries:
            saved = plain_state.get(index[id(e.param)])
            if saved is None:
                continue
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == e.numel:
                    if tuple(value.shape) != tuple(e.shape):
                        raise ValueError(f"load_state_dict: state[{index[id(e.param)]}][{key!r}] has shape "
                                         f"{tuple(value.shape)}, the parameter has {tuple(e.shape)}")
                    flat = shard_state.get(key)
                    if flat is None:
                        flat = shard_state[key] = torch.zeros(b.shard_numel, dtype=torch.float32, device=b.device)
                    a, z = max(e.offset, lo), min(e.offset + e.numel, hi)
                    if a < z:
                        flat[a - lo:z - lo].copy_(value.reshape(-1)[a - e.offset:z - e.offset])
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    raise ValueError(f"load_state_dict: state[{index[id(e.param)]}][{key!r}] has "
                                     f"{value.numel()} elements, the parameter has {e.numel}")
                else:
                    shard_state.setdefault(key, value.clone() if isinstance(value, torch.Tensor) else value)
        if shard_state:
            out[mi] = shard_state
    return out


def consolidated_state_dict(opt) -> dict:
    """Plain torch.optim state of the whole model, valid on every rank (collective)."""
    index = _param_index(opt)
    inner_state = opt.inner.state
    plain: dict[int, dict] = {}
    for b, master in zip(opt.buckets, opt.masters):
        st = inner_state.get(master, {})
        for key in sorted(st):  # same order on every rank: every rank stepped the same way
            value = st[key]
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == b.shard_numel:
                full = torch.empty(b.numel, dtype=value.dtype, device=value.device)
                comm.all_gather(full, value.contiguous(), opt.process_group, async_op=False)
                for e in b.entries:
                    plain.setdefault(index[id(e.param)], {})[key] = (
                        full[e.offset:e.offset + e.numel].view(e.shape).clone())
            else:
                for e in b.entries:
                    plain.setdefault(index[id(e.param)], {})[key] = (
                        value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value))
    ordered = {i: plain[i] for i in sorted(plain)}
    return {"state": ordered, "param_groups": _hyperparameters(opt)}
