"""zeroplus's own state (stages 1-3, ZeroRedundancyOptimizer) as torch.distributed.checkpoint
state dicts, so that DCP saves it sharded and reshards it on load:

    model_sd, optim_sd = zeroplus.checkpoint.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=AioStorageWriter(path))
    ...                                           # any world size, any stage, or plain torch
    model_sd, optim_sd = zeroplus.checkpoint.get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=AioStorageReader(path))
    zeroplus.checkpoint.set_state_dict(model, opt, model_sd, optim_sd)

The layout is torch.distributed.checkpoint.state_dict.get_state_dict's: model_sd maps every key
of model.state_dict() (tied parameters under each of their names, buffers) to a tensor of the
parameter's GLOBAL shape; optim_sd is {"state": {fqn: {"exp_avg": .., "exp_avg_sq": ..,
"step": ..}}, "param_groups": [{hyperparameters.., "params": [fqn, ..]}]}, fqn being the name
named_parameters() gives. So a checkpoint of a zeroplus model loads into a plain nn.Module and
torch optimizer through torch's own get/set_state_dict and dcp.load, and the other way round.

Nothing is gathered. A rank holds a flat element range [lo, hi) of a parameter (its piece of a
flat bucket shard: adapters.py gives the ranges); a row-major flat range is a union of a few
N-D boxes (at most 2 * ndim - 1), each a contiguous run of the flat buffer, so each becomes one
local shard of a ShardedTensor with explicit ShardMetadata (several shards per rank), whose
tensor is a VIEW of the engine's fp32 master or optimizer state: dcp.save writes from them
without a copy and dcp.load writes straight into them. A tensor every rank holds whole (buffers,
frozen parameters at stages 1-2, small persistent ones at stage 3, everything at world size 1)
is a plain tensor (a view too), which DCP writes once. A rank with no piece of a parameter holds
one empty shard, which DCP never reads. Optimizer state that does not exist yet (an
optimizer that has not stepped) is new zero tensors in the layout of the state the optimizer's
class creates at its first step, as torch's get_state_dict creates it.

set_state_dict then validates everything (keys and global shapes as model.load_state_dict
(strict=True) reports them, each value holding the ranges this rank needs, the param groups),
the ranks agree that all of them succeeded, and only then: the optimizer state goes in through
the optimizer's own load_state_dict (scalars such as step and the hyperparameters included),
values that are not already in place are copied into masters, parameters and buffers, and the
engine publishes the masters into the (possibly sharded) parameters. On a validation error every
rank raises and model and optimizer are untouched. dcp.load refuses a missing key or a shape
mismatch while planning, before it reads anything; an I/O error in the middle of dcp.load leaves
what it had already written into the model's masters (as it does with FSDP2's DTensors).

Both calls are collective over the optimizer's process group. Refused with a clear error:
offload_param "nvme" (the shards are in swap files; zeroplus.save_checkpoint handles it),
tensor-parallel models (adapters.py), offload_optimizer stores (the
state lives in swap files: use zeroplus.save_checkpoint), several optimizers, and
StateDictOptions other than the defaults (and strict=True).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from ..zero import state_dict_guard
from .plan import Piece
from .adapters import adapter_for
from .load import check_model_shapes

_STATE, _GROUPS, _EXTRA = "state", "param_groups", "zeroplus"
_MODEL_KEYS = ("param", "value")  # the keys adapters' pieces() give model tensors (not optimizer state)


# -- arguments ---------------------------------------------------------------------------------------

def _adapter(model, optimizers, options, op: str):
    if isinstance(optimizers, torch.optim.Optimizer):
        opt = optimizers
    else:
        try:
            opts = list(optimizers)
        except TypeError:
            raise TypeError(f"{op}: optimizers must be a zeroplus optimizer, got {type(optimizers).__name__}") from None
        if len(opts) != 1:
            raise ValueError(f"{op}: optimizers must be one zeroplus optimizer (zeroplus.initialize's, or "
                             f"zeroplus.ZeroRedundancyOptimizer), got {len(opts)}")
        opt = opts[0]
    if options is not None:
        if not isinstance(options, StateDictOptions):
            raise TypeError(f"{op}: options must be a torch.distributed.checkpoint.state_dict.StateDictOptions or "
                            f"None, got {type(options).__name__}")
        default = StateDictOptions()
        for field in ("full_state_dict", "cpu_offload", "ignore_frozen_params", "strict", "broadcast_from_rank0",
                      "flatten_optimizer_state_dict"):
            if getattr(options, field) != getattr(default, field):
                raise ValueError(f"{op}: does not support options.{field}={getattr(options, field)!r} (sharded, "
                                 f"strict state dicts only; a full state dict: zeroplus.full_state_dict)")
    if getattr(getattr(opt, "placement", None), "param_store", None) is not None:
        raise NotImplementedError(f"{op}: does not support offload_param yet (the parameter shards live in swap "
                                  f"files or host memory, not in tensors DCP could view); save with "
                                  f"zeroplus.save_checkpoint. "
                                  f"Nothing was changed")
    adapter = adapter_for(model, opt)
    if getattr(opt, "offload", None) is not None:
        raise NotImplementedError(f"{op}: does not support offload_optimizer stores yet (the optimizer state lives "
                                  f"in swap files); save with zeroplus.save_checkpoint. Nothing was changed")
    return adapter


def _global_ranks(adapter) -> list[int]:
    """Global rank of every rank of the optimizer's group (ShardMetadata placements name them)."""
    group = adapter.opt.process_group
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


