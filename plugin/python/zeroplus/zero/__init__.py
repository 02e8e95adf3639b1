"""ZeRO stages 1-3 behind one call: zeroplus.initialize (see docs/zero.md)."""

from .full_state import full_state_dict
from .grad_scaler import GradScaler
from .sharded_init import init_context
from .initialize import initialize
from .loss_scaler import DynamicLossScaler, LossScalerOptions
from .memory import estimate_memory, memory_report
from .stage2 import Stage1Optimizer, Stage2Optimizer
from .stage3 import Stage3Optimizer
from ..optim import zero as _zero_redundancy

_zero_redundancy.STAGE_ENGINES[2] = Stage2Optimizer  # ZeroRedundancyOptimizer(..., stage=2)

__all__ = ["full_state_dict", "GradScaler", "init_context", "initialize", "estimate_memory", "memory_report", "Stage1Optimizer",
           "Stage2Optimizer", "Stage3Optimizer", "DynamicLossScaler", "LossScalerOptions"]
