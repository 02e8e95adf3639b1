"""Hugging Face transformers: ZeRO stages 1-3 under the stock Trainer loop (docs/integrations.md).

    from zeroplus.integrations.transformers import ZeroPlusTrainer
    trainer = ZeroPlusTrainer(model=model, args=args, train_dataset=ds, stage=3)   # or config="ds_config.json"

ZeroPlusTrainer is transformers.Trainer with the optimizer built by zeroplus.initialize:
  * no DistributedDataParallel wrap at any stage (the engine reduces gradients itself; the model
    is marked prepared for accelerate through its public `prepare_model(evaluation_mode=True)`,
    which still applies accelerate's autocast);
  * the optimizer class, hyperparameters and param groups are the stock Trainer's own (`optim`,
    `learning_rate`, `adam_*`; `weight_decay` on the parameters get_decay_parameter_names names,
    none on biases and norms) unless the config has an `optimizer` block (then its hyperparameters
    apply to every parameter, as HF's DeepSpeed path does); `optimizers=(opt, scheduler)` gives
    your own torch optimizer instead (taken over by zeroplus.initialize: class, groups,
    hyperparameters; the scheduler built on it keeps working);
  * `bf16=True` -> mixed_precision="bf16"; `fp16=True` -> mixed_precision="fp16" with the engine's
    dynamic loss scaling (DeepSpeed's policy; the Trainer's loss.backward() carries the scale,
    a step skipped on overflow does not step the LR scheduler); `max_grad_norm` -> the engine's global-norm
    clip_grad_norm_ (across shards); gradient accumulation through the model's no_sync(), which
    zeroplus installs and accelerate calls; the LR scheduler is the Trainer's (`lr_scheduler_type`,
    warmup) or the config's `scheduler` block, built on the optimizer and stepped by the Trainer;
  * a DeepSpeed-style config (`config=`; HF's ds_config_zero2/3.json) with its "auto" values
    filled from TrainingArguments as transformers' HfTrainerDeepSpeedConfig does.

Checkpoints, at every stage, the way the Trainer drives DeepSpeed's engine: `checkpoint-N` holds
the Trainer's own files (trainer_state.json, scheduler.pt, rng_state_R.pth, the full weights
from save_model) and `checkpoint-N/zeroplus`, written by zeroplus.save_checkpoint (every rank its
shards of the weights and optimizer state). `train(resume_from_checkpoint=...)` loads that with
zeroplus.load_checkpoint once the engine exists (any world size and stage: it reshards), then
the scheduler; the Trainer restores its state and RNG. `trainer.save_model()` writes the full
weights at every stage (stage 3 gathers them with zeroplus.full_state_dict).

ConsolidateOnSave is the callback alone, for the stock Trainer with
`optimizers=(zeroplus.ZeroRedundancyOptimizer(...), None)`: the Trainer calls state_dict() on
the saving rank only, which cannot gather the other ranks' shards by itself.
"""

from __future__ import annotations

import copy
import os

import torch
from transformers import Trainer, TrainerCallback

from .. import zero as _zero
from ..zero import ds_config
from ..zero.config import load_config
from . import checkpoint_dir, consolidate_for_save, unwrap_optimizer, warn_if_not_zeroplus
from .accelerate import ZeroPlusOptimizer

_NOT_HYPERPARAMETERS = ("fused", "foreach", "capturable", "differentiable")
SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer's name for it


class _ScaleBackward(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by `scale` (in fp32)."""

    @staticmethod
    def forward(ctx, loss, scale):
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_backward(loss: torch.Tensor, scale: float) -> torch.Tensor:
    """`loss` (as fp32) whose backward is (loss.float() * scale).backward(): opt.backward's fp16
    scaling for code that calls loss.backward() itself."""
    return _ScaleBackward.apply(loss.float(), float(scale))


class ConsolidateOnSave(TrainerCallback):
    """Gathers a zeroplus optimizer's state on every rank in the step (or epoch end) whose
    checkpoint the Trainer is about to save (control.should_save, set by the Trainer's flow
    callback before this one runs)."""

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if control.should_save and optimizer is not None:
            consolidate_for_save(optimizer)

    on_epoch_end = on_step_end


def auto_values(args, model=None, num_training_steps=None) -> ds_config.AutoValues:
    """TrainingArguments as the source of a config's "auto" values (transformers' rules)."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    if hidden is None and getattr(config, "hidden_sizes", None):
        hidden = max(config.hidden_sizes)
    return ds_config.AutoValues(
        lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        fp16=bool(args.fp16 or args.fp16_full_eval), bf16=bool(args.bf16 or args.bf16_full_eval),
        micro_batch_size=args.per_device_train_batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        world_size=args.world_size, hidden_size=hidden if isinstance(hidden, int) else None,
        total_num_steps=num_training_steps,
        warmup_num_steps=None if num_training_steps is None else max(1, args.get_warmup_steps(num_training_steps)),
        check_matches=True, source="TrainingArguments")


