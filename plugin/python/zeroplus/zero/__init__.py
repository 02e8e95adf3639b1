"""ZeRO stages 1-3 behind one call: zeroplus.initialize (see docs/zero.md)."""

import functools

from .full_state import full_state_dict
from .gather_agreement import RankDivergenceError
from .grad_views import ShardedGrad
from .grad_scaler import GradScaler
from .sharded_init import init_context
from .initialize import initialize
from .loss_scaler import DynamicLossScaler, LossScalerOptions
from .memory import estimate_memory, memory_report
from .stages import Stage1Optimizer, Stage2Optimizer, Stage3Optimizer
from .policies import EngineOptions, PrecisionPolicy, Stage3Policy
from ..offload.policy import parse_offload
from ..optim import zero as _zero_redundancy


def _engine_from_params(engine, params, optimizer_class, *, process_group=None, mixed_precision=None,
                        reduce_bucket_elems=None, offload_optimizer=None, offload_param=None, **defaults):
    """ZeroRedundancyOptimizer(params, ..., stage=2), or stage 1 over tensor-parallel (DTensor)
    parameters: its extra keywords become the policies (offload_optimizer as zeroplus.initialize
    takes it; offload_param is stage 3's, which ZeroRedundancyOptimizer does not build)."""
    if offload_param is not None:
        raise ValueError("ZeroRedundancyOptimizer: offload_param applies to ZeRO stage 3 only (parameters are "
                         "sharded there): use zeroplus.initialize(model, ..., stage=3, offload_param=...)")
    try:
        extra = {} if reduce_bucket_elems is None else {"reduce_bucket_elems": reduce_bucket_elems}
        if offload_optimizer is not None:
            extra["offload_optimizer"] = parse_offload("offload_optimizer", offload_optimizer)
        options = EngineOptions(precision=PrecisionPolicy(mixed_precision=mixed_precision), **extra)
    except (TypeError, ValueError) as e:
        raise type(e)(f"ZeroRedundancyOptimizer: {e}") from e
    return engine(params, optimizer_class, options=options, process_group=process_group, **defaults)


_zero_redundancy.STAGE_ENGINES[1] = functools.partial(_engine_from_params, Stage1Optimizer)
_zero_redundancy.STAGE_ENGINES[2] = functools.partial(_engine_from_params, Stage2Optimizer)

__all__ = ["EngineOptions", "PrecisionPolicy", "Stage3Policy", "full_state_dict", "GradScaler", "init_context", "initialize", "estimate_memory", "memory_report", "Stage1Optimizer",
           "Stage2Optimizer", "Stage3Optimizer", "DynamicLossScaler", "LossScalerOptions", "RankDivergenceError",
           "ShardedGrad"]
