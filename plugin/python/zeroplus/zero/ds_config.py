"""The DeepSpeed-style config as users copy it from DeepSpeed's and Hugging Face's docs.

`prepare(config, auto)` runs before config.resolve and hands it a plain engine config:

  * every key is checked against one table (KEYS below): an unknown key raises ValueError naming
    it and the closest known key (difflib); a value of the wrong type raises ValueError naming
    the key and the value. Counts accept integral floats (`1e9`), as DeepSpeed's JSON files use.
  * Keys that only tune DeepSpeed's own engine (INTERNAL: steps_per_print, allgather_bucket_size,
    sub_group_size, ...) are dropped with ONE UserWarning naming each, so nobody believes they
    changed something.
  * HF's "auto" values are resolved from `auto` (an AutoValues): the HF integration fills it from
    TrainingArguments exactly as transformers' HfTrainerDeepSpeedConfig does (and, like it,
    refuses a non-"auto" value that contradicts TrainingArguments); zeroplus.initialize fills it
    from its own arguments. An "auto" with no value to take is dropped (the default applies),
    except scheduler total_num_steps, which has no default (ValueError naming the key).
  * `scheduler`, `gradient_accumulation_steps`, `train_micro_batch_size_per_gpu` and
    `train_batch_size` are returned beside the engine config (DsConfig): the scheduler is built on
    the optimizer by `attach`; the batch keys are checked (train_batch_size = micro x accum x world
    when all are known) and read by the integrations, which own the loop.
  * `zero_optimization.offload_optimizer/offload_param` are passed to config.resolve untouched
    (the offload engine owns their meaning); `aio` is type-checked here and passed on.
"""

from __future__ import annotations

import copy
import difflib
import math
import warnings
from dataclasses import dataclass
from typing import Any

from . import schedulers
from .config import load_config

AUTO = "auto"
# Value kinds. "count": an int or an integral float (JSON's 1e9); "number": finite int/float.
_T_BOOL, _T_COUNT, _T_NUM, _T_STR, _T_DICT, _T_PAIR = "bool", "count", "number", "string", "object", "pair"


@dataclass(frozen=True)
class Key:
    kind: str                 # one of the _T_* value kinds
    role: str = "engine"      # engine: read by config.resolve | loop | internal (warned, dropped) | owned
    auto: bool = False        # "auto" allowed


def _k(kind, auto=False):
    return Key(kind, "engine", auto)


def _internal(kind):
    return Key(kind, "internal")


_FP16 = {"enabled": _k(_T_BOOL, True), "loss_scale": _k(_T_NUM), "initial_scale_power": _k(_T_NUM),
         "loss_scale_window": _k(_T_COUNT), "hysteresis": _k(_T_COUNT), "consecutive_hysteresis": _k(_T_BOOL),
         "min_loss_scale": _k(_T_NUM), "auto_cast": _internal(_T_BOOL),
         "fp16_master_weights_and_grads": _internal(_T_BOOL)}
_BF16 = {"enabled": _k(_T_BOOL, True), "immediate_grad_update": _internal(_T_BOOL),
         "check_grad_overflow": _internal(_T_BOOL)}
