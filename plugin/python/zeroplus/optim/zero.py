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

State dicts (what frameworks need, beyond torch's contract; docs/integrations.md):

  * `state_dict()` before any rank stepped or loaded state needs no communication: every rank
    knows the (empty) state and the param groups, so it answers at once, in torch's format. This
    is what accelerate's `prepare` (and so HF's Trainer) calls on every optimizer.
  * `consolidate_state_dict(to=None)` keeps the consolidated state on every rank (one
    all_gather_object instead of torch's one broadcast per rank), for callers that run
    `state_dict()` on every rank (accelerate's `save_state`); `to=<rank>` is torch's.
  * an unconsolidated `state_dict()` raises torch's RuntimeError, with the line that fixes it
    for HF's Trainer and accelerate appended.

overlap_with_ddp=True keeps torch's machinery (functional local optimizer, DDP comm hooks
hook_with_zero_step / hook_with_zero_step_interleaved). Those hooks refuse the Gloo backend with
torch's RuntimeError ("Gloo backend using Overlapping DDP with ZeRO may meet hangs"); they run on
the zeroplus backend and on NCCL.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from .fused import fused_class_for

# Staging-chunk size for parameters_as_bucket_view=False: large enough that a chunk's broadcast
# is bandwidth-bound (docs: 2-8 MiB already reach ~90% of loopback peak), small enough to bound
# the largest single message.
SYNC_BUCKET_CAP_BYTES = 32 << 20

# Keywords that are options of that engine, not of optimizer_class (offload_param is refused there
# with its reason: it is stage 3's).
ENGINE_KEYWORDS = ("mixed_precision", "reduce_bucket_elems", "offload_optimizer", "offload_param")


class ZeroRedundancyOptimizer(_TorchZeroRedundancyOptimizer):
    def __new__(cls, params, optimizer_class=None, process_group=None, parameters_as_bucket_view=False,
                overlap_with_ddp=False, *, stage=1, **defaults):
        """stage=1 (default) is torch's ZeroRedundancyOptimizer; stage=2 returns the zeroplus
        ZeRO-2 engine (zeroplus.zero.Stage2Optimizer) over the same params, for models that are
        NOT wrapped in DDP. Extra stage-2 keywords: mixed_precision, reduce_bucket_elems,
        offload_optimizer (ENGINE_KEYWORDS; refused by name at stage 1, where torch's class runs).
        Tensor-parallel params (DTensors, torch.distributed.tensor.parallel) at stage 1 give the
        engine's Stage1Optimizer (process_group: the data-parallel group; docs/tensor_parallel.md)."""
        if stage == 3 and not isinstance(stage, bool):
            # Stage 3 shards the parameters, so it needs the model's forward hooks.
            raise ValueError("ZeroRedundancyOptimizer: stage=3 needs the model (parameters are gathered in its "
                             "forward): use model, opt = zeroplus.initialize(model, opt, stage=3) with your optimizer "
                             "(its param groups are taken over)")
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(f"ZeroRedundancyOptimizer: stage must be 1 or 2, got {stage!r}")
        params, tensor_parallel = _with_dtensor(params)
        engine_only = sorted(k for k in ENGINE_KEYWORDS if k in defaults)
        if stage == 1 and not tensor_parallel and engine_only:
            # torch's stage 1 would hand them to optimizer_class, which fails with a TypeError
            # that does not say why: they are options of zeroplus's engine.
            raise ValueError(f"ZeroRedundancyOptimizer: {', '.join(engine_only)} "
                             f"{'needs' if len(engine_only) == 1 else 'need'} zeroplus's ZeRO engine, which "
                             f"stage=1 (torch's ZeroRedundancyOptimizer, for a DDP-wrapped model) does not use: pass "
                             f"stage=2 here (a model not wrapped in DDP), or zeroplus.initialize(model, ..., stage=1, "
                             f"...) for stage 1")
        if stage == 1 and not tensor_parallel:
            obj = super().__new__(cls)
            obj._zp_params = params  # a generator was read here: __init__ takes the list
            return obj
        if overlap_with_ddp:
            raise ValueError("ZeroRedundancyOptimizer: overlap_with_ddp=True needs DDP and stage=1 without "
                             "tensor-parallel (DTensor) params; the ZeRO engine reduces gradients itself")
        # Stage 2, or tensor-parallel params at stage 1 (torch's per-parameter broadcasts have no
        # DTensor rule): the ZeRO engine, over local tensors (docs/tensor_parallel.md).
        # zeroplus.zero builds on this package's fused kernels, so it is imported here, when an
        # engine is asked for, never when this module is.
        from ..zero.stages import engine_for_stage

        return engine_for_stage(stage)(params, optimizer_class, process_group=process_group, **defaults)

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
        params = self.__dict__.pop("_zp_params", params)
        self._zp_sync = None  # set before torch's __init__, which calls _build_param_buckets()
        self._zp_stateless = True  # no rank has stepped or loaded state yet (step/load are collective)
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

    # -- state dicts -----------------------------------------------------------------------------

    def step(self, closure=None, **kwargs):
        self._zp_stateless = False
        return super().step(closure, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if any(v is not None for v in state_dict.get("state", {}).values()):
            self._zp_stateless = False
        super().load_state_dict(state_dict)

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """torch's consolidate_state_dict(to); to=None consolidates on every rank."""
        if to is not None:
            return super().consolidate_state_dict(to)
        self._check_overlap_initialized()
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, _to_cpu(self.optim.state_dict()), group=self.process_group)
        self._all_state_dicts = gathered
        return None

    def state_dict(self) -> dict[str, Any]:
        if not self._all_state_dicts and self._zp_stateless:
            return self._stateless_state_dict()
        try:
            return super().state_dict()
        except RuntimeError as e:
            if "has not been consolidated" not in str(e):
                raise
            raise RuntimeError(f"{e} zeroplus: HF Trainer: use zeroplus.integrations.transformers.ZeroPlusTrainer or "
                               f"add callbacks=[zeroplus.integrations.transformers.ConsolidateOnSave()]; accelerate: "
                               f"zeroplus.integrations.accelerate.prepare(...) (it consolidates before save_state); "
                               f"docs/integrations.md") from None

    def _stateless_state_dict(self) -> dict[str, Any]:
        """torch's consolidated format with empty state, built locally: each rank's local
        state_dict would hold its groups' hyperparameters and local indices, no state."""
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        locals_ = []
        for rank_groups in self._partition_parameters():
            index, groups = 0, []
            for group in rank_groups:
                n = len(group["params"])
                groups.append({**{k: v for k, v in group.items() if k != "params"},
                               "params": list(range(index, index + n))})
                index += n
            locals_.append({"state": {}, "param_groups": groups})
        self._all_state_dicts = locals_
        try:
            return super().state_dict()
        finally:
            self._all_state_dicts = []  # a later state_dict() after a step still needs consolidation


def _with_dtensor(params):
    """(params with every generator read into a list, whether any parameter is a DTensor). Anything
    malformed is passed on unchanged: torch's constructor names the problem."""
    if isinstance(params, torch.Tensor):
        return params, False
    try:
        params = list(params)
    except TypeError:
        return params, False
    found, out = False, []
    for item in params:
        group = item.get("params", ()) if isinstance(item, dict) else (item,)
        if isinstance(group, torch.Tensor):
            group = (group,)
        elif isinstance(item, dict) and not isinstance(group, (list, tuple)):
            try:  # a generator inside a group dict: read once, here, for both of us
                group = list(group)
                item = {**item, "params": group}
            except TypeError:
                pass
        found = found or any(isinstance(p, DTensor) for p in group if isinstance(p, torch.Tensor))
        out.append(item)
    return out, found


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