# -- flat ranges as boxes ------------------------------------------------------------------------------

def boxes(shape, lo: int, hi: int) -> list[tuple[list[int], list[int], int]]:
    """The row-major flat range [lo, hi) of a tensor of `shape` as N-D boxes (offsets, sizes,
    flat start), each one contiguous run of the flat tensor, in flat order."""
    shape = list(shape)
    if hi <= lo:
        return []
    if not shape:
        return [([], [], 0)]
    out = []

    def split(dim: int, prefix: list[int], base: int, a: int, z: int) -> None:
        # [a, z) inside the block shape[dim:] that starts at flat `base`, indices prefix fixed
        inner = math.prod(shape[dim + 1:])
        pad = [1] * dim
        if dim == len(shape) - 1:
            out.append((prefix + [a], pad + [z - a], base + a))
            return
        first, last = -(-a // inner), z // inner  # the whole rows inside [a, z)
        if first > last:  # inside one row
            r = a // inner
            split(dim + 1, prefix + [r], base + r * inner, a - r * inner, z - r * inner)
            return
        if a < first * inner:
            split(dim + 1, prefix + [first - 1], base + (first - 1) * inner, a - (first - 1) * inner, inner)
        if first < last:
            out.append((prefix + [first] + [0] * (len(shape) - dim - 1), pad + [last - first] + shape[dim + 1:],
                        base + first * inner))
        if z > last * inner:
            split(dim + 1, prefix + [last], base + last * inner, 0, z - last * inner)

    split(0, [], 0, lo, hi)
    return out


def _flat_start(shape, offsets) -> int:
    start, stride = 0, 1
    for size, off in zip(reversed(list(shape)), reversed(list(offsets))):
        start += off * stride
        stride *= size
    return start


def _sharded(shape, dtype, local: list, everyone: list, ranks: list[int], group) -> ShardedTensor:
    """A ShardedTensor of global `shape`: this rank's ranges `local` [(lo, hi, flat view)] as
    local shards (views), `everyone[r]` [(lo, hi, device)] the ranges of every rank. A rank with
    no range holds one empty shard (torch's ShardedTensor without local shards asks CUDA for its
    device), at offset `shape`, where no real chunk starts: DCP deduplicates chunks by offset, and
    an empty chunk overlaps nothing, so it is never read."""
    if not shape:
        raise NotImplementedError("get_state_dict: does not support a 0-d parameter that one rank's shard holds "
                                  "(its state cannot be split into boxes); use zeroplus.save_checkpoint")
    me = dist.get_rank(group)
    devices = {device for ranges in everyone for _lo, _hi, device in ranges}
    shards_md, local_shards = [], []
    for r, ranges in enumerate(everyone):
        views = [flat for _lo, _hi, flat in local] if r == me else [None] * len(ranges)
        if not ranges:  # the empty shard, on this rank's device (the devices of a group agree)
            device = str(local[0][2].device) if r == me and local else min(devices)
            md = ShardMetadata(shard_offsets=list(shape), shard_sizes=[0] * len(shape),
                               placement=f"rank:{ranks[r]}/{device}")
            shards_md.append(md)
            if r == me:
                local_shards.append(Shard(tensor=torch.empty([0] * len(shape), dtype=dtype, device=device),
                                          metadata=md))
            continue
        for (lo, hi, device), flat in zip(ranges, views):
            for offsets, sizes, start in boxes(shape, lo, hi):
                md = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{ranks[r]}/{device}")
                shards_md.append(md)
                if flat is not None:  # this rank's: a view of its flat range
                    n = math.prod(sizes)
                    local_shards.append(Shard(tensor=flat[start - lo:start - lo + n].view(sizes), metadata=md))
    pinned = local_shards[0].tensor.is_pinned()
    meta = ShardedTensorMetadata(shards_metadata=shards_md, size=torch.Size(shape),
                                 tensor_properties=TensorProperties(dtype=dtype, pin_memory=pinned))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, meta, process_group=group)


