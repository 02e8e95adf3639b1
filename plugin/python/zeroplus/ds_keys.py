"""Every DeepSpeed config key zeroplus accepts, in one table: section, type, default, role.

This is the only list of DeepSpeed key names in zeroplus. zero/ds_config.py (prepare: "auto",
warnings, scheduler and batch keys), zero/config.py (resolve: the engine's settings) and
offload/policy.py (offload_optimizer, offload_param, aio) derive what they accept from it, and
docs/zero.md's "Config keys" table is rendered from it (`markdown()`; a test keeps the page
equal to it).

The names are DeepSpeed's own (deepspeed/runtime/config.py, constants.py, precision_config.py,
zero/config.py, zero/offload_config.py, swap_tensor/aio_config.py): a key DeepSpeed reads is
never refused as unknown, and any other key raises ValueError naming it and the closest known
one, so a typo never silently changes nothing. Roles:

  engine    checked here and read by zeroplus (config.resolve, the offload policies)
  loop      taken out by ds_config.prepare: the scheduler and the batch keys
  internal  tunes DeepSpeed's own engine: dropped with one UserWarning naming each
  alias     another name DeepSpeed takes for `target` (pydantic field names beside the stage3_
            aliases, old names): renamed to it; both given is a ValueError naming both

Defaults of engine keys are defined here and only here (the policies read them from this table).
Torch-free and import-free, so any package module may import it.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable

# Value kinds. "count": an int or an integral float (JSON's 1e9); "number": finite int/float.
BOOL, COUNT, NUMBER, STRING, OBJECT, PAIR, ANY = "bool", "count", "number", "string", "object", "pair", "any"
ROLES = ("engine", "loop", "internal", "alias")
AUTO = "auto"


@dataclass(frozen=True)
class Key:
    kind: str                          # one of the value kinds above
    role: str = "engine"
    default: Any = None                # what zeroplus uses when the key is absent (None: none, or see doc)
    doc: str = ""                      # what zeroplus does with it
    auto: bool = False                 # HF's "auto" allowed
    nullable: bool = False             # JSON null allowed (DeepSpeed's Optional fields)
    refuse: Any = None                 # a value zeroplus refuses (not built); doc says why
    keyword: str | None = None         # the zeroplus.initialize keyword taking the same value
    target: str | None = None          # alias: the key it names
    convert: Callable | None = None    # alias: DeepSpeed's conversion of a deprecated value (None: drop)


class Open(dict):
    """A section whose unlisted names pass through (optimizer.params: the constructor checks them)."""


class Nullable(dict):
    """A section that may be JSON null (DeepSpeed's Optional sub-configs: null is the default)."""


def _e(kind, default=None, doc="", **kw):
    return Key(kind, "engine", default, doc, **kw)


def _internal(kind=ANY):
    return Key(kind, "internal", doc="tunes DeepSpeed's own engine: warned about, dropped")


def _alias(target, kind=ANY, convert=None):
    return Key(kind, "alias", doc=f"DeepSpeed's other name for `{target}`", target=target, convert=convert)


OFFLOAD_COMMON = {
    "device": _e(STRING, "none", "`none`, `cpu` or `nvme` (`docs/offload.md`)", nullable=True),
    "nvme_path": _e(STRING, None, "existing directory for the swap files (`nvme`)", nullable=True),
    "pin_memory": _e(BOOL, False, "CUDA training: page-locked host copies; NVMe buffers are always pinned"),
}
OFFLOAD_OPTIMIZER = Nullable({
    **OFFLOAD_COMMON,
    "buffer_count": _e(COUNT, 4, "pooled bucket records (resident optimizer memory)"),
    "pipeline_read": _e(BOOL, True, "read the next bucket while this one steps (DeepSpeed's default: false)"),
    "pipeline_write": _e(BOOL, True, "write without waiting (DeepSpeed's default: false)"),
    "pipeline": _e(BOOL, None, "zeroplus's shorthand for both pipeline_read and pipeline_write (not DeepSpeed's)"),
    "fast_init": _e(BOOL, False, "accepted, no effect (records are written at the first step)"),
    "ratio": _e(NUMBER, 1.0, "only 1.0: partial offload is not built"),
    "super_offload": _internal(BOOL), "convert_grad_on_cpu": _internal(BOOL), "cpuadam_cores_perc": _internal(NUMBER),
})
OFFLOAD_PARAM = Nullable({
    **OFFLOAD_COMMON,
    "buffer_count": _e(COUNT, 5, "stage 3: pooled parameter shard records"),
    "buffer_size": _e(COUNT, 100_000_000, "elements per pooled parameter buffer"),
    "max_in_cpu": _e(COUNT, 1_000_000_000, "checked, no effect: every offloaded shard is on disk"),
})
_STAGE3_NAMES = ("max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
                 "use_all_reduce_for_fetch_params", "allgather_sequential", "partition_stream_chunk_size",
                 "model_persistence_threshold")
ZERO = {
    "stage": _e(COUNT, None, "1, 2 or 3"),
    "reduce_bucket_size": _e(COUNT, 1 << 22, "gradient bucket in elements (the unit of reduce-scatter overlap)",
                             auto=True),
    "overlap_comm": _e(BOOL, True, "zeroplus always overlaps reduction with backward; false is refused",
                       refuse=False),
    "contiguous_gradients": _e(BOOL, True, "zeroplus always packs gradients into buckets; false is refused",
                               refuse=False),
    "reduce_scatter": _e(BOOL, True, "zeroplus always reduce-scatters at stages 2-3; false is refused",
                         refuse=False),
    "stage3_prefetch_bucket_size": _e(COUNT, None, "stage 3: elements gathered ahead (absent: one unit ahead)",
                                      auto=True, keyword="prefetch_bucket_size"),
    "stage3_max_live_parameters": _e(COUNT, 1_000_000_000, "stage 3: prefetch stops at this many gathered elements",
                                     keyword="max_live_parameters"),
    "stage3_param_persistence_threshold": _e(COUNT, 100_000, "stage 3: parameters this small stay whole",
                                             auto=True, keyword="param_persistence_threshold"),
    "offload_optimizer": OFFLOAD_OPTIMIZER,
    "offload_param": OFFLOAD_PARAM,
    "prefetch_bucket_size": _alias("stage3_prefetch_bucket_size"),
    "max_live_parameters": _alias("stage3_max_live_parameters"),
    "param_persistence_threshold": _alias("stage3_param_persistence_threshold"),
    # DeepSpeed's deprecated booleans, converted as it converts them (zero/config.py new_param_fn).
    "cpu_offload": _alias("offload_optimizer", BOOL, lambda v: {"device": "cpu"} if v else None),
    "cpu_offload_param": _alias("offload_param", BOOL, lambda v: {"device": "cpu"} if v else None),
    **{k: _internal() for k in (
        "allgather_bucket_size", "allgather_partitions", "use_multi_rank_bucket_allreduce", "load_from_fp32_weights",
        "elastic_checkpoint", "zenflow", "sub_group_size", "cpu_offload_use_pin_memory",
        "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
        "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
        "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
        "mics_hierarchical_params_gather", "memory_efficient_linear", "pipeline_loading_checkpoint",
        "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory", "leaf_module", *_STAGE3_NAMES,
        *(f"stage3_{k}" for k in _STAGE3_NAMES))},
}
FP16 = {
    "enabled": _e(BOOL, False, "fp16 mixed precision (fp32 masters)", auto=True),
    "loss_scale": _e(NUMBER, 0, "0: dynamic; > 0: static scale"),
    "initial_scale_power": _e(NUMBER, 16, "initial dynamic scale 2^power"),
    "loss_scale_window": _e(COUNT, 1000, "clean steps before the scale doubles"),
    "hysteresis": _e(COUNT, 2, "overflows absorbed before the scale halves"),
    "consecutive_hysteresis": _e(BOOL, False, "refill hysteresis after every clean step"),
    "min_loss_scale": _e(NUMBER, 1, "floor of the scale (an overflow at the floor raises)"),
    "auto_cast": _internal(BOOL), "fp16_master_weights_and_grads": _internal(BOOL),
}
BF16 = {
    "enabled": _e(BOOL, False, "bf16 mixed precision (fp32 masters)", auto=True),
    "immediate_grad_update": _internal(BOOL), "check_grad_overflow": _internal(BOOL),
    "bf16_master_weights_and_grads": _internal(BOOL), "bf16_optimizer_states": _internal(BOOL),
}
AIO = {
    "block_size": _e(COUNT, 1 << 20, "bytes per I/O request of the swap files (`docs/aio.md`)"),
    "queue_depth": _e(COUNT, 32, "requests in flight per thread (DeepSpeed's default: 8)"),
    "intra_op_parallelism": _e(COUNT, 1, "I/O threads"),
    "thread_count": _alias("intra_op_parallelism", COUNT),  # DeepSpeed's name before intra_op_parallelism
    "single_submit": _e(BOOL, False, "accepted, no effect"),
    "overlap_events": _e(BOOL, True, "accepted, no effect"),
    "use_gds": _e(BOOL, False, "zeroplus has no GPUDirect Storage path; true is refused", refuse=True),
}
DATA_TYPES = {
    "grad_accum_dtype": _e(STRING, None, "`fp32`, `bf16`, `fp16`: gradient shard dtype (absent: compute dtype)"),
    "param_dtype": _internal(STRING), "buffer_dtype": _internal(STRING),
}
# optimizer.params: the torch hyperparameters DeepSpeed's docs use; other names go to the optimizer
# constructor, which rejects what it does not take.
OPTIMIZER_PARAMS = Open({
    "lr": _e(NUMBER, auto=True), "betas": _e(PAIR, auto=True), "eps": _e(NUMBER, auto=True),
    "weight_decay": _e(NUMBER, auto=True), "momentum": _e(NUMBER), "dampening": _e(NUMBER),
    "nesterov": _e(BOOL), "amsgrad": _e(BOOL), "maximize": _e(BOOL),
    "torch_adam": _internal(BOOL), "adam_w_mode": _internal(BOOL),
})
OPTIMIZER = {
    "type": _e(STRING, None, "`Adam`, `AdamW`, `SGD` or any `torch.optim` class name"),
    "params": OPTIMIZER_PARAMS,
    "legacy_fusion": _internal(BOOL),
}
# Scheduler parameters (their defaults are zero/schedulers.py's).
_WARMUP = {"warmup_min_lr": _e(NUMBER, auto=True), "warmup_max_lr": _e(NUMBER, auto=True),
           "warmup_num_steps": _e(COUNT, auto=True), "warmup_type": _e(STRING), "last_batch_iteration": _e(COUNT)}
SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": _e(COUNT, auto=True)},
    "WarmupCosineLR": {"total_num_steps": _e(COUNT, auto=True), "warmup_min_ratio": _e(NUMBER),
                       "warmup_num_steps": _e(COUNT, auto=True), "cos_min_ratio": _e(NUMBER),
                       "warmup_type": _e(STRING), "last_batch_iteration": _e(COUNT)},
}
SCHEDULER = {"type": _e(STRING, None, "`WarmupLR`, `WarmupDecayLR` or `WarmupCosineLR`"), "params": _e(OBJECT)}
BATCH = {
    "gradient_accumulation_steps": Key(COUNT, "loop", 1, "checked (>= 1), read by the framework integrations; in "
                                       "your own loop call `opt.step()` every N micro-batches", auto=True),
    "train_micro_batch_size_per_gpu": Key(COUNT, "loop", None, "checked against `train_batch_size`, read by the "
                                          "integrations; your loader sets the batch", auto=True),
    "train_batch_size": Key(COUNT, "loop", None, "checked: micro batch x accumulation x data-parallel size (a "
                            "missing one of the two is derived as DeepSpeed derives it, so it must divide)",
                            auto=True),
}
_INTERNAL_TOP = (
    "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients", "gradient_predivide_factor",
    "gradient_allreduce_op", "disable_allgather", "sparse_gradients", "managed_gradient_accumulation",
    "graph_harvesting", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "memory_breakdown",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "communication_data_type",
    "seq_parallel_communication_data_type", "activation_checkpointing", "checkpoint", "amp", "torch_autocast",
    "compression_training", "weight_quantization", "quantize_training", "data_efficiency", "curriculum_learning",
    "progressive_layer_drop", "eigenvalue", "sparse_attention", "pipeline", "hybrid_engine", "elasticity",
    "autotuning", "nebula", "datastates_ckpt", "compile", "timers", "tensor_parallel", "expert_parallel",
    "dataloader_drop_last", "log_level", "use_data_before_expert_parallelism")
