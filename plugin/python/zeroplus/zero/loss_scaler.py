"""fp16 dynamic loss scaling: the Python engine's front-end of the C++ core's scaler.

The rules (DeepSpeed's: initial scale, growth window, hysteresis, consecutive hysteresis, minimum
scale, raising at the minimum) and the checks of their settings live once, in
optimizers/core/loss_scaler.hpp, which the C++ engine drives too; this module holds it through
``torch.classes.zeroplus.LossScaler`` (registration/optim_registration.cpp) and keeps what is
Python's: the options record, the state_dict format of checkpoints, and the exception type.

DeepSpeed defaults (its fp16 config): initial scale 2**16, growth window 1000, hysteresis 2,
minimum scale 1. The overflow decision is made elsewhere: the engine agrees on it across ranks
before calling `update`, so every rank's scaler stays identical.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..ds_keys import FP16 as _FP16  # the fp16 block's defaults (DeepSpeed's) are defined there

_STATE_KEYS = ("scale", "hysteresis_left", "iteration", "last_overflow_iteration")


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
        """TypeError for a value C++ cannot take; ValueError (the core's rules) for one it refuses."""
        _core(self)

    def _arguments(self) -> tuple:
        # Python's types are checked here (the C++ side sees double / int64 only); the values'
        # rules are the core's.
        for name in ("init_scale", "min_scale", "scale_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"loss scaler: {name} must be a number, got {value!r}")
        for name in ("scale_window", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"loss scaler: {name} must be an int, got {value!r}")
        return (float(self.init_scale), self.scale_window, self.hysteresis, float(self.min_scale),
                bool(self.consecutive_hysteresis), float(self.scale_factor), bool(self.raise_error_at_min_scale))


def _core(options: LossScalerOptions):
    return torch.classes.zeroplus.LossScaler(*options._arguments())


class DynamicLossScaler:
    def __init__(self, options: LossScalerOptions | None = None):
        self.options = options or LossScalerOptions()
        self._core = _core(self.options)

    @property
    def scale(self) -> float:
        return self._core.scale()

    @property
    def hysteresis_left(self) -> int:
        return self._core.state()[1]

    @property
    def iteration(self) -> int:
        return self._core.state()[2]

    @property
    def last_overflow_iteration(self) -> int:
        return self._core.state()[3]

    def update(self, overflow: bool) -> None:
        """After every step that had gradients. Raises LossScaleAtMinimumError (nothing changed)
        when an overflow finds the scale at its minimum and options.raise_error_at_min_scale."""
        if not self._core.update(bool(overflow)):
            raise LossScaleAtMinimumError(self._core.at_minimum_message())

    def state_dict(self) -> dict:
        return {**dict(zip(_STATE_KEYS, self._core.state())), "options": asdict(self.options)}

    def load_state_dict(self, state: dict) -> None:
        """Loads the four state fields; this run's options stay (a saved "options" is ignored)."""
        for key in _STATE_KEYS:
            if key not in state:
                raise KeyError(f"loss scaler state_dict: missing key {key!r}")
        self._core.load(float(state["scale"]), int(state["hysteresis_left"]), int(state["iteration"]),
                        int(state["last_overflow_iteration"]))

    def __deepcopy__(self, memo) -> DynamicLossScaler:
        # The engine checks a checkpoint's scaler state on a copy (zero/state.py); a TorchScript
        # object cannot be deep-copied, so the copy is a new core with this one's state.
        copy = DynamicLossScaler(LossScalerOptions(**asdict(self.options)))
        copy.load_state_dict(self.state_dict())
        return copy


class StaticLossScaler:
    """A fixed scale (1 for fp32 and bf16; fp16's configured loss_scale): nothing to scale
    dynamically, nothing is skipped, so no core is needed."""

    scale = 1.0

    def update(self, overflow: bool) -> None:  # a static scale never changes
        pass

    def state_dict(self) -> dict:
        return {"scale": 1.0}

    def load_state_dict(self, state: dict) -> None:
        pass
