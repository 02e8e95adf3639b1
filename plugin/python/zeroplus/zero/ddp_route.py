"""Stage 1 in fp32: DistributedDataParallel + ZeroRedundancyOptimizer, with the user's module kept.

zeroplus.initialize promises that `model` stays the user's object (same class, same forward, same
state_dict keys). DDP normally wraps the module; here DDP wraps a small private root that calls
the module's original forward, and the module's `forward` attribute routes calls through DDP. The
module's own hooks therefore run once, outside DDP; its state_dict and named_parameters are
untouched (the DDP object is stored without registering it as a submodule), and `model.no_sync()`
is DDP's.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


class _Root(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, forward):
        super().__init__()
        self.model = model
        object.__setattr__(self, "_forward", forward)

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)


def route_through_ddp(model: torch.nn.Module, process_group=None, **ddp_kwargs) -> DistributedDataParallel:
    original = model.forward
    ddp = DistributedDataParallel(_Root(model, original), process_group=process_group, **ddp_kwargs)

    def forward(*args, **kwargs):
        return ddp(*args, **kwargs)

    object.__setattr__(model, "forward", forward)
    object.__setattr__(model, "no_sync", ddp.no_sync)
    object.__setattr__(model, "_zeroplus_ddp", ddp)
    return ddp
