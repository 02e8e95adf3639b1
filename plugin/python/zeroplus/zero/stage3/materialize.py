"""ZeRO stage 3 from a model built on the meta device: real storage one unit at a time.

    with torch.device("meta"):
        model = GPT(config)                      # no memory: shapes only
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=3e-4,
                                     param_init_fn=my_init)   # or modules' reset_parameters()

For each unit in turn, every module of the unit that directly owns meta parameters or buffers
gets uninitialised storage on the target device (the parameter objects keep their identity, so
tied weights stay tied: torch.utils.swap_tensors), then param_init_fn(module) — or
module.reset_parameters() when no function is given — fills that module's own parameters and
buffers. The stage-3 builder then broadcasts rank 0's values for the unit, keeps this rank's
shard and drops the full copy before the next unit: no rank ever holds more than one unit in
full. Init code sees full shapes: a parameter that an earlier unit already sharded (a tied
weight) is replaced by a throwaway full-size stand-in during the call, so init code can neither
fail on nor overwrite a shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import deferred


def _meta_members(module: nn.Module) -> tuple[list[str], list[str]]:
    """A module's own meta tensors that need init code (not those built under init_context)."""
    params = [n for n, p in module._parameters.items()
              if p is not None and p.is_meta and deferred.record_of(p) is None]
    bufs = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
    return params, bufs


def target_device(module: nn.Module, group) -> torch.device:
    """Where the shards live: the parameters' device, or for a meta model the current CUDA
    device under NCCL and the CPU otherwise."""
    devices = {p.device for p in module.parameters()} - {torch.device("meta")}
    if devices:
        return next(iter(devices))
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_initializable(module: nn.Module, init_fn) -> None:
    """Before anything changes: with no param_init_fn, every module owning meta tensors must have
    reset_parameters(), and meta buffers need param_init_fn unless the module resets them."""
    if init_fn is not None:
        return
    for name, sub in module.named_modules():
        params, bufs = _meta_members(sub)
        if (params or bufs) and not callable(getattr(sub, "reset_parameters", None)):
            what = ", ".join(repr(n) for n in params + bufs)
            raise ValueError(f"zeroplus.initialize: module {name or '<root>'!r} ({type(sub).__name__}) has meta "
                             f"tensors {what} and no reset_parameters(); pass param_init_fn=fn, called as fn(module) "
                             f"to initialise a module's own parameters and buffers")


class Materializer:
    def __init__(self, root: nn.Module, units, device: torch.device, init_fn):
        self.device = device
        self.init_fn = init_fn
        self.full_shape = {id(p): p.shape for p in root.parameters()}
        self.modules_of: dict[int, list[nn.Module]] = {u.index: [] for u in units}
        unit_of: dict[int, int] = {}
        for u in units[:-1]:
            for sub in u.module.modules():
                unit_of.setdefault(id(sub), u.index)
        seen = set()
        for sub in root.modules():
            if id(sub) not in seen:
                seen.add(id(sub))
                self.modules_of[unit_of.get(id(sub), units[-1].index)].append(sub)
        self.root = root

    def materialize_unit(self, unit_index: int) -> None:
        for sub in self.modules_of[unit_index]:
            # Built under init_context: gather the value (every rank, same order: a collective).
            for p in sub._parameters.values():
                if p is not None and deferred.record_of(p) is not None:
                    deferred.materialize(p, self.device)
                    p._zeroplus_built = True
            params, bufs = _meta_members(sub)
            if params or bufs:
                self._materialize(sub, params, bufs)

    def _materialize(self, module: nn.Module, params: list[str], bufs: list[str]) -> None:
        for n in params:
            p = module._parameters[n]
            real = nn.Parameter(torch.empty_like(p, device=self.device), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, real)  # same Python object: ties and optimizer groups hold
        for n in bufs:
            module._buffers[n] = torch.empty_like(module._buffers[n], device=self.device)
        standins = {}
        for n, p in module._parameters.items():
            if p is not None and (getattr(p, "_zeroplus_managed", False) or getattr(p, "_zeroplus_built", False)):
                standins[n] = p
                module._parameters[n] = nn.Parameter(torch.empty(self.full_shape[id(p)], dtype=p.dtype,
                                                                 device=self.device), requires_grad=p.requires_grad)
        try:
            with torch.no_grad():
                if self.init_fn is not None:
                    self.init_fn(module)
                else:
                    module.reset_parameters()
        finally:
            module._parameters.update(standins)

    def finish(self) -> None:
        for name, sub in self.root.named_modules():
            params, bufs = _meta_members(sub)
            if params or bufs:
                raise RuntimeError(f"zeroplus.initialize: module {name or '<root>'!r} still has meta tensors "
                                   f"{params + bufs} after materialisation")
