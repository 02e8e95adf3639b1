"""Tensor parallel x ZeRO (docs/tensor_parallel.md): 4 ranks as a 2 x 2 ("dp", "tp") mesh on backend zeroplus.

A TinyGPT (tp_models.py) parallelised with torch's ColwiseParallel/RowwiseParallel over "tp" trains
with zeroplus's ZeRO over "dp" and must match the data-parallel-only reference after 30 AdamW steps
to 1e-5 (fp32): the same model unparallelised, trained by torch.optim.AdamW on the mean of the two
dp ranks' losses (DDP's result over "dp"), clipped by torch.nn.utils.clip_grad_norm_. Checked on
the way: the clipping norm at every step (covers both mesh dimensions), the consolidated optimizer
state (DTensors shaped like torch.optim's), a save/load round trip in the middle of training,
parameters staying DTensors, sequence parallelism (Partial gradients), bf16, and the errors (wrong
group, stage 3, overlap_with_ddp).
All cases run in one call on one pool of 4 ranks and one mesh (torch's DeviceMesh cannot be rebuilt
in a rank after the pool destroyed the previous case's groups); each case reports its own result.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from harness import run_pooled

STEPS, CHECKPOINT_AT = 30, 15
HYPER = dict(lr=1e-3, weight_decay=0.1)
CLIP = 0.5
TOL = 1e-5


def _setup(mesh, plan="manual"):
    import tp_models as tm
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    ref = tm.TinyGPT()
    model = copy.deepcopy(ref)
    styles = tm.manual_plan(model) if plan == "manual" else tm.sequence_parallel_plan(model)
    parallelize_module(model, mesh["tp"], styles)
    return tm, mesh, ref, model


def _make_opt(entry, model, stage, dp_group):
    import zeroplus

    if entry == "zero_redundancy":  # the reproduction: torch's constructor
        return zeroplus.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=dp_group, **HYPER)
    return zeroplus.initialize(model, torch.optim.AdamW, stage=stage, process_group=dp_group, **HYPER)[1]


def _consolidated(opt, dp_rank):
    """The consolidated optimizer state on every rank (each dp rank keeps it in its turn)."""
    out = None
    for to in range(2):
        opt.consolidate_state_dict(to=to)
        if dp_rank == to:
            out = opt.state_dict()
    return out


def _parity(mesh, stage, entry, plan="manual", steps=STEPS):
    from torch.distributed.tensor import DTensor

    tm, mesh, ref, model = _setup(mesh, plan)
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    opt = _make_opt(entry, model, stage, dp_group)
    assert type(opt).__name__ == f"Stage{stage}Optimizer", type(opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()}
    assert {"wte.weight", "lm_head.weight", "blocks.0.up.weight", "blocks.1.o_proj.weight"} <= sharded, sharded
    norm_err, state_err, inf_err = 0.0, None, None
    for i, step in enumerate(tm.batches(steps, 2)):
        x, y = step[dp_rank]
        tm.lm_loss(model(x), y).backward()
        (sum(tm.lm_loss(ref(a), b) for a, b in step) / 2).backward()
        if i == 0:  # the inf-norm: a max over both mesh dimensions (a bound that clips nothing)
            inf = float("inf")
            inf_err = abs(opt.clip_grad_norm_(1e9, norm_type=inf).item()
                          - torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=inf).item())
        norm = opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        norm_err = max(norm_err, abs(norm.item() - ref_norm.item()))
        if i + 1 == CHECKPOINT_AT:
            state = _consolidated(opt, dp_rank)
            state_err = 0.0
            for index, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
                mine, theirs = state["state"][index], ref_opt.state[q]
                assert set(mine) == set(theirs), (set(mine), set(theirs))
                if isinstance(p, DTensor):  # torch.optim's format for a DTensor parameter
                    assert isinstance(mine["exp_avg"], DTensor) and mine["exp_avg"].placements == p.placements
                    assert mine["exp_avg"].shape == p.shape
                for key in ("exp_avg", "exp_avg_sq"):
                    state_err = max(state_err, (tm.full(mine[key]) - theirs[key]).abs().max().item())
                assert float(mine["step"]) == float(theirs["step"]) == CHECKPOINT_AT
            assert state_err < TOL, state_err
            if stage == 2:  # resume in a fresh model and optimizer from the two state dicts
                model_state = model.state_dict()
                _, _, _, model = _setup(mesh, plan)
                opt = _make_opt(entry, model, stage, dp_group)
                model.load_state_dict(model_state)
                opt.load_state_dict(state)
    assert all(isinstance(p, DTensor) for n, p in model.named_parameters() if n in sharded)
    err = max((tm.full(p) - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    # Checked after the last collective: a rank failing alone must not leave its peers waiting.
    # (The gradients themselves differ in the last bits: TP sums in another order.)
    assert norm_err < TOL and err < TOL and inf_err < TOL, (norm_err, err, inf_err)
    return {"param_err": err, "norm_err": norm_err, "inf_norm_err": inf_err, "state_err": state_err}


def _mixed(mesh, precision, stage):
    """mixed_precision over DTensor parameters: local tensors and the DTensors' dtype are the compute
    dtype, the fp32 masters train close to the fp32 reference (fp16: with the dynamic loss scale,
    its overflow checks agreed over both mesh dimensions), memory_report counts local pieces."""
    import zeroplus
    from torch.distributed.tensor import DTensor

    tm, mesh, ref, model = _setup(mesh)
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    _, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, process_group=dp_group,
                                 mixed_precision=precision, **HYPER)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    up = model.blocks[0].up.weight
    assert isinstance(up, DTensor) and up.dtype == dtype and up.to_local().dtype == dtype
    for step in tm.batches(5, 2):
        x, y = step[dp_rank]
        opt.backward(tm.lm_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        (sum(tm.lm_loss(ref(a), b) for a, b in step) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    err = max((tm.full(p).float() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    report = zeroplus.memory_report(model, opt)
    local_numel = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    assert err < 2e-2, err  # the rounding of the weights the forward uses
    assert report["parameters"] == 2 * local_numel, (report["parameters"], local_numel)
    return {"err": err, "skipped_steps": opt.skipped_steps, "loss_scale": opt.loss_scale}


def _errors(mesh):
    """Bad arguments raise naming them, and leave the model as it was."""
    import zeroplus
    from torch.distributed.tensor import DTensor

    tm, mesh, ref, model = _setup(mesh)
    dp_group = mesh["dp"].get_group()
    before = {n: p.to_local().clone() if isinstance(p, DTensor) else p.detach().clone()
              for n, p in model.named_parameters()}
    out = {}
    with pytest.raises(ValueError, match="process_group must be the data-parallel group") as e:
        zeroplus.initialize(model, torch.optim.AdamW, stage=2, **HYPER)  # the world group: tp peers inside
    out["world_group"] = str(e.value)
    with pytest.raises(ValueError, match="stage 3 does not take tensor-parallel") as e:
        zeroplus.initialize(model, torch.optim.AdamW, stage=3, process_group=dp_group, **HYPER)
    out["stage3"] = str(e.value)
    with pytest.raises(ValueError, match="overlap_with_ddp=True"):
        zeroplus.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=dp_group,
                                         overlap_with_ddp=True, **HYPER)
    with pytest.raises(ValueError, match="process_group must be the data-parallel group"):
        zeroplus.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=mesh["tp"].get_group(),
                                         **HYPER)
    for n, p in model.named_parameters():
        assert not getattr(p, "_zeroplus_managed", False), n
        now = p.to_local() if isinstance(p, DTensor) else p.detach()
        assert torch.equal(now, before[n]), n
    # zeroplus.save_checkpoint names shards by dp rank: refused for TP models before any file exists.
    import os
    import tempfile

    _, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=1, process_group=dp_group, **HYPER)
    with tempfile.TemporaryDirectory() as d:
        for call in (zeroplus.save_checkpoint, zeroplus.load_checkpoint):
            with pytest.raises(ValueError, match="checkpoint: does not support tensor-parallel models"):
                call(os.path.join(d, "ckpt"), model, opt)
        assert os.listdir(d) == []
    # Param-group dicts holding generators are read once and reach the engine whole.
    _, _, _, fresh = _setup(mesh)
    opt = zeroplus.ZeroRedundancyOptimizer([{"params": (p for p in fresh.parameters())}], torch.optim.AdamW,
                                           process_group=dp_group, **HYPER)
    assert type(opt).__name__ == "Stage1Optimizer"
    assert len(opt.param_groups[0]["params"]) == len(list(fresh.parameters()))
    # Plain parameters at stage 1 still get torch's class (the drop-in path is unchanged).
    plain = torch.nn.Linear(4, 4)
    opt = zeroplus.ZeroRedundancyOptimizer((p for p in plain.parameters()), torch.optim.AdamW, lr=1e-3)
    assert isinstance(opt, torch.distributed.optim.ZeroRedundancyOptimizer) and len(opt.param_groups[0]["params"]) == 2
    return out


def _torch_clip(kind, params, step):
    """The clipping lines of a user's script, unchanged: torch's functions on model.parameters()."""
    params = list(params)
    if kind == "norm":  # step-dependent norm type and foreach, so every path of clip_grad.py runs
        norm_type, foreach = [(2.0, None), (float("inf"), None), (2.0, True), (3.0, False), (1.0, None)][step % 5]
        return float(torch.nn.utils.clip_grad_norm_(params, CLIP, norm_type=norm_type, foreach=foreach))
    if kind == "value":
        torch.nn.utils.clip_grad_value_(params, 1e-3, foreach=(None, True, False)[step % 3])
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, CLIP, total)
    return float(total)


def _torch_clip_parity(mesh, stage, kind, plan="manual", steps=5):
    """torch.nn.utils.clip_grad_norm_ / clip_grad_value_ / get_total_norm on a TP x ZeRO model's
    parameters (DTensor ones included) give the data-parallel-only reference's norms, and the clipped
    training its parameters (issue 38: before, DTensor parameters had no p.grad, so torch's functions
    silently left them out of the norm and unclipped)."""
    from torch.distributed.tensor import DTensor

    tm, mesh, ref, model = _setup(mesh, plan)
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    opt = _make_opt("initialize", model, stage, dp_group)
    if plan == "sp":  # Replicate DTensor parameters are in the norm too
        assert any(isinstance(p, DTensor) and p.placements[0].is_replicate() for p in model.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    start = [q.detach().clone() for q in ref.parameters()]
    norm_err, grads_ok = 0.0, True
    for i, step in enumerate(tm.batches(steps, 2)):
        x, y = step[dp_rank]
        tm.lm_loss(model(x), y).backward()
        grads_ok &= all(p.grad is not None and tuple(p.grad.shape) == tuple(p.shape) for p in model.parameters())
        norm = _torch_clip(kind, model.parameters(), i)
        opt.step()
        opt.zero_grad()
        (sum(tm.lm_loss(ref(a), b) for a, b in step) / 2).backward()
        ref_norm = _torch_clip(kind, ref.parameters(), i)
        ref_opt.step()
        ref_opt.zero_grad()
        norm_err = max(norm_err, abs(norm - ref_norm) / max(1.0, abs(ref_norm)))
    err = max((tm.full(p) - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    moved = max((q - q0).abs().max().item() for q, q0 in zip(ref.parameters(), start))  # the reference moved
    # p.grad of a DTensor parameter: other reads raise naming the zeroplus call (never a silent piece).
    tm.lm_loss(model(step[dp_rank][0]), step[dp_rank][1]).backward()
    up = model.blocks[0].up.weight
    try:
        up.grad.sum()
        read_error = None
    except (RuntimeError, AttributeError) as e:  # AttributeError: no p.grad at all
        read_error = str(e)
    opt.zero_grad()
    assert isinstance(up, DTensor)
    assert grads_ok and norm_err < TOL and err < TOL and moved > 100 * TOL, (grads_ok, norm_err, err, moved)
    assert read_error is not None and "opt.clip_grad_norm_" in read_error, read_error
    return {"param_err": err, "norm_err": norm_err, "moved": moved}


# zero1_sp: torch's SequenceParallel on the norms (tp_models.sequence_parallel_plan): their
# gradients arrive as Partial DTensors and some vocabulary-parallel ones as Replicate; the engine
# redistributes them to the parameters' placements.
CASES = {"zero1": (_parity, 1, "zero_redundancy"), "zero2": (_parity, 2, "initialize"),
         "zero1_sp": (_parity, 1, "initialize", "sp", 10), "bf16": (_mixed, "bf16", 2), "fp16": (_mixed, "fp16", 1),
         "errors": (_errors,)}
CASES.update({f"torch_clip_{kind}_{stage}": (_torch_clip_parity, stage, kind)
              for stage in (1, 2) for kind in ("norm", "value", "total")})
# Sequence parallelism: the norms are Replicate DTensors (each counted once over tp, summed over dp).
CASES["torch_clip_norm_2_sp"] = (_torch_clip_parity, 2, "norm", "sp")


def _all_cases(rank, world):
    import tp_models as tm

    return tm.run_cases(CASES)


@pytest.fixture(scope="module")
def results():
    start = time.monotonic()
    out = run_pooled(_all_cases, 4, timeout=600)
    print(f"\n4 ranks, all cases: {time.monotonic() - start:.1f} s")
    return out


def _result(results, key):
    for rank, per_rank in enumerate(results):
        status, value, seconds = per_rank[key]
        if status != "ok":
            pytest.fail(f"case {key} failed on rank {rank}:\n{value}")
    print(f"{key}: {results[0][key][1]} ({results[0][key][2]:.1f} s)")
    return results[0][key][1]


@pytest.mark.parametrize("key", ["zero1", "zero2", "zero1_sp"])
def test_tp2_zero_matches_data_parallel(results, key):
    """TP2 x ZeRO-1 (zeroplus.ZeroRedundancyOptimizer), TP2 x ZeRO-2 (zeroplus.initialize), and
    TP2 with sequence parallelism x ZeRO-1 (zeroplus.initialize, 10 steps)."""
    _result(results, key)


@pytest.mark.parametrize("key", ["bf16", "fp16"])
def test_tp2_zero_mixed_precision(results, key):
    """TP2 x ZeRO-2 in bf16, TP2 x ZeRO-1 in fp16 (the dynamic loss scale skips its first steps: every
    rank of the mesh must skip the same ones)."""
    _result(results, key)
    assert len({(r[key][1]["skipped_steps"], r[key][1]["loss_scale"]) for r in results}) == 1, results


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", ["norm", "value", "total"])
def test_torch_clip_functions_on_tp_zero_model(results, stage, kind):
    """torch's clip_grad_norm_ (norm types 2, inf, 3, 1; foreach on and off), clip_grad_value_ and
    get_total_norm + clip_grads_with_norm_ on model.parameters() of TP2 x ZeRO-1/2 match the
    data-parallel-only reference (its norms at every step, its parameters after 5 steps)."""
    _result(results, f"torch_clip_{kind}_{stage}")


def test_torch_clip_grad_norm_on_sequence_parallel_zero2(results):
    """The same with SequenceParallel norms (Replicate DTensor parameters) at stage 2."""
    _result(results, "torch_clip_norm_2_sp")


def test_tp_errors(results):
    out = _result(results, "errors")
    assert "mesh['dp'].get_group()" in out["world_group"]
    assert "stage=1 or stage=2" in out["stage3"]
