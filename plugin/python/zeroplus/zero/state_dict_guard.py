"""model.state_dict() on a ZeRO stage-3 model raises instead of returning flat shards.

Between uses a sharded parameter holds no values (its .data is a resting view: full shape, one
NaN element behind it, layout.resting_view; this rank's slice is in its bucket's shard), so
torch's Module.state_dict() would return full-shape NaN tensors (before resting views: flat
shards, {'0.weight': (256,)} for a 16 x 32 weight at 2 ranks), and a DDP script's
`torch.save(model.state_dict(), path)` would save them without a word.
Gathering inside state_dict() is no remedy: it would be a collective, and the common
`if rank == 0: torch.save(model.state_dict(), path)` would then hang rank 0 (or pair its
gathers with whatever collective the other ranks issue next). So a state_dict pre-hook on every
module that owns a sharded parameter raises on the calling rank at once (no collective, nothing
pending), naming the calls that do what the user meant:

    sd = zeroplus.full_state_dict(model)   # on EVERY rank (collective); rank 0 gets the full dict
    if rank == 0: torch.save(sd, path)
    zeroplus.checkpoint.get_state_dict(model, opt)   # torch DCP's layout (what get_state_dict gives)

torch's DCP get_state_dict / set_state_dict call model.state_dict() and so raise the same error.

The optimizer, at every stage: torch's DCP get_state_dict(model, opt) relabels the integer keys of
opt.state_dict() with parameter names, but the engine's state dict is keyed by this rank's
segments and holds shards, so it would return '0.weight': exp_avg of shape (4,) for a (32, 8)
weight, and set_state_dict would load that; dcp.save({"optim": opt}) would keep one rank's shards
under keys every rank uses. refuse_torch_dcp() (called by the engine's state_dict and
load_state_dict) raises when torch's torch.distributed.checkpoint is the caller, naming
zeroplus.checkpoint.get_state_dict / set_state_dict, which give torch's layout (sharded tensors
DCP saves and reshards). Before that, get_state_dict and set_state_dict "initialise" an optimizer
without state by setting zero gradients and lr=0 and calling step(); the engine's step is a no-op
for that caller (called_by_torch_dcp), so nothing changes and torch restores lr before the
state_dict() call that raises (set_state_dict loads the optimizer before the model: the model is
untouched too).
While a unit is gathered (inside forward or backward) its parameters are whole and state_dict()
works. zeroplus's own code that needs the live parameters (keys and identities, never values)
reads them inside `allowed()`. Persistent (small, kept whole) parameters never raise.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch

from .layout import is_resting

_LOCAL = threading.local()


@contextlib.contextmanager
def allowed():
    """zeroplus-internal: model.state_dict(keep_vars=True) for parameter identities."""
    depth = getattr(_LOCAL, "depth", 0)
    _LOCAL.depth = depth + 1
    try:
        yield
    finally:
        _LOCAL.depth = depth


_TORCH_DCP = "torch.distributed.checkpoint"
_CALLER_DEPTH = 6  # the engine method, torch.optim's step wrappers, then torch's DCP function


def called_by_torch_dcp() -> bool:
    """Whether torch.distributed.checkpoint called the engine method that calls this."""
    return _called_from_dcp_above(sys._getframe(2))  # above the engine method that called this


def refuse_torch_dcp(what: str) -> None:
    """Raise when torch.distributed.checkpoint called the engine's `what` (see the module doc)."""
    if _called_from_dcp_above(sys._getframe(2)):
        raise RuntimeError(
            f"zeroplus: torch.distributed.checkpoint called the ZeRO optimizer's {what}, whose state is this "
            f"rank's shards keyed by its own segments, not torch's per-parameter layout (torch's get_state_dict "
            f"would label shards with parameter names). Use zeroplus.checkpoint.get_state_dict(model, opt) and "
            f"zeroplus.checkpoint.set_state_dict(model, opt, model_sd, optim_sd) (torch's layout: DCP saves and "
            f"reshards it; a plain torch model and optimizer load it), or zeroplus.save_checkpoint / "
            f"load_checkpoint")


def _called_from_dcp_above(frame) -> bool:
    for _ in range(_CALLER_DEPTH):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith(_TORCH_DCP):
            return True
        frame = frame.f_back
    return False


def _gathered(p: torch.Tensor, shape) -> bool:
    """Whether p holds its values now (its unit is gathered: inside forward or backward)."""
    return not is_resting(p.data, shape) and tuple(p.shape) == tuple(shape)


def install(engine) -> None:
    """A state_dict pre-hook on each module owning a sharded (non-persistent) parameter."""
    shape_of: dict[int, torch.Size] = {}
    for b in list(engine.buckets) + list(engine.placement.frozen_buckets):
        if not b.persistent:
            for e in b.entries:
                shape_of[id(e.param)] = e.shape

    def hook(module, prefix, _keep_vars):
        if getattr(_LOCAL, "depth", 0):
            return
        for name, p in module._parameters.items():
            if p is not None and id(p) in shape_of and not _gathered(p, shape_of[id(p)]):
                raise RuntimeError(
                    f"zeroplus: model.state_dict() on a ZeRO stage-3 model would return no values for "
                    f"'{prefix}{name}' (shape {tuple(shape_of[id(p)])}): between steps this rank holds only its "
                    f"shard of it. Call zeroplus.full_state_dict(model) on every rank (collective; rank 0 gets the "
                    f"full dict: sd = zeroplus.full_state_dict(model); if rank == 0: torch.save(sd, path)), or "
                    f"zeroplus.checkpoint.get_state_dict(model, opt) for torch.distributed.checkpoint "
                    f"(docs/zero.md, 'Your DDP script's other lines')")

    for module in engine.module.modules():
        if any(p is not None and id(p) in shape_of for p in module._parameters.values()):
            module.register_state_dict_pre_hook(hook)
