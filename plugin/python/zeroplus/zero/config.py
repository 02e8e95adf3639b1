"""zeroplus.initialize's settings: keyword arguments merged with a DeepSpeed-style config.

zeroplus.initialize first passes the config through ds_config.prepare (key table, "auto" values,
warnings for DeepSpeed-internal keys, the scheduler and batch keys taken out); resolve reads
what is left.

The config may be a dict or a path to a JSON file. Keys read (DeepSpeed's names and meanings):

    optimizer.type / optimizer.params          optimizer class ("Adam", "AdamW", "SGD", or any
                                               torch.optim class name) and its hyperparameters
    zero_optimization.stage                    1, 2, 3
    zero_optimization.stage3_prefetch_bucket_size, .stage3_max_live_parameters,
         .stage3_param_persistence_threshold   stage-3 knobs (elements), as in DeepSpeed
    zero_optimization.stage3_max_reuse_distance, .stage3_gather_16bit_weights_on_model_save
                                               accepted for compatibility, no effect (units are
                                               released when their backward is done;
                                               zeroplus.full_state_dict gathers on demand)
    zero_optimization.reduce_bucket_size       gradient bucket, in elements
    zero_optimization.allgather_bucket_size    accepted for compatibility (buckets are shared)
    zero_optimization.overlap_comm, .contiguous_gradients, .reduce_scatter
                                               accepted; zeroplus always overlaps, packs and
                                               reduce-scatters (false is refused: not built)
    bf16.enabled / fp16.enabled                mixed precision
    fp16.loss_scale (0 = dynamic), .initial_scale_power, .loss_scale_window, .hysteresis,
         .min_loss_scale, .consecutive_hysteresis
    gradient_clipping                          > 0: step() clips to this global norm unless
                                               clip_grad_norm_ was called for the step
    data_types.grad_accum_dtype                "fp32", "bf16", "fp16": gradient shard dtype
    zero_optimization.offload_optimizer, .offload_param
                                               offload (zeroplus.offload.policy: device none|cpu|
                                               nvme, nvme_path, buffer_count, ...), also taken as
                                               keyword arguments of zeroplus.initialize
    aio.block_size, .queue_depth, .intra_op_parallelism (.thread_count)
                                               the swap files' I/O engine (docs/aio.md)

Stage-3 keyword arguments without a DeepSpeed key (STAGE3_KEYWORDS: None) are keywords only:
reshard_after_forward, unit_classes, param_init_fn, persistent_modules.

Which keys exist, their types, defaults and DeepSpeed's other names come from the one table,
zeroplus.ds_keys; resolve checks a config against it (a no-op after ds_config.prepare).

Keys DeepSpeed uses for its own engine's loop (train_batch_size, train_micro_batch_size_per_gpu,
gradient_accumulation_steps, steps_per_print, wall_clock_breakdown, ...) have no meaning when the
user owns the loop; they are accepted and ignored. Any other key raises ValueError, so a typo
never silently changes nothing. A value given both as an argument and in the config must agree,
else ValueError names both.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import ds_keys
from ..offload.policy import parse_aio, parse_offload
from .loss_scaler import LossScalerOptions
from .policies import DEFAULT_REDUCE_BUCKET_ELEMS, EngineOptions, PrecisionPolicy, Stage3Policy
from .precision import COMPUTE_DTYPES

# Stage-3 keyword arguments of zeroplus.initialize and their DeepSpeed config names (None: no
# config name, keyword only).
STAGE3_KEYWORDS = {**{spec.keyword: name for name, spec in ds_keys.ZERO.items()
                      if isinstance(spec, ds_keys.Key) and spec.keyword is not None},
                   "reshard_after_forward": None, "unit_classes": None, "param_init_fn": None,
                   "persistent_modules": None}
_DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                "fp16": torch.float16, "float16": torch.float16}


@dataclass(frozen=True)
class ZeroSettings:
    """What zeroplus.initialize builds: the stage, the optimizer, and the engine's policies."""
    stage: int
    optimizer_class: type
    optimizer_defaults: dict[str, Any]
    options: EngineOptions
    ignored_keys: list[str] = field(default_factory=list)


