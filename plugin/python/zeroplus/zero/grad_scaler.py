"""zeroplus.GradScaler: torch.amp.GradScaler's API for the sharded ZeRO optimizers.

torch.amp.GradScaler finds infs by reading `p.grad` of the optimizer's parameters; at ZeRO stage 2
those are freed as soon as their bucket is reduced (each rank keeps only its shard), so torch's
scaler would see no gradient at all. This class keeps torch's interface and scale policy
(init 2**16, x2 after 2000 clean steps, x0.5 on an overflow) and asks the optimizer to unscale its
shards and to agree on inf/NaN across ranks (one allreduce, like FSDP's ShardedGradScaler):

    scaler = zeroplus.GradScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(opt); opt.clip_grad_norm_(1.0)   # optional
    scaler.step(opt); scaler.update(); opt.zero_grad()

opt.backward(loss) with mixed_precision="fp16" does the same with DeepSpeed's policy instead;
use one or the other.
"""

from __future__ import annotations

import math

import torch


class GradScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"GradScaler: init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"GradScaler: growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"GradScaler: backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"GradScaler: growth_interval must be an int >= 1, got {growth_interval!r}")
        self._enabled = bool(enabled)
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._per_optimizer: dict[int, dict] = {}

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def scale(self, outputs):
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"GradScaler.scale: outputs must be a tensor or a list/tuple of tensors, got "
                        f"{type(outputs).__name__}")

    @staticmethod
    def _check(optimizer):
        if not hasattr(optimizer, "_unscale_external"):
            raise TypeError(f"zeroplus.GradScaler needs an optimizer from zeroplus.initialize (stage 2) or "
                            f"ZeroRedundancyOptimizer(stage=2); got {type(optimizer).__name__} (use torch.amp.GradScaler)")

    def unscale_(self, optimizer) -> None:
        if not self._enabled:
            return
        self._check(optimizer)
        state = self._per_optimizer.setdefault(id(optimizer), {})
        if state.get("unscaled"):
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state.get("stepped"):
            raise RuntimeError("unscale_() is being called after step().")
        state["found_inf"] = optimizer._unscale_external(1.0 / self._scale)
        state["unscaled"] = True

    def step(self, optimizer, *args, **kwargs):
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        self._check(optimizer)
        state = self._per_optimizer.setdefault(id(optimizer), {})
        if state.get("stepped"):
            raise RuntimeError("step() has already been called since the last update().")
        if not state.get("unscaled"):
            self.unscale_(optimizer)
        state["stepped"] = True
        if state["found_inf"]:
            optimizer._skip_step()
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
        else:
            if not self._per_optimizer:
                raise RuntimeError("GradScaler.update: no inf checks were recorded prior to update() "
                                   "(call step() first)")
            if any(s.get("found_inf") for s in self._per_optimizer.values()):
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale *= self._growth_factor
                    self._growth_tracker = 0
        self._per_optimizer = {}

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        self._scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
