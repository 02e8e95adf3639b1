"""Hugging Face accelerate: ZeRO stages 1-3 with an Accelerator (docs/integrations.md).

    import torch.distributed as dist; dist.init_process_group("zeroplus")   # CPU: before Accelerator (see docs)
    accelerator = Accelerator(cpu=True)
    model, opt = zeroplus.integrations.accelerate.prepare(accelerator, model, torch.optim.AdamW, stage=3, lr=3e-4)
    loader = accelerator.prepare(loader)
    ... accelerator.backward(loss); opt.step(); opt.zero_grad() ...
    accelerator.save_state(path, safe_serialization=False)   # stage 1 (stages 2-3: zeroplus.save_checkpoint(path, model, opt) directly)

prepare() builds the optimizer with zeroplus.initialize (any stage; the engine reduces gradients,
so the model is NOT wrapped in DDP: accelerate's public prepare_model(evaluation_mode=True)
marks it prepared and applies accelerate's autocast, without moving it), wraps the optimizer
with accelerator.prepare_optimizer, and registers a save_state pre-hook: at stage 1 it gathers
the optimizer state on every rank (accelerate's save_state calls state_dict() on every rank);
at stages 2-3 it refuses, since accelerate would save the sharded weights of a stage-3 model.
`safe_serialization=False`: the engine's parameters are views of its flat buffers, and
safetensors' load_model (what load_state uses for model.safetensors) refuses a model whose
tensors share one storage without covering it; torch.save's format loads them.

For the stock path (your own model wrapped by accelerator.prepare in DDP, with
zeroplus.ZeroRedundancyOptimizer), prepare() is not needed; register the same hook:

    accelerator.register_save_state_pre_hook(zeroplus.integrations.accelerate.consolidate_on_save(opt))
"""

from __future__ import annotations

from .. import zero as _zero
from . import consolidate_for_save, unwrap_optimizer


def consolidate_on_save(optimizer):
    """A save_state pre-hook (hook(models, weights, output_dir), run on every rank) that makes
    `optimizer.state_dict()` the full state for the save that follows."""
    def hook(models, weights, output_dir):
        inner = unwrap_optimizer(optimizer)
        stage = getattr(inner, "stage", 1)
        if stage >= 2:
            raise NotImplementedError(
                f"zeroplus: accelerator.save_state at stage {stage} needs zeroplus.save_checkpoint, which is not "
                f"built yet (accelerate would save this rank's shards); save the weights with "
                f"zeroplus.full_state_dict(model), or use stage=1")
        consolidate_for_save(inner)
    return hook


def prepare(accelerator, model, optimizer_class=None, *, stage=None, config=None, **kwargs):
    """(model, optimizer) for `accelerator`: zeroplus.initialize's arguments, no DDP wrap; see
    the module docstring. `mixed_precision` defaults to the accelerator's bf16; fp16 goes through
    zeroplus's own loss scaler (Accelerator(mixed_precision="no"), mixed_precision="fp16" here and
    opt.backward(loss)), since accelerator.backward would scale with accelerate's GradScaler."""
    if accelerator.mixed_precision == "fp16":
        raise ValueError("zeroplus.integrations.accelerate.prepare: Accelerator(mixed_precision='fp16') scales the "
                         "loss with accelerate's GradScaler, which the ZeRO engine does not see; use "
                         "mixed_precision='fp16' here with Accelerator(mixed_precision='no') and opt.backward(loss)")
    if "mixed_precision" not in kwargs and accelerator.mixed_precision == "bf16":
        kwargs["mixed_precision"] = "bf16"
    model, opt = _zero.initialize(model, optimizer_class, stage=stage, config=config, **kwargs)
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    opt = accelerator.prepare_optimizer(opt)
    accelerator.register_save_state_pre_hook(consolidate_on_save(opt))
    return model, opt
