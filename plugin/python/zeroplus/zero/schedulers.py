"""DeepSpeed's config schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR) as torch LRSchedulers.

The curves are DeepSpeed's (deepspeed/runtime/lr_schedules.py) to the formula. DeepSpeed's
schedulers count `last_batch_iteration` from -1 at construction and its engine calls
`scheduler.step()` after every optimizer step that was not skipped, so the n-th optimizer step
(n = 0, 1, ...) runs with the learning rate of iteration n - 1. A torch LRScheduler counts
`last_epoch` from 0 at construction (its initial step), so here iteration = last_epoch - 1 and
`get_lr` is a closed form of it: the same learning rate at every step as DeepSpeed's engine,
and `state_dict`/`load_state_dict`, `get_last_lr` and torch's checkpointing work as for any
torch scheduler.

`build_scheduler(opt, spec)` makes one from the config's `scheduler` block. zeroplus.initialize
attaches it as `opt.lr_scheduler` and steps it after each `opt.step()` that updated the weights
(a step skipped on an fp16 overflow does not advance it, as in DeepSpeed); see docs/zero.md.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

WARMUP_TYPES = ("log", "linear")


def _per_group(opt, value, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(opt.param_groups):
            raise ValueError(f"scheduler: {name} has {len(value)} values for {len(opt.param_groups)} param groups")
        return [float(v) for v in value]
    return [float(value)] * len(opt.param_groups)


def _check_warmup(warmup_num_steps, warmup_type) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"scheduler: warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"scheduler: warmup_type must be one of {list(WARMUP_TYPES)}, got {warmup_type!r}")
    return max(2, warmup_num_steps)  # DeepSpeed's floor: log(1) would divide by zero


def _warmup_gamma(iteration: int, steps: int, warmup_type: str) -> float:
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(steps)
    return iteration / steps


class WarmupLR(LRScheduler):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then constant."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log", last_epoch=-1):
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        if warmup_max_lr is None:  # DeepSpeed: the first group's lr
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer, last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self):
        iteration = self.last_epoch - 1
        if iteration < 0:  # DeepSpeed's value before its first step()
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_epoch=-1):
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"scheduler: total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return max(0.0, float(self.total_num_steps - iteration) /
                   float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(LRScheduler):
    """Ratio of each group's lr: warmup_min_ratio -> 1 over warmup_num_steps, then cosine to
    cos_min_ratio at total_num_steps (and held there)."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                 warmup_type="log", last_epoch=-1):
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"scheduler: total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        super().__init__(optimizer, last_epoch)

    def _ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            ratio = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self):
        ratio = self._ratio(self.last_epoch - 1)
        return [base * ratio for base in self.base_lrs]  # base_lrs: DeepSpeed's org_lrs


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(opt: torch.optim.Optimizer, spec: dict) -> LRScheduler:
    """The scheduler of a resolved config `scheduler` block ({"type": ..., "params": {...}})."""
    cls = SCHEDULERS[spec["type"]]
    params = dict(spec.get("params", {}))
    params.pop("last_batch_iteration", None)  # -1: a fresh schedule; resume goes through load_state_dict
    return cls(opt, **params)


def step_after_optimizer(opt: torch.optim.Optimizer, scheduler: LRScheduler):
    """An optimizer step-post-hook that advances `scheduler` once per `opt.step()` that updated
    the weights. The engines count steps skipped on an fp16 overflow in `skipped_steps`;
    DeepSpeed does not advance its scheduler on those, and neither does this."""
    seen = {"skipped": getattr(opt, "skipped_steps", 0)}

    def hook(optimizer, args, kwargs):
        skipped = getattr(optimizer, "skipped_steps", 0)
        if skipped != seen["skipped"]:
            seen["skipped"] = skipped
            return
        scheduler.step()
    return hook
