"""Parameters built under zeroplus.init_context: meta tensors whose values live as shards.

A deferred parameter keeps its Python object, full shape, dtype and requires_grad, but its data
is a `meta` tensor (no storage); its value is held in a `Shards` record, attribute
`_zeroplus_deferred`: this rank's contiguous slice of the flattened value, padded to
ceil(numel / world) elements (DeepSpeed's zero.Init layout), always rank 0's value.

`DeferredMode` (a TorchFunctionMode active inside the context) gives every later use of such a
parameter the value it would have had without the context, one parameter at a time:

  * shape/dtype queries run on the meta tensor; `.device` answers the real device;
  * a known whole-tensor overwrite (nn.init.normal_/uniform_/constant_/kaiming_uniform_,
    Tensor.normal_/uniform_/zero_/fill_/copy_/...) runs on a fresh full-size tensor, so it draws
    exactly the random numbers it would have drawn on the real parameter (same size, dtype,
    device, generator), and no communication is needed to read the old value;
  * anything else (x.mul_(2), p[0].zero_(), p.sum(), repr(p)) all-gathers the value, runs on it
    and, if the value changed, keeps the new shard. A view (p.data[idx], p.view(-1)[:k]) comes
    back as a deferred view that re-derives itself from the gathered value on each use, so a
    write through it lands in the parameter.

Every changed value is broadcast from group rank 0 before each rank keeps its slice, so ranks
seeded differently end with rank 0's values, as DDP and zeroplus.initialize give without the
context. Both the gather and the broadcast are collectives: every rank must run the same
construction code (the same holds for DeepSpeed's zero.Init and for stage 3 itself).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import comm
from .heap import return_freed_memory

ATTR = "_zeroplus_deferred"
_TRIM_BYTES = 1 << 20

# Calls that only read metadata: answered by the meta tensor itself.
_META_METHODS = {getattr(torch.Tensor, n) for n in (
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "stride", "is_contiguous", "requires_grad_", "__len__", "get_device", "is_signed", "storage_offset")}
_META_PROPERTIES = {"shape", "dtype", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "names",
                    "name", "is_sparse", "is_quantized", "is_nested", "itemsize", "nbytes", "_base", "is_mkldnn"}
_ALIAS_PROPERTIES = {"data"}
_ALIAS_METHODS = {torch.Tensor.detach}

# Whole-tensor overwrites: the first argument's old value is not read.
_OVERWRITES = {getattr(torch.Tensor, n) for n in (
    "normal_", "uniform_", "zero_", "fill_", "random_", "exponential_", "log_normal_", "cauchy_", "geometric_",
    "copy_")} | {torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.constant_,
                 torch.nn.init.kaiming_uniform_}


def record_of(t) -> "Shards | View | None":
    return getattr(t, ATTR, None) if isinstance(t, torch.Tensor) else None


def _descriptor_name(func) -> str | None:
    """'shape' for Tensor.shape.__get__ (properties reach the mode as their getter/setter)."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", None) in ("__get__", "__set__") and owner is not None:
        return getattr(owner, "__name__", None)
    return None


