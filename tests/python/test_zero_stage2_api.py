"""zeroplus.initialize / stage-2 API: state dicts, bad input, memory accounting, the
ZeroRedundancyOptimizer(stage=2) constructor, the estimator CLI."""

import copy
import os
import json
import subprocess
import sys

import pytest
import torch

from harness import run_pooled

LR = 3e-3


def _train(model, opt, rank, steps, start=0):
    import zero_models as zm
    for step in range(start, start + steps):
        x, y = zm.batch(step, rank)
        loss = zm.loss_fn(model, x, y)
        opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
        opt.step()
        opt.zero_grad()


def _state_round_trip(rank, world):
    import zeroplus
    import zero_models as zm

    model, opt = zeroplus.initialize(zm.make_model(), torch.optim.AdamW, stage=2, lr=LR,
                                     config={"zero_optimization": {"reduce_bucket_size": 3000}})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(3):
        _train(model, opt, rank, 1, start=step)
        sched.step()
    sharded = copy.deepcopy(opt.state_dict())
    params = copy.deepcopy(model.state_dict())
    opt.consolidate_state_dict(to=0)
    full = opt.state_dict() if rank == 0 else None

    # Sharded round trip: a fresh engine loaded from it continues exactly like the original.
    twin, twin_opt = zeroplus.initialize(zm.make_model(seed=1), torch.optim.AdamW, stage=2, lr=LR,
                                         config={"zero_optimization": {"reduce_bucket_size": 3000}})
    twin.load_state_dict(params)
    twin_opt.load_state_dict(sharded)
    assert twin_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == LR * 0.5
    _train(model, opt, rank, 3, start=3)
    _train(twin, twin_opt, rank, 3, start=3)
    sharded_diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), twin.parameters()))

    # Consolidated (plain torch format) loads into a plain torch AdamW, and into stage 2 at world 1 size too.
    plain_ok = True
    if rank == 0:
        ref = zm.make_model()
        ref.load_state_dict(params)
        plain = torch.optim.AdamW(ref.parameters(), lr=LR)
        plain.load_state_dict(full)
        n_params = len(list(ref.parameters()))
        plain_ok = (sorted(full["state"]) == list(range(n_params))
                    and all(full["state"][i]["exp_avg"].shape == p.shape for i, p in enumerate(ref.parameters())))
    return sharded_diff, plain_ok


def test_state_dict_round_trips_sharded_and_consolidated():
    for diff, plain_ok in run_pooled(_state_round_trip, 2, timeout=240):
        assert diff == 0.0
        assert plain_ok


def _consolidated_reload_other_world(rank, world, path):
    import zeroplus
    import zero_models as zm

    model, opt = zeroplus.initialize(zm.make_model(), torch.optim.AdamW, stage=2, lr=LR)
    full = torch.load(path, weights_only=False)
    model.load_state_dict(full["model"])
    opt.load_state_dict(full["optim"])
    _train(model, opt, rank, 2, start=100)
    return [p.detach().clone() for p in model.parameters()]


def _save_consolidated(rank, world, path):
    import zeroplus
    import zero_models as zm

    model, opt = zeroplus.initialize(zm.make_model(), torch.optim.AdamW, stage=2, lr=LR)
    _train(model, opt, rank, 3)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    return True


def _plain_reference(rank, world, path):
    import zero_models as zm
    from torch.nn.parallel import DistributedDataParallel as DDP
    full = torch.load(path, weights_only=False)
    model = zm.make_model()
    model.load_state_dict(full["model"])
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    opt.load_state_dict(full["optim"])
    _train(ddp, opt, rank, 2, start=100)
    return [p.detach().clone() for p in model.parameters()]


def test_consolidated_state_reloads_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    run_pooled(_save_consolidated, 2, path, timeout=180)
    ours = run_pooled(_consolidated_reload_other_world, 3, path, timeout=180)[0]
    ref = run_pooled(_plain_reference, 3, path, backend="gloo", timeout=180)[0]
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-5


