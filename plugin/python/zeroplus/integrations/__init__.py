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

import warnings

_warned_backend = False


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


def warn_if_not_zeroplus(where: str) -> None:
    """One UserWarning per process when the default process group is not on backend "zeroplus"
    (a script that forgot dist.init_process_group("zeroplus") before the framework made its own
    group trains on gloo or nccl without a word otherwise)."""
    global _warned_backend
    import torch.distributed as dist

    if _warned_backend or not dist.is_initialized():
        return
    backend = str(dist.get_backend())
    if "zeroplus" in backend:
        return
    _warned_backend = True
    warnings.warn(f"{where}: the default process group runs on backend {backend!r}, not 'zeroplus'; call "
                  f"dist.init_process_group(backend='zeroplus') before the framework creates its group "
                  f"(TrainingArguments, Accelerator, Lightning's Trainer)", UserWarning, stacklevel=3)
