"""The two methods a ZeRO engine puts on the user's own module: `no_sync()` and `zero_grad()`.

A DDP script calls `model.no_sync()` for gradient accumulation and often `model.zero_grad()`
instead of `opt.zero_grad()`. Under DDP the latter clears every `p.grad`, which is where DDP
keeps gradients; the engine keeps the reduced gradients in its own accumulators, so the
module's zero_grad must clear those too, or gradients silently accumulate across steps.

Both are instance attributes holding weak references (the model does not keep the optimizer
alive). A deepcopy of the model (an EMA copy) is not managed by the engine: the copies of these
attributes fall back to the module class's own zero_grad and to a no-op no_sync, instead of
copying the engine or clearing the original's gradients.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


class _EngineModuleMethod:
    def __init__(self, engine, module: torch.nn.Module, name: str):
        self._engine = weakref.ref(engine)
        self._module = weakref.ref(module)
        self._name = name

    def __call__(self, *args, **kwargs):
        engine, module = self._engine(), self._module()
        if self._name == "no_sync":
            return engine.no_sync() if engine is not None else contextlib.nullcontext()
        # zero_grad: the module's own (its class may override it), then the engine's gradients.
        type(module).zero_grad(module, *args, **kwargs)
        if engine is not None:
            set_to_none = kwargs.get("set_to_none", args[0] if args else True)
            engine.zero_grad(set_to_none=set_to_none)

    def __deepcopy__(self, memo):
        copy = memo.get(id(self._module()))
        if copy is None:  # the method copied without its module: nothing to bind to
            return self
        if self._name == "no_sync":
            return contextlib.nullcontext
        return type(copy).zero_grad.__get__(copy)


def install(engine, module: torch.nn.Module) -> None:
    """module.no_sync() and module.zero_grad() act on `engine` (see the module doc)."""
    for name in ("no_sync", "zero_grad"):
        object.__setattr__(module, name, _EngineModuleMethod(engine, module, name))
