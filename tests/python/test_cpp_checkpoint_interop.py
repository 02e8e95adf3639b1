"""C++ <-> Python checkpoints: zeroplus::save_checkpoint (the C++ ZeRO engine, driven by the
LibTorch program tests/cpp/plugin/zero_checkpoint_tool.cpp with ranks as threads) writes the
Python package's format, and zeroplus.load_checkpoint reads it at another world size and stage
(1, 2 and 3); and back: a Python stage-2 checkpoint (AdamW or SGD, fp32 or bf16) loads in C++ at
world sizes 2 and 3. Both directions then take one more step on the same data and must agree,
which checks the optimizer state (moments, step counts, momentum buffers) as well as the values.
The `offload` cases run the C++ engine with its optimizer state on NVMe (the tool's NVME_DIR):
the checkpoint is read from, or written into, its swap records. The fp16 cases carry the dynamic
loss scaler (the manifest's optimizer.loss_scaler, skipped_steps) across in both directions:
with an initial scale of 2^19 and hysteresis 1 (FP16, as the tool's) the first step overflows
and is skipped, so the state moved.
Python runs at world size 1 in this process (one_rank_group), so every load is a reshard."""

import json
import os
import subprocess

import pytest
import torch
import torch.jit._pickle  # noqa: F401  (restore_type_tag: what torch::pickle_save files reference)

import zeroplus

BUILD = os.environ.get("ZEROPLUS_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
TOOL = os.path.join(BUILD, "bin", "zero_checkpoint_tool")
ROWS = 12
FP16 = {"initial_scale_power": 19, "hysteresis": 1}  # zero_checkpoint_tool's fp16 knobs

pytestmark = pytest.mark.skipif(not os.path.exists(TOOL), reason=f"{TOOL} is not built")


def tool(*args):
    r = subprocess.run([TOOL, *map(str, args)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def batch(step):
    x = torch.sin(torch.arange(ROWS * 7, dtype=torch.float32) * 0.37 + step).reshape(ROWS, 7)
    y = torch.cos(torch.arange(ROWS * 3, dtype=torch.float32) * 0.21 + step).reshape(ROWS, 3)
    return x, y


def make(opt_name, stage, precision):
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 17), torch.nn.ReLU(),
                                torch.nn.Linear(17, 3))
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.copy_((torch.sin(torch.arange(p.numel(), dtype=torch.float32) * 0.7 + k) * 0.3).reshape(p.shape))
    kwargs = dict(lr=0.05, momentum=0.9) if opt_name == "sgd" else dict(lr=1e-2, weight_decay=0.1)
    cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
    config = {"fp16": {"enabled": True, **FP16}} if precision == "fp16" else None
    return zeroplus.initialize(model, cls, stage=stage, mixed_precision=None if precision == "fp32" else precision,
                               config=config, **kwargs)


def step(model, opt, s):
    x, y = batch(s)
    dtype = next(model.parameters()).dtype
    loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
    opt.zero_grad()
    opt.backward(loss)  # fp16: scaled by the loss scale
    opt.step()


def params(model):
    """The full parameters (model.state_dict() gathers stage 3's shards)."""
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def load_pt(path):
    """Parameters the C++ tool wrote with torch::pickle_save (its type tags need this global)."""
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return dict(torch.load(path))


def expect_equal(got, want, tol, what):
    assert sorted(got) == sorted(want), what
    for n in want:
        diff = (got[n].float() - want[n].float()).abs().max().item()
        assert diff <= tol, f"{what}: {n} differs by {diff}"


def test_zeroplus_is_this_worktree():
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "plugin", "python"))
    assert os.path.abspath(zeroplus.__file__).startswith(here)


def nvme_args(tmp_path, offload):
    if not offload:
        return ()
    (tmp_path / "nvme").mkdir()
    return (tmp_path / "nvme",)


@pytest.mark.parametrize("opt_name,precision,cpp_world,cpp_stage,offload",
                         [("adamw", "fp32", 2, 2, False), ("sgd", "fp32", 3, 1, False), ("adamw", "bf16", 2, 1, False),
                          ("adamw", "bf16", 2, 3, True), ("sgd", "fp32", 2, 2, True)])