_ZERO = {
    "stage": _k(_T_COUNT), "reduce_bucket_size": _k(_T_COUNT, True), "overlap_comm": _k(_T_BOOL),
    "contiguous_gradients": _k(_T_BOOL), "reduce_scatter": _k(_T_BOOL),
    "stage3_prefetch_bucket_size": _k(_T_COUNT, True), "stage3_max_live_parameters": _k(_T_COUNT),
    "stage3_param_persistence_threshold": _k(_T_COUNT, True),
    "offload_optimizer": Key(_T_DICT, "owned"), "offload_param": Key(_T_DICT, "owned"),
    "allgather_bucket_size": _internal(_T_COUNT), "allgather_partitions": _internal(_T_BOOL),
    "round_robin_gradients": _internal(_T_BOOL), "elastic_checkpoint": _internal(_T_BOOL),
    "load_from_fp32_weights": _internal(_T_BOOL), "ignore_unused_parameters": _internal(_T_BOOL),
    "sub_group_size": _internal(_T_COUNT), "stage3_max_reuse_distance": _internal(_T_COUNT),
    "stage3_gather_16bit_weights_on_model_save": _internal(_T_BOOL),
    "stage3_gather_fp16_weights_on_model_save": _internal(_T_BOOL),
    "zero_hpz_partition_size": _internal(_T_COUNT), "zero_quantized_weights": _internal(_T_BOOL),
    "zero_quantized_gradients": _internal(_T_BOOL), "memory_efficient_linear": _internal(_T_BOOL),
    "stage3_module_granularity_threshold": _internal(_T_COUNT), "mics_shard_size": _internal(_T_NUM),
}
_AIO = {"block_size": _k(_T_COUNT), "queue_depth": _k(_T_COUNT), "thread_count": _k(_T_COUNT),
        "intra_op_parallelism": _k(_T_COUNT), "single_submit": _k(_T_BOOL), "overlap_events": _k(_T_BOOL),
        "use_gds": _k(_T_BOOL)}
# optimizer.params: the torch hyperparameters DeepSpeed's docs use; other names go to the optimizer
# constructor, which rejects what it does not take.
_OPT_PARAMS = {"lr": _k(_T_NUM, True), "betas": _k(_T_PAIR, True), "eps": _k(_T_NUM, True),
               "weight_decay": _k(_T_NUM, True), "momentum": _k(_T_NUM), "dampening": _k(_T_NUM),
               "nesterov": _k(_T_BOOL), "amsgrad": _k(_T_BOOL), "maximize": _k(_T_BOOL),
               "torch_adam": _internal(_T_BOOL), "adam_w_mode": _internal(_T_BOOL)}
_WARMUP = {"warmup_min_lr": _k(_T_NUM, True), "warmup_max_lr": _k(_T_NUM, True),
           "warmup_num_steps": _k(_T_COUNT, True), "warmup_type": _k(_T_STR), "last_batch_iteration": _k(_T_COUNT)}
SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": _k(_T_COUNT, True)},
    "WarmupCosineLR": {"total_num_steps": _k(_T_COUNT, True), "warmup_min_ratio": _k(_T_NUM),
                       "warmup_num_steps": _k(_T_COUNT, True), "cos_min_ratio": _k(_T_NUM),
                       "warmup_type": _k(_T_STR), "last_batch_iteration": _k(_T_COUNT)},
}
_LOOP = {"gradient_accumulation_steps": Key(_T_COUNT, "loop", True),
         "train_micro_batch_size_per_gpu": Key(_T_COUNT, "loop", True),
         "train_batch_size": Key(_T_COUNT, "loop", True)}
_INTERNAL_TOP = ("steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
                 "gradient_predivide_factor", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                 "memory_breakdown", "tensorboard", "wandb", "csv_monitor", "comms_logger", "flops_profiler",
                 "communication_data_type", "seq_parallel_communication_data_type", "activation_checkpointing",
                 "checkpoint", "amp", "compression_training", "data_efficiency", "elasticity", "autotuning")
# Top level: a dict value is a section (its own table); a Key is a leaf. "optimizer" and
# "scheduler" are checked by their own functions.
KEYS: dict[str, Any] = {
    "zero_optimization": _ZERO, "fp16": _FP16, "bf16": _BF16, "aio": _AIO,
    "data_types": {"grad_accum_dtype": _k(_T_STR)},
    "gradient_clipping": _k(_T_NUM, True), "optimizer": None, "scheduler": None,
    **_LOOP, **{k: Key("any", "internal") for k in _INTERNAL_TOP},
}


@dataclass(frozen=True)
class AutoValues:
    """Where HF's "auto" values come from (None: not known, the key's default applies)."""
    lr: float | None = None
    betas: tuple | None = None
    eps: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None
    fp16: bool | None = None
    bf16: bool | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    world_size: int | None = None
    hidden_size: int | None = None
    total_num_steps: int | None = None
    warmup_num_steps: int | None = None
    check_matches: bool = False  # HF: a non-"auto" value contradicting these is an error
    source: str = "zeroplus.initialize"