# The whole config: a dict value is a section (its own table), a Key is a leaf.
KEYS: dict[str, Any] = {
    "zero_optimization": ZERO, "fp16": FP16, "bf16": BF16, "aio": AIO, "data_types": DATA_TYPES,
    "optimizer": OPTIMIZER,
    "gradient_clipping": _e(NUMBER, 0, "> 0: `step()` clips to this global norm unless `clip_grad_norm_` ran",
                            auto=True),
    "bfloat16": _alias("bf16", OBJECT),  # DeepSpeed's old name (precision_config.py BFLOAT16_OLD)
    "scheduler": Key(OBJECT, "loop", None, "`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR` built as "
                     "`opt.lr_scheduler`, stepped by `opt.step()` (`docs/zero.md` \"Schedulers\")"),
    **BATCH,
    **{k: _internal() for k in _INTERNAL_TOP},
}


def table(path: tuple) -> dict:
    """The section table at `path`, e.g. ("zero_optimization", "offload_param")."""
    node = KEYS
    for p in path:
        node = node[p]
    if not isinstance(node, dict):
        raise KeyError(f"ds_keys: {'.'.join(path)} is a key, not a section")
    return node


def known(path: tuple) -> frozenset:
    """Every name accepted at `path` (all roles)."""
    return frozenset(table(path))


