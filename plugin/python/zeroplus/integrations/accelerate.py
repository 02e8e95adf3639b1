"""Hugging Face accelerate: ZeRO stages 1-3 with an Accelerator (docs/integrations.md).

    import torch.distributed as dist; dist.init_process_group("zeroplus")   # CPU: before Accelerator (see docs)
    accelerator = Accelerator(cpu=True)
    model, opt = zeroplus.integrations.accelerate.prepare(accelerator, model, torch.optim.AdamW, stage=3, lr=3e-4)
    loader = accelerator.prepare(loader)
    ... accelerator.backward(loss); opt.step(); opt.zero_grad() ...
    accelerator.save_state(path)        # any stage; accelerator.load_state(path) resumes (any world size/stage)

prepare() builds the optimizer with zeroplus.initialize (any stage; the engine reduces gradients,
so the model is NOT wrapped in DDP: accelerate's public prepare_model(evaluation_mode=True)
marks it prepared and applies accelerate's autocast, without moving it) and registers it with
the accelerator as a ZeroPlusOptimizer (accelerate's AcceleratedOptimizer: steps skipped while
accumulating, as for any optimizer).

Checkpoints, as accelerate drives DeepSpeed's engine: save_state's pre-hook writes the model and
the optimizer state with zeroplus.save_checkpoint into PATH/zeroplus (collective, each rank its
shards) and takes this model's weights out of what accelerate saves (the pattern of accelerate's
hook documentation); the optimizer file accelerate writes holds only a reference to PATH/zeroplus.
load_state's pre-hook loads PATH/zeroplus (at any world size and stage) and takes the model out
of what accelerate loads; the optimizer's load of the reference checks that the hook ran.
At stage 3 `accelerator.get_state_dict(model)` returns zeroplus.full_state_dict(model)
(collective, as accelerate's own DeepSpeed ZeRO-3 path: the full weights on rank 0, {} elsewhere),
since the model's own state_dict() refuses to return shards (zeroplus.zero.state_dict_guard);
save_state's own call gets {} (its hook saves the weights). Schedulers, RNG states and dataloaders
go through accelerate's own files. The hooks hold the model
and optimizer weakly: after accelerator.free_memory() (or once the user dropped them) the engine,
its memory and its swap files go, as they would without the accelerator.

For the stock path (your own model wrapped by accelerator.prepare in DDP, with
zeroplus.ZeroRedundancyOptimizer), prepare() is not needed; register the consolidating hook:

    accelerator.register_save_state_pre_hook(zeroplus.integrations.accelerate.consolidate_on_save(opt))
"""

from __future__ import annotations

import sys
import weakref

from accelerate.optimizer import AcceleratedOptimizer

from .. import zero as _zero
from . import checkpoint_dir, consolidate_for_save, unwrap_optimizer, warn_if_not_zeroplus

_REFERENCE_KEY = "zeroplus_checkpoint"


class ZeroPlusOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper around a zeroplus engine whose checkpoint is written by
    prepare()'s save_state hook. state_dict() answers the engine's own state dict, except during
    save_state (after the hook wrote PATH/zeroplus): then a reference to it, so that accelerate's
    optimizer file does not duplicate (rank 0's shard of) the state."""

    _is_accelerate_prepared = True  # accelerator.prepare_optimizer registers it as it is

    def __init__(self, optimizer, scaler=None):
        super().__init__(optimizer, device_placement=False, scaler=scaler)
        self.zeroplus_saved_to = None   # set by the save_state hook, cleared by the next state_dict()
        self.zeroplus_loaded_from = None  # set by the load_state hook
        self._skipped_by_engine = False

    def backward(self, loss, **kwargs):
        """The engine's backward (fp16: scaled by its loss scale), with the loss divided by the
        accelerator's gradient_accumulation_steps as accelerator.backward divides it."""
        return self.optimizer.backward(loss / self.gradient_state.num_steps, **kwargs)

    def step(self, closure=None):
        # An fp16 engine skips a step on overflow by itself (its loss scaler): report it as
        # accelerate reports its GradScaler's skips (step_was_skipped), so that schedulers wait.
        before = getattr(self.optimizer, "skipped_steps", 0)
        result = super().step(closure)
        self._skipped_by_engine = getattr(self.optimizer, "skipped_steps", 0) != before
        return result

    @property
    def step_was_skipped(self):
        return self._skipped_by_engine or super().step_was_skipped

    def state_dict(self):
        if self.zeroplus_saved_to is None:
            return self.optimizer.state_dict()
        reference, self.zeroplus_saved_to = {_REFERENCE_KEY: checkpoint_dir.SUBDIR}, None
        return reference

    def load_state_dict(self, state_dict):
        if not (isinstance(state_dict, dict) and _REFERENCE_KEY in state_dict):
            return self.optimizer.load_state_dict(state_dict)
        if self.zeroplus_loaded_from is None:
            raise ValueError("ZeroPlusOptimizer.load_state_dict: this optimizer file refers to a zeroplus checkpoint "
                             f"({state_dict[_REFERENCE_KEY]}/ beside it); load it with accelerator.load_state on an "
                             "accelerator set up by zeroplus.integrations.accelerate.prepare")
        self.zeroplus_loaded_from = None


def _save_hook(model, opt: ZeroPlusOptimizer):
    # The accelerator keeps its hooks for its whole life, also after free_memory() dropped its
    # models and optimizers: the hooks hold them weakly, so that they (the engine's memory, its
    # swap files) can go then. A hook whose model is gone has nothing to save.
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)

    def hook(models, weights, output_dir):
        model, opt = model_ref(), opt_ref()
        if model is None or opt is None:
            return
        for i, m in enumerate(models):
            if m is model:
                checkpoint_dir.save(output_dir, model, opt.optimizer, "accelerator.save_state")
                opt.zeroplus_saved_to = output_dir
                weights.pop(i)  # written by zeroplus.save_checkpoint (models and weights are index-aligned)
                return
    return hook


