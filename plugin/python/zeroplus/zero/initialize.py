"""zeroplus.initialize: the one entry point for ZeRO stages 1, 2 and 3.

    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=2, lr=3e-4, mixed_precision="bf16")

Stage 1 in fp32 is DistributedDataParallel + zeroplus.ZeroRedundancyOptimizer (routed so the user
keeps their module object); stage 1 with mixed precision and stage 2 are the flat-bucket engine
(Stage1Optimizer / Stage2Optimizer); stage 3 is Stage3Optimizer. Arguments and the DeepSpeed-style config are merged by
config.resolve; every check runs before anything is changed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import config as config_mod
from . import deferred
from .ddp_route import route_through_ddp
from .stage2 import Stage1Optimizer, Stage2Optimizer
from .stage3 import Stage3Optimizer


def _check_model(model) -> None:
    if isinstance(model, DistributedDataParallel):
        raise ValueError("zeroplus.initialize: model is already wrapped in DistributedDataParallel; pass the plain "
                         "module (zeroplus does the data-parallel part)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zeroplus.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "_zeroplus_ddp", None) is not None or any(
            getattr(p, "_zeroplus_managed", False) for p in model.parameters()):
        raise ValueError("zeroplus.initialize: model was already passed to zeroplus.initialize")
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"zeroplus.initialize: model parameters are on several devices {sorted(map(str, devices))}; "
                         f"move the model to one device first")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("zeroplus.initialize: model has no parameter with requires_grad=True")


def initialize(model, optimizer_class=None, *, stage=None, process_group=None, mixed_precision=None, config=None,
               **optimizer_defaults):
    """Returns (model, optimizer). See docs/zero.md."""
    settings = config_mod.resolve(optimizer_class, stage, mixed_precision, config, optimizer_defaults)
    _check_model(model)
    if settings.stage != 3 and any(deferred.record_of(p) is not None for p in model.parameters()):
        raise ValueError(f"zeroplus.initialize: model was built under zeroplus.init_context() (its parameters are "
                         f"shards); only stage=3 can take it, got stage={settings.stage}")
    if settings.stage != 3 and any(p.is_meta for p in model.parameters()):
        raise ValueError("zeroplus.initialize: model has parameters on the meta device; building from meta needs "
                         "stage=3 (parameters are materialised shard by shard)")
    if not dist.is_initialized():
        raise RuntimeError("zeroplus.initialize: torch.distributed is not initialized; call "
                           "dist.init_process_group(backend='zeroplus') (or gloo/nccl) first")

    if settings.stage == 1 and settings.mixed_precision is None:
        if settings.gradient_clipping or settings.grad_accum_dtype is not None:
            raise ValueError("zeroplus.initialize: config gradient_clipping / grad_accum_dtype need stage 2 or mixed "
                             "precision at stage 1; call torch.nn.utils.clip_grad_norm_ yourself")
        from ..optim import ZeroRedundancyOptimizer
        ddp = route_through_ddp(model, process_group=process_group, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=settings.optimizer_class,
                                      process_group=process_group, **settings.optimizer_defaults)
        _attach_stage1_helpers(opt, model, ddp)
        return model, opt

    engine = {1: Stage1Optimizer, 2: Stage2Optimizer, 3: Stage3Optimizer}[settings.stage]
    opt = engine(model.parameters(), settings.optimizer_class, process_group=process_group, **settings.stage3,
                 mixed_precision=settings.mixed_precision, module=model,
                 reduce_bucket_elems=settings.reduce_bucket_elems, loss_scaler=settings.loss_scaler,
                 static_loss_scale=settings.static_loss_scale, gradient_clipping=settings.gradient_clipping,
                 grad_accum_dtype=settings.grad_accum_dtype, **settings.optimizer_defaults)
    return model, opt


def _attach_stage1_helpers(opt, model, ddp) -> None:
    """opt.backward / opt.clip_grad_norm_ / opt.loss_scale on the DDP + ZeRO-1 pair, so one
    training loop serves every stage."""
    params = [p for p in model.parameters() if p.requires_grad]

    def backward(loss, **kwargs):
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward: loss must be a tensor, got {type(loss).__name__}")
        loss.backward(**kwargs)

    def clip_grad_norm_(max_norm, norm_type=2.0, error_if_nonfinite=False):
        from .clipping import check_norm_args
        check_norm_args(max_norm, norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    object.__setattr__(opt, "backward", backward)
    object.__setattr__(opt, "clip_grad_norm_", clip_grad_norm_)
    object.__setattr__(opt, "loss_scale", 1.0)
    object.__setattr__(opt, "no_sync", ddp.no_sync)
