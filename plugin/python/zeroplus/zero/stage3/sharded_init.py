"""zeroplus.init_context(): build a model for ZeRO stage 3 without ever holding it in full.

    with zeroplus.init_context():
        model = GPT(config)             # each parameter is sharded as soon as it is registered
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=3e-4)

The anchor is DeepSpeed's zero.Init, which patches every nn.Module subclass's __init__ and
partitions a module's parameters when its __init__ returns, then wraps Module.apply so that a
function applied from a parent (GPT's `self.apply(self._init_weights)`) gathers, runs and
re-partitions. Anything else a parent does to a child's parameter after that (nanoGPT's
`for pn, p in self.named_parameters(): nn.init.normal_(p, ...)`) reaches an empty tensor there
and is silently lost.

Here a parameter is sharded the moment it is registered on a module (a global parameter
registration hook; no class is patched), and every later use of it goes through
deferred.DeferredMode, a TorchFunctionMode active inside the context, which gives the call the
real full value one parameter at a time (see deferred.py). So init code anywhere - a module's
own reset_parameters, nn.init on self.weight in __init__, self.apply(fn) on the root, a loop
over named_parameters(), `.data.normal_()`, `weight.data[padding_idx].zero_()` - sees and
produces the values it would without the context: whole-tensor initialisers run on a fresh
full-size tensor of the same shape and dtype and so draw the same random numbers, and the global
generator ends in the same state. Peak memory while building: this rank's shards plus one full
parameter (plus one gathered parameter while a call reads one).

Not covered (documented in docs/zero.md): parameters created on `meta` inside the context stay
plain meta parameters (zeroplus.initialize then needs param_init_fn or reset_parameters, as for
any meta model); a tensor that shares storage with a parameter without being obtained from it
inside the context (`w = torch.randn(n); self.p = nn.Parameter(w); w.mul_(2)`) is not followed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_mod

from . import deferred

_active = False


def _group_of(process_group):
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"zeroplus.init_context: process_group must be a torch.distributed ProcessGroup or None, "
                        f"got {type(process_group).__name__}")
    return process_group if process_group is not None else dist.group.WORLD


@contextlib.contextmanager
def init_context(process_group=None, *, enabled: bool = True):
    """Parameters registered on a module inside the block keep only this rank's shard; the
    model built there can only be passed to zeroplus.initialize(..., stage=3) with a process
    group of the same ranks. Collective: every rank of the group must build the same model."""
    global _active
    if not isinstance(enabled, bool):
        raise TypeError(f"zeroplus.init_context: enabled must be a bool, got {enabled!r}")
    if not enabled:
        yield
        return
    if not dist.is_initialized():
        raise RuntimeError("zeroplus.init_context: torch.distributed is not initialized; call "
                           "dist.init_process_group(...) before building the model")
    group = _group_of(process_group)
    if _active:
        raise RuntimeError("zeroplus.init_context: already inside an init_context (they do not nest)")

    def on_parameter(module, name, param):
        if param is not None and deferred.record_of(param) is None and not param.is_meta:
            deferred.make_deferred(param, group)
        return None

    def on_buffer(module, name, buffer):
        # A buffer computed from a sharded parameter gets the real value: buffers are never sharded.
        if deferred.record_of(buffer) is not None:
            return deferred.realize(buffer).detach().clone()
        return None

    original_deepcopy = nn.Parameter.__deepcopy__

    def deepcopy_parameter(self, memo):
        # nn.TransformerEncoder and friends deep-copy a prototype layer. Copying a deferred
        # parameter copies this rank's shard (no communication) into a new deferred parameter.
        record = deferred.record_of(self)
        if record is None or not isinstance(record, deferred.Shards):
            return original_deepcopy(self, memo)
        if id(self) in memo:
            return memo[id(self)]
        copy = nn.Parameter(torch.empty(self.shape, dtype=self.dtype, device="meta"), self.requires_grad)
        clone = object.__new__(deferred.Shards)
        clone.__dict__.update(record.__dict__)
        clone.shard = record.shard.clone()
        deferred.track(copy, clone)
        memo[id(self)] = copy
        return copy

    handles = [module_mod.register_module_parameter_registration_hook(on_parameter),
               module_mod.register_module_buffer_registration_hook(on_buffer)]
    _active = True
    nn.Parameter.__deepcopy__ = deepcopy_parameter
    try:
        with deferred.DeferredMode():
            yield
    finally:
        nn.Parameter.__deepcopy__ = original_deepcopy
        for h in handles:
            h.remove()
        _active = False


def deferred_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if deferred.record_of(p) is not None]


def check_group(module: nn.Module, group, name: str) -> None:
    """A model built under init_context must be initialised over a group of the same ranks in
    the same order: each rank holds the slice its group rank named then."""
    params = deferred_parameters(module)
    if not params:
        return
    rec = deferred.record_of(params[0])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if (rec.world, rec.rank) != (world, rank):
        raise ValueError(f"{name}: model was built under zeroplus.init_context with a process group of "
                         f"{rec.world} ranks (this rank {rec.rank}); process_group has {world} ranks (this rank "
                         f"{rank}); pass the same group to both")