def names(section: dict, role: str) -> tuple:
    """The names of `section`'s leaf keys with `role`, in table order."""
    return tuple(k for k, v in section.items() if isinstance(v, Key) and v.role == role)


def closest(key: str, candidates) -> str:
    match = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.0)
    return match[0] if match else "?"


def where(path: tuple) -> str:
    return "config" + "".join(f"[{p!r}]" for p in path)


_CHECKS = {
    BOOL: lambda v: isinstance(v, bool),
    COUNT: lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v == int(v),
    NUMBER: lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v),
    STRING: lambda v: isinstance(v, str),
    OBJECT: lambda v: isinstance(v, dict),
    PAIR: lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(
        not isinstance(x, bool) and isinstance(x, (int, float)) for x in v),
    ANY: lambda v: True,
}


def check_value(path: tuple, value, spec: Key, prefix: str = "zeroplus.initialize: ") -> None:
    """ValueError naming the key and the value when `value` is not of `spec`'s kind or is the
    value zeroplus refuses ("auto" passes where allowed: ds_config.prepare fills it)."""
    if (spec.auto and value == AUTO) or (spec.nullable and value is None):
        return
    if not _CHECKS[spec.kind](value):
        article = "an" if spec.kind[0] in "aeio" else "a"
        raise ValueError(f"{prefix}{where(path)} must be {article} {spec.kind}, got {value!r}")
    if spec.refuse is not None and type(value) is type(spec.refuse) and value == spec.refuse:
        raise ValueError(f"{prefix}{where(path)}={json_value(value)} is not supported: {spec.doc}")