def test_cpp_checkpoint_loads_in_python(one_rank_group, tmp_path, opt_name, precision, cpp_world, cpp_stage, offload):
    tool("save", tmp_path, cpp_world, cpp_stage, opt_name, precision, *nvme_args(tmp_path, offload))
    if offload:
        assert not any((tmp_path / "nvme").iterdir())  # the swap directory went with the optimizer
    at_save = load_pt(tmp_path / "at_save.pt")
    step3 = load_pt(tmp_path / "step3.pt")
    for stage in (1, 2, 3):
        model, opt = make(opt_name, stage, precision)
        zeroplus.load_checkpoint(str(tmp_path / "ckpt"), model, opt)
        expect_equal(params(model), at_save, 0.0, f"stage {stage} load")
        step(model, opt, 2)
        expect_equal(params(model), step3, 1e-5 if precision == "fp32" else 1e-2, f"stage {stage} step after load")


@pytest.mark.parametrize("opt_name,precision,cpp_world,offload",
                         [("adamw", "fp32", 2, False), ("sgd", "fp32", 3, False), ("adamw", "bf16", 3, False),
                          ("adamw", "bf16", 2, True), ("sgd", "fp32", 2, True)])
def test_python_checkpoint_loads_in_cpp(one_rank_group, tmp_path, opt_name, precision, cpp_world, offload):
    model, opt = make(opt_name, 2, precision)
    for s in range(2):
        step(model, opt, s)
    zeroplus.save_checkpoint(str(tmp_path / "py" / "ckpt"), model, opt)
    at_save = params(model)
    step(model, opt, 2)
    step3 = params(model)
    tool("load", tmp_path / "py", tmp_path, cpp_world, 2, opt_name, precision,  # through `latest`
         *nvme_args(tmp_path, offload))
    if offload:
        assert not any((tmp_path / "nvme").iterdir())
    expect_equal(load_pt(tmp_path / "loaded.pt"), at_save, 0.0, "C++ load")
    expect_equal(load_pt(tmp_path / "step3.pt"), step3, 1e-5 if precision == "fp32" else 1e-2,
                 "C++ step after load")


@pytest.mark.parametrize("cpp_world,cpp_stage", [(2, 2), (3, 3)])
def test_cpp_fp16_checkpoint_loads_in_python_with_its_loss_scaler(one_rank_group, tmp_path, cpp_world, cpp_stage):
    tool("save", tmp_path, cpp_world, cpp_stage, "adamw", "fp16")
    at_save, step3, scaler = (load_pt(tmp_path / f) for f in ("at_save.pt", "step3.pt", "scaler.pt"))
    with open(tmp_path / "ckpt" / "manifest.json") as f:
        meta = json.load(f)["optimizer"]
    saved = meta["loss_scaler"]  # where and as the Python engine keeps it
    assert set(saved) == {"scale", "hysteresis_left", "iteration", "last_overflow_iteration", "options"}, saved
    assert saved["scale"] == scaler["scale"].item() and meta["skipped_steps"] == scaler["skipped_steps"].item()
    assert meta["skipped_steps"] >= 1 and saved["iteration"] == 2 and saved["scale"] < 2.0 ** 19, meta  # it moved
    for stage in (1, 2, 3):
        model, opt = make("adamw", stage, "fp16")
        assert opt.scaler.state_dict() != saved
        zeroplus.load_checkpoint(str(tmp_path / "ckpt"), model, opt)
        assert opt.scaler.state_dict() == saved, stage
        assert opt.skipped_steps == meta["skipped_steps"]
        expect_equal(params(model), at_save, 0.0, f"stage {stage} load")
        step(model, opt, 2)
        expect_equal(params(model), step3, 1e-2, f"stage {stage} step after load")


@pytest.mark.parametrize("cpp_world", [2, 3])
def test_python_fp16_checkpoint_loads_in_cpp_with_its_loss_scaler(one_rank_group, tmp_path, cpp_world):
    model, opt = make("adamw", 2, "fp16")
    for s in range(2):
        step(model, opt, s)
    assert opt.skipped_steps >= 1 and opt.loss_scale < 2.0 ** 19  # the state moved
    zeroplus.save_checkpoint(str(tmp_path / "py" / "ckpt"), model, opt)
    at_save, scale, skipped = params(model), opt.loss_scale, opt.skipped_steps
    step(model, opt, 2)
    step3 = params(model)
    tool("load", tmp_path / "py", tmp_path, cpp_world, 2, "adamw", "fp16")
    expect_equal(load_pt(tmp_path / "loaded.pt"), at_save, 0.0, "C++ load")
    scaler = load_pt(tmp_path / "scaler.pt")
    assert (scaler["scale"].item(), scaler["skipped_steps"].item()) == (scale, skipped)
    expect_equal(load_pt(tmp_path / "step3.pt"), step3, 1e-2, "C++ step after load")
