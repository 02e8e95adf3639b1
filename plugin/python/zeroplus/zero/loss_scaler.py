"""Dynamic loss scaling for fp16, with DeepSpeed's rules (torch-free, pure Python).

DeepSpeed defaults (its fp16 config): initial scale 2**16, growth window 1000, hysteresis 2,
minimum scale 1. An overflow consumes one unit of hysteresis; only when hysteresis is down to
one does an overflow halve the scale (never below the minimum). Every `scale_window` clean
steps since the last overflow the scale doubles and hysteresis is refilled (after any clean
step with `consecutive_hysteresis`). The overflow decision itself is made elsewhere: the engine
agrees on it across ranks before calling `update`, so every rank's scaler stays identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, asdict

from ..ds_keys import FP16 as _FP16  # the fp16 block's defaults (DeepSpeed's) are defined there


class LossScaleAtMinimumError(RuntimeError):
    """An overflow happened while the scale was already at its minimum."""


@dataclass
class LossScalerOptions:
    init_scale: float = 2.0 ** _FP16["initial_scale_power"].default
    scale_window: int = _FP16["loss_scale_window"].default
    hysteresis: int = _FP16["hysteresis"].default
    min_scale: float = float(_FP16["min_loss_scale"].default)
    consecutive_hysteresis: bool = _FP16["consecutive_hysteresis"].default
    scale_factor: float = 2.0
    raise_error_at_min_scale: bool = True

    def validate(self) -> None:
        def positive(name, value):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"loss scaler: {name} must be a positive finite number, got {value!r}")

        positive("init_scale", self.init_scale)
        positive("min_scale", self.min_scale)
        if not (isinstance(self.scale_factor, (int, float)) and self.scale_factor > 1):
            raise ValueError(f"loss scaler: scale_factor must be > 1, got {self.scale_factor!r}")
        for name in ("scale_window", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"loss scaler: {name} must be an integer >= 1, got {value!r}")
        if self.init_scale < self.min_scale:
            raise ValueError(f"loss scaler: init_scale ({self.init_scale}) is below min_scale ({self.min_scale})")


class DynamicLossScaler:
    def __init__(self, options: LossScalerOptions | None = None):
        self.options = options or LossScalerOptions()
        self.options.validate()
        self.scale = float(self.options.init_scale)
        self.hysteresis_left = self.options.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        o = self.options
        if overflow:
            if o.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale <= o.min_scale and o.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 loss scale is already at its minimum ({o.min_scale}) and gradients still "
                        f"overflow; lower the learning rate or train in bf16")
                self.scale = max(self.scale / o.scale_factor, o.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if o.consecutive_hysteresis:
                self.hysteresis_left = o.hysteresis
            if (self.iteration - self.last_overflow_iteration) % o.scale_window == 0:
                if not o.consecutive_hysteresis:
                    self.hysteresis_left = o.hysteresis
                self.scale *= o.scale_factor
        self.iteration += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration, "options": asdict(self.options)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("scale", "hysteresis_left", "iteration", "last_overflow_iteration"):
            if key not in state:
                raise KeyError(f"loss scaler state_dict: missing key {key!r}")
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])


class StaticLossScaler:
    """Scale 1 (fp32 and bf16): nothing is scaled, nothing is skipped."""

    scale = 1.0

    def update(self, overflow: bool) -> None:  # bf16/fp32 never skip a step
        pass

    def state_dict(self) -> dict:
        return {"scale": 1.0}

    def load_state_dict(self, state: dict) -> None:
        pass