def _bad_input(rank, world):
    import zeroplus
    import zero_models as zm
    from torch.nn.parallel import DistributedDataParallel as DDP

    errors = {}

    def expect(name, exc, fn):
        try:
            fn()
        except exc as e:
            errors[name] = str(e)
        else:
            errors[name] = None

    model = zm.make_model()
    snapshot = copy.deepcopy(model.state_dict())
    expect("stage", ValueError, lambda: zeroplus.initialize(model, torch.optim.AdamW, stage=4, lr=LR))
    expect("stage0", ValueError, lambda: zeroplus.initialize(model, torch.optim.AdamW, stage=0, lr=LR))
    expect("ddp", ValueError, lambda: zeroplus.initialize(DDP(zm.make_model()), torch.optim.AdamW, stage=2))
    expect("precision", ValueError, lambda: zeroplus.initialize(model, torch.optim.AdamW, stage=2,
                                                                mixed_precision="fp8"))
    expect("conflict", ValueError, lambda: zeroplus.initialize(
        model, torch.optim.AdamW, stage=2, config={"zero_optimization": {"stage": 1}}))
    expect("lr_conflict", ValueError, lambda: zeroplus.initialize(
        model, torch.optim.AdamW, stage=2, lr=1.0, config={"optimizer": {"params": {"lr": 2.0}}}))
    expect("unknown_key", ValueError, lambda: zeroplus.initialize(
        model, torch.optim.AdamW, stage=2, config={"zero_optimisation": {"stage": 2}}))
    expect("optimizer_class", TypeError, lambda: zeroplus.initialize(model, "AdamW", stage=2))
    expect("differentiable", ValueError, lambda: zeroplus.initialize(
        model, torch.optim.AdamW, stage=2, mixed_precision="bf16", differentiable=True))
    expect("bad_hyperparameter", TypeError, lambda: zeroplus.initialize(model, torch.optim.AdamW, stage=2,
                                                                         mixed_precision="bf16", momentum=0.9))
    expect("negative_lr", ValueError, lambda: zeroplus.initialize(model, torch.optim.AdamW, stage=2, lr=-1.0))
    expect("offload", ValueError, lambda: zeroplus.initialize(model, torch.optim.AdamW, stage=2,
                                                              offload_optimizer={"device": "nvme"}))
    expect("offload_path", FileNotFoundError, lambda: zeroplus.initialize(
        model, torch.optim.AdamW, stage=2, offload_optimizer={"device": "nvme", "nvme_path": "/nonexistent/zp"}))
    mixed = zm.make_model()
    mixed.head = torch.nn.Linear(32, 64, bias=False).to("meta")
    expect("devices", ValueError, lambda: zeroplus.initialize(mixed, torch.optim.AdamW, stage=2))
    unchanged = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), snapshot.values()))
    unchanged = unchanged and not any(getattr(p, "_zeroplus_managed", False) for p in model.parameters())

    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=2, lr=LR)
    expect("max_norm", ValueError, lambda: opt.clip_grad_norm_(0.0))
    expect("max_norm_neg", ValueError, lambda: opt.clip_grad_norm_(-1.0))
    expect("twice", ValueError, lambda: zeroplus.initialize(model, torch.optim.AdamW, stage=2))
    expect("add_group", NotImplementedError, lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]}))
    expect("backward", TypeError, lambda: opt.backward(1.0))
    return errors, unchanged


def test_bad_input_is_rejected_naming_the_argument_and_changes_nothing():
    errors, unchanged = run_pooled(_bad_input, 2, timeout=120)[0]
    for name, message in errors.items():
        assert message is not None, f"{name}: no error raised"
    assert "stage" in errors["stage"] and "stage" in errors["stage0"]
    assert "DistributedDataParallel" in errors["ddp"]
    assert "mixed_precision" in errors["precision"]
    assert "stage=2" in errors["conflict"] and "['zero_optimization']['stage']=1" in errors["conflict"]
    assert "lr=1.0" in errors["lr_conflict"] and "2.0" in errors["lr_conflict"]
    assert "zero_optimisation" in errors["unknown_key"]
    assert "optimizer_class" in errors["optimizer_class"]
    assert "differentiable" in errors["differentiable"]
    assert "devices" in errors["devices"]
    assert "momentum" in errors["bad_hyperparameter"] and "AdamW" in errors["bad_hyperparameter"]
    assert "learning rate" in errors["negative_lr"]
    assert "offload_optimizer" in errors["offload"] and "nvme_path" in errors["offload"]
    assert "/nonexistent/zp" in errors["offload_path"]
    assert "max_norm" in errors["max_norm"] and "max_norm" in errors["max_norm_neg"]
    assert "already" in errors["twice"]
    assert unchanged