def json_value(value) -> str:
    """`value` as JSON writes a scalar (true/false), for messages."""
    return {True: "true", False: "false"}.get(value, repr(value)) if isinstance(value, bool) else repr(value)


def canonical(path: tuple, block: dict, section: dict, prefix: str = "zeroplus.initialize: ") -> dict:
    """A copy of `block` with aliases renamed to their targets (deprecated values converted as
    DeepSpeed converts them); an alias beside its target with another value (or a deprecated one
    beside its replacement, which DeepSpeed refuses too) is a ValueError naming both."""
    out = {}
    for key, value in block.items():
        spec = section.get(key)
        if not (isinstance(spec, Key) and spec.role == "alias"):
            out[key] = value
            continue
        check_value(path + (key,), value, spec, prefix)
        if spec.target in block:
            if spec.convert is None and block[spec.target] == value:
                continue  # the same value under both names
            raise ValueError(f"{prefix}{where(path + (key,))}={value!r} and {where(path + (spec.target,))}="
                             f"{block[spec.target]!r} name the same setting; give one")
        value = spec.convert(value) if spec.convert is not None else value
        if value is not None:
            out[spec.target] = value
    return out


def check(cfg: dict, ignored: list, path: tuple = (), section: dict | None = None,
          prefix: str = "zeroplus.initialize: ") -> dict:
    """A checked copy of `cfg` against the table: aliases renamed, internal keys dropped (their
    dotted paths appended to `ignored`), unknown keys and wrong types raise ValueError naming the
    key (and the closest known one). Sections are checked recursively; an Open section passes
    unlisted names through."""
    section = KEYS if section is None else section
    if not isinstance(cfg, dict):
        raise ValueError(f"{prefix}{where(path)} must be an object, got {cfg!r}")
    out = {}
    for key, value in canonical(path, cfg, section, prefix).items():
        spec = section.get(key)
        if spec is None:
            if isinstance(section, Open):
                out[key] = value
                continue
            raise ValueError(f"{prefix}unknown config key {where(path + (key,))}; "
                             f"did you mean {closest(key, section)!r}?")
        if isinstance(spec, dict):
            nothing = value is None and isinstance(spec, Nullable)
            out[key] = None if nothing else check(value, ignored, path + (key,), spec, prefix)
        elif spec.role == "internal":
            ignored.append(".".join(path + (key,)))
        else:
            check_value(path + (key,), value, spec, prefix)
            out[key] = value
    return out


