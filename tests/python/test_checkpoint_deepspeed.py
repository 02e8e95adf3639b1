"""zeroplus.load_checkpoint of DeepSpeed checkpoints, against the real DeepSpeed (0.19.8, CPU, gloo).

One 2-rank gloo launch runs DeepSpeed's own engine (deepspeed_runs.py) at ZeRO stages 1, 2 and 3 in
fp32 and bf16 with a torch AdamW client optimizer and DeepSpeed's WarmupLR, plus stage 2 with the
optimizer built from DeepSpeed's config; a 3-rank launch runs stages 2 and 3 (uneven partitions,
the last rank's padded): 3 steps, engine.save_checkpoint (global_step3, `latest`),
3 more steps, a second save (global_step6: the continuation's reference). DeepSpeed's own
zero_to_fp32 consolidates both (the oracle for the mapping of flat partitions to parameters).

zeroplus then loads global_step3 (through `latest`) into a fresh model of another seed at world
sizes 2, 1 and 3 and stages 2 and 3 (stage 3 with every parameter sharded, asserted; two cases at
stage 1), recreates
DeepSpeed's scheduler from the returned extra, and trains the same 3 steps on the same global
batches. Checked: right after the load the parameters equal DeepSpeed's fp32 masters exactly, the
lr and step count are DeepSpeed's; after the 3 steps fp32 matches DeepSpeed's continuation within
1e-5 (DeepSpeed moved the parameters by far more than that), bf16 within bf16 rounding. The first
load of a launch asserts DeepSpeed was not imported by it. `convert --from deepspeed` writes a
native checkpoint (streaming: one DeepSpeed rank's file mapped at a time, asserted) that loads to
the same values as the DeepSpeed checkpoint itself.

Errors: a checkpoint carrying a code-running pickle (in an optim file, in the model states'
client_state) is refused naming the callable and nothing runs (marker file never created), also
by load_checkpoint, which leaves model and optimizer untouched; a model of other shapes is named
key by key (torch's strict wording); another optimizer class is named by its state keys.

Also stage 1 and 3 runs with two param groups and a frozen parameter (hyperparameters come from
the checkpoint: zeroplus's optimizer is built with others), stage 2 and 3 runs with tied weights,
and an fp16 checkpoint made by hand
from a stage-2 one (DeepSpeed's own DynamicLossScaler pickled into it): its scale, iteration, last
overflow and hysteresis reach a zeroplus fp16 engine, an fp32 engine keeps its own scaler.

Not run here (reported with their reason): DeepSpeed training in fp16 (DeepSpeed's CPU accelerator
reports fp16 unsupported, so DeepSpeed refuses an fp16 config on this machine). Opt-in
(ZEROPLUS_TEST_DEEPSPEED_OPS=1): DeepSpeed's own FusedAdam, which it JIT-compiles on first use.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

# DeepSpeed's side runs on CPU by design (gloo ranks; its accelerator detection would pick CUDA on a GPU box)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
try:
    import deepspeed  # noqa: F401
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
except ImportError as e:  # decided before anything runs
    pytest.skip(f"deepspeed==0.19.8 is not installed in this venv ({e}); scripts/setup.sh installs it",
                allow_module_level=True)

import deepspeed_runs as dr
from deepspeed_resume import MORE, PARAMS, STEPS, mismatch, refused_load, scaler_after_load, zeroplus_cases
from harness import run_cases_in_own_groups, run_pooled

DS_CASES = {  # name -> (stage, precision, optimizer from DeepSpeed's config, variant: True = two param groups and a
    #           frozen parameter, "tied" = tied weights)
    "s1_fp32": (1, None, False, False), "s2_fp32": (2, None, False, False), "s3_fp32": (3, None, False, False),
    "s1_bf16": (1, "bf16", False, False), "s2_bf16": (2, "bf16", False, False), "s3_bf16": (3, "bf16", False, False),
    "s2_cfgopt": (2, None, True, False), "s1_groups": (1, None, False, True), "s3_groups": (3, None, False, True),
    "s2_tied": (2, None, False, "tied"), "s3_tied": (3, None, False, "tied"),
}
# saved by 3 DeepSpeed ranks: uneven partitions (stages 1-2: the tail padding removed from the last
# rank's; stage 3: every parameter padded to a multiple of 3)
DS_CASES_W3 = {"s2_w3": (2, None, False, False), "s3_w3": (3, None, False, False)}
ALL_CASES = {**DS_CASES, **DS_CASES_W3}
FP32_TOL = 1e-5


def _ds_all(rank, world, root):
    out = {}
    for name, (stage, precision, cfgopt, grouped) in (DS_CASES if world == 2 else DS_CASES_W3).items():
        out[name] = dr.train_save_continue(rank, world, root, name, stage, precision, cfgopt, grouped, STEPS, MORE)
    return out


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    """Every DeepSpeed run, their consolidated fp32 weights at steps 3 and 6, and the run info."""
    root = str(tmp_path_factory.mktemp("ds"))
    t0 = time.monotonic()
    info = run_pooled(_ds_all, 2, root, backend="gloo", timeout=900)[0]
    print(f"\nDeepSpeed: {len(DS_CASES)} runs on 2 ranks (gloo): {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    info.update(run_pooled(_ds_all, 3, root, backend="gloo", timeout=900)[0])
    print(f"DeepSpeed: {len(DS_CASES_W3)} runs on 3 ranks (gloo): {time.monotonic() - t0:.1f} s")
    refs = {}
    for name in ALL_CASES:
        refs[name] = {tag: {k: v.float().clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(
            os.path.join(root, name), tag=f"global_step{tag}").items()} for tag in (STEPS, STEPS + MORE)}
    return root, info, refs


def _run_zeroplus(world, cases):
    t0 = time.monotonic()
    results = run_pooled(zeroplus_cases, world, cases, timeout=600)
    print(f"zeroplus: {len(cases)} loads + {MORE} steps each on {world} ranks: {time.monotonic() - t0:.1f} s")
    out = {}
    for key in cases:
        for rank in range(world):
            status, value = results[rank][key]
            assert status == "ok", f"{key}, rank {rank}:\n{value}"
        out[key] = results[0][key][1]
    return out


def _max_diff(a, b) -> float:
    """Over the trained parameters of reference b (zero_to_fp32's; tied ones under both names)."""
    return max((a[k] - b[k]).abs().max().item() for k in b if k not in ("shift", "gate"))


def _check(key, got, ds_name, info, refs, precision, grouped):
    ref3, ref6 = refs[ds_name][STEPS], refs[ds_name][STEPS + MORE]
    for k in PARAMS:  # the fp32 masters, bit for bit (bf16: the master, not the rounded parameter)
        if precision is None:
            assert torch.equal(got["loaded"][k], ref3[k]), f"{key}: {k} differs from DeepSpeed's master after the load"
    if grouped == "tied":  # one tensor under both names, DeepSpeed's master
        assert torch.equal(got["loaded"]["lin_back.weight"], ref3["lin2.weight"]), key
        assert torch.equal(got["trained"]["lin_back.weight"], got["trained"]["lin2.weight"]), key
    if grouped is True:  # the frozen parameter (DeepSpeed's run started from make(0)), unchanged by training
        gate = dr.make(0, True).gate.detach()
        assert torch.equal(got["loaded"]["gate"], gate) and torch.equal(got["trained"]["gate"], gate), key
    # hyperparameters from the checkpoint (zeroplus's optimizer was built with lr 1e-3, weight decay 0.5)
    assert got["lr"] == [pytest.approx(info[ds_name]["lr"], rel=1e-12)] * len(got["lr"]), f"{key}: lr {got['lr']}"
    assert got["weight_decay"] == ([0.1, 0.0] if grouped is True else [0.1]), f"{key}: {got['weight_decay']}"
    assert got["steps"] == [float(STEPS)], f"{key}: optimizer step counts {got['steps']}"
    assert got["extra"]["lr_scheduler"] == info[ds_name]["scheduler"], key
    assert got["extra"]["global_steps"] == STEPS, key
    moved, diff = _max_diff(ref6, ref3), _max_diff(got["trained"], ref6)
    tol = FP32_TOL if precision is None else 0.02 * moved  # bf16: forward and gradients rounded to 8 bits
    assert moved > 100 * FP32_TOL, f"{ds_name}: DeepSpeed's continuation moved only {moved}"
    assert diff <= tol, f"{key}: after {MORE} steps {diff} from DeepSpeed's continuation (tolerance {tol}, " \
                        f"moved {moved})"
    return diff, moved


def test_resume_matches_deepspeed(ds_runs, tmp_path):
    root, info, refs = ds_runs
    # world 1 first: its first case loads before anything imports deepspeed in these ranks
    cases1 = {"first_load": (os.path.join(root, "s2_fp32"), 2, None, False, True, None)}
    for name, (_stage, precision, _c, grouped) in ALL_CASES.items():
        for stage in (2, 3):
            cases1[f"{name}->w1s{stage}"] = (os.path.join(root, name), stage, precision, grouped, False,
                                              str(tmp_path / f"{name}-w1s{stage}"))
    got1 = _run_zeroplus(1, cases1)
    assert got1["first_load"]["deepspeed_imported"] is False, "loading a DeepSpeed checkpoint imported deepspeed"
    assert torch.equal(got1["first_load"]["loaded"]["lin1.weight"], refs["s2_fp32"][STEPS]["lin1.weight"])

    # convert, streaming: at most one DeepSpeed rank's optim file mapped while the shards are written
    from zeroplus.checkpoint import deepspeed_convert, deepspeed_layout

    peak = []
    opened = deepspeed_layout.DeepSpeedLayout.open_rank

    def counting(self, rank):
        value = opened(self, rank)
        peak.append(len(self._optim))
        return value

    converted = {}
    deepspeed_layout.DeepSpeedLayout.open_rank = counting
    try:
        for name in ("s2_fp32", "s3_bf16", "s1_groups"):
            converted[name] = str(tmp_path / f"native_{name}")
            peak.clear()
            deepspeed_convert.convert_from_deepspeed(os.path.join(root, name), converted[name])
            assert max(peak) == 1, f"convert {name} held {max(peak)} DeepSpeed ranks' files at once"
    finally:
        deepspeed_layout.DeepSpeedLayout.open_rank = opened

    cases2 = {}
    for name, (_stage, precision, _c, grouped) in ALL_CASES.items():
        for stage in (2, 3):
            cases2[f"{name}->w2s{stage}"] = (os.path.join(root, name), stage, precision, grouped, False,
                                              str(tmp_path / f"{name}-w2s{stage}"))
    for name in ("s3_fp32", "s2_bf16"):  # and into zeroplus's stage 1
        cases2[f"{name}->w2s1"] = (os.path.join(root, name), 1, DS_CASES[name][1], False, False,
                                   str(tmp_path / f"{name}-w2s1"))
    for name, path in converted.items():  # frozen parameters in group 0 (convert puts them there)
        grouped = "with_frozen" if DS_CASES[name][3] is True else DS_CASES[name][3]
        cases2[f"native_{name}->w2s3"] = (path, 3, DS_CASES[name][1], grouped, False,
                                          str(tmp_path / f"native_{name}-w2s3"))
        cases2[f"{name}->w2s3"] = (os.path.join(root, name), 3, DS_CASES[name][1], grouped, False,
                                   str(tmp_path / f"{name}-w2s3"))
    got2 = _run_zeroplus(2, cases2)
    got3 = _run_zeroplus(3, {f"{name}->w3s{stage}": (os.path.join(root, name), stage, DS_CASES[name][1],
                                                      DS_CASES[name][3], False, str(tmp_path / f"{name}-w3s{stage}"))
                             for name, stage in (("s3_fp32", 3), ("s1_fp32", 2), ("s2_bf16", 3), ("s3_groups", 2))})
    report = []
    for got in (got1, got2, got3):
        for key, value in got.items():
            if key == "first_load":
                continue
            ds_name = key.split("->")[0].replace("native_", "")
            diff, moved = _check(key, value, ds_name, info, refs, ALL_CASES[ds_name][1], ALL_CASES[ds_name][3])
            report.append(f"{key}: {diff:.2e} (moved {moved:.2e})")
    for name in converted:  # the native checkpoint loads to what the DeepSpeed one loads to
        a, b = got2[f"native_{name}->w2s3"], got2[f"{name}->w2s3"]
        assert all(torch.equal(a["loaded"][k], b["loaded"][k]) for k in a["loaded"]), name
        assert all(torch.equal(a["trained"][k], b["trained"][k]) for k in PARAMS), name
    print("max |zeroplus - DeepSpeed| after the continuation:\n  " + "\n  ".join(report))


def test_deepspeed_fp16_training_is_not_run_here():
    """States why one row of the matrix cannot run on this machine (decided before running it)."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() == "cpu" and not accel.is_fp16_supported():
        pytest.skip(f"DeepSpeed's CPU accelerator reports fp16 unsupported (is_fp16_supported() -> "
                    f"{accel.is_fp16_supported()!r}): DeepSpeed refuses an fp16 config here, so no fp16 run is "
                    f"generated (test_fp16_loss_scaler_travels covers the fp16 scaler state)")
    pytest.fail("DeepSpeed's CPU accelerator supports fp16 now: add the fp16 cases to DS_CASES")


def _ds_fused(rank, world, root):
    return dr.train_save_continue(rank, world, root, "s2_fused", 2, None, "fused", False, STEPS, MORE)


def test_deepspeed_fused_adam(tmp_path):
    """DeepSpeed's own FusedAdam (its step count kept as an int in the state, DeepSpeed's group keys
    bias_correction ...): stage 2 at 2 ranks, loaded at 1 rank into stages 2 and 3, parity as above.
    Opt-in: DeepSpeed JIT-compiles the op on first use (the first run took 73 s on the 2-core machine)."""
    if os.environ.get("ZEROPLUS_TEST_DEEPSPEED_OPS") != "1":
        pytest.skip("DeepSpeed's FusedAdam is JIT-compiled on first use (DS_BUILD_OPS=0; the first run, compile "
                    "included, took 73 s on the loaded 2-core machine): set ZEROPLUS_TEST_DEEPSPEED_OPS=1 to run it")
    root = str(tmp_path)
    # ranks of their own: DeepSpeed caches process groups in module globals, which the harness's
    # clean-up after the first launch's case destroyed
    info = {"s2_fused": run_pooled(_ds_fused, 2, root, backend="gloo", timeout=900, env={"DS_FUSED": "1"})[0]}
    path = os.path.join(root, "s2_fused")
    refs = {"s2_fused": {tag: {k: v.float().clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(
        path, tag=f"global_step{tag}").items()} for tag in (STEPS, STEPS + MORE)}}
    from zeroplus.checkpoint.deepspeed_convert import convert_from_deepspeed

    native = str(tmp_path / "native")
    convert_from_deepspeed(path, native)  # FusedAdam's int step count becomes torch's 0-dim tensor
    got = _run_zeroplus(1, {f"{p}s2_fused->w1s{stage}": (src, stage, None, False, False,
                                                          str(tmp_path / f"{p}w1s{stage}"))
                            for stage in (2, 3) for p, src in (("", path), ("native_", native))})
    for key, value in got.items():
        diff, moved = _check(key, value, "s2_fused", info, refs, None, False)  # native_ too: same values
        print(f"{key}: {diff:.2e} (moved {moved:.2e})")


# -- errors --------------------------------------------------------------------------------------------


class _RunsCode:
    """Pickles as a call of os.system: what a malicious checkpoint carries."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _poison(src_tag: str, dst: str, marker: str, where: str) -> str:
    """A copy of DeepSpeed tag directory src_tag with a code-running object in one of its files."""
    shutil.copytree(src_tag, dst)
    name = ("zero_pp_rank_1_mp_rank_00_optim_states.pt" if where == "optim" else "mp_rank_00_model_states.pt")
    sd = torch.load(os.path.join(src_tag, name), weights_only=False)
    sd["payload"] = _RunsCode(marker)
    os.unlink(os.path.join(dst, name))
    torch.save(sd, os.path.join(dst, name))
    return dst


