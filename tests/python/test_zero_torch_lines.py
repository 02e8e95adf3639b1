"""The lines of a DDP script that touch gradients and model state, unchanged, at ZeRO stages 1-3
(issue 38 item 2): each behaves as under DDP or raises naming the zeroplus call to use.

Reference: DistributedDataParallel + torch.optim.AdamW on the same data. Before the fix every
`p.grad` was None after backward at stages 1-3, so torch.nn.utils.clip_grad_norm_ returned 0 and
clipped nothing, clip_grad_value_ did nothing, and get_total_norm was 0; a stage-3 model's
state_dict() returned flat shards ('0.weight': (256,) for a 16 x 32 weight at 2 ranks) without a
word, and a rank-0-only `torch.save(model.state_dict())` saved them.

Model: a 3-layer MLP (1.2k parameters) with param_persistence_threshold=0 at stage 3, so every
parameter is really sharded (asserted). One 2-rank launch runs every case, each in its own group.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import tempfile
import time

import pytest
import torch
from torch import nn

from harness import run_cases_in_own_groups, run_pooled

LR, STEPS = 1e-2, 5
STAGES = (1, 2, 3)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 4))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g) * 5


def _initialize(model, stage, group, precision=None):
    import zeroplus
    extra = {"param_persistence_threshold": 0} if stage == 3 else {}
    return zeroplus.initialize(model, torch.optim.AdamW, stage=stage, lr=LR, process_group=group,
                               mixed_precision=precision, **extra)


def _clip(kind: str, params, step: int):
    """What a DDP script does between backward and step; the same call on both sides."""
    params = list(params)
    if kind == "norm":  # step-dependent norm type and foreach, so every path of clip_grad.py runs
        norm_type, foreach = [(2.0, None), (float("inf"), None), (2.0, True), (3.0, False), (1.0, None)][step]
        return float(torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type, foreach=foreach))
    if kind == "value":
        torch.nn.utils.clip_grad_value_(params, 0.05, foreach=(None, True, False)[step % 3])
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, 0.5, total)
    return float(total)


def _clip_case(rank, group, stage, kind, precision):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zeroplus
    model = _model()
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model, process_group=group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    model, opt = _initialize(model, stage, group, precision)
    sharded = _resting(model)
    norms, ref_norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_norms.append(_clip(kind, ref.parameters(), step))
        ref_opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(model(x).float(), y).backward()
        norms.append(_clip(kind, model.parameters(), step))
        opt.step()
        opt.zero_grad()
    mine = zeroplus.full_state_dict(model, rank0_only=False)
    diff = max((mine[k].float() - v).abs().max().item() for k, v in ref_model.state_dict().items())
    return {"norms": norms, "ref_norms": ref_norms, "diff": diff, "resting": sharded}


CLIP_CASES = [(stage, kind, None) for stage in STAGES for kind in ("norm", "value", "total")] + \
             [(stage, "norm", "bf16") for stage in STAGES]


def _grad_reads_case(rank, group, stage):
    """p.grad after backward: DDP's values at stage 1 (plain views); at stages 2-3 the full shape
    and dtype, and a clear error naming the zeroplus call for an op it cannot answer locally."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _model()
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model, process_group=group)
    model, opt = _initialize(model, stage, group)
    x, y = _batch(0, rank)
    nn.functional.mse_loss(ref(x), y).backward()
    nn.functional.mse_loss(model(x), y).backward()
    out = {"none": [p.grad is None for p in model.parameters()],
           "shapes_ok": all(tuple(p.grad.shape) == tuple(r.shape) and p.grad.dtype == r.dtype
                            for p, r in zip(model.parameters(), ref_model.parameters()))}
    if stage == 1:
        out["diff"] = max((p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref_model.parameters()))
    else:
        try:
            next(iter(model.parameters())).grad.sum()
            out["error"] = None
        except RuntimeError as e:
            out["error"] = str(e)
        try:  # a foreach op the clip functions do not use
            torch._foreach_add_([p.grad for p in model.parameters()], 1.0)
            out["foreach_error"] = None
        except RuntimeError as e:
            out["foreach_error"] = str(e)
        try:  # torch's GradScaler reads p.grad too: refused, naming zeroplus's
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(torch.ones(()))  # as after scaler.scale(loss).backward()
            scaler.unscale_(opt)
            out["scaler_error"] = None
        except RuntimeError as e:
            out["scaler_error"] = str(e)
    opt.zero_grad(set_to_none=False)  # as torch's: gradients stay, as zeros
    out["zeros_after_keep"] = [p.grad is not None for p in model.parameters()]
    out["zero_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    model.zero_grad()
    out["none_after_zero_grad"] = all(p.grad is None for p in model.parameters())
    return out


def _resting(model) -> list[bool]:
    """Per parameter: at stage 3 and released between uses (it holds no values, full shape)."""
    from zeroplus.zero.layout import is_resting
    return [is_resting(p.data, p.shape) for p in model.parameters()]


def _param_lines(model) -> dict:
    """What a DDP script's logging lines read from model.parameters()."""
    params = list(model.parameters())
    return {"count": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad),
            "shapes": [tuple(p.shape) for p in params], "sizes": [tuple(p.size()) for p in params],
            "dims": [p.dim() for p in params], "dtypes": [p.dtype for p in params],
            "devices": [p.device for p in params], "requires_grad": [p.requires_grad for p in params]}


