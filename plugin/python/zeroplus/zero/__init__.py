"""ZeRO stages 1-2 behind one call: zeroplus.initialize (see docs/zero.md)."""

from .initialize import initialize
from .loss_scaler import DynamicLossScaler, LossScalerOptions
from .memory import estimate_memory, memory_report
from .stage2 import Stage1Optimizer, Stage2Optimizer

__all__ = ["initialize", "estimate_memory", "memory_report", "Stage1Optimizer", "Stage2Optimizer",
           "DynamicLossScaler", "LossScalerOptions"]