@dataclass(frozen=True)
class DsConfig:
    engine: dict                   # what config.resolve reads (no "auto", no internal keys)
    scheduler: dict | None         # {"type": ..., "params": {...}}, resolved
    gradient_accumulation_steps: int = 1
    train_micro_batch_size_per_gpu: int | None = None
    train_batch_size: int | None = None
    ignored: tuple[str, ...] = ()  # the internal keys dropped (and warned about)


def _closest(key: str, known) -> str:
    match = difflib.get_close_matches(key, list(known), n=1, cutoff=0.0)
    return match[0] if match else "?"


def _where(path: tuple) -> str:
    return "config" + "".join(f"[{p!r}]" for p in path)


def _check_type(path: tuple, value, kind: str) -> None:
    ok = {
        _T_BOOL: lambda v: isinstance(v, bool),
        _T_COUNT: lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        and v == int(v),
        _T_NUM: lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v),
        _T_STR: lambda v: isinstance(v, str),
        _T_DICT: lambda v: isinstance(v, dict),
        _T_PAIR: lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(
            not isinstance(x, bool) and isinstance(x, (int, float)) for x in v),
        "any": lambda v: True,
    }[kind](value)
    if not ok:
        article = "an" if kind[0] in "aeio" else "a"
        raise ValueError(f"zeroplus.initialize: {_where(path)} must be {article} {kind}, got {value!r}")


def _check_section(path: tuple, block, table: dict, ignored: list) -> dict:
    """A copy of `block` with internal keys dropped (recorded in `ignored`); raises on unknown
    keys and wrong types."""
    if not isinstance(block, dict):
        raise ValueError(f"zeroplus.initialize: {_where(path)} must be an object, got {block!r}")
    out = {}
    for key, value in block.items():
        if key not in table:
            raise ValueError(f"zeroplus.initialize: unknown config key {_where(path + (key,))}; "
                             f"did you mean {_closest(key, table)!r}?")
        spec = table[key]
        if spec.role == "internal":
            ignored.append(".".join(path + (key,)))
            continue
        if not (spec.auto and value == AUTO) and spec.role != "owned":
            _check_type(path + (key,), value, spec.kind)
        out[key] = value
    return out


def _check(cfg: dict, ignored: list) -> dict:
    out = {}
    for key, value in cfg.items():
        if key not in KEYS:
            raise ValueError(f"zeroplus.initialize: unknown config key {_where((key,))}; "
                             f"did you mean {_closest(key, KEYS)!r}?")
        spec = KEYS[key]
        if key == "optimizer":
            block = _check_section((key,), value, {"type": _k(_T_STR), "params": _k(_T_DICT)}, ignored)
            if "params" in block:
                block["params"] = _check_open_section(("optimizer", "params"), block["params"], _OPT_PARAMS, ignored)
            out[key] = block
        elif key == "scheduler":
            out[key] = _check_scheduler(value, ignored)
        elif isinstance(spec, dict):
            out[key] = _check_section((key,), value, spec, ignored)
        elif spec.role == "internal":
            ignored.append(key)
        else:
            if not (spec.auto and value == AUTO):
                _check_type((key,), value, spec.kind)
            out[key] = value
    return out


def _check_open_section(path, block, table, ignored) -> dict:
    """optimizer.params: known names are type-checked, the others go to the constructor."""
    out = {}
    for key, value in block.items():
        spec = table.get(key)
        if spec is not None and spec.role == "internal":
            ignored.append(".".join(path + (key,)))
            continue
        if spec is not None and not (spec.auto and value == AUTO):
            _check_type(path + (key,), value, spec.kind)
        out[key] = value
    return out


