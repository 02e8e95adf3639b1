"""Lightning: ZeroPlusStrategy, ZeRO stages 1-3 as a Trainer strategy (docs/integrations.md).

    from zeroplus.integrations.lightning import ZeroPlusStrategy
    trainer = L.Trainer(strategy=ZeroPlusStrategy(stage=3), accelerator="cpu", devices=2, precision="bf16-mixed")

A DDPStrategy whose process group backend is "zeroplus" and whose model is not wrapped in DDP:
the optimizer `configure_optimizers` returns (one optimizer; any param groups, which may leave
parameters out) is taken over by zeroplus.initialize (its class, groups and hyperparameters) at
the chosen stage, with Lightning's precision mapped ("bf16-mixed"/"bf16-true" -> bf16,
"16-mixed"/"16-true" -> fp16 with the engine's dynamic loss scaling through its backward; on CPU
Lightning itself turns "16-mixed" into "bf16-mixed") and
`gradient_clip_val` mapped to the engine's global-norm clipping (Lightning's own clip sees no
local gradients and does nothing). Gradient accumulation uses the module's no_sync(), which
zeroplus installs. A DeepSpeed-style `config` may give the optimizer instead (then
configure_optimizers may return None) and a `scheduler` block, stepped by opt.step().

LR schedulers returned by configure_optimizers (torch's, built on that optimizer) work: the
engine's param_groups are the optimizer's own group dicts, which the scheduler writes.
Strategy names "zeroplus_stage_1", "zeroplus_stage_2", "zeroplus_stage_3" are registered when
this module is imported (`Trainer(strategy="zeroplus_stage_3")`).
Checkpoints (every stage), as Lightning's DeepSpeedStrategy does them: a checkpoint path is a
directory holding `zeroplus/` (zeroplus.save_checkpoint: each rank's shards of the weights and
optimizer state) and `lightning_state.pt` (Lightning's checkpoint dict without "state_dict" and
"optimizer_states": loops, callbacks, hyperparameters; the config scheduler's state travels in
the zeroplus checkpoint).
`fit(ckpt_path=...)` loads it after setup (the engine exists then), at any world size and stage;
Lightning's own model and optimizer restore steps are skipped (the weights and the state are in).
Loading outside fit (validate/test/predict with ckpt_path) raises: no optimizer is built there.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from .. import zero as _zero
from . import checkpoint_dir, warn_if_not_zeroplus

_STATE_FILE = "lightning_state.pt"
_PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16",
               "16-true": "fp16"}


class _CallThrough(nn.Module):
    """The strategy's `model` at stage 3: forwards to the LightningModule's own __call__. Lightning
    calls training_step (validation_step, ...) directly on an unwrapped module, so its forward
    hooks, where stage 3 gathers the root unit's parameters (those not inside a block or a direct
    child: an LM's embeddings, final norm and head) and brackets a pass, would never run; through
    a wrapper Lightning redirects each step through wrapper(...) -> module(...), as for DDP."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class ZeroPlusStrategy(DDPStrategy):
    strategy_name = "zeroplus"

    def __init__(self, stage: int = 1, config=None, process_group_backend: str = "zeroplus", **kwargs):
        if isinstance(stage, bool) or stage not in (1, 2, 3):
            raise ValueError(f"ZeroPlusStrategy: stage must be 1, 2 or 3, got {stage!r}")
        super().__init__(process_group_backend=process_group_backend, **kwargs)
        self.stage = stage
        self.zeroplus_config = config

    def configure_ddp(self) -> None:
        # No DDP: the ZeRO engine reduces the gradients (built in setup_optimizers).
        return None

    def setup(self, trainer) -> None:
        # validate/test/predict after fit: DDPStrategy broadcasts rank 0's parameters and buffers
        # (it has no DDP wrapper to do it). The parameters are the engine's (stage 3: shards
        # between uses, which a broadcast cannot write into) and the engine keeps every rank's
        # consistent, so only the buffers are broadcast.
        module = self.lightning_module
        engine = getattr(module, "_zeroplus_engine", None) if module is not None else None
        if trainer.state.fn != TrainerFn.FITTING and engine is not None and engine() is not None:
            ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
            ignored += [n for n, _ in module.named_parameters() if n not in ignored]
            module._ddp_params_and_buffers_to_ignore = ignored
        super().setup(trainer)
        if self.stage == 3 and self.model is self.lightning_module:
            self.model = _CallThrough(self.model)  # every stage, fit or not (see _CallThrough)

    def teardown(self) -> None:
        if isinstance(self.model, _CallThrough):
            self.model = self.lightning_module  # as DDPStrategy unwraps DDP
        super().teardown()

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        warn_if_not_zeroplus("ZeroPlusStrategy")
        if len(self.optimizers) > 1:
            raise ValueError(f"ZeroPlusStrategy: one optimizer is supported, configure_optimizers returned "
                             f"{len(self.optimizers)}")
        # The user's optimizer itself: zeroplus.initialize takes over its class, param groups and
        # hyperparameters; the engine's param_groups are its group dicts, so the LR schedulers
        # configure_optimizers built on it keep stepping the groups the engine uses.
        user = self.optimizers[0] if self.optimizers else None
        precision = str(self.precision_plugin.precision)
        if precision not in _PRECISIONS:
            raise ValueError(f"ZeroPlusStrategy: precision={precision!r} is not supported (one of "
                             f"{', '.join(_PRECISIONS)})")
        config = _zero.ds_config.load_config(self.zeroplus_config)
        if trainer.gradient_clip_val:
            if trainer.gradient_clip_algorithm not in (None, "norm"):  # None: Lightning's default, norm
                raise ValueError("ZeroPlusStrategy: gradient_clip_algorithm='value' is not supported (global norm only)")
            config = {**config, "gradient_clipping": float(trainer.gradient_clip_val)}
        mixed = _PRECISIONS[precision]
        if config.get("bf16", {}).get("enabled") is True or config.get("fp16", {}).get("enabled") is True:
            mixed = None  # the config says it
        if mixed == "fp16" and getattr(self.precision_plugin, "scaler", None) is not None:
            # "16-mixed" on CUDA comes with torch's GradScaler, which would scale the loss a second
            # time and check p.grad (freed at stages 2-3); the engine's loss scaler replaces it.
            self.precision_plugin.scaler = None
        _, engine = _zero.initialize(self.lightning_module, user, stage=self.stage, mixed_precision=mixed,
                                     config=config)
        self.optimizers = [engine]

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        engine = self.optimizers[0] if self.optimizers else None
        if getattr(engine, "mixed_precision", None) != "fp16":
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # fp16: the engine's backward applies its dynamic loss scale (DeepSpeed's policy), as
        # Lightning's DeepSpeed precision calls deepspeed_engine.backward; the engine unscales,
        # skips a step on overflow and updates the scale in opt.step().
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        engine.backward(closure_loss, *args, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    def block_backward_sync(self):
        no_sync = getattr(self.lightning_module, "no_sync", None)
        if no_sync is None:
            yield
        else:
            with no_sync():
                yield

    # -- checkpoints -----------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (built in setup_optimizers) loads the checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the optimizer state came back with zeroplus.load_checkpoint

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroPlusStrategy: save_checkpoint(storage_options=...) is not supported (the checkpoint "
                            "is written by zeroplus.save_checkpoint, not by a CheckpointIO)")
        filepath = self.broadcast(os.fspath(filepath))  # rank 0's name, as DeepSpeedStrategy does
        if not self.optimizers:
            raise RuntimeError("ZeroPlusStrategy: save_checkpoint needs the zeroplus optimizer, which is built when "
                               "fit() starts")
        engine = self.optimizers[0]
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        checkpoint_dir.save(filepath, self.lightning_module, engine, "ZeroPlusStrategy.save_checkpoint")
        if self.is_global_zero:
            checkpoint_dir.write_state_file(filepath, _STATE_FILE, state)
        self.barrier("ZeroPlusStrategy.save_checkpoint")  # complete on every rank when this returns

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        checkpoint_path = self.broadcast(os.fspath(checkpoint_path))
        # Outside fit the strategy builds no engine (and may still hold the one of an earlier
        # fit, of another module): nothing to load into.
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING or not self.optimizers:
            raise RuntimeError("ZeroPlusStrategy: a checkpoint loads into the zeroplus optimizer, which exists during "
                               "fit() only; for validate/test/predict load the weights with "
                               "`python -m zeroplus.checkpoint` (consolidation) or zeroplus.load_checkpoint")
        engine = self.optimizers[0]
        checkpoint_dir.load(checkpoint_path, self.lightning_module, engine, "ZeroPlusStrategy: ckpt_path")
        # weights_only=None: torch.load's default, as Lightning loads a local checkpoint file.
        state = checkpoint_dir.read_state_file(checkpoint_path, _STATE_FILE, weights_only=weights_only)
        return state

    def lightning_module_state_dict(self):
        # Lightning puts this into the checkpoint dict, which save_checkpoint does not write (the
        # weights go with zeroplus.save_checkpoint). At stage 3 the module's own state_dict()
        # refuses to return shards, so none is asked for, as DeepSpeedStrategy does at stage 3.
        engine = self.optimizers[0] if self.optimizers else None
        if engine is not None and getattr(engine.placement, "gatherer", None) is not None:
            return {}
        return super().lightning_module_state_dict()

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # loaded by load_checkpoint (zeroplus.load_checkpoint)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # likewise



def _register_strategy_names() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for stage in (1, 2, 3):
        name = f"zeroplus_stage_{stage}"
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, ZeroPlusStrategy, description=f"zeroplus ZeRO stage {stage}", stage=stage)


_register_strategy_names()