def _param_lines_case(rank, group, stage, directory):
    """sum(p.numel() ...), p.shape, p.size(), p.dim(), dtype, device, requires_grad between steps:
    as DDP's at every stage: after initialize, after steps, after load_checkpoint. Before the fix a
    stage-3 parameter was this rank's 1-D piece between uses (a 32 x 8 weight read (128,) at 2 ranks),
    so the commonest logging line of a fine-tuning script counted half the model. Reading values
    at rest gives NaN (no plausible numbers); writing them raises, at once or at the next gather."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zeroplus
    from sharding import assert_sharded
    model = _model()
    model[0].bias.requires_grad_(False)  # a frozen parameter: its own (frozen) bucket at stage 3
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model, process_group=group)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    model, opt = _initialize(model, stage, group)
    want = _param_lines(ref_model)
    out = {"sharded": assert_sharded(model, opt) if stage == 3 else [], "want": want,
           "initialized": _param_lines(model)}
    for step in range(2):
        _train_step(ref, ref_opt, step, rank)
        _train_step(model, opt, step, rank)
    out["stepped"] = _param_lines(model)
    out["resting"] = _resting(model)
    path = os.path.join(directory, f"param_lines{stage}")
    zeroplus.save_checkpoint(path, model, opt)
    _train_step(model, opt, 2, rank)  # moved away from the checkpoint, then back
    zeroplus.load_checkpoint(path, model, opt)
    out["loaded"] = _param_lines(model)
    _train_step(ref, ref_opt, 2, rank)
    _train_step(model, opt, 2, rank)
    mine = zeroplus.full_state_dict(model, rank0_only=False)
    out["diff"] = max((mine[k].float() - v).abs().max().item() for k, v in ref_model.state_dict().items())
    weight = model[2].weight
    out["vector"] = tuple(torch.nn.utils.parameters_to_vector(model.parameters()).shape)
    out["reads_nan"] = bool(torch.isnan(weight).all()) if stage == 3 else None
    try:  # an in-place write between steps: refused by torch (no memory behind the view)
        with torch.no_grad():
            weight.mul_(0.5)
        out["write_error"] = None
    except RuntimeError as e:
        out["write_error"] = str(e)
    if stage == 3:
        # torch allows fill_ into the view; the next use raises naming the parameter, on every rank
        with torch.no_grad():
            torch.nn.init.zeros_(model[4].bias)
        try:
            model(_batch(3, rank)[0])
            out["fill_error"] = None
        except RuntimeError as e:
            out["fill_error"] = str(e)
    return out


def _train_step(model, opt, step, rank, zero_grad=None):
    x, y = _batch(step, rank)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    (zero_grad or opt.zero_grad)()


def _state_case(rank, group, stage, directory):
    """model.state_dict() / load_state_dict(), the rank-0-only save, torch's DCP calls."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zeroplus
    model = _model()
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model, process_group=group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    model, opt = _initialize(model, stage, group)
    out = {"sharded": any(_resting(model))}
    for step in range(2):
        _train_step(ref, ref_opt, step, rank)
        _train_step(model, opt, step, rank)

    def diff_to_ref(sd):
        return max((sd[k].float() - v).abs().max().item() for k, v in ref_model.state_dict().items())

    try:
        out["state_dict_diff"] = diff_to_ref(model.state_dict())
        out["state_dict_error"] = None
    except RuntimeError as e:
        out["state_dict_error"] = str(e)
    # A DDP script's checkpoint line: on rank 0 only. Works or raises at once, never hangs, and
    # leaves the group in step (the next training step matches DDP on every rank).
    path = os.path.join(directory, f"stage{stage}.pt")
    start = time.monotonic()
    out["rank0_error"] = None
    if rank == 0:
        try:
            torch.save(model.state_dict(), path)
        except RuntimeError as e:
            out["rank0_error"] = str(e)
    out["rank0_s"] = time.monotonic() - start
    _train_step(ref, ref_opt, 2, rank)
    _train_step(model, opt, 2, rank)
    out["after_save_diff"] = diff_to_ref(zeroplus.full_state_dict(model, rank0_only=False))
    # What the error names: full_state_dict on every rank, rank 0 saves; a plain module loads it.
    sd = zeroplus.full_state_dict(model)
    if rank == 0:
        torch.save(sd, path + ".full")
    torch.distributed.barrier(group)
    plain = _model()
    plain.load_state_dict(torch.load(path + ".full"))
    out["saved_diff"] = diff_to_ref(plain.state_dict())
    # model.load_state_dict(full dict) on every rank, then train: as DDP after the same load.
    torch.manual_seed(5)
    new = {k: torch.randn_like(v) for k, v in ref_model.state_dict().items()}
    ref_model.load_state_dict(new)
    model.load_state_dict(new)
    out["loaded_diff"] = diff_to_ref(zeroplus.full_state_dict(model, rank0_only=False))
    _train_step(ref, ref_opt, 3, rank)
    _train_step(model, opt, 3, rank)
    out["after_load_diff"] = diff_to_ref(zeroplus.full_state_dict(model, rank0_only=False))
    # torch's DCP: get_model_state_dict as DDP at stages 1-2; the optimizer's part raises.
    if stage < 3:
        out["dcp_model_diff"] = diff_to_ref(get_model_state_dict(model))
    errors = {}
    for name, call in (("get_state_dict", lambda: get_state_dict(model, opt)),
                       ("set_state_dict", lambda: set_state_dict(model, opt, model_state_dict=new,
                                                                 optim_state_dict=ref_opt.state_dict()))):
        try:
            call()
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    out["dcp_errors"] = errors
    # Still in step after the refusals (nothing half-done): one more step as DDP.
    _train_step(ref, ref_opt, 4, rank)
    _train_step(model, opt, 4, rank)
    out["final_diff"] = diff_to_ref(zeroplus.full_state_dict(model, rank0_only=False))
    return out


