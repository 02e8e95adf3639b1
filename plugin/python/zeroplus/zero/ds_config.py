"""The DeepSpeed-style config as users copy it from DeepSpeed's and Hugging Face's docs.

`prepare(config, auto)` runs before config.resolve and hands it a plain engine config:

  * every key is checked against the one table, zeroplus.ds_keys.KEYS (re-exported here): an
    unknown key raises ValueError naming it and the closest known key (difflib); a value of the
    wrong type raises ValueError naming the key and the value. Counts accept integral floats
    (`1e9`), as DeepSpeed's JSON files use. DeepSpeed's other names for a key (its pydantic field
    names beside the stage3_ aliases, `bfloat16`, the deprecated `cpu_offload` booleans) are
    renamed to the key zeroplus reads.
  * Keys that only tune DeepSpeed's own engine (role "internal": steps_per_print,
    allgather_bucket_size, sub_group_size, ...) are dropped with ONE UserWarning naming each, so
    nobody believes they changed something.
  * HF's "auto" values are resolved from `auto` (an AutoValues): the HF integration fills it from
    TrainingArguments exactly as transformers' HfTrainerDeepSpeedConfig does (and, like it,
    refuses a non-"auto" value that contradicts TrainingArguments); zeroplus.initialize fills it
    from its own arguments. An "auto" with no value to take is dropped (the default applies),
    except scheduler total_num_steps, which has no default (ValueError naming the key).
  * `scheduler`, `gradient_accumulation_steps`, `train_micro_batch_size_per_gpu` and
    `train_batch_size` are returned beside the engine config (DsConfig): the scheduler is built on
    the optimizer by `attach`; the batch keys are checked (train_batch_size = micro x accum x world
    when all are known) and read by the integrations, which own the loop.
  * `zero_optimization.offload_optimizer/offload_param` and `aio` are checked against the table
    like every section and passed on; the offload policies own their meaning.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

from .. import ds_keys
from ..ds_keys import AUTO, BATCH, COUNT, KEYS, SCHEDULER, SCHEDULER_PARAMS  # noqa: F401  (KEYS: the table)
from . import schedulers
from .config import load_config


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


_where = ds_keys.where


def _check(cfg: dict, ignored: list) -> dict:
    """Every key against ds_keys.KEYS; the scheduler's params against its type's table."""
    cfg = dict(cfg)
    has_scheduler, scheduler = "scheduler" in cfg, cfg.pop("scheduler", None)
    out = ds_keys.check(cfg, ignored)
    if has_scheduler:
        out["scheduler"] = _check_scheduler(scheduler, ignored)
    return out


def _check_scheduler(block, ignored) -> dict:
    checked = ds_keys.check(block, ignored, ("scheduler",), SCHEDULER)
    kind = checked.get("type")
    if kind not in SCHEDULER_PARAMS:
        raise ValueError(f"zeroplus.initialize: config['scheduler']['type']={kind!r} is not supported; "
                         f"supported: {sorted(SCHEDULER_PARAMS)} (did you mean "
                         f"{ds_keys.closest(str(kind), SCHEDULER_PARAMS)!r}?)")
    checked["params"] = ds_keys.check(checked.get("params", {}), ignored, ("scheduler", "params"),
                                      SCHEDULER_PARAMS[kind])
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
    loop = {k: cfg.pop(k) for k in BATCH if k in cfg}
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
                     "params": {k: int(v) if SCHEDULER_PARAMS[scheduler["type"]][k].kind == COUNT else v
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
