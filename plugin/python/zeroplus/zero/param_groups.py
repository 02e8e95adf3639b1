"""What zeroplus.initialize builds its optimizer from: the user's torch optimizer, or a class.

    model, opt = zeroplus.initialize(model, opt, stage=3)                        # the user's own instance
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, params=groups, lr=3e-4, stage=3)
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, lr=3e-4, stage=3)  # model.parameters()

One owner of "which group a parameter belongs to": the engine's `param_groups`. Given an
instance they ARE the instance's group dicts (the same objects, hyperparameters and extra keys
included), so an LR scheduler built on the instance before initialize keeps acting on the groups
the engine steps with (it only reads and writes `param_groups`): it is rebound, not ignored.
The engine (layout.py) gives each group its own buckets, so a bucket's step uses one group's
hyperparameters (bucket_optimizer.py).

Parameters that no group names (frozen, or deliberately not optimized) are never stepped. They
stay whole on every rank at stages 1-2 and are sharded and gathered like the others at stage 3
(its frozen buckets); rank 0's values are broadcast at initialize, as DDP does.

The instance is retired once the engine exists (`retire`): its state (if it stepped or loaded a
state dict) is loaded into the engine, and its step/zero_grad/add_param_group/state_dict/
load_state_dict raise RuntimeError naming the optimizer to use instead, since they would
silently act on nothing the engine reads. Its `_opt_called` flag follows the engine's steps, so
torch's LRScheduler check ("lr_scheduler.step() before optimizer.step()") stays quiet.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

# Group keys that are bookkeeping, not constructor arguments of the optimizer class.
_NOT_ARGUMENTS = ("params", "initial_lr")
_RETIRED_METHODS = ("step", "zero_grad", "add_param_group", "state_dict", "load_state_dict")


@dataclass
class Source:
    """The engine's inputs: optimizer class, params (None: model.parameters()), the constructor
    defaults, and the user's instance to retire (None for a class)."""
    optimizer_class: Any
    params: Any = None
    defaults: dict = field(default_factory=dict)
    instance: torch.optim.Optimizer | None = None


def _is_zeroplus_optimizer(opt) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from .engine import ZeroEngine
    return isinstance(opt, (ZeroEngine, TorchZero))


def constructor_defaults(instance: torch.optim.Optimizer) -> dict:
    """The instance's defaults that its class's constructor takes (a group also carries derived
    keys, e.g. AdamW's decoupled_weight_decay, which the constructor would refuse)."""
    accepted = inspect.signature(type(instance).__init__).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return {k: v for k, v in instance.defaults.items()
            if k not in _NOT_ARGUMENTS and (takes_kwargs or k in accepted)}


def source(optimizer, params) -> Source:
    """Checks the optimizer argument of zeroplus.initialize (a torch.optim.Optimizer instance, a
    subclass, or None for the config's) and params (groups as torch.optim takes them, only with a
    class). Changes nothing."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if _is_zeroplus_optimizer(optimizer):
            raise ValueError(f"zeroplus.initialize: optimizer is already a ZeRO optimizer "
                             f"({type(optimizer).__name__}); pass the plain torch optimizer (or its class)")
        if params is not None:
            raise ValueError("zeroplus.initialize: params= is for an optimizer class; the optimizer instance's own "
                             "param_groups are the groups")
        if not optimizer.param_groups:
            raise ValueError("zeroplus.initialize: the optimizer has no param groups")
        return Source(type(optimizer), optimizer.param_groups, constructor_defaults(optimizer), optimizer)
    if params is not None:
        if isinstance(params, torch.Tensor) or isinstance(params, (dict, set, str)):
            raise TypeError(f"zeroplus.initialize: params must be an iterable of parameters or of param group dicts "
                            f"(as torch.optim takes them), got {type(params).__name__}")
        try:
            params = list(params)
        except TypeError:
            raise TypeError(f"zeroplus.initialize: params must be an iterable of parameters or of param group "
                            f"dicts, got {type(params).__name__}") from None
        if not params:
            raise ValueError("zeroplus.initialize: params is empty")
    return Source(optimizer, params)


def check_instance_settings(src: Source, leftover: dict, has_config_optimizer: bool, tensor_parallel: bool) -> None:
    """With an instance, hyperparameters come from it alone: keyword hyperparameters or a config
    optimizer block would silently lose to (or override) the instance's groups."""
    if src.instance is None:
        return
    if tensor_parallel and any(src.instance.state.values()):
        raise ValueError("zeroplus.initialize: the optimizer already has state (it stepped or loaded a state dict) and "
                         "tensor_parallel replaces the model's parameters; pass a fresh optimizer and load the state "
                         "into the returned one (opt.load_state_dict or zeroplus.load_checkpoint)")
    if has_config_optimizer:
        raise ValueError("zeroplus.initialize: config['optimizer'] and an optimizer instance both give the optimizer; "
                         "drop one (the instance's param groups carry its hyperparameters)")
    if leftover:
        raise ValueError(f"zeroplus.initialize: {sorted(leftover)} given beside an optimizer instance; set them on the "
                         f"instance's param groups (or pass the optimizer class with these keywords)")