def _accumulation_case(rank, group, stage):
    """model.no_sync() for accumulation, torch's clip, model.zero_grad(): as DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zeroplus
    model = _model()
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model, process_group=group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    model, opt = _initialize(model, stage, group)
    norms, ref_norms = [], []
    for step in range(3):
        for m, o, sink in ((ref, ref_opt, ref_norms), (model, opt, norms)):
            x, y = _batch(step, rank)
            with m.no_sync():
                nn.functional.mse_loss(m(x[:3]), y[:3]).backward()
            nn.functional.mse_loss(m(x[3:]), y[3:]).backward()
            sink.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)))
            o.step()
            m.zero_grad()
    mine = zeroplus.full_state_dict(model, rank0_only=False)
    diff = max((mine[k] - v).abs().max().item() for k, v in ref_model.state_dict().items())
    return {"norms": norms, "ref_norms": ref_norms, "diff": diff,
            "count": len(list(model.parameters())), "ref_count": len(list(ref_model.parameters()))}


def _fp16_case(rank, group, stage):
    """fp16 (loss-scaled accumulators): torch's norm over p.grad is the true gradient's norm, the
    one opt.clip_grad_norm_ returns."""
    model, opt = _initialize(_model(), stage, group, "fp16")
    x, y = _batch(0, rank)
    for _ in range(20):  # the first scales overflow: the engine's step skips them and halves the scale
        opt.backward(nn.functional.mse_loss(model(x).float(), y))
        ours = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        if math.isfinite(ours):
            break
        opt.step()
        opt.zero_grad()
    engine = float(opt.clip_grad_norm_(1e9))
    return {"torch": ours, "engine": engine, "scale": opt.loss_scale}


CASES = {("clip",) + c: functools.partial(_clip_case, stage=c[0], kind=c[1], precision=c[2]) for c in CLIP_CASES}
CASES.update({("grad_reads", s): functools.partial(_grad_reads_case, stage=s) for s in STAGES})
CASES.update({("fp16", s): functools.partial(_fp16_case, stage=s) for s in (2, 3)})
CASES.update({("accumulation", s): functools.partial(_accumulation_case, stage=s) for s in STAGES})


def _all_cases(rank, world, directory):
    cases = dict(CASES)
    cases.update({("state", s): functools.partial(_state_case, stage=s, directory=directory) for s in STAGES})
    cases.update({("param_lines", s): functools.partial(_param_lines_case, stage=s, directory=directory)
                  for s in STAGES})
    return run_cases_in_own_groups(rank, world, cases)


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as directory:
        return run_pooled(_all_cases, 2, directory, timeout=600)


def _ok(results, key):
    for r, res in enumerate(results):
        status, value = res[key]
        assert status == "ok", f"rank {r}:\n{value}"
    return [res[key][1] for res in results]


@pytest.mark.parametrize("case", CLIP_CASES, ids=lambda c: f"stage{c[0]}-{c[1]}-{c[2] or 'fp32'}")
def test_torch_clip_functions_match_ddp(results, case):
    stage, kind, precision = case
    tolerance = 1e-5 if precision is None else 3e-2
    for r, res in enumerate(_ok(results, ("clip",) + case)):
        if stage == 3:  # every parameter really sharded: a rank holds half of each, none whole
            assert all(res["resting"]), res["resting"]
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=tolerance), f"rank {r}"
        if kind != "value":
            assert all(n > 0.5 for n in res["norms"]), res["norms"]  # clipping is active every step
        assert res["diff"] <= tolerance, f"rank {r}: weights differ from DDP by {res['diff']:.3g}"


@pytest.mark.parametrize("stage", STAGES)
def test_grad_reads(results, stage):
    for r, res in enumerate(_ok(results, ("grad_reads", stage))):
        assert not any(res["none"]) and res["shapes_ok"], res
        if stage == 1:
            assert res["diff"] <= 1e-6, res["diff"]
        else:
            assert res["error"] is not None and "opt.clip_grad_norm_" in res["error"], res["error"]
            assert res["foreach_error"] is not None and "opt.clip_grad_norm_" in res["foreach_error"], res
            assert res["scaler_error"] is not None and "zeroplus.GradScaler" in res["scaler_error"], res["scaler_error"]
        assert all(res["zeros_after_keep"]) and res["zero_norm"] == 0.0, res
        assert res["none_after_zero_grad"], res


@pytest.mark.parametrize("stage", STAGES)
def test_model_state_dict_and_torch_dcp(results, stage):
    for r, res in enumerate(_ok(results, ("state", stage))):
        assert res["sharded"] == (stage == 3)
        if stage < 3:  # as DDP: the full parameters, and the rank-0-only save works
            assert res["state_dict_error"] is None and res["state_dict_diff"] <= 1e-6, res
            assert res["rank0_error"] is None and res["dcp_model_diff"] <= 1e-6, res
        else:  # raises at once on the calling rank, naming the calls to use; nothing hangs
            for message in (res["state_dict_error"], res["rank0_error"] if r == 0 else res["state_dict_error"]):
                assert message and "zeroplus.full_state_dict(model)" in message and "shard" in message, message
        assert res["rank0_s"] < 5.0, res["rank0_s"]
        for key in ("after_save_diff", "saved_diff", "loaded_diff", "after_load_diff", "final_diff"):
            assert res[key] <= 1e-5, (key, res[key])
        for name, message in res["dcp_errors"].items():  # torch's DCP never labels shards silently
            assert message and "zeroplus.checkpoint.get_state_dict(model, opt)" in message, (name, message)


@pytest.mark.parametrize("stage", STAGES)
def test_no_sync_clip_and_module_zero_grad(results, stage):
    for r, res in enumerate(_ok(results, ("accumulation", stage))):
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-5), f"rank {r}"
        assert res["diff"] <= 1e-5 and res["count"] == res["ref_count"], res


@pytest.mark.parametrize("stage", (2, 3))
def test_fp16_norm_is_the_unscaled_one(results, stage):
    for r, res in enumerate(_ok(results, ("fp16", stage))):
        assert res["scale"] > 1.0 and res["engine"] > 0, res
        assert res["torch"] == pytest.approx(res["engine"], rel=1e-4), res


@pytest.mark.parametrize("stage", STAGES)
def test_parameter_counts_and_shapes_between_steps_are_ddps(results, stage):
    """sum(p.numel()), p.shape, p.size(), p.dim(), dtype, device, requires_grad: DDP's, after
    initialize, after steps and after load_checkpoint; training still matches DDP."""
    for r, res in enumerate(_ok(results, ("param_lines", stage))):
        want = res["want"]
        for when in ("initialized", "stepped", "loaded"):
            assert res[when] == want, (f"rank {r}, {when}", res[when], want)
        assert res["diff"] <= 1e-5, f"rank {r}: weights differ from DDP by {res['diff']:.3g}"
        assert res["vector"] == (want["count"],), res["vector"]
        if stage == 3:
            assert res["sharded"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"], res["sharded"]
            assert all(res["resting"]) and res["reads_nan"], res  # no values at rest: NaN, never plausible
            assert "more than one element of the written-to tensor" in res["write_error"], res["write_error"]
            assert res["fill_error"] and "4.bias was written in place" in res["fill_error"], res["fill_error"]
            assert "zeroplus.full_state_dict(model)" in res["fill_error"], res["fill_error"]
        else:
            assert res["write_error"] is None, res["write_error"]
