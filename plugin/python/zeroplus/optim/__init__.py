"""zeroplus.optim: fused Adam/AdamW/SGD (drop-in subclasses of torch.optim) and
ZeroRedundancyOptimizer. Assumes the package __init__ has loaded libzeroplus.so, so
torch.ops.zeroplus.* are registered."""

from .fused import SGD, Adam, AdamW, fused_class_for
from .zero import ZeroRedundancyOptimizer

__all__ = ["Adam", "AdamW", "SGD", "ZeroRedundancyOptimizer", "fused_class_for"]