class Shards:
    """This rank's slice of one deferred value. Mutable: `.data = x` may change shape/dtype."""

    def __init__(self, group, full: torch.Tensor):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.store(full)

    def store(self, full: torch.Tensor) -> None:
        """Keep this rank's slice of rank 0's `full` (a collective)."""
        full = full.detach().contiguous()
        if self.world > 1:
            dist.broadcast(full, src=comm.group_src_rank(self.group, 0), group=self.group)
        self.shape, self.dtype, self.device = full.shape, full.dtype, full.device
        self.numel = full.numel()
        self.chunk = math.ceil(self.numel / self.world)
        lo = self.rank * self.chunk
        n = max(0, min(self.chunk, self.numel - lo))
        shard = torch.zeros(self.chunk, dtype=full.dtype, device=full.device)
        shard[:n].copy_(full.reshape(-1)[lo:lo + n])
        self.shard = shard
        del full
        if self.numel * self.dtype.itemsize >= _TRIM_BYTES:
            return_freed_memory()  # the caller drops the full tensor next; see heap.return_freed_memory

    def gather(self, device: torch.device | None = None) -> torch.Tensor:
        """The full value on every rank (an all-gather)."""
        device = self.device if device is None else device
        shard = self.shard.to(device)
        out = torch.empty(self.world * self.chunk, dtype=self.dtype, device=device)
        if self.world > 1:
            comm.all_gather(out, shard, self.group, async_op=False)
        else:
            out.copy_(shard)
        return out[:self.numel].view(self.shape)

    def fresh(self) -> torch.Tensor:
        """Uninitialised full-size storage for a whole-tensor overwrite."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


class View:
    """A view of deferred values (p.data[0], p.view(-1)): re-derived from the gathered bases."""

    def __init__(self, derive, roots):
        self.derive = derive  # derive(call) -> the real view, using call.resolve for tracked inputs
        self.roots = roots    # the Shards it reads
        self.device = roots[0].device


def track(meta: torch.Tensor, record) -> torch.Tensor:
    setattr(meta, ATTR, record)
    return meta


def make_deferred(param: nn.Parameter, group) -> None:
    """Turn a real parameter into a deferred one in place (same Python object, so ties and any
    reference the constructor kept stay valid)."""
    record = Shards(group, param.data)
    kept = dict(param.__dict__)
    torch.utils.swap_tensors(param, nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                                 requires_grad=param.requires_grad))
    param.__dict__.update(kept)  # swap_tensors swaps __dict__ too: user attributes stay with the object
    track(param, record)


def realize(t: torch.Tensor) -> torch.Tensor:
    """The real value of a deferred tensor (a collective)."""
    return _Call().resolve(t)


def materialize(param: nn.Parameter, device: torch.device) -> None:
    """Give a deferred parameter its full value on `device` again (zeroplus.initialize, one
    unit at a time). Collective: all ranks call it for the same parameters in the same order."""
    record = record_of(param)
    full = record.gather(device)
    kept = {k: v for k, v in param.__dict__.items() if k != ATTR}
    torch.utils.swap_tensors(param, nn.Parameter(full, requires_grad=param.requires_grad))
    param.__dict__.update(kept)


class _Call:
    """Real tensors for the tracked arguments of one intercepted call."""

    def __init__(self, overwrite_target: Shards | None = None):
        self.full: dict[int, tuple[Shards, torch.Tensor, int]] = {}
        self.resolved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(tracked) -> (tracked, real)
        if overwrite_target is not None:
            t = overwrite_target.fresh()
            self.full[id(overwrite_target)] = (overwrite_target, t, -1)

    def _full(self, rec: Shards) -> torch.Tensor:
        if id(rec) not in self.full:
            t = rec.gather()
            self.full[id(rec)] = (rec, t, t._version)
        return self.full[id(rec)][1]

    def resolve(self, x):
        rec = record_of(x)
        if rec is None:
            return x
        if id(x) not in self.resolved:
            if isinstance(rec, Shards):
                real = self._full(rec).detach().requires_grad_(x.requires_grad and x.is_leaf)
            else:
                real = rec.derive(self)
            self.resolved[id(x)] = (x, real)
        return self.resolved[id(x)][1]

    def write_back(self) -> None:
        for rec, t, version in self.full.values():
            if version < 0 or t._version != version:
                rec.store(t)


class DeferredMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tracked = [x for x in flat if record_of(x) is not None]
        if not tracked:
            return func(*args, **kwargs)
        prop = _descriptor_name(func)
        first = record_of(args[0]) if args else None
        if func in _META_METHODS or prop in _META_PROPERTIES:
            return func(*args, **kwargs)
        if prop == "device" and first is not None:
            return first.device
        if prop == "is_meta" and first is not None:
            return False
        if prop in ("is_cpu", "is_cuda") and first is not None:
            return first.device.type == prop[3:]
        if (prop in _ALIAS_PROPERTIES and getattr(func, "__name__", "") == "__get__") or func in _ALIAS_METHODS:
            return track(func(*args, **kwargs), first)  # a meta alias of the same value
        if prop == "data" and getattr(func, "__name__", "") == "__set__":
            return self._set_data(func, args[0], args[1])
        if (func in _OVERWRITES and isinstance(first, Shards) and len(tracked) == 1 and tracked[0] is args[0]):
            call = _Call(overwrite_target=first)
        else:
            call = _Call()
        real_args, real_kwargs = tree_map(call.resolve, (args, kwargs))
        out = func(*real_args, **real_kwargs)
        call.write_back()
        return self._wrap(out, call, func, args, kwargs)

    @staticmethod
    def _set_data(func, target, value):
        rec = record_of(target)
        if not isinstance(rec, Shards):
            raise RuntimeError("zeroplus.init_context: assigning .data of a view of a sharded parameter is not "
                               "supported; assign the parameter's own .data")
        if record_of(value) is not None:
            value = realize(value)
        rec.store(value)
        func(target, torch.empty(rec.shape, dtype=rec.dtype, device="meta"))
        return None

    @staticmethod
    def _wrap(out, call: _Call, func, args, kwargs):
        """Results that are the call's real stand-ins become the tracked tensors again; views of a
        gathered value become deferred views; everything else is an ordinary tensor."""
        by_real = {id(real): tracked for tracked, real in call.resolved.values()}
        storages = {t.untyped_storage().data_ptr(): rec for rec, t, _ in call.full.values() if t.numel() > 0}
        roots = [rec for rec, _, _ in call.full.values()]
        flat, spec = tree_flatten(out)
        wrapped = []
        for i, o in enumerate(flat):
            if isinstance(o, torch.Tensor) and id(o) in by_real:
                o = by_real[id(o)]
            elif isinstance(o, torch.Tensor) and o.numel() > 0 and o.untyped_storage().data_ptr() in storages:
                def derive(c, i=i):
                    ra, rk = tree_map(c.resolve, (args, kwargs))
                    return tree_flatten(func(*ra, **rk))[0][i]
                meta = torch.empty_strided(o.size(), o.stride(), dtype=o.dtype, device="meta")
                o = track(meta, View(derive, roots))
            wrapped.append(o)
        return tree_unflatten(wrapped, spec)