def _memory(rank, world, stage, precision):
    import zeroplus
    import zero_models as zm

    census = zm.TensorCensus() if world == 2 else None  # a census walks every object: 2 ranks show it
    model = zm.make_model(dim=64, layers=2, vocab=128)
    psi = sum(p.numel() for p in model.parameters())
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, lr=LR, mixed_precision=precision)
    _train(model, opt, rank, 1)
    # Measured where every category is live: optimizer state exists, gradients of a backward are in.
    x, y = zm.batch(1, rank)
    opt.backward(zm.loss_fn(model, x, y))
    del x, y
    report = zeroplus.memory_report(model, opt)
    estimate = zeroplus.estimate_memory(psi, world, stage, precision)
    return report, estimate, census and census.new_bytes(), zm.held_bytes(model, report)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage,precision", [(1, None), (1, "bf16"), (2, None), (2, "bf16")])
def test_model_state_bytes_match_the_zero_formula(world, stage, precision):
    reports = run_pooled(_memory, world, stage, precision, timeout=240)
    for report, estimate, measured, held in reports:
        # What the rank's tensors take, counted outside the engine, is what the report says
        # (the estimator is ours too: agreeing with it alone proves nothing).
        assert world != 2 or measured == pytest.approx(held, rel=0.01), (measured, held, report)
        assert report["model_state"] == pytest.approx(estimate["model_state"], rel=0.05), (report, estimate)
        assert report["parameters"] == pytest.approx(estimate["parameters"], rel=0.05)
        assert report["communication_buffers"] == 0  # nothing in flight at rest
    report, estimate = reports[0][:2]
    if stage == 2 and precision is None and world == 2:
        # fp32 at N = 2: 10 bytes per parameter, 0.625x DDP's 16.
        assert estimate["model_state"] / estimate["parameters"] * 4 == pytest.approx(10.0)


def _zero_redundancy_stage2(rank, world):
    import zeroplus
    import zero_models as zm
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = zm.make_model()
    ref = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    opt = zeroplus.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, stage=2, lr=LR)
    assert isinstance(opt, torch.optim.Optimizer)
    for step in range(5):
        x, y = zm.batch(step, rank)
        zm.loss_fn(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        zm.loss_fn(model, x, y).backward()  # plain loss.backward(): the hooks do the work
        opt.step()
        opt.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.module.parameters()))
    # offload_optimizer as zeroplus.initialize takes it: NVMe under stage 2, bit for bit the
    # in-memory engine; refused by name where the engine does not run (stage 1 is torch's class)
    # or cannot (offload_param is stage 3's).
    import tempfile

    root = [tempfile.mkdtemp(prefix="zp-zro-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(root, src=0)
    nvme = {"device": "nvme", "nvme_path": root[0]}
    in_memory, offloaded = zm.make_model(), zm.make_model()
    opts = [zeroplus.ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, stage=2, lr=LR, **kw)
            for m, kw in ((in_memory, {}), (offloaded, {"offload_optimizer": nvme}))]
    for step in range(3):
        x, y = zm.batch(step, rank)
        for m, o in zip((in_memory, offloaded), opts):
            zm.loss_fn(m, x, y).backward()
            o.step()
            o.zero_grad()
    same = all(torch.equal(a, b) for a, b in zip(in_memory.parameters(), offloaded.parameters()))
    swapping = opts[1].offload is not None and os.path.isdir(opts[1].offload.directory.path)
    errors = []
    for kw in ({"offload_optimizer": nvme}, {"mixed_precision": "bf16"}, {"stage": 2, "offload_param": nvme}):
        try:
            zeroplus.ZeroRedundancyOptimizer(zm.make_model().parameters(), optimizer_class=torch.optim.AdamW, lr=LR, **kw)
        except ValueError as e:
            errors.append(str(e))
    del opts, offloaded, m, o  # (the loop's names hold the last engine too)
    import gc
    gc.collect()
    torch.distributed.barrier()
    if rank == 0:
        os.rmdir(root[0])  # the engine removed its swap directory: the root is empty
    return diff, same, swapping, errors


def test_zero_redundancy_optimizer_stage2_constructor():
    for diff, same, swapping, errors in run_pooled(_zero_redundancy_stage2, 2, timeout=120):
        assert diff < 1e-6
        assert same and swapping, (same, swapping)
        assert len(errors) == 3, errors
        assert "offload_optimizer needs zeroplus's ZeRO engine" in errors[0] and "stage=2" in errors[0], errors[0]
        assert "mixed_precision needs" in errors[1], errors[1]
        assert "offload_param applies to ZeRO stage 3 only" in errors[2], errors[2]


def test_config_file_gives_the_same_engine(tmp_path):
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95]}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000}, "bf16": {"enabled": True},
           "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 4}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    from zeroplus.zero.config import resolve
    settings = resolve(None, None, None, str(path), {})
    assert settings.optimizer_class is torch.optim.AdamW
    assert settings.optimizer_defaults == {"lr": LR, "betas": (0.9, 0.95)}
    options = settings.options
    assert (settings.stage, options.precision.mixed_precision, options.reduce_bucket_elems) == (2, "bf16", 5000)
    assert options.gradient_clipping == 1.0


