"""Framework integrations (docs/integrations.md): one module per framework, each imported on
demand so that `import zeroplus` never imports transformers, accelerate or lightning.

    zeroplus.integrations.transformers   ZeroPlusTrainer (stages 1-3), ConsolidateOnSave
    zeroplus.integrations.accelerate     prepare(accelerator, model, optimizer_class, ...)
    zeroplus.integrations.lightning      ZeroPlusStrategy(stage=1|2|3)
    zeroplus.integrations.checkpoint_dir a zeroplus checkpoint inside a framework's checkpoint
                                         directory (what the three above save and resume with)

They build on zeroplus.initialize, zeroplus.ZeroRedundancyOptimizer and the checkpoint package's
save/load (public API).
"""

from __future__ import annotations


def unwrap_optimizer(opt):
    """The zeroplus optimizer inside a framework's wrapper (accelerate's AcceleratedOptimizer,
    Lightning's LightningOptimizer keep it as `.optimizer`)."""
    seen = 0
    while hasattr(opt, "optimizer") and not hasattr(opt, "consolidate_state_dict") and seen < 8:
        opt, seen = opt.optimizer, seen + 1
    return opt


def consolidate_for_save(opt) -> None:
    """Collective: make `state_dict()` of a zeroplus optimizer the full state, on every rank for
    zeroplus.ZeroRedundancyOptimizer (`to=None`) and on rank 0 for the stage engines."""
    from ..optim import ZeroRedundancyOptimizer

    inner = unwrap_optimizer(opt)
    if isinstance(inner, ZeroRedundancyOptimizer):
        inner.consolidate_state_dict(to=None)
    elif hasattr(inner, "consolidate_state_dict"):
        inner.consolidate_state_dict(to=0)
