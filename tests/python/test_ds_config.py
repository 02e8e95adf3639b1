"""The DeepSpeed-style config (zeroplus.zero.ds_config + schedulers): every accepted key, HF's
"auto" values, unknown and mistyped keys, HF's two seed files, DeepSpeed's scheduler curves, and
(2 ranks, one pooled launch) the scheduler stepped by opt.step() through zeroplus.initialize."""

from __future__ import annotations

import copy
import json
import math
import pathlib
import time
import warnings

import pytest
import torch

from harness import run_pooled
from sharding import assert_sharded
from zeroplus.zero import ds_config, schedulers
from zeroplus.zero.config import resolve

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "ds_configs"
T0 = time.monotonic()

# key path -> a valid value, and what resolve() makes of it (None: only checked/ignored).
ACCEPTED = [
    (("zero_optimization", "stage"), 3, lambda s, d: s.stage == 3),
    (("zero_optimization", "reduce_bucket_size"), 5e5, lambda s, d: s.options.reduce_bucket_elems == 500000),
    (("zero_optimization", "overlap_comm"), True, None),
    (("zero_optimization", "contiguous_gradients"), True, None),
    (("zero_optimization", "reduce_scatter"), True, None),
    (("zero_optimization", "stage3_prefetch_bucket_size"), 1e6,
     lambda s, d: s.options.stage3.prefetch_bucket_size == 1000000),
    (("zero_optimization", "stage3_max_live_parameters"), 1e9,
     lambda s, d: s.options.stage3.max_live_parameters == 10**9),
    (("zero_optimization", "stage3_param_persistence_threshold"), 1234,
     lambda s, d: s.options.stage3.param_persistence_threshold == 1234),
    (("fp16", "enabled"), True, lambda s, d: s.options.precision.mixed_precision == "fp16"),
    (("fp16", "loss_scale"), 128.0, None),
    (("fp16", "initial_scale_power"), 12, None),
    (("fp16", "loss_scale_window"), 500, None),
    (("fp16", "hysteresis"), 3, None),
    (("fp16", "consecutive_hysteresis"), True, None),
    (("fp16", "min_loss_scale"), 2, None),
    (("bf16", "enabled"), True, lambda s, d: s.options.precision.mixed_precision == "bf16"),
    (("gradient_clipping",), 1.5, lambda s, d: s.options.gradient_clipping == 1.5),
    (("data_types", "grad_accum_dtype"), "fp32", lambda s, d: s.options.precision.grad_accum_dtype == torch.float32),
    (("gradient_accumulation_steps",), 4, lambda s, d: d.gradient_accumulation_steps == 4),
    (("train_micro_batch_size_per_gpu",), 8, lambda s, d: d.train_micro_batch_size_per_gpu == 8),
    (("train_batch_size",), 64, lambda s, d: d.train_batch_size == 64),
    (("optimizer", "type"), "SGD", lambda s, d: s.optimizer_class is torch.optim.SGD),
    (("optimizer", "params", "lr"), 0.5, lambda s, d: s.optimizer_defaults["lr"] == 0.5),
    (("optimizer", "params", "betas"), [0.8, 0.9], lambda s, d: s.optimizer_defaults["betas"] == (0.8, 0.9)),
    (("optimizer", "params", "eps"), 1e-6, lambda s, d: s.optimizer_defaults["eps"] == 1e-6),
    (("optimizer", "params", "weight_decay"), 0.1, lambda s, d: s.optimizer_defaults["weight_decay"] == 0.1),
    (("optimizer", "params", "momentum"), 0.9, lambda s, d: s.optimizer_defaults["momentum"] == 0.9),
    (("optimizer", "params", "nesterov"), True, lambda s, d: s.optimizer_defaults["nesterov"] is True),
    (("scheduler", "type"), "WarmupCosineLR", lambda s, d: d.scheduler["type"] == "WarmupCosineLR"),
    (("aio", "block_size"), 1048576, lambda s, d: d.engine["aio"]["block_size"] == 1048576),
    (("aio", "queue_depth"), 8, None),
    (("aio", "thread_count"), 2, None),
    (("aio", "intra_op_parallelism"), 2, None),
    (("aio", "single_submit"), False, None),
    (("aio", "overlap_events"), True, None),
    (("aio", "use_gds"), False, None),
]
# Keys that tune DeepSpeed's own engine: one warning names each, and they are dropped.
INTERNAL = [("steps_per_print",), ("wall_clock_breakdown",), ("prescale_gradients",), ("flops_profiler",),
            ("zero_optimization", "allgather_bucket_size"), ("zero_optimization", "allgather_partitions"),
            ("zero_optimization", "sub_group_size"), ("zero_optimization", "stage3_max_reuse_distance"),
            ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"),
            ("zero_optimization", "round_robin_gradients"), ("fp16", "auto_cast"), ("bf16", "immediate_grad_update"),
            ("optimizer", "params", "torch_adam"), ("optimizer", "params", "adam_w_mode")]