# -- docs/zero.md's table -------------------------------------------------------------------------

def _shown(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'`"{value}"`'
    return str(value)


def _rows(section: dict, path: tuple):
    internal = []
    for key, spec in section.items():
        dotted = ".".join(path + (key,))
        if isinstance(spec, dict):
            if path == () and key in ("optimizer",):
                yield f"| `{dotted}.type`, `{dotted}.params` | — | optimizer class by name (`\"AdamW\"`, any " \
                      f"`torch.optim` class) and its hyperparameters (`{dotted}.params.torch_adam`, " \
                      f"`adam_w_mode`, `{dotted}.legacy_fusion`: warned, dropped) |"
                continue
            yield from _rows(spec, path + (key,))
        elif spec.role == "internal":
            internal.append(key)
        elif spec.role == "alias":
            converted = ' (true: `{"device": "cpu"}`, deprecated by DeepSpeed)' if spec.convert else ""
            yield f"| `{dotted}` | — | {spec.doc}{converted} |"
        else:
            extra = ' (`"auto"` allowed)' if spec.auto else ""
            yield f"| `{dotted}` | {_shown(spec.default)} | {spec.doc}{extra} |"
    if internal:
        listed = ", ".join(f"`{k}`" for k in internal)
        yield f"| {'in `' + '.'.join(path) + '`' if path else 'top level'}: {listed} | — | DeepSpeed's own engine " \
              f"or features zeroplus does not have: one `UserWarning` names each; dropped |"


def markdown() -> str:
    """docs/zero.md's "Config keys" table, rendered from KEYS."""
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *_rows(KEYS, ())]) + "\n"

