"""The zeroplus side of test_checkpoint_deepspeed.py, run inside pooled zeroplus ranks: load a DeepSpeed
checkpoint (or its conversion), continue as DeepSpeed did, and the refused loads. Kept apart from
the test module, which imports deepspeed at the top: unpickling these functions in a rank must not
import it (the first load of a launch checks that the loader itself never does)."""

from __future__ import annotations

import functools
import os
import sys

import torch

import deepspeed_runs as dr
from checkpoint_models import sharded_names
from harness import run_cases_in_own_groups

STEPS, MORE = 3, 3
PARAMS = ["lin1.weight", "lin1.bias", "norm.weight", "norm.bias", "lin2.weight", "lin2.bias"]


def build(stage, precision, group, optimizer=torch.optim.AdamW, model=None, grouped=False):
    """zeroplus's side: another init (every value must come from the load) and DeepSpeed's param
    groups, with hyperparameters other than the checkpoint's (lr 1e-3, weight decay 0.5). The
    engine classes take param groups (zeroplus.initialize takes model.parameters() as one group)."""
    from zeroplus.zero import (EngineOptions, PrecisionPolicy, Stage1Optimizer, Stage2Optimizer, Stage3Optimizer,
                               Stage3Policy)

    model = dr.make(11, grouped) if model is None else model
    options = EngineOptions(precision=PrecisionPolicy(mixed_precision=precision),
                            stage3=Stage3Policy(param_persistence_threshold=0))
    groups = [{**g, "weight_decay": 0.5} for g in dr.param_groups(model, grouped)]
    defaults = {"lr": 1e-3} if optimizer is torch.optim.AdamW else {"lr": 1e-3, "momentum": 0.9}
    engine = {1: Stage1Optimizer, 2: Stage2Optimizer, 3: Stage3Optimizer}[stage]
    return model, engine(groups, optimizer, options=options, process_group=group, module=model, **defaults)


def full(model):
    import zeroplus

    return {k: v.float().clone() for k, v in zeroplus.full_state_dict(model, rank0_only=False).items()}


def masters(scratch, model, opt):
    """The fp32 masters of a mixed-precision engine, through a zeroplus checkpoint (its "param" values)."""
    import zeroplus
    from zeroplus.checkpoint.consolidate import iter_tensors
    from zeroplus.checkpoint.reader import CheckpointReader

    zeroplus.save_checkpoint(os.path.join(scratch, "masters"), model, opt)
    with CheckpointReader(os.path.join(scratch, "masters")) as reader:
        return {k: v.float().clone() for k, v in iter_tensors(reader)}


def resume(path, stage, precision, grouped, check_no_deepspeed, scratch, rank, group):
    """Load `path` at (stage, precision), continue MORE steps as DeepSpeed did; returns what the
    parent checks. The trained values are the fp32 masters (bf16: read back from a zeroplus
    checkpoint saved under `scratch`, since the bf16 parameters are rounded)."""
    import torch.distributed as dist

    import zeroplus

    world = dist.get_world_size(group)
    model, opt = build(stage, precision, group, grouped=grouped)
    sharded = sharded_names(model, opt)
    if stage == 3 and world > 1 and sharded != sorted(n for n, _p in model.named_parameters()):
        raise AssertionError(f"stage 3 holds only {sharded} sharded")
    sched = None
    if not check_no_deepspeed:  # the DeepSpeed user's scheduler, built before the load as before engine.initialize
        from deepspeed.runtime.lr_schedules import WarmupLR

        sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=10)
    extra = zeroplus.load_checkpoint(path, model, opt)
    out = {"deepspeed_imported": "deepspeed" in sys.modules, "extra": extra, "loaded": full(model),
           "lr": [g["lr"] for g in opt.param_groups], "weight_decay": [g["weight_decay"] for g in opt.param_groups]}
    steps = [st.get("step") for st in opt.state_dict()["state"].values()]
    out["steps"] = sorted({float(s) for s in steps if s is not None})
    if sched is None:
        return out
    sched.load_state_dict(extra["lr_scheduler"])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for step in range(STEPS, STEPS + MORE):
        x, y = dr.local_batch(step, rank, world)
        opt.backward(dr.loss_of(model, x, y, dtype))
        opt.clip_grad_norm_(dr.GRADIENT_CLIPPING)  # DeepSpeed clips at 1.0 unless its config says otherwise
        opt.step()
        opt.zero_grad()
        sched.step()
    out["trained"] = full(model) if precision is None else masters(scratch, model, opt)
    return out