INTERNAL_VALUES = {"wall_clock_breakdown": False, "allgather_partitions": True, "round_robin_gradients": True,
                   "stage3_gather_16bit_weights_on_model_save": True, "auto_cast": False,
                   "immediate_grad_update": False, "torch_adam": True, "adam_w_mode": True, "flops_profiler": {}}


def _base(stage=3):
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
            "zero_optimization": {"stage": stage}}


def _put(cfg, path, value):
    node = cfg
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value
    return cfg


def _resolve(cfg, auto=None, **kwargs):
    ds = ds_config.prepare(cfg, auto)
    return resolve(kwargs.pop("optimizer_class", None), kwargs.pop("stage", None), kwargs.pop("mixed_precision", None),
                   ds.engine, dict(kwargs)), ds


@pytest.mark.parametrize("path,value,check", ACCEPTED, ids=[".".join(a[0]) for a in ACCEPTED])
def test_every_accepted_key(path, value, check):
    cfg = _put(_base(), path, value)
    if path[0] == "scheduler":
        cfg["scheduler"]["params"] = {"total_num_steps": 100}
    if path == ("train_batch_size",):
        cfg.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=4)
    if path[-1] in ("momentum", "nesterov"):
        cfg["optimizer"]["type"] = "SGD"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an accepted key is never warned about
        settings, ds = _resolve(cfg)
    if check is not None:
        assert check(settings, ds), (path, settings, ds)