def _check_scheduler(block, ignored) -> dict:
    checked = _check_section(("scheduler",), block, {"type": _k(_T_STR), "params": _k(_T_DICT)}, ignored)
    kind = checked.get("type")
    if kind not in SCHEDULER_PARAMS:
        raise ValueError(f"zeroplus.initialize: config['scheduler']['type']={kind!r} is not supported; "
                         f"supported: {sorted(SCHEDULER_PARAMS)} (did you mean {_closest(str(kind), SCHEDULER_PARAMS)!r}?)")
    checked["params"] = _check_section(("scheduler", "params"), checked.get("params", {}), SCHEDULER_PARAMS[kind],
                                       ignored)
    warmup_type = checked["params"].get("warmup_type", "log")
    if warmup_type not in schedulers.WARMUP_TYPES:
        raise ValueError(f"zeroplus.initialize: config['scheduler']['params']['warmup_type'] must be one of "
                         f"{list(schedulers.WARMUP_TYPES)}, got {warmup_type!r}")
    return checked


# (path, AutoValues field or a function of it) in transformers' order; None value: drop the key.
def _auto_table(a: AutoValues, stage3: bool):
    hidden = a.hidden_size
    batch = None
    if None not in (a.world_size, a.micro_batch_size, a.gradient_accumulation_steps):
        batch = a.world_size * a.micro_batch_size * a.gradient_accumulation_steps
    return [
        (("train_micro_batch_size_per_gpu",), a.micro_batch_size, True),
        (("gradient_accumulation_steps",), a.gradient_accumulation_steps, True),
        (("train_batch_size",), batch, True),
        (("gradient_clipping",), a.max_grad_norm, True),
        (("optimizer", "params", "lr"), a.lr, True),
        (("optimizer", "params", "betas"), None if a.betas is None else list(a.betas), True),
        (("optimizer", "params", "eps"), a.eps, True),
        (("optimizer", "params", "weight_decay"), a.weight_decay, True),
        (("scheduler", "params", "warmup_min_lr"), 0, False),
        (("scheduler", "params", "warmup_max_lr"), a.lr, True),
        (("fp16", "enabled"), a.fp16, True),
        (("bf16", "enabled"), a.bf16, True),
        (("zero_optimization", "reduce_bucket_size"), None if hidden is None else hidden * hidden, False),
        (("zero_optimization", "stage3_prefetch_bucket_size"),
         None if hidden is None or not stage3 else int(0.9 * hidden * hidden), False),
        (("zero_optimization", "stage3_param_persistence_threshold"),
         None if hidden is None or not stage3 else 10 * hidden, False),
        (("scheduler", "params", "total_num_steps"), a.total_num_steps, True),
        (("scheduler", "params", "warmup_num_steps"), a.warmup_num_steps, True),
    ]


def _fill_auto(cfg: dict, a: AutoValues) -> None:
    stage3 = cfg.get("zero_optimization", {}).get("stage") == 3
    mismatches = []
    for path, value, must_match in _auto_table(a, stage3):
        node = cfg
        for p in path[:-1]:
            node = node.get(p)
            if not isinstance(node, dict):
                break
        else:
            key = path[-1]
            if key not in node:
                continue
            if node[key] == AUTO:
                if value is not None:
                    node[key] = value
                elif path[-1] == "total_num_steps":
                    raise ValueError(f"zeroplus.initialize: {_where(path)}='auto' has no value to take: "
                                     f"{a.source} does not know the run's length; write the number in the config")
                else:
                    del node[key]  # the default applies
            elif a.check_matches and must_match and value is not None and node[key] != value:
                mismatches.append(f"{_where(path)}={node[key]!r} vs {a.source} {value!r}")
    if mismatches:
        raise ValueError("zeroplus: DeepSpeed config values contradict " + a.source + ": " + "; ".join(mismatches)
                         + " (set them to \"auto\")")