def test_unsafe_pickles_and_mismatches_are_refused(ds_runs, tmp_path):
    from zeroplus.checkpoint import deepspeed_layout
    from zeroplus.checkpoint.deepspeed_pickle import UnsafeCheckpointError

    root, _info, _refs = ds_runs
    tag = os.path.join(root, "s2_fp32", f"global_step{STEPS}")
    marker = str(tmp_path / "payload_ran")
    poisoned = {where: _poison(tag, str(tmp_path / f"poisoned_{where}"), marker, where) for where in ("optim", "model")}
    for where, path in poisoned.items():
        with pytest.raises(UnsafeCheckpointError, match=r"posix\.system") as e:
            deepspeed_layout.DeepSpeedLayout(path).close()
        assert "nothing in it was run" in str(e.value)
        assert not os.path.exists(marker), f"the {where} payload ran"
    cli = subprocess.run([sys.executable, "-m", "zeroplus.checkpoint", "convert", "--from", "deepspeed",
                          poisoned["optim"], str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "posix.system" in cli.stderr, cli.stderr
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(marker)

    cases = {"poisoned": functools.partial(refused_load, poisoned["optim"], marker),
             "mismatch": functools.partial(mismatch, os.path.join(root, "s2_fp32"))}
    results = run_pooled(run_cases_in_own_groups, 1, cases, timeout=300)[0]
    for key, (status, value) in results.items():
        assert status == "ok", f"{key}:\n{value}"
    refused = results["poisoned"][1]
    assert refused["error"] and "posix.system" in refused["error"], refused
    assert refused["untouched"] and refused["no_state"] and not refused["ran"], refused
    named = results["mismatch"][1]
    assert named["shapes"] and "size mismatch for lin2.weight" in named["shapes"], named
    assert "size mismatch for lin2.bias" in named["shapes"] and 'Missing key(s) in state_dict: "extra.weight"' in \
        named["shapes"], named
    assert named["shapes_untouched"], named
    assert named["optimizer"] and "['exp_avg', 'exp_avg_sq']" in named["optimizer"] and "momentum_buffer" in \
        named["optimizer"], named
    # the control: the payload is real (a plain torch.load runs it)
    torch.load(os.path.join(poisoned["model"], "mp_rank_00_model_states.pt"), weights_only=False)
    assert os.path.exists(marker)


def _as_fp16(src_tag: str, dst: str) -> str:
    """DeepSpeed's fp16 layout, written by hand (DeepSpeed refuses fp16 on this CPU machine): a copy
    of a stage-2 fp32 checkpoint whose optim files carry DeepSpeed's own DynamicLossScaler (in the
    state a run 40 steps after an overflow has) and whose config says fp16; ZeRO keeps the same fp32
    partitions and optimizer state at every precision."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    shutil.copytree(src_tag, dst)
    for name in os.listdir(src_tag):
        sd = torch.load(os.path.join(src_tag, name), weights_only=False)
        if "optim_states" in name:
            scaler = DynamicLossScaler(init_scale=2.0 ** 12, scale_window=100, min_scale=1.0, delayed_shift=2,
                                       consecutive_hysteresis=False)
            scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis = 57, 17, 1
            sd["optimizer_state_dict"]["loss_scaler"] = scaler
            sd["optimizer_state_dict"]["dynamic_loss_scale"] = True
        sd["ds_config"] = {**sd["ds_config"], "fp16": {"enabled": True}}
        os.unlink(os.path.join(dst, name))
        torch.save(sd, os.path.join(dst, name))
    return dst


def test_fp16_loss_scaler_travels(ds_runs, tmp_path):
    root, _info, _refs = ds_runs
    path = _as_fp16(os.path.join(root, "s2_fp32", f"global_step{STEPS}"), str(tmp_path / "fp16"))
    cases = {"fp16": functools.partial(scaler_after_load, path, "fp16"),
             "fp32": functools.partial(scaler_after_load, path, None)}
    results = run_pooled(run_cases_in_own_groups, 1, cases, timeout=300)[0]
    for key, (status, value) in results.items():
        assert status == "ok", f"{key}:\n{value}"
    fp16 = results["fp16"][1]
    assert (fp16["scale"], fp16["iteration"], fp16["last_overflow_iteration"], fp16["hysteresis_left"]) == \
        (4096.0, 57, 17, 1), fp16
    assert results["fp32"][1] == {"scale": 1.0}, results["fp32"][1]  # another precision: the run keeps its own