@pytest.mark.parametrize("path", INTERNAL, ids=[".".join(p) for p in INTERNAL])
def test_internal_keys_warn_once_naming_each(path):
    cfg = _put(_base(), path, INTERNAL_VALUES.get(path[-1], 1e9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings, ds = _resolve(cfg)
    messages = [str(w.message) for w in caught if "no effect in zeroplus" in str(w.message)]
    assert len(messages) == 1 and ".".join(path) in messages[0], messages
    assert ".".join(path) in ds.ignored


def test_stage3_keys_at_stage2_are_ignored_with_the_warning():
    cfg = _put(_base(stage=2), ("zero_optimization", "stage3_max_live_parameters"), 1e9)
    with pytest.warns(UserWarning, match="zero_optimization.stage3_max_live_parameters"):
        settings, _ = _resolve(cfg)
    assert settings.stage == 2


@pytest.mark.parametrize("path,closest", [
    (("zero_optimisation",), "zero_optimization"),
    (("gradient_clip",), "gradient_clipping"),
    (("zero_optimization", "stage3_prefetch_bucketsize"), "stage3_prefetch_bucket_size"),
    (("zero_optimization", "reduce_bucket"), "reduce_bucket_size"),
    (("fp16", "enable"), "enabled"),
    (("bf16", "enbled"), "enabled"),
    (("aio", "queue_deph"), "queue_depth"),
    (("scheduler", "params", "warmup_num_step"), "warmup_num_steps"),
])
def test_unknown_keys_name_the_key_and_the_closest(path, closest):
    cfg = _put(_base(), path, 1)
    with pytest.raises(ValueError, match=rf"unknown config key .*{path[-1]}.*did you mean '{closest}'"):
        ds_config.prepare(cfg)


def test_unknown_scheduler_type_names_the_closest():
    cfg = _base()
    cfg["scheduler"]["type"] = "WarmupCosine"
    with pytest.raises(ValueError, match="'WarmupCosine' is not supported.*did you mean 'WarmupCosineLR'"):
        ds_config.prepare(cfg)


@pytest.mark.parametrize("path,value", [
    (("zero_optimization", "stage"), "3"),
    (("zero_optimization", "reduce_bucket_size"), 1.5),
    (("zero_optimization", "overlap_comm"), "true"),
    (("fp16", "enabled"), 1),
    (("bf16", "enabled"), "yes"),
    (("gradient_clipping",), "1.0"),
    (("gradient_accumulation_steps",), 2.5),
    (("train_micro_batch_size_per_gpu",), True),
    (("optimizer", "type"), 3),
    (("optimizer", "params", "lr"), "fast"),
    (("optimizer", "params", "betas"), [0.9]),
    (("scheduler", "params", "warmup_num_steps"), "ten"),
    (("aio", "block_size"), "1M"),
    (("data_types", "grad_accum_dtype"), 32),
    (("zero_optimization",), [1, 2]),
])
def test_wrong_types_name_key_and_value(path, value):
    cfg = _put(_base(), path, value)
    with pytest.raises(ValueError) as err:
        ds_config.prepare(cfg)
    assert repr(path[-1]) in str(err.value) and repr(value) in str(err.value), str(err.value)


def _hf_values(**over):
    values = dict(lr=5e-4, betas=(0.85, 0.95), eps=1e-7, weight_decay=0.01, max_grad_norm=0.5, fp16=False, bf16=True,
                  micro_batch_size=4, gradient_accumulation_steps=2, world_size=2, hidden_size=32,
                  total_num_steps=40, warmup_num_steps=7, check_matches=True, source="TrainingArguments")
    values.update(over)
    return ds_config.AutoValues(**values)


@pytest.mark.parametrize("name", ["ds_config_zero2.json", "ds_config_zero3.json"])
def test_hf_seed_files_load_with_trainingarguments_autos(name):
    raw = json.loads((FIXTURES / name).read_text())
    # offload_* belong to the offload engine (config.resolve): drop them here; the test below
    # checks the whole file is handed to it unchanged.
    raw["zero_optimization"].pop("offload_optimizer"), raw["zero_optimization"].pop("offload_param", None)
    with pytest.warns(UserWarning, match="steps_per_print"):
        ds = ds_config.prepare(raw, _hf_values())
    settings = resolve(None, None, None, ds.engine, {})
    assert settings.optimizer_class is torch.optim.AdamW
    assert settings.optimizer_defaults == {"lr": 5e-4, "betas": (0.85, 0.95), "eps": 1e-7, "weight_decay": 0.01}
    assert settings.options.precision.mixed_precision == "bf16" and settings.options.gradient_clipping == 0.5
    assert ds.scheduler == {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-4,
                                                           "warmup_num_steps": 7}}
    assert (ds.gradient_accumulation_steps, ds.train_micro_batch_size_per_gpu, ds.train_batch_size) == (2, 4, 16)
    if settings.stage == 3:  # transformers' hidden-size rules
        assert settings.options.reduce_bucket_elems == 32 * 32
        assert settings.options.stage3.prefetch_bucket_size == int(0.9 * 32 * 32)
        assert settings.options.stage3.param_persistence_threshold == 320
    else:
        assert settings.options.reduce_bucket_elems == 200_000_000


@pytest.mark.parametrize("name", ["ds_config_zero2.json", "ds_config_zero3.json"])
def test_hf_seed_files_hand_offload_blocks_to_resolve_unchanged(name):
    raw = json.loads((FIXTURES / name).read_text())
    with pytest.warns(UserWarning):
        ds = ds_config.prepare(raw, _hf_values())
    assert ds.engine["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_auto_without_trainingarguments_uses_initialize_arguments_or_defaults():
    raw = json.loads((FIXTURES / "ds_config_zero2.json").read_text())
    raw["zero_optimization"].pop("offload_optimizer")
    model = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning):
        ds = ds_config.prepare(raw, ds_config.auto_from_initialize(model, None, {"lr": 0.25}))
    settings = resolve(None, None, None, ds.engine, {"lr": 0.25})
    assert settings.optimizer_defaults == {"lr": 0.25}  # betas/eps/weight_decay: the class defaults
    assert settings.options.precision.mixed_precision is None and settings.options.gradient_clipping == 0.0
    assert ds.scheduler == {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.25}}
    assert ds.gradient_accumulation_steps == 1 and ds.train_micro_batch_size_per_gpu is None


