"""ZeRO stages 1-3 behind one call: zeroplus.initialize (see docs/zero.md)."""

from .full_state import full_state_dict
from .stage3.gather_agreement import RankDivergenceError
from .grad_views import ShardedGrad
from .grad_scaler import GradScaler
from .stage3.sharded_init import init_context
from .initialize import initialize
from .loss_scaler import DynamicLossScaler, LossScalerOptions
from .memory import estimate_memory, memory_report
from .stages import Stage1Optimizer, Stage2Optimizer, Stage3Optimizer, engine_for_stage
from .policies import EngineOptions, PrecisionPolicy, Stage3Policy

__all__ = ["EngineOptions", "PrecisionPolicy", "Stage3Policy", "full_state_dict", "GradScaler", "init_context", "initialize", "estimate_memory", "memory_report", "Stage1Optimizer",
           "Stage2Optimizer", "Stage3Optimizer", "engine_for_stage", "DynamicLossScaler", "LossScalerOptions", "RankDivergenceError",
           "ShardedGrad"]