def check_membership(model: torch.nn.Module, groups) -> list:
    """Every parameter in the groups belongs to `model` (the engine flattens and hooks the
    model's parameters; a stranger would be stepped but never reduced or gathered). Returns the
    groups with every dict group's params a list (a generator is read once, here)."""
    in_model = {id(p) for p in model.parameters()}
    out = []
    for gi, g in enumerate(groups):
        if isinstance(g, dict):
            members = g["params"]
            members = [members] if isinstance(members, torch.Tensor) else list(members)
            g["params"] = members
        else:
            members = [g]
        out.append(g)
        for p in members:
            p = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # (name, parameter), as torch.optim takes
            if isinstance(p, torch.Tensor) and id(p) not in in_model:
                raise ValueError(f"zeroplus.initialize: param group {gi} has a parameter of shape {tuple(p.shape)} "
                                 f"that is not a parameter of model")
    return out


def parameter_names(model: torch.nn.Module, groups) -> list:
    """The groups as parameter names (per dict group, or per bare parameter), so that
    rebind_to_model can find them again after tensor parallelism replaced the Parameters."""
    name_of = {id(p): n for n, p in model.named_parameters()}

    def name(item):  # a parameter, or a (name, parameter) pair as torch.optim also takes
        return name_of[id(item[1] if isinstance(item, tuple) else item)]
    return [[name(p) for p in g["params"]] if isinstance(g, dict) else name(g) for g in groups]


def rebind_to_model(model: torch.nn.Module, groups: list, names: list) -> None:
    """After torch's parallelize_module replaced the model's Parameters with DTensor ones: every
    group names the model's new Parameters again (dict groups in place: with an optimizer
    instance they are its groups, so LR schedulers built on it keep working)."""
    named = dict(model.named_parameters())
    for i, (g, n) in enumerate(zip(groups, names)):
        if isinstance(g, dict):
            g["params"] = [named[x] for x in n]
        else:
            groups[i] = named[n]


class _Retired:
    """A method of a retired optimizer instance: raises, naming the engine's method."""

    def __init__(self, name: str, engine):
        self._name = name
        self._engine = weakref.ref(engine)
        self._wrapped_by_lr_sched = True  # torch's LRScheduler checks that step is still its wrapper

    def __call__(self, *args, **kwargs):
        engine = self._engine()
        what = type(engine).__name__ if engine is not None else "the optimizer zeroplus.initialize returned"
        raise RuntimeError(f"this {self._name}() belongs to the torch optimizer that zeroplus.initialize took over "
                           f"(its param groups and state now belong to the {what} it returned); call "
                           f"{self._name}() on the optimizer that zeroplus.initialize returned")


def retire(instance: torch.optim.Optimizer, engine) -> None:
    """After the engine is built over instance.param_groups: move its state in (the plain
    torch.optim format: each rank keeps its own slices, no communication), then make the
    instance's methods raise (see the module doc)."""
    if any(instance.state.values()):
        engine.load_state_dict(instance.state_dict())
        instance.state.clear()  # now the engine's (sharded); a full copy here would undo ZeRO's saving
    ref = weakref.ref(instance)

    def mark_stepped(opt, args, kwargs):
        inst = ref()
        if inst is not None:
            inst._opt_called = True  # what torch's LRScheduler step wrapper records

    engine.register_step_post_hook(mark_stepped)
    for name in _RETIRED_METHODS:
        setattr(instance, name, _Retired(name, engine))