def test_auto_total_num_steps_without_a_source_is_an_error():
    cfg = _base()
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}
    with pytest.raises(ValueError, match=r"\['total_num_steps'\]='auto' has no value"):
        ds_config.prepare(cfg)


def test_trainingarguments_mismatch_is_an_error_naming_both():
    cfg = _base()
    cfg["optimizer"]["params"]["lr"] = 1e-3
    with pytest.raises(ValueError, match=r"\['lr'\]=0.001 vs TrainingArguments 0.0005"):
        ds_config.prepare(cfg, _hf_values())


def test_train_batch_size_must_be_the_product():
    cfg = dict(_base(), train_batch_size=10, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="train_batch_size"):
        ds_config.prepare(cfg, _hf_values())


def test_caller_dict_is_not_modified():
    raw = json.loads((FIXTURES / "ds_config_zero3.json").read_text())
    before = copy.deepcopy(raw)
    with pytest.warns(UserWarning):
        ds_config.prepare(raw, _hf_values())
    assert raw == before


# -- DeepSpeed's curves ---------------------------------------------------------------------------

def _deepspeed_lr(kind, iteration, base_lr, p):
    """DeepSpeed's formulas (lr_schedules.py), written out: lr of iteration `iteration` (-1 at
    construction; the engine's k-th step runs at iteration k-1)."""
    n = max(2, p.get("warmup_num_steps", 1000))
    typ = p.get("warmup_type", "log")

    def warm(i):
        return math.log(i + 1) / math.log(n) if typ == "log" else i / n
    if kind == "WarmupCosineLR":
        if iteration < 0:
            return 0.0
        if iteration < n:
            lo = p.get("warmup_min_ratio", 0.0)
            return base_lr * (lo + warm(iteration) * (1 - lo))
        cmin = p.get("cos_min_ratio", 1e-4)
        prog = min(1.0, (iteration - n + 1) / max(1, p["total_num_steps"] - n))
        return base_lr * max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * prog)) / 2)
    lo = p.get("warmup_min_lr", 0.0)
    hi = p.get("warmup_max_lr", base_lr if kind == "WarmupLR" else 0.001)
    if iteration < 0:
        return lo
    if iteration < n:
        gamma = warm(iteration)
    elif kind == "WarmupLR":
        gamma = 1.0
    else:
        gamma = max(0.0, (p["total_num_steps"] - iteration) / max(1.0, p["total_num_steps"] - n))
    return lo + (hi - lo) * gamma


CURVES = [("WarmupLR", {"warmup_num_steps": 5}), ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear",
                                                                "warmup_min_lr": 0.1, "warmup_max_lr": 0.7}),
          ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_max_lr": 0.3}),
          ("WarmupDecayLR", {"total_num_steps": 9, "warmup_num_steps": 1, "warmup_type": "linear"}),
          ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3, "warmup_min_ratio": 0.1}),
          ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 4, "warmup_type": "linear",
                              "cos_min_ratio": 0.05})]


@pytest.mark.parametrize("kind,params", CURVES)
def test_scheduler_curves_are_deepspeeds(kind, params):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = schedulers.build_scheduler(opt, {"type": kind, "params": params})
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    for step in range(16):
        want = _deepspeed_lr(kind, step - 1, 0.5, params)
        assert opt.param_groups[0]["lr"] == pytest.approx(want, abs=1e-12), (kind, step)
        opt.step()
        sched.step()
    # state_dict round trip continues the curve
    again = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    resumed = schedulers.build_scheduler(again, {"type": kind, "params": params})
    resumed.load_state_dict(sched.state_dict())
    assert resumed.get_last_lr() == sched.get_last_lr()


@pytest.mark.parametrize("params,match", [({"warmup_num_steps": 0}, "warmup_num_steps"),
                                          ({"warmup_type": "cubic"}, "warmup_type")])