def _load_hook(model, opt: ZeroPlusOptimizer):
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)  # as _save_hook's

    def hook(models, input_dir):
        model, opt = model_ref(), opt_ref()
        if model is None or opt is None:
            return
        for i, m in enumerate(models):
            if m is model:
                checkpoint_dir.load(input_dir, model, opt.optimizer, "accelerator.load_state")
                opt.zeroplus_loaded_from = input_dir
                models.pop(i)
                return
    return hook


def consolidate_on_save(optimizer):
    """A save_state pre-hook (hook(models, weights, output_dir), run on every rank) that makes
    `optimizer.state_dict()` of a zeroplus.ZeroRedundancyOptimizer the full state for the save
    that follows (the stock path: DDP + ZeroRedundancyOptimizer through accelerator.prepare)."""
    optimizer_ref = weakref.ref(optimizer)  # as _save_hook's: the hook does not keep it alive

    def hook(models, weights, output_dir):
        optimizer = optimizer_ref()
        if optimizer is not None:
            consolidate_for_save(unwrap_optimizer(optimizer))
    return hook


def prepare(accelerator, model, optimizer_class=None, *, stage=None, config=None, **kwargs):
    """(model, optimizer) for `accelerator`: zeroplus.initialize's arguments (optimizer_class may be
    the user's own torch optimizer instance, its groups taken over), no DDP wrap; see
    the module docstring. `mixed_precision` defaults to the accelerator's bf16; fp16 goes through
    zeroplus's own loss scaler (Accelerator(mixed_precision="no"), mixed_precision="fp16" here and
    opt.backward(loss)), since accelerator.backward would scale with accelerate's GradScaler."""
    warn_if_not_zeroplus("zeroplus.integrations.accelerate.prepare")
    if accelerator.mixed_precision == "fp16":
        raise ValueError("zeroplus.integrations.accelerate.prepare: Accelerator(mixed_precision='fp16') scales the "
                         "loss with accelerate's GradScaler, which the ZeRO engine does not see; use "
                         "mixed_precision='fp16' here with Accelerator(mixed_precision='no') and opt.backward(loss)")
    if "mixed_precision" not in kwargs and accelerator.mixed_precision == "bf16":
        kwargs["mixed_precision"] = "bf16"
    model, engine = _zero.initialize(model, optimizer_class, stage=stage, config=config, **kwargs)
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    opt = accelerator.prepare_optimizer(ZeroPlusOptimizer(engine, scaler=accelerator.scaler))
    accelerator.register_save_state_pre_hook(_save_hook(model, opt))
    accelerator.register_load_state_pre_hook(_load_hook(model, opt))
    if engine.placement.gatherer is not None:
        _route_get_state_dict(accelerator, model)
    return model, opt


def _route_get_state_dict(accelerator, model) -> None:
    """accelerator.get_state_dict of this stage-3 model (see the module doc); other models as before."""
    original = accelerator.get_state_dict
    model_ref = weakref.ref(model)

    def get_state_dict(m, unwrap=True):
        ours = model_ref()
        if ours is None or (m is not ours and accelerator.unwrap_model(m) is not ours):
            return original(m, unwrap=unwrap)
        caller = sys._getframe(1)
        if caller.f_code.co_name == "save_state" and caller.f_globals.get("__name__", "").startswith("accelerate"):
            return {}  # save_state: its pre-hook writes the weights with zeroplus.save_checkpoint
        return _zero.full_state_dict(ours)

    accelerator.get_state_dict = get_state_dict