def _dcp_tensors(entries: dict, shapes: dict, everyone: list[dict], ranks: list[int], group) -> dict:
    """{key: tensor for DCP} from this rank's {key: [(lo, hi, flat view)]} and every rank's
    {key: ([(lo, hi, device)], dtype)}: a plain view where every rank holds the whole tensor
    (replicated: DCP writes it once), a ShardedTensor otherwise (a rank holding the whole tensor
    while others hold none of it included: DCP would take a plain tensor for a replicated one)."""
    out = {}
    keys = sorted({k for per_rank in everyone for k in per_rank}, key=str)
    for key in keys:
        shape = shapes[key]
        mine = entries.get(key, [])
        numel = math.prod(shape)
        ranges = [per_rank.get(key, ([], None))[0] for per_rank in everyone]
        if all(len(r) == 1 and r[0][:2] == (0, numel) for r in ranges):  # replicated: DCP writes it once
            out[key] = mine[0][2].view(shape)
            continue
        dtype = next(per_rank[key][1] for per_rank in everyone if key in per_rank)
        out[key] = _sharded(shape, dtype, mine, ranges, ranks, group)
    return out


# -- get_state_dict --------------------------------------------------------------------------------------

def _describe(entries: dict) -> dict:
    return {k: ([(lo, hi, str(t.device)) for lo, hi, t in v], v[0][2].dtype) for k, v in entries.items() if v}


def get_state_dict(model, optimizers, *, options=None) -> tuple[dict, dict]:
    """(model_sd, optim_sd) in the layout of torch.distributed.checkpoint.state_dict.get_state_dict,
    sharded as zeroplus holds the state, made of views of it (module docstring). Collective."""
    adapter = _adapter(model, optimizers, options, "get_state_dict")
    group = adapter.opt.process_group
    pieces, scalars = adapter.pieces()
    state_pieces = [p for p in pieces if p.key not in _MODEL_KEYS]
    has_state = [None] * dist.get_world_size(group)
    dist.all_gather_object(has_state, bool(state_pieces or scalars), group=group)
    if not any(has_state):  # no rank's optimizer has stepped: the state its first step creates
        fresh = adapter.fresh_optimizer_states()
        state_pieces, scalars = [], {}
        for r in adapter.optimizer_ranges():
            if not adapter.params[r.name].requires_grad:
                continue  # never stepped: no state (torch's get_state_dict creates none either)
            for key, value in fresh[r.segment].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state_pieces.append(Piece(r.name, key, r.lo, r.hi, value))
                else:
                    scalars.setdefault(r.name, {})[key] = value

    model_entries: dict[str, list] = {}
    for d in adapter.destinations():
        model_entries.setdefault(d.name, []).append((d.lo, d.hi, d.tensor.detach()))
    state_entries: dict[tuple, list] = {}
    for name, key, lo, hi, value in state_pieces:
        state_entries.setdefault((name, key), []).append((lo, hi, value.detach()))
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (_describe(model_entries), _describe(state_entries)), group=group)

    ranks = _global_ranks(adapter)
    shapes = adapter.model_shapes()
    tensors = _dcp_tensors(model_entries, shapes, [e[0] for e in everyone], ranks, group)
    model_sd = {}
    with state_dict_guard.allowed():  # keys and identities; the values are the pieces above
        live = adapter.model.state_dict(keep_vars=True)
    for key, value in live.items():
        canonical = adapter.aliases.get(key, key)
        if canonical in tensors:
            model_sd[key] = tensors[canonical]
        else:  # an empty tensor: no rank holds an element of it
            model_sd[key] = torch.empty(shapes[canonical], dtype=value.dtype, device=value.device)

    state_shapes = {k: shapes[k[0]] for per_rank in everyone for k in per_rank[1]}
    state_tensors = _dcp_tensors(state_entries, state_shapes, [e[1] for e in everyone], ranks, group)
    state: dict[str, dict] = {}
    for (name, key), value in state_tensors.items():
        state.setdefault(name, {})[key] = value
    for name, values in scalars.items():
        state.setdefault(name, {}).update(values)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [adapter.name_of[id(p)] for p in g["params"]]}
              for g in adapter.opt.param_groups]
    optim_sd = {_STATE: state, _GROUPS: groups}
    if getattr(adapter.opt, "mixed_precision", None) == "fp16":
        # The loss scaler travels too (torch's optimizers have none: a torch checkpoint lacks it).
        optim_sd[_EXTRA] = adapter.optimizer_meta()
    return model_sd, optim_sd