def load_config(config) -> dict:
    """The config as a dict: a dict is used as is, a str/PathLike is read as JSON."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as f:
                loaded = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"zeroplus.initialize: config file {os.fspath(config)!r} is not valid JSON: {e}") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"zeroplus.initialize: config file {os.fspath(config)!r} must hold a JSON object")
        return loaded
    raise TypeError(f"zeroplus.initialize: config must be a dict, a JSON file path or None, got {type(config).__name__}")


def _default(section: dict, key: str):
    return section[key].default


def _merge(name: str, arg_value, cfg_value, cfg_path: str):
    """The argument or the config value; both given and different is an error naming both."""
    if arg_value is None:
        return cfg_value
    if cfg_value is not None and cfg_value != arg_value:
        raise ValueError(f"zeroplus.initialize: {name}={arg_value!r} conflicts with config{cfg_path}={cfg_value!r}")
    return arg_value


def _optimizer_class_from_name(name) -> type:
    if not isinstance(name, str):
        raise ValueError(f"zeroplus.initialize: config['optimizer']['type'] must be a string, got {name!r}")
    lowered = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
               if isinstance(getattr(torch.optim, n), type) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)}
    cls = lowered.get(name.lower())
    if cls is None:
        raise ValueError(f"zeroplus.initialize: config['optimizer']['type']={name!r} is not a torch.optim optimizer")
    return cls


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def resolve(optimizer_class, stage, mixed_precision, config, optimizer_defaults) -> ZeroSettings:
    # Checked against the one table (zeroplus.initialize's config was checked by ds_config.prepare
    # already: this is a no-op there, and the same check for a config given here directly).
    ignored: list[str] = []
    cfg = ds_keys.check(load_config(config), ignored)
    ignored += [k for k in cfg if isinstance(ds_keys.KEYS[k], ds_keys.Key) and ds_keys.KEYS[k].role == "loop"]

    offload_args = {k: optimizer_defaults.pop(k) for k in ("offload_optimizer", "offload_param")
                    if k in optimizer_defaults}
    # Optimizer: class and hyperparameters.
    opt_cfg = cfg.get("optimizer", {})
    cfg_class = _optimizer_class_from_name(opt_cfg["type"]) if "type" in opt_cfg else None
    if optimizer_class is not None and not (isinstance(optimizer_class, type)
                                            and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"zeroplus.initialize: optimizer_class must be a torch.optim.Optimizer subclass, "
                        f"got {optimizer_class!r}")
    if optimizer_class is not None and cfg_class is not None and cfg_class is not optimizer_class:
        raise ValueError(f"zeroplus.initialize: optimizer_class={optimizer_class.__name__} conflicts with "
                         f"config['optimizer']['type']={opt_cfg['type']!r}")
    opt_class = optimizer_class or cfg_class
    if opt_class is None:
        raise ValueError("zeroplus.initialize: no optimizer: pass optimizer_class or config['optimizer']['type']")
    stage3_args = {k: optimizer_defaults.pop(k) for k in list(optimizer_defaults) if k in STAGE3_KEYWORDS}
    defaults = dict(opt_cfg.get("params", {}))
    if "betas" in defaults and isinstance(defaults["betas"], list):
        defaults["betas"] = tuple(defaults["betas"])
    for key, value in optimizer_defaults.items():
        defaults[key] = _merge(key, value, defaults.get(key), f"['optimizer']['params'][{key!r}]")

    # Stage.
    zero_cfg = cfg.get("zero_optimization", {})
    stage = _merge("stage", stage, zero_cfg.get("stage"), "['zero_optimization']['stage']")
    if stage is None:
        raise ValueError("zeroplus.initialize: no ZeRO stage: pass stage= or config['zero_optimization']['stage']")
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (1, 2, 3):
        raise ValueError(f"zeroplus.initialize: stage must be 1, 2 or 3, got {stage!r}")
    for key, cfg_key in STAGE3_KEYWORDS.items():
        if cfg_key is not None and cfg_key in zero_cfg:
            stage3_args[key] = _merge(key, stage3_args.get(key), zero_cfg[cfg_key],
                                      f"['zero_optimization'][{cfg_key!r}]")
    if stage != 3 and stage3_args:
        raise ValueError(f"zeroplus.initialize: {sorted(stage3_args)} apply to stage 3 only, got stage={stage}")
    bucket = zero_cfg.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET_ELEMS)
    if not _is_number(bucket) or bucket < 1:
        raise ValueError(f"zeroplus.initialize: config['zero_optimization']['reduce_bucket_size'] must be a "
                         f"positive number of elements, got {bucket!r}")

    # Precision.
    fp16_keys = ds_keys.FP16
    bf16 = cfg.get("bf16", {}).get("enabled", _default(ds_keys.BF16, "enabled"))
    fp16_cfg = cfg.get("fp16", {})
    fp16 = fp16_cfg.get("enabled", _default(fp16_keys, "enabled"))
    if bf16 and fp16:
        raise ValueError("zeroplus.initialize: config enables both bf16 and fp16")
    cfg_precision = "bf16" if bf16 else "fp16" if fp16 else None
    if mixed_precision not in COMPUTE_DTYPES:
        raise ValueError(f"zeroplus.initialize: mixed_precision must be None, 'bf16' or 'fp16', got {mixed_precision!r}")
    if mixed_precision is not None and cfg_precision is not None and mixed_precision != cfg_precision:
        raise ValueError(f"zeroplus.initialize: mixed_precision={mixed_precision!r} conflicts with config "
                         f"[{cfg_precision!r}]['enabled']=true")
    precision = mixed_precision or cfg_precision

    loss_scaler, static_loss_scale = None, None
    if precision == "fp16":
        loss_scale = fp16_cfg.get("loss_scale", _default(fp16_keys, "loss_scale"))
        if not _is_number(loss_scale) or loss_scale < 0:
            raise ValueError(f"zeroplus.initialize: config['fp16']['loss_scale'] must be >= 0, got {loss_scale!r}")
        if loss_scale > 0:
            static_loss_scale = float(loss_scale)
        else:
            power = fp16_cfg.get("initial_scale_power", _default(fp16_keys, "initial_scale_power"))
            if not _is_number(power) or not 0 <= power <= 64:
                raise ValueError(f"zeroplus.initialize: config['fp16']['initial_scale_power'] must be in [0, 64], "
                                 f"got {power!r}")
            given = {field: fp16_cfg[key] for key, field in (
                ("loss_scale_window", "scale_window"), ("hysteresis", "hysteresis"), ("min_loss_scale", "min_scale"),
                ("consecutive_hysteresis", "consecutive_hysteresis")) if key in fp16_cfg}
            loss_scaler = LossScalerOptions(init_scale=2.0 ** power, **given)
            loss_scaler.validate()

    clip = cfg.get("gradient_clipping", _default(ds_keys.KEYS, "gradient_clipping"))
    if not _is_number(clip) or clip < 0:
        raise ValueError(f"zeroplus.initialize: config['gradient_clipping'] must be >= 0, got {clip!r}")

    try:
        aio = parse_aio(cfg.get("aio"))
    except (TypeError, ValueError) as e:
        raise type(e)(f"zeroplus.initialize: config['aio']: {str(e).removeprefix('aio: ')}") from e
    offload = {}
    for key in ("offload_optimizer", "offload_param"):
        arg, cfg_value = offload_args.get(key), zero_cfg.get(key)
        if arg is not None and cfg_value is not None and arg != cfg_value:
            raise ValueError(f"zeroplus.initialize: {key}={arg!r} conflicts with config['zero_optimization']"
                             f"[{key!r}]={cfg_value!r}")
        try:
            offload[key] = parse_offload(key, arg if arg is not None else cfg_value, aio)
        except (TypeError, ValueError) as e:
            where = f"{key}=" if arg is not None else f"config['zero_optimization'][{key!r}]"
            raise type(e)(f"zeroplus.initialize: {where}: {e}") from e
    if offload["offload_param"].enabled and stage != 3:
        raise ValueError(f"zeroplus.initialize: offload_param applies to stage 3 only, got stage={stage}")

    accum = cfg.get("data_types", {}).get("grad_accum_dtype")
    if accum is not None and accum not in _DTYPE_NAMES:
        raise ValueError(f"zeroplus.initialize: config['data_types']['grad_accum_dtype'] must be one of "
                         f"{sorted(_DTYPE_NAMES)}, got {accum!r}")

    try:
        options = EngineOptions(
            reduce_bucket_elems=int(bucket), gradient_clipping=float(clip),
            precision=PrecisionPolicy(mixed_precision=precision, loss_scaler=loss_scaler,
                                      static_loss_scale=static_loss_scale,
                                      grad_accum_dtype=_DTYPE_NAMES[accum] if accum is not None else None),
            stage3=Stage3Policy(**stage3_args), **offload)
    except (TypeError, ValueError) as e:
        raise type(e)(f"zeroplus.initialize: {e}") from e
    return ZeroSettings(stage=stage, optimizer_class=opt_class, optimizer_defaults=defaults, options=options,
                        ignored_keys=sorted(ignored))