def test_scheduler_bad_params(params, match):
    cfg = _base()
    cfg["scheduler"]["params"] = params
    with pytest.raises(ValueError, match=match):
        if "warmup_type" in params:
            ds_config.prepare(cfg)
        else:
            schedulers.build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                                       {"type": "WarmupLR", "params": params})


# -- through zeroplus.initialize, 2 ranks -----------------------------------------------------------

def _stepped_by_opt_step(rank, world_size):
    import zeroplus

    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}},
               "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                                 "warmup_max_lr": "auto"}},
               "zero_optimization": {"stage": stage}}
        if stage == 3:
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        model, opt = zeroplus.initialize(model, config=cfg, lr=0.01)
        if stage == 3:
            assert_sharded(model, opt)
        lrs = []
        for _ in range(6):
            lrs.append(opt.param_groups[0]["lr"])
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        out[stage] = (lrs, opt.lr_scheduler.last_epoch)
    # fp16 overflow: the skipped step does not advance the scheduler (DeepSpeed's engine)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    cfg = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "fp16": {"enabled": True, "initial_scale_power": 40},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}, "zero_optimization": {"stage": 2}}
    model, opt = zeroplus.initialize(model, config=cfg)
    opt.backward(model(torch.randn(4, 8).half()).float().sum())
    opt.step()
    out["fp16"] = (opt.skipped_steps, opt.lr_scheduler.last_epoch)
    return out


def test_scheduler_is_stepped_by_opt_step_at_every_stage():
    params = {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_max_lr": 0.01}
    want = [_deepspeed_lr("WarmupDecayLR", k - 1, 0.01, params) for k in range(6)]
    for result in run_pooled(_stepped_by_opt_step, 2, timeout=240):
        for stage in (1, 2, 3):
            lrs, last_epoch = result[stage]
            assert lrs == pytest.approx(want, abs=1e-12), (stage, lrs)
            assert last_epoch == 6  # 0 after construction, + one per opt.step()
        assert result["fp16"] == (1, 0)  # skipped, not advanced
    print(f"test_ds_config wall time so far: {time.monotonic() - T0:.1f}s")


def _seed_files_through_initialize(rank, world_size):
    """HF's seed files as they are (offload blocks with "device": "cpu", "auto" values) through
    zeroplus.initialize(config=path), against the same config without the offload blocks."""
    import warnings

    import zeroplus

    out = {}
    for name in ("ds_config_zero2.json", "ds_config_zero3.json"):
        raw = json.loads((FIXTURES / name).read_text())
        plain = copy.deepcopy(raw)
        plain["zero_optimization"].pop("offload_optimizer"), plain["zero_optimization"].pop("offload_param", None)
        runs = []
        for config in (str(FIXTURES / name), plain):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # steps_per_print & co.: tested above
                # The zero3 file's persistence threshold is "auto" (10 * hidden size; dropped for a
                # model without a config): 0 shards every parameter of so small a model.
                shard = {"param_persistence_threshold": 0} if name == "ds_config_zero3.json" else {}
                model, opt = zeroplus.initialize(model, config=config, lr=0.01, **shard)
            if shard:
                assert_sharded(model, opt)
            g = torch.Generator().manual_seed(rank)
            for _ in range(3):
                model(torch.randn(4, 8, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            runs.append((opt.stage, opt.options.offload_optimizer.device, type(opt.lr_scheduler).__name__,
                         {k: v.clone() for k, v in zeroplus.full_state_dict(model, rank0_only=False).items()}))
        out[name] = runs
    return out


def test_hf_seed_files_train_through_initialize():
    for result in run_pooled(_seed_files_through_initialize, 2, timeout=240):
        for name, stage in (("ds_config_zero2.json", 2), ("ds_config_zero3.json", 3)):
            (s1, dev1, sched1, p1), (s2, dev2, sched2, p2) = result[name]
            assert (s1, dev1, sched1) == (stage, "cpu", "WarmupLR") and (s2, dev2) == (stage, "none"), name
            for k in p1:  # CPU offload of the optimizer step: the same weights
                assert torch.allclose(p1[k], p2[k], rtol=1e-6, atol=1e-7), (name, k)
    print(f"test_ds_config wall time so far: {time.monotonic() - T0:.1f}s")
