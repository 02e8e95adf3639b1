"""The one table of DeepSpeed config keys (zeroplus.ds_keys): every key DeepSpeed reads is
accepted (used, renamed from DeepSpeed's other name, or warned about and dropped) on every path
(zeroplus.initialize's ds_config.prepare, config.resolve given a config directly, the offload
policies given keyword dicts), a typo still raises ValueError naming the key, no module keeps a
second list of key names, and docs/zero.md's key table is the table's rendering.

The DeepSpeed names are taken from its sources (deepspeedai/DeepSpeed: deepspeed/runtime/config.py,
constants.py, precision_config.py, zero/config.py, zero/offload_config.py, swap_tensor/constants.py).
Single process, no ranks."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch

from zeroplus.offload.policy import parse_aio, parse_offload
from zeroplus.zero import ds_config
from zeroplus.zero.config import resolve

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "plugin" / "python" / "zeroplus"


def _base(stage=3):
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}


def _put(cfg, path, value):
    node = cfg
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value
    return cfg


def _prepare(cfg):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = ds_config.prepare(cfg)
    return ds, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


# Keys DeepSpeed reads that zeroplus refused as unknown on some path before the table was one.
# Internal to DeepSpeed's engine: warned about (one warning naming each) and dropped.
DEEPSPEED_INTERNAL = [
    # in ds_config's table but not in config.py's lists: config.resolve refused them
    (("zero_optimization", "zero_hpz_partition_size"), 1),
    (("zero_optimization", "zero_quantized_weights"), False),
    (("zero_optimization", "zero_quantized_gradients"), False),
    (("zero_optimization", "memory_efficient_linear"), True),
    (("zero_optimization", "stage3_module_granularity_threshold"), 0),
    (("zero_optimization", "mics_shard_size"), -1),
    (("activation_checkpointing",), {"partition_activations": False}),
    (("checkpoint",), {"tag_validation": "WARN"}),
    (("amp",), {"enabled": False}),
    (("compression_training",), {}),
    (("data_efficiency",), {"enabled": False}),
    (("elasticity",), {"enabled": False}),
    (("autotuning",), {"enabled": False}),
    # in no list: refused everywhere (DeepSpeed's zero/config.py DeepSpeedZeroConfig fields)
    (("zero_optimization", "use_multi_rank_bucket_allreduce"), True),
    (("zero_optimization", "stage3_model_persistence_threshold"), 10**6),
    (("zero_optimization", "stage3_use_all_reduce_for_fetch_params"), False),
    (("zero_optimization", "stage3_allgather_sequential"), False),
    (("zero_optimization", "zero_quantized_nontrainable_weights"), False),
    (("zero_optimization", "mics_hierarchical_params_gather"), False),
    (("zero_optimization", "override_module_apply"), True),
    (("zero_optimization", "log_trace_cache_warnings"), False),
    (("zero_optimization", "leaf_module"), {"classes": []}),
    (("zero_optimization", "max_reuse_distance"), 10**9),  # pydantic field name of stage3_max_reuse_distance
    (("zero_optimization", "cpu_offload_use_pin_memory"), True),
    # precision_config.py, constants.py
    (("bf16", "bf16_master_weights_and_grads"), False),
    (("bf16", "bf16_optimizer_states"), False),
    (("data_types", "param_dtype"), "bf16"),
    (("optimizer", "legacy_fusion"), False),
    # offload_config.py DeepSpeedZeroOffloadOptimizerConfig
    (("zero_optimization", "offload_optimizer", "super_offload"), False),
    (("zero_optimization", "offload_optimizer", "cpuadam_cores_perc"), 0.8),
    # runtime/config.py top level
    (("torch_autocast",), {"enabled": False}),
    (("tensor_parallel",), {"autotp_size": 1}),
    (("gradient_allreduce_op",), "mean"),
    (("dataloader_drop_last",), False),
    (("comet",), {"enabled": False}),
    (("sparse_gradients",), False),
]


@pytest.mark.parametrize("path,value", DEEPSPEED_INTERNAL, ids=[".".join(p) for p, _ in DEEPSPEED_INTERNAL])
def test_deepspeed_keys_are_warned_about_and_dropped(path, value):
    cfg = _put(_base(), path, value)
    if path[:2] == ("zero_optimization", "offload_optimizer"):
        cfg["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
    ds, messages = _prepare(cfg)
    named = [m for m in messages if "no effect in zeroplus" in m]
    assert len(named) == 1 and ".".join(path) in named[0], messages
    settings = resolve(None, None, None, ds.engine, {})
    assert settings.stage == 3


@pytest.mark.parametrize("path,value", DEEPSPEED_INTERNAL[:13], ids=[".".join(p) for p, _ in DEEPSPEED_INTERNAL[:13]])
def test_resolve_takes_what_prepare_takes(path, value):
    # config.resolve given a config directly (no prepare) accepts the same keys
    settings = resolve(None, None, None, _put(_base(), path, value), {})
    assert settings.stage == 3 and ".".join(path) in settings.ignored_keys


# DeepSpeed's other names for keys zeroplus reads (pydantic field names beside the stage3_
# aliases; precision_config.py BFLOAT16_OLD; the deprecated cpu_offload booleans).
ALIASES = [
    (("zero_optimization", "prefetch_bucket_size"), 12345, lambda s: s.options.stage3.prefetch_bucket_size == 12345),
    (("zero_optimization", "max_live_parameters"), 777, lambda s: s.options.stage3.max_live_parameters == 777),
    (("zero_optimization", "param_persistence_threshold"), 55,
     lambda s: s.options.stage3.param_persistence_threshold == 55),
    (("bfloat16",), {"enabled": True}, lambda s: s.options.precision.mixed_precision == "bf16"),
    (("zero_optimization", "cpu_offload"), True, lambda s: s.options.offload_optimizer.device == "cpu"),
    (("zero_optimization", "cpu_offload_param"), True, lambda s: s.options.offload_param.device == "cpu"),
    (("zero_optimization", "cpu_offload"), False, lambda s: not s.options.offload_optimizer.enabled),
]


@pytest.mark.parametrize("path,value,check", ALIASES, ids=[".".join(p) + f"={v}" for p, v, _ in ALIASES])
def test_deepspeed_other_names_are_used(path, value, check):
    ds, messages = _prepare(_put(_base(), path, value))
    assert not messages, messages
    assert check(resolve(None, None, None, ds.engine, {})), ds.engine
    assert check(resolve(None, None, None, _put(_base(), path, value), {}))  # and given to resolve directly


@pytest.mark.parametrize("alias,target,value", [
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size", 10),
    ("cpu_offload", "offload_optimizer", True),
])
def test_other_name_beside_the_key_names_both(alias, target, value):
    cfg = _base()
    cfg["zero_optimization"].update({alias: value, target: 20 if alias != "cpu_offload" else {"device": "cpu"}})
    with pytest.raises(ValueError, match=rf"\['{alias}'\].*\['{target}'\].*name the same setting"):
        ds_config.prepare(cfg)


def test_bfloat16_beside_bf16_names_both():
    cfg = {**_base(), "bf16": {"enabled": True}, "bfloat16": {"enabled": False}}
    with pytest.raises(ValueError, match=r"\['bfloat16'\].*\['bf16'\]"):
        ds_config.prepare(cfg)


@pytest.mark.parametrize("path,closest", [
    (("zero_optimization", "prefetch_bucket_sise"), "prefetch_bucket_size"),
    (("bfloat17",), "bfloat16"),
    (("zero_optimization", "offload_optimizer", "super_ofload"), "super_offload"),
    (("data_types", "param_dtyp"), "param_dtype"),
])
def test_typos_still_name_the_key(path, closest):
    cfg = _put(_base(), path, 1)
    for call in (lambda: ds_config.prepare(cfg), lambda: resolve(None, None, None, cfg, {})):
        with pytest.raises(ValueError, match=rf"unknown config key .*{path[-1]}.*did you mean '{closest}'"):
            call()


def test_offload_keyword_dicts_take_deepspeeds_keys_too():
    with pytest.warns(UserWarning, match="super_offload"):
        policy = parse_offload("offload_optimizer", {"device": "cpu", "super_offload": False,
                                                     "convert_grad_on_cpu": True})
    assert policy.device == "cpu"
    with pytest.raises(ValueError, match=r"unknown keys \['super_ofload'\].*did you mean 'super_offload'"):
        parse_offload("offload_optimizer", {"device": "cpu", "super_ofload": False})


def test_aio_thread_count_is_intra_op_parallelism():
    assert parse_aio({"thread_count": 3}).threads == 3
    assert parse_aio({"thread_count": 3, "intra_op_parallelism": 3}).threads == 3
    with pytest.raises(ValueError, match="thread_count.*intra_op_parallelism"):
        parse_aio({"thread_count": 2, "intra_op_parallelism": 3})
    with pytest.raises(ValueError, match="use_gds=true is not supported"):
        parse_aio({"use_gds": True})


def test_null_offload_block_is_no_offload():
    cfg = _base()
    cfg["zero_optimization"].update(offload_optimizer=None, offload_param=None)
    settings = resolve(None, None, None, ds_config.prepare(cfg).engine, {})
    assert not settings.options.offload_optimizer.enabled and not settings.options.offload_param.enabled


# -- one table -------------------------------------------------------------------------------------

def _key_name_sets(path: pathlib.Path, names: set[str]):
    """Set literals (and set()/frozenset() of a literal) of two or more DeepSpeed key names."""
    for node in ast.walk(ast.parse(path.read_text())):
        elts = None
        if isinstance(node, ast.Set):
            elts = node.elts
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("set", "frozenset") and node.args \
                and isinstance(node.args[0], (ast.List, ast.Tuple, ast.Set)):
            elts = node.args[0].elts
        if elts and len(elts) >= 2 and all(isinstance(e, ast.Constant) and e.value in names for e in elts):
            yield node.lineno


def _all_names(section) -> set[str]:
    from zeroplus import ds_keys

    out = set()
    for key, spec in section.items():
        out.add(key)
        if isinstance(spec, dict):
            out |= _all_names(spec)
    return out | {k for params in ds_keys.SCHEDULER_PARAMS.values() for k in params}


def test_no_second_list_of_key_names():
    from zeroplus import ds_keys

    names = _all_names(ds_keys.KEYS)
    found = {f"{p.relative_to(PACKAGE)}:{line}" for p in PACKAGE.rglob("*.py") if p.name != "ds_keys.py"
             for line in _key_name_sets(p, names)}
    assert not found, f"sets of DeepSpeed key names outside zeroplus/ds_keys.py: {sorted(found)}"


def test_table_is_well_formed():
    from zeroplus import ds_keys

    def walk(section, path):
        for key, spec in section.items():
            if isinstance(spec, dict):
                yield from walk(spec, path + (key,))
            else:
                yield path + (key,), section, spec

    for path, section, spec in walk(ds_keys.KEYS, ()):
        assert spec.role in ds_keys.ROLES and spec.kind in ds_keys._CHECKS, path
        if spec.role == "alias":
            assert spec.target in section and not (isinstance(section[spec.target], ds_keys.Key)
                                                   and section[spec.target].role == "alias"), path
        if spec.default is not None and spec.role == "engine" and spec.kind != ds_keys.ANY:
            ds_keys.check_value(path, spec.default, spec)  # a default passes its own check


def test_docs_key_table_is_the_tables_rendering():
    from zeroplus import ds_keys

    page = (REPO / "docs" / "zero.md").read_text()
    assert ds_keys.markdown() in page, "docs/zero.md: paste the output of `python -m zeroplus.ds_keys` into " \
                                       "\"Config keys (DeepSpeed names)\""


def test_defaults_come_from_the_table():
    from zeroplus import ds_keys
    from zeroplus.offload.policy import OffloadPolicy
    from zeroplus.zero.loss_scaler import LossScalerOptions
    from zeroplus.zero.policies import EngineOptions, Stage3Policy

    settings = resolve(torch.optim.AdamW, 3, "fp16", None, {"lr": 1e-3})
    scaler = settings.options.precision.loss_scaler
    fp16 = ds_keys.FP16
    assert (scaler.init_scale, scaler.scale_window, scaler.hysteresis, scaler.min_scale,
            scaler.consecutive_hysteresis) == (2.0 ** fp16["initial_scale_power"].default,
                                               fp16["loss_scale_window"].default, fp16["hysteresis"].default,
                                               fp16["min_loss_scale"].default, fp16["consecutive_hysteresis"].default)
    assert LossScalerOptions().scale_window == fp16["loss_scale_window"].default
    assert EngineOptions().reduce_bucket_elems == ds_keys.ZERO["reduce_bucket_size"].default
    assert Stage3Policy().max_live_parameters == ds_keys.ZERO["stage3_max_live_parameters"].default
    assert OffloadPolicy().buffer_count == ds_keys.OFFLOAD_OPTIMIZER["buffer_count"].default
    assert parse_aio(None).queue_depth == ds_keys.AIO["queue_depth"].default