def test_estimate_cli_prints_all_stages():
    out = subprocess.run([sys.executable, "-m", "zeroplus.estimate", "--params", "1.3e9", "--world-size", "8"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    total = {int(r[0]): float(r[-1]) for r in rows}
    gib = 1.3e9 / 2**30
    assert total[0] == pytest.approx(16 * gib, rel=1e-3)
    assert total[1] == pytest.approx((4 + 12 / 8) * gib, rel=1e-3)
    assert total[2] == pytest.approx((2 + 14 / 8) * gib, rel=1e-3)
    assert total[3] == pytest.approx(16 / 8 * gib, rel=1e-3)


def test_estimate_cli_help_and_mixed_precision_none():
    """--help describes the tool (it printed a stray usage line as its description), and the
    advertised `--mixed-precision none` is fp32 training, as --fp32 (it was rejected)."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", "zeroplus.estimate", *args], capture_output=True, text=True,
                              timeout=120, check=True).stdout

    help_text = run("--help")
    description = help_text.split("\n\n")[1]
    assert description.startswith("Prints the ZeRO model-state bytes per rank"), help_text
    assert "[--offload-param" not in description
    fp32 = run("--params", "1e9", "--world-size", "4", "--fp32")
    assert run("--params", "1e9", "--world-size", "4", "--mixed-precision", "none") == fp32
    assert ", fp32," in fp32.splitlines()[0]


def _stage1(rank, world, precision, tolerance):
    import zeroplus
    import zero_models as zm
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = zm.make_model()
    keys = list(model.state_dict().keys())
    names = [n for n, _ in model.named_parameters()]
    ref = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=1, lr=LR, mixed_precision=precision)
    same_module = (type(model) is zm.TiedGPT and list(model.state_dict().keys()) == keys
                   and [n for n, _ in model.named_parameters()] == names)
    for step in range(6):
        x, y = zm.batch(step, rank)
        with ref.no_sync() if step % 2 == 0 else torch.enable_grad():
            zm.loss_fn(ref, x, y).backward()
        with model.no_sync() if step % 2 == 0 else torch.enable_grad():
            opt.backward(zm.loss_fn(model, x, y))
        if step % 2 == 1:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            norm = opt.clip_grad_norm_(0.5)
            assert abs(norm.item() - ref_norm.item()) <= max(tolerance, 1e-5) * ref_norm.item()
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
    diff = max((a.float() - b).abs().max().item() for a, b in zip(model.parameters(), ref.module.parameters()))
    return same_module, diff


@pytest.mark.parametrize("precision,tolerance", [(None, 1e-6), ("bf16", 2e-2)])
def test_stage1_keeps_the_module_and_matches_ddp(precision, tolerance):
    for same_module, diff in run_pooled(_stage1, 2, precision, tolerance, timeout=240):
        assert same_module
        assert diff < tolerance


def _module_identity(rank, world):
    import zeroplus
    import zero_models as zm

    model = zm.make_model()
    keys = list(model.state_dict().keys())
    returned, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=2, lr=LR, mixed_precision="bf16")
    return (returned is model, list(model.state_dict().keys()) == keys, hasattr(model, "no_sync"),
            isinstance(opt, torch.optim.Optimizer), sorted(opt.param_groups[0]) == sorted(
                torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]).param_groups[0]))


def test_stage2_returns_the_users_module_and_a_torch_optimizer():
    for flags in run_pooled(_module_identity, 2, timeout=120):
        assert all(flags), flags


def test_engine_lookup_is_explicit():
    # ZeroRedundancyOptimizer(stage=2) asks zeroplus.zero.stages for its engine; nothing registers one
    from zeroplus.optim import zero as optim_zero
    from zeroplus.zero.stages import Stage1Optimizer, Stage2Optimizer, engine_for_stage

    assert not hasattr(optim_zero, "STAGE_ENGINES")
    assert engine_for_stage(1).args == (Stage1Optimizer,) and engine_for_stage(2).args == (Stage2Optimizer,)
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        engine_for_stage(3)