class ZeroPlusTrainer(Trainer):
    """transformers.Trainer over zeroplus.initialize. Extra keyword arguments: `stage` (1, 2 or 3;
    or config's zero_optimization.stage) and `config` (a DeepSpeed-style dict or JSON path)."""

    def __init__(self, *args, stage: int | None = None, config=None, **kwargs):
        user_optimizer, user_scheduler = kwargs.pop("optimizers", (None, None))
        if user_optimizer is not None and not isinstance(user_optimizer, torch.optim.Optimizer):
            raise TypeError(f"ZeroPlusTrainer: optimizers[0] must be a torch.optim.Optimizer, got "
                            f"{type(user_optimizer).__name__}")
        if user_scheduler is not None and user_optimizer is None:
            raise ValueError("ZeroPlusTrainer: optimizers=(None, scheduler): a scheduler needs the optimizer it was built "
                             "on; pass optimizers=(optimizer, scheduler)")
        # The user's optimizer is taken over by zeroplus.initialize in create_optimizer (its class,
        # groups and hyperparameters); the scheduler stays the Trainer's, built on it (it writes
        # the groups the engine steps with).
        self._zp_user_optimizer = user_optimizer
        kwargs["optimizers"] = (None, user_scheduler)
        if isinstance(stage, bool) or stage not in (None, 1, 2, 3):
            raise ValueError(f"ZeroPlusTrainer: stage must be 1, 2 or 3, got {stage!r}")
        raw = copy.deepcopy(load_config(config))
        self._zp_scheduler_block = raw.pop("scheduler", None)  # built in create_scheduler (it needs the run length)
        self._zp_config = raw
        self._zp_stage = stage
        super().__init__(*args, **kwargs)
        if self.args.fp16 and self.accelerator.scaler is not None:
            # accelerate's GradScaler (made for fp16 on CUDA) would scale the loss a second time and
            # step the engine through torch's inf check; the engine's own loss scaler does both
            # (as DeepSpeed's engine does under the Trainer, where accelerate makes no scaler).
            self.accelerator.scaler = None
        if stage is None and "stage" not in raw.get("zero_optimization", {}):
            raise ValueError("ZeroPlusTrainer: no ZeRO stage: pass stage= or config['zero_optimization']['stage']")

    # -- optimizer and scheduler ---------------------------------------------------------------

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        ds = ds_config.prepare(self._zp_config, auto_values(self.args, model))
        warn_if_not_zeroplus("ZeroPlusTrainer")
        kwargs = {}
        opt_class, groups = self._zp_user_optimizer, None
        if opt_class is None and "optimizer" not in ds.engine:
            opt_class, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            kwargs = {k: v for k, v in kwargs.items() if k not in _NOT_HYPERPARAMETERS}
            groups = self._zp_param_groups(model)
        precision = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else None
        if ds.engine.get("bf16", {}).get("enabled") or ds.engine.get("fp16", {}).get("enabled"):
            precision = None  # the config says it (and was checked against TrainingArguments)
        _, engine = _zero.initialize(model, opt_class, stage=self._zp_stage, mixed_precision=precision,
                                     config=ds.engine, params=groups, **kwargs)
        self.zeroplus_stage = engine.stage
        # accelerate's wrapper that reports an fp16 step the engine skipped (overflow), so that the
        # Trainer does not step its LR scheduler for it (DeepSpeed's engine does not either).
        self.optimizer = self.accelerator.prepare_optimizer(ZeroPlusOptimizer(engine))
        # The Trainer clears gradients with model.zero_grad() (DDP style): the engine's own
        # model.zero_grad clears its gradients too (zero/module_methods.py).
        # The engine reduces gradients: accelerate must not wrap the model in DDP. prepare_model's
        # evaluation_mode skips only that (autocast still applies) and marks the model prepared,
        # so the Trainer's own prepare() call leaves it as it is. No device placement: the Trainer
        # placed the model before the engine was built, and a second model.to() (accelerate's
        # CPU device is "cpu:0", not "cpu") would swap the parameters' storage out from under the
        # engine's flat buffers.
        self.model = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        self.model_wrapped = self.model
        return self.optimizer

    def _zp_param_groups(self, model) -> list[dict]:
        """The stock Trainer's groups (Trainer.create_optimizer): weight decay on the parameters
        get_decay_parameter_names names, none on biases and norms; empty groups left out."""
        decay = set(self.get_decay_parameter_names(model))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trainable if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is not None or self._zp_scheduler_block is None:
            return super().create_scheduler(num_training_steps, optimizer)
        ds = ds_config.prepare({"scheduler": self._zp_scheduler_block},
                               auto_values(self.args, self.model, num_training_steps))
        from ..zero.schedulers import build_scheduler
        self.lr_scheduler = build_scheduler(unwrap_optimizer(optimizer or self.optimizer), ds.scheduler)
        return self.lr_scheduler

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        engine = None if self.optimizer is None else unwrap_optimizer(self.optimizer)
        if getattr(engine, "mixed_precision", None) != "fp16" or not torch.is_grad_enabled():
            return result
        # fp16: the Trainer's backward (accelerator.backward: loss.backward()) must carry the
        # engine's dynamic loss scale, as opt.backward(loss) does; the loss's value (logged) is kept.
        if return_outputs:
            return scale_backward(result[0], engine.loss_scale), result[1]
        return scale_backward(result, engine.loss_scale)

    def _clip_grad_norm(self, model):
        # The global norm across shards (the Trainer's default clips each rank's local gradients).
        return unwrap_optimizer(self.optimizer).clip_grad_norm_(self.args.max_grad_norm)

    # -- saving ----------------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir):
        # The Trainer's DeepSpeed branch calls engine.save_checkpoint(output_dir) on every rank;
        # here zeroplus.save_checkpoint writes output_dir/zeroplus (collective), and the
        # scheduler is saved by the saving rank as the Trainer saves it.
        checkpoint_dir.save(output_dir, self.model, self.optimizer, "ZeroPlusTrainer")
        if self.args.should_save and self.lr_scheduler is not None:
            checkpoint_dir.write_state_file(output_dir, SCHEDULER_NAME, self.lr_scheduler.state_dict())

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # train() calls this before the engine exists (the Trainer's non-DeepSpeed order): only
        # check that the checkpoint is one of ours; the weights come back with the optimizer
        # state in _load_optimizer_and_scheduler, after the engine is built (DeepSpeed's order).
        checkpoint_dir.require(resume_from_checkpoint, "ZeroPlusTrainer: resume_from_checkpoint")

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        checkpoint_dir.load(checkpoint, self.model, self.optimizer, "ZeroPlusTrainer: resume_from_checkpoint")
        if self.lr_scheduler is not None and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
            self.lr_scheduler.load_state_dict(checkpoint_dir.read_state_file(checkpoint, SCHEDULER_NAME))

    def _load_best_model(self):
        # load_best_model_at_end: the best checkpoint's zeroplus/ into the engine (weights and
        # optimizer state), as the Trainer's DeepSpeed branch loads the engine's checkpoint; the
        # Trainer's own path would load model.safetensors into parameters that may be shards.
        checkpoint_dir.load(self.state.best_model_checkpoint, self.model, self.optimizer,
                            "ZeroPlusTrainer: load_best_model_at_end")

    def save_model(self, output_dir=None, _internal_call=False):
        if getattr(self, "zeroplus_stage", 1) == 3:
            full = _zero.full_state_dict(self.model)  # collective: the full weights on rank 0
            if self.args.should_save:
                self._save(output_dir or self.args.output_dir, state_dict=full)
            return
        return super().save_model(output_dir, _internal_call)
