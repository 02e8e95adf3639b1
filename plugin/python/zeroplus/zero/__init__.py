"""ZeRO stages 1-2 behind one call: zeroplus.initialize (see docs/zero.md)."""

from .grad_scaler import GradScaler
from .initialize import initialize
from .loss_scaler import DynamicLossScaler, LossScalerOptions
from .memory import estimate_memory, memory_report
from .stage2 import Stage1Optimizer, Stage2Optimizer

__all__ = ["GradScaler", "initialize", "estimate_memory", "memory_report", "Stage1Optimizer", "Stage2Optimizer",
           "DynamicLossScaler", "LossScalerOptions"]