# -- set_state_dict --------------------------------------------------------------------------------------

def _size(value: torch.Tensor) -> tuple:
    """The global shape (ShardedTensor.size() works too, with a FutureWarning each call)."""
    return tuple(value.metadata().size if isinstance(value, ShardedTensor) else value.size())


def _runs(value: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(flat start, flat view) of every piece of `value` this rank holds: a ShardedTensor's local
    shards (each a box, hence a contiguous flat run), or the whole of a plain tensor."""
    if isinstance(value, ShardedTensor):
        shape = _size(value)
        return [(_flat_start(shape, s.metadata.shard_offsets), s.tensor.reshape(-1)) for s in value.local_shards()]
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        raise TypeError(f"a {type(value).__name__} (plain tensors and ShardedTensors only)")
    return [(0, value.reshape(-1))]


def _take(value, lo: int, hi: int, what: str) -> torch.Tensor:
    """Elements [lo, hi) of `value` flattened: a view where one piece holds them all, else a new
    tensor; ValueError naming `what` where this rank does not hold all of them."""
    try:
        runs = _runs(value)
    except TypeError as e:
        raise TypeError(f"set_state_dict: {what} is {e}") from None
    for start, flat in runs:
        if start <= lo and hi <= start + flat.numel():
            return flat[lo - start:hi - start]
    out = torch.empty(hi - lo, dtype=runs[0][1].dtype if runs else torch.float32,
                      device=runs[0][1].device if runs else "cpu")
    covered = 0
    for start, flat in runs:
        a, z = max(lo, start), min(hi, start + flat.numel())
        if a < z:
            out[a - lo:z - lo].copy_(flat[a - start:z - start])
            covered += z - a
    if covered != hi - lo:  # the pieces of a DCP state dict never overlap
        raise ValueError(f"set_state_dict: {what} holds {covered} of the elements [{lo}, {hi}) this rank needs "
                         f"(pass the state dict get_state_dict returned on this rank, filled by dcp.load)")
    return out


def _check_model_values(model_sd: dict, adapter) -> list:
    """(destination, source) pairs for every range this rank holds now, after checking keys and
    global shapes as load_state_dict(strict=True) does. Nothing is written."""
    if not isinstance(model_sd, dict):
        raise TypeError(f"set_state_dict: model_state_dict must be a dict, got {type(model_sd).__name__}")
    for key, value in model_sd.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"set_state_dict: model_state_dict[{key!r}] is a {type(value).__name__}, expected a tensor")
    check_model_shapes({k: _size(v) for k, v in model_sd.items()}, adapter, adapter.model)
    pairs = []
    for name, lo, hi, dest in adapter.destinations():
        value = model_sd[name]
        if not _in_place(value, lo, hi, dest):  # get_state_dict's views, filled by dcp.load: nothing to copy
            pairs.append((dest, _take(value, lo, hi, f"model_state_dict[{name!r}]")))
    return pairs


def _in_place(value, lo: int, hi: int, dest: torch.Tensor) -> bool:
    """Whether the pieces of `value` covering [lo, hi) are `dest`'s own memory, element for element."""
    try:
        runs = _runs(value)
    except TypeError:
        return False
    covered = 0
    for start, flat in runs:
        a, z = max(lo, start), min(hi, start + flat.numel())
        if a < z:
            if flat.dtype != dest.dtype or flat[a - start:].data_ptr() != dest[a - lo:].data_ptr():
                return False
            covered += z - a
    return covered == hi - lo


def _check_groups(optim_sd: dict, adapter) -> list[dict]:
    """The hyperparameters of each of the optimizer's param groups, from the saved group holding
    the same parameters (matched by name, as torch's set_state_dict does)."""
    saved = optim_sd[_GROUPS]
    if not isinstance(saved, (list, tuple)) or not all(isinstance(g, dict) and "params" in g for g in saved):
        raise ValueError("set_state_dict: optim_state_dict['param_groups'] must be a list of dicts with 'params'")
    where = {name: i for i, g in enumerate(saved) for name in g["params"]}
    out = []
    for gi, g in enumerate(adapter.opt.param_groups):
        names = [adapter.name_of[id(p)] for p in g["params"]]
        missing = [n for n in names if n not in where]
        if missing:
            raise ValueError(f"set_state_dict: optim_state_dict['param_groups'] holds no group with parameter(s) "
                             f"{missing[:5]} (param group {gi} of the optimizer)")
        found = {where[n] for n in names}
        if len(found) != 1 or sorted(saved[min(found)]["params"]) != sorted(names):
            raise ValueError(f"set_state_dict: param group {gi} of the optimizer holds other parameters than the "
                             f"saved param group(s) {sorted(found)} of optim_state_dict")
        out.append({k: v for k, v in saved[found.pop()].items() if k != "params"})
    return out


def _check_state(optim_sd: dict, adapter) -> dict:
    """{range index: state} of the optimizer ranges this rank owns (elementwise tensors flat)."""
    state = optim_sd[_STATE]
    if not isinstance(state, dict):
        raise ValueError(f"set_state_dict: optim_state_dict['state'] must be a dict, got {type(state).__name__}")
    managed = {adapter.name_of[id(p)]: p for g in adapter.opt.param_groups for p in g["params"]}
    unknown = sorted(set(state) - set(managed), key=str)
    if unknown:
        raise ValueError(f"set_state_dict: optim_state_dict['state'] has entries for {unknown[:5]}, which are not "
                         f"parameters of the optimizer")
    shapes = adapter.model_shapes()
    out = {}
    for i, name, lo, hi in adapter.optimizer_ranges():
        saved = state.get(name)
        if not saved:
            continue
        st = {}
        for key, value in saved.items():
            what = f"optim_state_dict['state'][{name!r}][{key!r}]"
            if isinstance(value, torch.Tensor) and _size(value):
                if _size(value) != tuple(shapes[name]):
                    raise ValueError(f"set_state_dict: {what} has shape {_size(value)}, the parameter has "
                                     f"{tuple(shapes[name])}")
                piece = _take(value, lo, hi, what)
                # the optimizer's load_state_dict deep-copies: a view would copy its whole storage
                whole = piece.untyped_storage().nbytes() == piece.numel() * piece.element_size()
                st[key] = piece if whole else piece.clone()
            else:
                st[key] = value
        out[i] = st
    return out


def _agree(group, error) -> None:
    """Every rank learns whether every rank succeeded; raises on all of them if one did not."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
    if failed:
        raise RuntimeError(f"set_state_dict: rank {failed[0][0]} refused the state dicts: {failed[0][1]} (nothing "
                           f"was changed)")


def set_state_dict(model, optimizers, model_state_dict, optim_state_dict, *, options=None) -> _IncompatibleKeys:
    """Load (model_state_dict, optim_state_dict), get_state_dict's layout (typically filled by
    dcp.load), into model and the optimizer: validate on every rank, agree, then change
    (module docstring). Returns torch's _IncompatibleKeys (always empty: loading is strict). Collective."""
    adapter = _adapter(model, optimizers, options, "set_state_dict")
    group = adapter.opt.process_group
    error = None
    try:
        pairs = _check_model_values(model_state_dict, adapter)
        if not isinstance(optim_state_dict, dict) or _STATE not in optim_state_dict or _GROUPS not in optim_state_dict:
            raise ValueError("set_state_dict: optim_state_dict must be a dict with 'state' and 'param_groups' "
                             "(get_state_dict's layout)")
        groups = _check_groups(optim_state_dict, adapter)
        states = _check_state(optim_state_dict, adapter)
        extra = optim_state_dict.get(_EXTRA)
        # fp16's loss scaler, when the dict carries it; otherwise the optimizer keeps its own
        optimizer_meta = (extra if isinstance(extra, dict)
                          else {"skipped_steps": getattr(adapter.opt, "skipped_steps", 0)})
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised
        error = e
    _agree(group, error)
    adapter.load_optimizer(states, groups, optimizer_meta)
    with torch.no_grad():
        for dest, src in pairs:
            dest.copy_(src)
    adapter.finish_load()
    return _IncompatibleKeys([], [])
