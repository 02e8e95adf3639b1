"""zeroplus.initialize: the one entry point for ZeRO stages 1, 2 and 3.

    model, opt = zeroplus.initialize(model, opt, stage=2, mixed_precision="bf16")   # opt: the user's torch optimizer
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=2, lr=3e-4)     # or a class (params= groups)

Every stage is the flat-bucket engine: Stage1Optimizer (gradients all-reduced and kept whole),
Stage2Optimizer (gradients reduce-scattered) and Stage3Optimizer (parameters sharded too), so every
stage and precision follows the same rules (DDP + the torch optimizer: a parameter no rank gave a
gradient is not stepped). torch's ZeroRedundancyOptimizer interface for a user's own DDP model is
zeroplus.ZeroRedundancyOptimizer. Which optimizer, param groups and hyperparameters (a torch
optimizer instance taken over, or a class with params= groups): param_groups.py. Arguments and the
DeepSpeed-style config are merged by ds_config.prepare and config.resolve; every check runs before
anything is changed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from ..tensor_parallel import auto_plan

from . import config as config_mod
from . import dtensor_params
from .stage3 import deferred
from . import ds_config, param_groups
from .stages import Stage1Optimizer, Stage2Optimizer, Stage3Optimizer


def _check_model(model) -> None:
    if isinstance(model, DistributedDataParallel):
        raise ValueError("zeroplus.initialize: model is already wrapped in DistributedDataParallel; pass the plain "
                         "module (zeroplus does the data-parallel part)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zeroplus.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    if any(getattr(p, "_zeroplus_managed", False) for p in model.parameters()):
        raise ValueError("zeroplus.initialize: model was already passed to zeroplus.initialize")
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"zeroplus.initialize: model parameters are on several devices {sorted(map(str, devices))}; "
                         f"move the model to one device first")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("zeroplus.initialize: model has no parameter with requires_grad=True")


def _tensor_parallel(tensor_parallel, process_group, model):
    """tensor_parallel=mesh: the auto plan over mesh['tp'] (checked, not applied) and mesh['dp']'s group."""
    if not isinstance(tensor_parallel, DeviceMesh):
        raise TypeError(f"zeroplus.initialize: tensor_parallel must be a 2-D DeviceMesh with dims ('dp', 'tp'), got "
                        f"{type(tensor_parallel).__name__}")
    if tensor_parallel.ndim != 2 or tuple(tensor_parallel.mesh_dim_names or ()) != ("dp", "tp"):
        raise ValueError(f"zeroplus.initialize: tensor_parallel must be a 2-D DeviceMesh with mesh_dim_names "
                         f"('dp', 'tp'), got {tensor_parallel.ndim}-D {tensor_parallel.mesh_dim_names}")
    if any(dtensor_params.is_dtensor(p) for p in model.parameters()):
        raise ValueError("zeroplus.initialize: model is already tensor-parallel (DTensor parameters); pass "
                         "process_group=mesh['dp'].get_group() instead of tensor_parallel")
    if process_group is not None:
        raise ValueError("zeroplus.initialize: pass either tensor_parallel (the data-parallel group is its 'dp' "
                         "dimension) or process_group, not both")
    return auto_plan(model, tensor_parallel["tp"].size()), tensor_parallel["dp"].get_group()


def _data_parallel_size(process_group, tensor_parallel) -> int | None:
    """The data-parallel world size when it is known already (train_batch_size is checked against it)."""
    if not dist.is_initialized():
        return None
    if isinstance(tensor_parallel, DeviceMesh) and "dp" in (tensor_parallel.mesh_dim_names or ()):
        return tensor_parallel["dp"].size()
    try:
        return dist.get_world_size(process_group)
    except (TypeError, ValueError, RuntimeError):
        return None  # a bad process_group: the engine names it


def initialize(model, optimizer_class=None, *, stage=None, process_group=None, mixed_precision=None, config=None,
               tensor_parallel=None, params=None, **optimizer_defaults):
    """Returns (model, optimizer). optimizer_class: the user's torch optimizer instance (its class,
    param groups, hyperparameters and state are taken over), a torch.optim.Optimizer subclass (with
    params= groups, default model.parameters(), and keyword hyperparameters) or None (the config's).
    See docs/zero.md; tensor_parallel: docs/tensor_parallel.md."""
    src = param_groups.source(optimizer_class, params)
    auto = ds_config.auto_from_initialize(model, mixed_precision, src.defaults or optimizer_defaults,
                                          _data_parallel_size(process_group, tensor_parallel))
    ds = ds_config.prepare(config, auto)
    settings = config_mod.resolve(src.optimizer_class, stage, mixed_precision, ds.engine, optimizer_defaults)
    param_groups.check_instance_settings(src, settings.optimizer_defaults, "optimizer" in ds.engine,
                                         tensor_parallel is not None)
    _check_model(model)
    if src.params is not None:
        src.params = param_groups.check_membership(model, src.params)
    plan = None
    if tensor_parallel is not None:
        if settings.stage == 3:
            raise ValueError("zeroplus.initialize: tensor_parallel needs stage=1 or stage=2 (stage 3 shards whole "
                             "parameters itself)")
        plan, process_group = _tensor_parallel(tensor_parallel, process_group, model)
    if settings.stage != 3 and any(deferred.record_of(p) is not None for p in model.parameters()):
        raise ValueError(f"zeroplus.initialize: model was built under zeroplus.init_context() (its parameters are "
                         f"shards); only stage=3 can take it, got stage={settings.stage}")
    if settings.stage != 3 and any(p.is_meta for p in model.parameters()):
        raise ValueError("zeroplus.initialize: model has parameters on the meta device; building from meta needs "
                         "stage=3 (parameters are materialised shard by shard)")
    if not dist.is_initialized():
        raise RuntimeError("zeroplus.initialize: torch.distributed is not initialized; call "
                           "dist.init_process_group(backend='zeroplus') (or gloo/nccl) first")

    if plan is not None:  # every argument is checked: parallelise (parameters become DTensors)
        names = None if src.params is None else param_groups.parameter_names(model, src.params)
        plan.apply(model, tensor_parallel["tp"])
        if names is not None:  # the groups name the model's new (DTensor) Parameters
            param_groups.rebind_to_model(model, src.params, names)
    engine = {1: Stage1Optimizer, 2: Stage2Optimizer, 3: Stage3Optimizer}[settings.stage]
    opt = engine(model.parameters() if src.params is None else src.params, settings.optimizer_class,
                 options=settings.options, process_group=process_group, module=model,
                 **(src.defaults if src.instance is not None else settings.optimizer_defaults))
    if src.instance is not None:
        param_groups.retire(src.instance, opt)
    ds_config.attach(opt, ds)  # the config's scheduler as opt.lr_scheduler, stepped by opt.step()
    return model, opt

