"""zeroplus.ZeroRedundancyOptimizer: ZeRO stage 1 with torch's exact constructor and semantics.

Drop-in for torch.distributed.optim.ZeroRedundancyOptimizer (a subclass of it, hence a
torch.optim.Optimizer and a Joinable): same partition, param_groups kept in sync for LR
schedulers, add_param_group, zero_grad, consolidate_state_dict / state_dict / load_state_dict in
the plain torch.optim format, the Join hook and torch's errors. What zeroplus changes:

  * the partition is computed by the C++ shard planner (op zeroplus::partition_params), which
    reproduces torch's sorted-greedy policy exactly;
  * the post-step parameter synchronisation is planned and run in C++ (torchbind class
    zeroplus.ZeroParamSync): instead of one broadcast per parameter, each rank's shard moves in a
    few broadcasts of flat staging chunks (at most SYNC_BUCKET_CAP_BYTES each); with
    parameters_as_bucket_view=True the buckets (same layout as torch's) are built by the same
    planner and broadcast directly;
  * when optimizer_class is torch.optim.Adam, AdamW or SGD (and overlap_with_ddp is False) the
    local shard optimizer is zeroplus's fused twin (zeroplus.optim.fused), a subclass of the torch
    class, so isinstance checks and state_dicts are unchanged; any other class, or options the
    kernels do not support, run torch's generic implementation.

overlap_with_ddp=True keeps torch's machinery (functional local optimizer, DDP comm hooks
hook_with_zero_step / hook_with_zero_step_interleaved). Those hooks refuse the Gloo backend with
torch's RuntimeError ("Gloo backend using Overlapping DDP with ZeRO may meet hangs"); they run on
the zeroplus backend and on NCCL.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZeroRedundancyOptimizer

from .fused import fused_class_for

# Staging-chunk size for parameters_as_bucket_view=False: large enough that a chunk's broadcast
# is bandwidth-bound (docs: 2-8 MiB already reach ~90% of loopback peak), small enough to bound
# the largest single message.
SYNC_BUCKET_CAP_BYTES = 32 << 20

# stage -> engine class, for ZeroRedundancyOptimizer(..., stage=2). Filled by zeroplus.zero when it
# is imported (it builds on this package's fused kernels, so this package must not import it).
STAGE_ENGINES: dict[int, type] = {}


class ZeroRedundancyOptimizer(_TorchZeroRedundancyOptimizer):
    def __new__(cls, params, optimizer_class=None, process_group=None, parameters_as_bucket_view=False,
                overlap_with_ddp=False, *, stage=1, **defaults):
        """stage=1 (default) is torch's ZeroRedundancyOptimizer; stage=2 returns the zeroplus
        ZeRO-2 engine (zeroplus.zero.Stage2Optimizer) over the same params, for models that are
        NOT wrapped in DDP. Extra stage-2 keywords: mixed_precision, reduce_bucket_elems."""
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(f"ZeroRedundancyOptimizer: stage must be 1 or 2, got {stage!r}")
        if stage == 1:
            return super().__new__(cls)
        if overlap_with_ddp:
            raise ValueError("ZeroRedundancyOptimizer: overlap_with_ddp=True needs DDP and stage=1; stage 2 "
                             "reduces gradients itself")
        return STAGE_ENGINES[stage](params, optimizer_class, process_group=process_group, **defaults)

    def __init__(
        self,
        params,
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        stage: int = 1,
        **defaults: Any,
    ):
        self._zp_sync = None  # set before torch's __init__, which calls _build_param_buckets()
        # The DDP-overlap path maps torch classes to functional twins; leave that mapping alone.
        if not overlap_with_ddp and isinstance(optimizer_class, type):
            optimizer_class = fused_class_for(optimizer_class) or optimizer_class
        super().__init__(
            params,
            optimizer_class,
            process_group=process_group,
            parameters_as_bucket_view=parameters_as_bucket_view,
            overlap_with_ddp=overlap_with_ddp,
            **defaults,
        )

    # -- partition -------------------------------------------------------------------------------

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

    # -- parameter synchronisation (planned and executed in C++) ---------------------------------

    def _make_param_sync(self, bucket_view: bool):
        flat = [p for g in self.param_groups for p in g["params"]]
        sizes = [len(g["params"]) for g in self.param_groups]
        return torch.classes.zeroplus.ZeroParamSync(
            flat, sizes, self.process_group.boxed(), bucket_view, SYNC_BUCKET_CAP_BYTES)

    def _clear_cache(self) -> None:
        super()._clear_cache()
        self._zp_sync = None  # the managed set changed (add_param_group): re-plan lazily

    def _build_param_buckets(self) -> None:
        # Called by torch at construction, after add_param_group and when trainability changes.
        self._zp_sync = None
        if not self.parameters_as_bucket_view or self._overlap_with_ddp:
            return
        self._zp_sync = self._make_param_sync(bucket_view=True)
        flat = self._zp_sync.buckets()
        ws = self.world_size
        self._buckets = [flat[d * ws:(d + 1) * ws] for d in range(self._zp_sync.num_devices())]

    def _sync_params(self) -> None:
        if self._zp_sync is None:
            self._zp_sync = self._make_param_sync(bucket_view=bool(self.parameters_as_bucket_view))
            if self.parameters_as_bucket_view:  # rebuilt after _clear_cache: keep torch's view
                flat, ws = self._zp_sync.buckets(), self.world_size
                self._buckets = [flat[d * ws:(d + 1) * ws] for d in range(self._zp_sync.num_devices())]
        self._zp_sync.run()
