"""zeroplus.ZeroRedundancyOptimizer: ZeRO stage 1 with torch's exact constructor and semantics.

Drop-in for torch.distributed.optim.ZeroRedundancyOptimizer (same partition, state_dict format,
consolidate_state_dict, join support, LR schedulers, bucket view). Two things change:
  * the partition is computed by the C++ shard planner (optimizers/core/shard_planner.hpp,
    op zeroplus::partition_params), which reproduces torch's sorted-greedy policy exactly;
  * when optimizer_class is torch.optim.Adam, AdamW or SGD (and overlap_with_ddp is False),
    the local shard optimizer is zeroplus's fused twin (zeroplus.optim.fused), a subclass of the
    torch class, so isinstance checks and state_dicts are unchanged; any other class, or options
    the kernels do not support, run torch's generic implementation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZeroRedundancyOptimizer

from .fused import fused_class_for


class ZeroRedundancyOptimizer(_TorchZeroRedundancyOptimizer):
    def __init__(
        self,
        params,
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ):
        # The DDP-overlap path maps torch classes to functional twins; leave that mapping alone.
        if not overlap_with_ddp:
            optimizer_class = fused_class_for(optimizer_class) or optimizer_class
        super().__init__(
            params,
            optimizer_class,
            process_group=process_group,
            parameters_as_bucket_view=parameters_as_bucket_view,
            overlap_with_ddp=overlap_with_ddp,
            **defaults,
        )

    def _partition_parameters(self, params_per_rank=None):
        # Manual partitions (DDP overlap) and the cached plan keep torch's code path.
        if params_per_rank is not None or len(self._partition_parameters_cache) != 0:
            return super()._partition_parameters(params_per_rank)
        sizes = [len(g["params"]) for g in self.param_groups]
        flat = [p for g in self.param_groups for p in g["params"]]
        pairs = torch.ops.zeroplus.partition_params([p.numel() for p in flat], sizes, self.world_size)
        self._partition_parameters_cache = [[] for _ in range(self.world_size)]
        k = 0
        for group, n in zip(self.param_groups, sizes):
            per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
            for _ in range(n):  # (rank, flat index) pairs, in torch's assignment order
                per_rank[pairs[2 * k]].append(flat[pairs[2 * k + 1]])
                k += 1
            self._partition_param_group(group, per_rank)
        return self._partition_parameters_cache