def zeroplus_cases(rank, world, cases):
    return run_cases_in_own_groups(rank, world, {key: functools.partial(resume, *args) for key, args in cases.items()})


def refused_load(path, marker, rank, group):
    import zeroplus

    model, opt = build(2, None, group)
    before = full(model)
    try:
        zeroplus.load_checkpoint(path, model, opt)
    except Exception as e:  # noqa: BLE001 - returned to the parent
        error = f"{type(e).__name__}: {e}"
    else:
        error = None
    after = full(model)
    return {"error": error, "untouched": all(torch.equal(before[k], after[k]) for k in before),
            "no_state": not opt.state_dict()["state"] or all(not s for s in opt.state_dict()["state"].values()),
            "ran": os.path.exists(marker)}


def mismatch(path, rank, group):
    from torch import nn

    import zeroplus

    out = {}
    model = dr.make(3)
    model.lin2 = nn.Linear(dr.HIDDEN, dr.OUT + 1)
    model.extra = nn.Linear(2, 2)
    model, opt = build(2, None, group, model=model)
    before = full(model)
    try:
        zeroplus.load_checkpoint(path, model, opt)
        out["shapes"] = None
    except RuntimeError as e:
        out["shapes"] = str(e)
    out["shapes_untouched"] = all(torch.equal(before[k], v) for k, v in full(model).items())
    model, opt = build(2, None, group, optimizer=torch.optim.SGD)
    try:
        zeroplus.load_checkpoint(path, model, opt)
        out["optimizer"] = None
    except ValueError as e:
        out["optimizer"] = str(e)
    return out


def scaler_after_load(path, precision, rank, group):
    """The loss scaler state of a stage-2 engine at `precision` after loading `path`."""
    import zeroplus

    model, opt = build(2, precision, group)
    zeroplus.load_checkpoint(path, model, opt)
    return opt.scaler.state_dict()


def train_save_continue(path, stage, grouped, optimizer, precision, rank, group):
    """zeroplus's side of convert --to deepspeed: trains STEPS steps from DsNet's seed-0 init with
    DeepSpeed's scheduler (built on zeroplus's optimizer), saves PATH (extra: the scheduler state,
    global_steps and a client value), trains MORE steps on: the continuation a DeepSpeed resume of
    the exported files must match. Returns the parameters after the continuation (fp32; bf16: the
    fp32 masters, read back from a zeroplus checkpoint saved beside PATH)."""
    import torch.distributed as dist

    import zeroplus
    from deepspeed.runtime.lr_schedules import WarmupLR

    world = dist.get_world_size(group)
    model, opt = build(stage, precision, group, optimizer=optimizer, model=dr.make(0, grouped), grouped=grouped)
    for g in opt.param_groups:  # DeepSpeed's run: lr 1e-2 (the scheduler's), weight decay 0.1 / 0.0
        g["weight_decay"] = 0.1 if g is opt.param_groups[0] else 0.0
    sharded = sharded_names(model, opt)
    if stage == 3 and world > 1 and sharded != sorted(n for n, _p in model.named_parameters()):
        raise AssertionError(f"stage 3 holds only {sharded} sharded")
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=10)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for step in range(STEPS + MORE):
        x, y = dr.local_batch(step, rank, world)
        opt.backward(dr.loss_of(model, x, y, dtype))
        opt.clip_grad_norm_(dr.GRADIENT_CLIPPING)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step + 1 == STEPS:
            zeroplus.save_checkpoint(path, model, opt, extra={"lr_scheduler": sched.state_dict(),
                                                              "global_steps": STEPS, "run": "zeroplus"})
    trained = full(model) if precision is None else masters(path + "_after", model, opt)
    return {"trained": trained, "lr": [g["lr"] for g in opt.param_groups]}
