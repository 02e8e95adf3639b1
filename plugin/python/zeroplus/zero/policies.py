"""What a ZeRO engine is configured with: small frozen policies, built once and passed whole.

zeroplus.initialize builds them from its arguments and the DeepSpeed-style config
(config.resolve); the engines read them and never take their fields as a dozen keyword
arguments. Each policy checks its own fields when it is created (ValueError/TypeError naming the
field), so an engine only ever sees valid settings. Defaults are defined here and only here, except
those of settings with a DeepSpeed config key, which zeroplus.ds_keys defines beside the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..ds_keys import ZERO as _ZERO
from ..offload.policy import DEFAULT_PARAM_BUFFERS, OffloadPolicy
from .loss_scaler import LossScalerOptions
from .precision import COMPUTE_DTYPES

# The defaults of the settings that have a DeepSpeed config key live in zeroplus.ds_keys, beside
# the key (reduce_bucket_size: 16 MiB of fp32, large enough to be bandwidth-bound).
DEFAULT_REDUCE_BUCKET_ELEMS = _ZERO["reduce_bucket_size"].default
DEFAULT_MAX_LIVE_PARAMETERS = _ZERO["stage3_max_live_parameters"].default
DEFAULT_PERSISTENCE_THRESHOLD = _ZERO["stage3_param_persistence_threshold"].default


def _count(owner: str, key: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < minimum:
        raise ValueError(f"{owner}: {key} must be a number >= {minimum}, got {value!r}")
    return int(value)


def _module_specs(value) -> tuple:
    """persistent_modules as a tuple of nn.Module classes, instances and qualified names (one item
    alone is a list of one; a module container is one module, not a list of its children)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, (str, type, torch.nn.Module)) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"Stage3Policy: persistent_modules must be nn.Module classes, nn.Module instances or "
                        f"qualified module names (one or a list), got {type(value).__name__}") from None
    for item in items:
        module_class = isinstance(item, type) and issubclass(item, torch.nn.Module)
        if not (module_class or isinstance(item, (str, torch.nn.Module))):
            raise TypeError(f"Stage3Policy: persistent_modules must hold nn.Module classes, nn.Module instances or "
                            f"qualified module names, got {item!r}")
    return items


@dataclass(frozen=True)
class PrecisionPolicy:
    """Compute dtype of parameters and gradients; masters and optimizer state stay fp32."""
    mixed_precision: str | None = None            # None (fp32) | "bf16" | "fp16"
    grad_accum_dtype: torch.dtype | None = None   # gradient shard dtype; None: the compute dtype
    loss_scaler: LossScalerOptions | None = None  # fp16: dynamic scaling options (None: defaults)
    static_loss_scale: float | None = None        # fp16: a fixed scale instead

    def __post_init__(self):
        if self.mixed_precision not in COMPUTE_DTYPES:
            raise ValueError(f"PrecisionPolicy: mixed_precision must be None, 'bf16' or 'fp16', got {self.mixed_precision!r}")
        if self.grad_accum_dtype is not None and not (isinstance(self.grad_accum_dtype, torch.dtype)
                                                      and self.grad_accum_dtype.is_floating_point):
            raise TypeError(f"PrecisionPolicy: grad_accum_dtype must be a floating torch.dtype, got {self.grad_accum_dtype!r}")

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return COMPUTE_DTYPES[self.mixed_precision]


@dataclass(frozen=True)
class Stage3Policy:
    """Stage-3 parameter gathering (DeepSpeed's names; docs/zero.md "Stage 3").

    prefetch_bucket_size None (the default) prefetches one unit ahead, FSDP2's depth: enough to
    overlap the next unit's all-gather with this unit's compute, and it keeps the gathered peak
    at two units. An int is DeepSpeed's element budget for what is gathered ahead (its default,
    5e7, gathers a whole 50M-parameter model at once; 0 turns prefetch off).

    persistent_modules (no DeepSpeed name: keyword only) keeps every parameter of the listed
    modules' subtrees whole on every rank, as param_persistence_threshold does for small ones, so
    a module that some ranks run and others skip (a rank-conditional head, MoE experts) is never
    gathered. Items: nn.Module classes (every instance), module instances, or qualified names as
    model.named_modules() gives them; resolved against the model by ShardedParams."""
    prefetch_bucket_size: int | None = None
    max_live_parameters: int = DEFAULT_MAX_LIVE_PARAMETERS
    param_persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD
    reshard_after_forward: bool = True
    unit_classes: Any = None
    param_init_fn: Callable | None = None
    persistent_modules: Any = None

    def __post_init__(self):
        for key in ("prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold"):
            if key == "prefetch_bucket_size" and self.prefetch_bucket_size is None:
                continue
            object.__setattr__(self, key, _count("Stage3Policy", key, getattr(self, key), 0))
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"Stage3Policy: reshard_after_forward must be a bool, got {self.reshard_after_forward!r}")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(f"Stage3Policy: param_init_fn must be callable, got {type(self.param_init_fn).__name__}")
        object.__setattr__(self, "persistent_modules", _module_specs(self.persistent_modules))


@dataclass(frozen=True)
class EngineOptions:
    """Everything a ZeRO engine is built with besides the parameters, the optimizer class with
    its hyperparameters, the process group and the module."""
    reduce_bucket_elems: int = DEFAULT_REDUCE_BUCKET_ELEMS
    gradient_clipping: float = 0.0  # > 0: step() clips to this global norm unless clip_grad_norm_ ran
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    stage3: Stage3Policy = field(default_factory=Stage3Policy)
    offload_optimizer: OffloadPolicy = field(default_factory=lambda: OffloadPolicy(what="offload_optimizer"))
    offload_param: OffloadPolicy = field(default_factory=lambda: OffloadPolicy(what="offload_param",
                                                                              buffer_count=DEFAULT_PARAM_BUFFERS))

    def __post_init__(self):
        bucket = self.reduce_bucket_elems
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"EngineOptions: reduce_bucket_elems must be a positive int, got {bucket!r}")
        clip = self.gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
            raise ValueError(f"EngineOptions: gradient_clipping must be a number >= 0, got {clip!r}")
        if not isinstance(self.precision, PrecisionPolicy):
            raise TypeError(f"EngineOptions: precision must be a PrecisionPolicy, got {type(self.precision).__name__}")
        if not isinstance(self.stage3, Stage3Policy):
            raise TypeError(f"EngineOptions: stage3 must be a Stage3Policy, got {type(self.stage3).__name__}")
        for key in ("offload_optimizer", "offload_param"):
            policy = getattr(self, key)
            if not isinstance(policy, OffloadPolicy):
                raise TypeError(f"EngineOptions: {key} must be an OffloadPolicy, got {type(policy).__name__}")
            if policy.what != key:
                raise ValueError(f"EngineOptions: {key} got an OffloadPolicy for {policy.what!r}")