def _check_batch(micro, accum, total, world) -> None:
    """train_batch_size = micro batch x accumulation x data-parallel size, DeepSpeed's rule; a
    missing one of micro/accumulation is derived as DeepSpeed derives it, so it must divide."""
    if total is None or world is None or (micro is None and accum is None):
        return
    if micro is not None and accum is not None:
        ok = total == micro * accum * world
    else:
        ok = total % ((micro or accum) * world) == 0
    if not ok:
        shown = lambda v: "(derived)" if v is None else v  # noqa: E731
        raise ValueError(f"zeroplus: config['train_batch_size']={total} != train_micro_batch_size_per_gpu "
                         f"{shown(micro)} x gradient_accumulation_steps {shown(accum)} x data-parallel size {world}")


def prepare(config, auto: AutoValues | None = None) -> DsConfig:
    """Check, warn about and resolve a DeepSpeed-style config (dict, JSON path or None)."""
    raw = load_config(config)
    ignored: list[str] = []
    cfg = _check(copy.deepcopy(raw), ignored)
    _fill_auto(cfg, auto or AutoValues())
    stage = cfg.get("zero_optimization", {}).get("stage")
    if stage is not None and stage != 3:  # DeepSpeed ignores stage-3 knobs at stages 1-2
        for key in [k for k in cfg["zero_optimization"] if k.startswith("stage3_")]:
            del cfg["zero_optimization"][key]
            ignored.append(f"zero_optimization.{key}")
    if ignored:
        warnings.warn(f"zeroplus: DeepSpeed config keys with no effect in zeroplus (they tune DeepSpeed's own "
                      f"engine), ignored: {', '.join(ignored)}", UserWarning, stacklevel=3)
    loop = {k: cfg.pop(k) for k in list(_LOOP) if k in cfg}
    for key, value in loop.items():
        if value == AUTO:
            loop[key] = None
        elif value < 1:
            raise ValueError(f"zeroplus.initialize: {_where((key,))} must be >= 1, got {value!r}")
        else:
            loop[key] = int(value)
    micro, accum, total = (loop.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                   "train_batch_size"))
    _check_batch(micro, accum, total, (auto or AutoValues()).world_size)
    scheduler = cfg.pop("scheduler", None)
    if scheduler is not None:
        scheduler = {"type": scheduler["type"],
                     "params": {k: int(v) if SCHEDULER_PARAMS[scheduler["type"]][k].kind == _T_COUNT else v
                                for k, v in scheduler["params"].items()}}
    params = cfg.get("optimizer", {}).get("params")
    if params and isinstance(params.get("betas"), list):
        params["betas"] = tuple(params["betas"])
    return DsConfig(engine=cfg, scheduler=scheduler, gradient_accumulation_steps=accum or 1,
                    train_micro_batch_size_per_gpu=micro, train_batch_size=total, ignored=tuple(ignored))


def auto_from_initialize(model, mixed_precision, optimizer_defaults: dict, world_size: int | None = None) -> AutoValues:
    """zeroplus.initialize's own arguments as the source of "auto" values; world_size: the
    data-parallel size (None when not known yet), against which train_batch_size is checked."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    return AutoValues(lr=optimizer_defaults.get("lr"), betas=optimizer_defaults.get("betas"),
                      eps=optimizer_defaults.get("eps"), weight_decay=optimizer_defaults.get("weight_decay"),
                      fp16=mixed_precision == "fp16", bf16=mixed_precision == "bf16",
                      hidden_size=hidden if isinstance(hidden, int) else None, world_size=world_size)


def attach(opt, ds: DsConfig) -> None:
    """Builds the config's scheduler on `opt` as `opt.lr_scheduler` (None without one), stepped
    after every `opt.step()` that updated the weights, as DeepSpeed's engine steps it."""
    opt.lr_scheduler = None
    if ds.scheduler is not None:
        try:
            scheduler = schedulers.build_scheduler(opt, ds.scheduler)
        except (TypeError, ValueError) as e:
            raise type(e)(f"zeroplus.initialize: config['scheduler']: {e}") from e
        opt.lr_scheduler = scheduler
        opt.register_step_post_hook(schedulers.step_after_optimizer(opt, scheduler))
