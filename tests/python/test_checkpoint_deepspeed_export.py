"""convert --to deepspeed (deepspeed_export.py) against the real DeepSpeed (0.19.8, CPU, gloo).

One 2-rank zeroplus launch trains DsNet (two param groups and a frozen parameter) at stages 2 and 3
in fp32 and stage 3 in bf16, with tied weights at stage 2, and at stage 1 (stage 3 with every
parameter sharded, asserted) with DeepSpeed's WarmupLR for 3 steps,
saves a zeroplus checkpoint (extra: the scheduler state, global_steps, a client value), and trains
3 more steps (zeroplus continuing: the reference); it also saves an SGD checkpoint (refused).
The parent converts each to DeepSpeed's layout (the Python API, the command line for fp32
stage 3) at the saved stage and world size (the defaults), and checks DeepSpeed's own
zero_to_fp32 reads the files to zeroplus's masters exactly. One 2-rank DeepSpeed launch then
loads them with engine.load_checkpoint into a fresh engine (another seed), saves at once (tag
"reloaded") and trains the same 3 steps. Checked:
  * DeepSpeed's continuation matches zeroplus's within 1e-5 in fp32 (bf16: 2 % of how far it
    moved), and zeroplus's moved far more; at fp32 stages 2 and 3 it also matches DeepSpeed
    resuming from its own save of what it loaded (another engine); the frozen parameter is
    untouched, tied names one tensor;
    the lr, scheduler state, global_steps and client value reached DeepSpeed;
  * the fp32 stage 2 and 3 checkpoints converted for 3 DeepSpeed ranks (uneven partitions: the
    last rank's padded, its group_paddings checked) resume in a 3-rank DeepSpeed launch the same way;
  * zeroplus -> DeepSpeed -> zeroplus: DeepSpeed's "reloaded" save, converted back
    (convert --from deepspeed), holds zeroplus's masters, exp_avg, exp_avg_sq and step counts bit
    for bit, the same hyperparameters and the scheduler state;
  * the same round trip without DeepSpeed's engine, across stages 1-3 and world sizes 1-3;
  * streaming: each optim file is written from at most its own rank's partition (elements read
    between two files, counted).
Errors (no DeepSpeed run needed): bad world_size / stage / src / out refused naming the argument,
an existing OUT left alone, the SGD checkpoint refused naming the optimizer, and (manifests edited)
fp16, one group's parameters at different step counts, an extra key of DeepSpeed's own; a failure
while the files are being written (injected after two files, and a corrupt shard through the
command line's main, exit status 2) leaves no OUT.
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

os.environ.setdefault("DS_ACCELERATOR", "cpu")
try:
    import deepspeed  # noqa: F401
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
except ImportError as e:  # decided before anything runs
    pytest.skip(f"deepspeed==0.19.8 is not installed in this venv ({e}); scripts/setup.sh installs it",
                allow_module_level=True)

import deepspeed_runs as dr
from deepspeed_resume import MORE, PARAMS, STEPS, train_save_continue
from harness import run_cases_in_own_groups, run_pooled

CASES = {"s2": (2, None, True), "s3": (3, None, True),  # name -> (stage, precision, DsNet variant: True = two
         "s3_bf16": (3, "bf16", True), "s2_tied": (2, None, "tied"),  # param groups + a frozen parameter)
         "s1": (1, None, True)}
FP32_TOL = 1e-5


def _values(path) -> tuple[dict, dict]:
    """Every value of a zeroplus checkpoint: (name, key) -> flat tensor, and the manifest."""
    from zeroplus.checkpoint.reader import CheckpointReader

    out = {}
    with CheckpointReader(path) as reader:
        m = reader.manifest
        for name, t in m["tensors"].items():
            numel = int(torch.Size(t["shape"]).numel())
            for key in ["param" if t["kind"] == "param" else "value"] + sorted(t.get("state", {})):
                out[(name, key)] = reader.read_many([(name, key, 0, numel)])[0]
    return out, m


def _assert_same_state(a_path, b_path, what: str) -> None:
    a, ma = _values(a_path)
    b, mb = _values(b_path)
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
    trainable = [n for n, t in ma["tensors"].items() if t["kind"] == "param" and t["trainable"]]
    assert trainable and all(ma["tensors"][n]["state"] for n in trainable), what  # the state really was there
    for n in trainable:
        assert ma["tensors"][n]["scalars"] == mb["tensors"][n]["scalars"], f"{what}: {n} step count"
    groups = [{k: v for k, v in g.items() if k != "params"} for g in ma["param_groups"]]
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in mb["param_groups"]], what


@pytest.fixture(scope="module")
def zp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zp")
    cases = {name: functools.partial(train_save_continue, str(root / f"zp_{name}"), stage, grouped, torch.optim.AdamW,
                                     precision) for name, (stage, precision, grouped) in CASES.items()}
    cases["sgd"] = functools.partial(train_save_continue, str(root / "zp_sgd"), 2, False, torch.optim.SGD, None)
    t0 = time.monotonic()
    results = run_pooled(run_cases_in_own_groups, 2, cases, timeout=600)
    print(f"\nzeroplus: {len(cases)} runs on 2 ranks: {time.monotonic() - t0:.1f} s")
    for rank in range(2):
        for key, (status, value) in results[rank].items():
            assert status == "ok", f"{key}, rank {rank}:\n{value}"
    return root, {k: v[1] for k, v in results[0].items()}


AGAIN = ("s2", "s3")  # DeepSpeed also resumes from its own save of what it loaded


def _ds_load_all(rank, world, root):
    out = {name: dr.load_continue(rank, world, os.path.join(root, f"ds_{name}"), os.path.join(root, f"ds_back_{name}"),
                                  stage, precision, grouped, STEPS, MORE)
           for name, (stage, precision, grouped) in CASES.items()}
    for name in AGAIN:
        stage, precision, grouped = CASES[name]
        out[f"{name}_again"] = dr.load_continue(rank, world, os.path.join(root, f"ds_back_{name}"),
                                                os.path.join(root, f"ds_again_{name}"), stage, precision, grouped,
                                                STEPS, MORE, tag="reloaded")
    return out


def _ds_load_w3(rank, world, root):
    return {name: dr.load_continue(rank, world, os.path.join(root, f"ds3_{name}"), os.path.join(root, f"ds3_back_{name}"),
                                   CASES[name][0], None, True, STEPS, MORE) for name in AGAIN}


def test_deepspeed_resumes_an_exported_checkpoint(zp_runs):
    from zeroplus.checkpoint import deepspeed_export
    from zeroplus.checkpoint.consolidate import iter_tensors
    from zeroplus.checkpoint.deepspeed_convert import convert_from_deepspeed
    from zeroplus.checkpoint.reader import CheckpointReader

    root, zp = zp_runs
    # streaming: elements read from the zeroplus shards between two written files
    read, per_file = [0], {}
    real_read, real_save = deepspeed_export.CheckpointReader.read_many, deepspeed_export.save

    def counting_read(self, requests):
        read[0] += sum(hi - lo for _n, _k, lo, hi in requests)
        return real_read(self, requests)

    def counting_save(obj, fd):
        per_file[len(per_file)] = (obj, read[0])
        read[0] = 0
        return real_save(obj, fd)

    deepspeed_export.CheckpointReader.read_many, deepspeed_export.save = counting_read, counting_save
    try:
        res = deepspeed_export.convert_to_deepspeed(root / "zp_s2", root / "ds_s2")
    finally:
        deepspeed_export.CheckpointReader.read_many, deepspeed_export.save = real_read, real_save
    assert (res["stage"], res["world_size"], res["tag"]) == (2, 2, f"global_step{STEPS}"), res
    for obj, elements in per_file.values():
        osd = obj.get("optimizer_state_dict")
        if osd is not None:  # masters + exp_avg + exp_avg_sq of this rank's partition, nothing more
            partition = sum(t.numel() for t in osd["base_optimizer_state"]["state"][0].values() if t.dim()) // 2
            partition += sum(t.numel() for t in osd["base_optimizer_state"]["state"][1].values() if t.dim()) // 2
            assert 0 < elements <= 3 * partition, f"an optim file read {elements} elements, its partition {partition}"
    cli = subprocess.run([sys.executable, "-m", "zeroplus.checkpoint", "convert", "--to", "deepspeed",
                          str(root / "zp_s3"), str(root / "ds_s3")], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "stage 3" in cli.stdout, cli.stderr
    for name in ("s3_bf16", "s2_tied", "s1"):
        deepspeed_export.convert_to_deepspeed(root / f"zp_{name}", root / f"ds_{name}")
    assert any(f.startswith("bf16_zero_pp_rank_") for f in os.listdir(root / "ds_s3_bf16" / f"global_step{STEPS}"))
    for name, (stage, _precision, _grouped) in CASES.items():  # DeepSpeed's own consolidation reads the masters
        with CheckpointReader(root / f"zp_{name}") as reader:
            masters = {k: v.float() for k, v in iter_tensors(reader)}
        ds = get_fp32_state_dict_from_zero_checkpoint(str(root / f"ds_{name}"))
        assert set(ds) >= set(PARAMS), (name, sorted(ds))
        # (DeepSpeed records frozen parameters from stage 2 on: its zero_to_fp32 has none at stage 1)
        for k in PARAMS + [k for k in ("gate", "lin_back.weight") if k in masters and (stage > 1 or k != "gate")]:
            assert torch.equal(ds[k].float(), masters[k]), f"{name}: zero_to_fp32 {k}"

    t0 = time.monotonic()
    got = run_pooled(_ds_load_all, 2, str(root), backend="gloo", timeout=600)[0]
    print(f"DeepSpeed: {len(got)} loads + {MORE} steps on 2 ranks (gloo): {time.monotonic() - t0:.1f} s")
    for name, (stage, precision, grouped) in CASES.items():
        info, mine = got[name], zp[name]
        assert info["path"] and info["global_steps"] == STEPS and info["client_state"] == {"run": "zeroplus"}, info
        assert info["scheduler"] == {"last_batch_iteration": STEPS - 1}, info
        ref = get_fp32_state_dict_from_zero_checkpoint(str(root / f"ds_back_{name}"), tag=f"global_step{STEPS + MORE}")
        with CheckpointReader(root / f"zp_{name}") as reader:
            start = {k: v.float() for k, v in iter_tensors(reader)}
        moved = max((mine["trained"][k] - start[k]).abs().max().item() for k in PARAMS)
        diff = max((ref[k].float() - mine["trained"][k]).abs().max().item() for k in PARAMS)
        tol = FP32_TOL if precision is None else 0.02 * moved  # bf16: forward and gradients rounded to 8 bits
        assert moved > 100 * FP32_TOL, f"{name}: zeroplus's continuation moved only {moved}"
        assert diff <= tol, f"{name}: DeepSpeed's continuation is {diff} from zeroplus's (tolerance {tol}, " \
                            f"moved {moved})"
        if grouped is True and precision is None and stage > 1:  # the frozen parameter, untouched
            assert torch.equal(ref["gate"], dr.make(0, True).gate.detach()), name
        if grouped == "tied":
            assert torch.equal(ref["lin_back.weight"], ref["lin2.weight"]), name
        # zeroplus -> DeepSpeed -> zeroplus, through DeepSpeed's engine: bit for bit
        back = root / f"zp_back_{name}"
        convert_from_deepspeed(root / f"ds_back_{name}" / "reloaded", back)
        _assert_same_state(root / f"zp_{name}", back, f"{name} round trip")
        _, m = _values(back)
        assert m["extra"]["lr_scheduler"] == {"last_batch_iteration": STEPS - 1}, m["extra"]
        assert m["extra"]["global_steps"] == STEPS, m["extra"]  # (client_state: only what save_checkpoint is given)
        print(f"{name}: |DeepSpeed - zeroplus| after {MORE} steps {diff:.2e} (moved {moved:.2e})")
        if name in AGAIN:  # DeepSpeed from the converted files continues as DeepSpeed from its own save
            own = get_fp32_state_dict_from_zero_checkpoint(str(root / f"ds_again_{name}"),
                                                           tag=f"global_step{STEPS + MORE}")
            again = max((own[k] - ref[k]).abs().max().item() for k in PARAMS)
            assert again <= FP32_TOL, f"{name}: DeepSpeed from its own save is {again} from DeepSpeed from ours"
            print(f"{name}: |DeepSpeed from its own save - DeepSpeed from the converted files| {again:.2e}")

    # at another world size than zeroplus saved at: 3 DeepSpeed ranks (uneven partitions, padded)
    for name in AGAIN:
        deepspeed_export.convert_to_deepspeed(root / f"zp_{name}", root / f"ds3_{name}", world_size=3)
    t0 = time.monotonic()
    got3 = run_pooled(_ds_load_w3, 3, str(root), backend="gloo", timeout=600)[0]
    print(f"DeepSpeed: {len(got3)} loads + {MORE} steps on 3 ranks (gloo): {time.monotonic() - t0:.1f} s")
    for name in AGAIN:
        assert got3[name]["global_steps"] == STEPS, got3[name]
        tag = root / f"ds3_{name}" / f"global_step{STEPS}"
        if CASES[name][0] < 3:  # the flat group of 56 elements is padded to 60: the last rank's 20 hold 16
            osd = torch.load(tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt", weights_only=False)
            assert osd["optimizer_state_dict"]["group_paddings"][0] == 4, osd["optimizer_state_dict"]["group_paddings"]
        ref = get_fp32_state_dict_from_zero_checkpoint(str(root / f"ds3_back_{name}"), tag=f"global_step{STEPS + MORE}")
        diff = max((ref[k].float() - zp[name]["trained"][k]).abs().max().item() for k in PARAMS)
        assert diff <= FP32_TOL, f"{name} at 3 DeepSpeed ranks: {diff} from zeroplus's continuation at 2"
        back = root / f"zp3_back_{name}"
        convert_from_deepspeed(root / f"ds3_back_{name}" / "reloaded", back)
        _assert_same_state(root / f"zp_{name}", back, f"{name} round trip through 3 DeepSpeed ranks")
        print(f"{name} at 3 DeepSpeed ranks: |DeepSpeed - zeroplus| after {MORE} steps {diff:.2e}")


def test_round_trip_across_stages_and_world_sizes(zp_runs, tmp_path):
    """No DeepSpeed engine: zeroplus -> DeepSpeed layout at stages 1-3, 1-3 ranks -> zeroplus, bit for bit."""
    from zeroplus.checkpoint.deepspeed_convert import convert_from_deepspeed
    from zeroplus.checkpoint.deepspeed_export import convert_to_deepspeed

    root, _zp = zp_runs
    for name in CASES:
        for stage in (1, 2, 3):
            for world in (1, 3):
                ds, back = tmp_path / f"ds_{name}_{stage}_{world}", tmp_path / f"zp_{name}_{stage}_{world}"
                res = convert_to_deepspeed(root / f"zp_{name}", ds, world_size=world, stage=stage)
                n_optim = sum("optim_states" in f for f in os.listdir(ds / res["tag"]))
                assert n_optim == world, (name, stage, world, os.listdir(ds / res["tag"]))
                convert_from_deepspeed(ds, back)
                _assert_same_state(root / f"zp_{name}", back, f"zeroplus {name} via DeepSpeed stage {stage} x {world}")
                extra = _values(back)[1]["extra"]
                assert extra["client_state"] == {"run": "zeroplus"} and extra["global_steps"] == STEPS, extra
                assert extra["lr_scheduler"] == {"last_batch_iteration": STEPS - 1}, extra


def _edited(src, dst, edit):
    """A copy of zeroplus checkpoint `src` whose manifest `edit` changed (re-sealed with its checksum)."""
    import json

    from zeroplus.checkpoint.format import encode_manifest

    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_bytes())
    edit(m)
    os.chmod(dst / "manifest.json", 0o600)
    (dst / "manifest.json").write_bytes(encode_manifest(m))
    return dst


def test_bad_arguments_and_failures_leave_no_output(zp_runs, tmp_path, capsys):
    from zeroplus.checkpoint import deepspeed_export
    from zeroplus.checkpoint.deepspeed_export import convert_to_deepspeed

    root, _zp = zp_runs
    src, out = root / "zp_s2", tmp_path / "out"
    for kwargs, error, match in (({"world_size": 0}, ValueError, "world_size"),
                                 ({"world_size": "2"}, TypeError, "world_size"),
                                 ({"world_size": True}, TypeError, "world_size"),
                                 ({"stage": 4}, ValueError, "stage"), ({"stage": 2.0}, TypeError, "stage")):
        with pytest.raises(error, match=match):
            convert_to_deepspeed(src, out, **kwargs)
        assert not out.exists(), kwargs
    with pytest.raises(TypeError, match="out"):
        convert_to_deepspeed(src, 3)
    with pytest.raises(TypeError, match="src"):
        convert_to_deepspeed(None, out)
    with pytest.raises(ValueError, match="SGD"):
        convert_to_deepspeed(root / "zp_sgd", out)
    assert not out.exists()

    def fp16(m):
        m["source"]["mixed_precision"] = "fp16"

    def steps_differ(m):
        m["tensors"]["lin2.bias"]["scalars"]["step"]["data"] = [2.0]

    def clash(m):
        m["extra"]["module"] = 1

    for edit, match in ((fp16, "fp16"), (steps_differ, "different optimizer step counts"),
                        (clash, r"extra keys \['module'\]")):
        with pytest.raises(ValueError, match=match):
            convert_to_deepspeed(_edited(src, tmp_path / edit.__name__, edit), out)
        assert not out.exists(), edit.__name__
    out.mkdir()
    (out / "mine").write_text("keep")
    with pytest.raises(FileExistsError):
        convert_to_deepspeed(src, out)
    assert os.listdir(out) == ["mine"]
    out = tmp_path / "out2"

    written = []
    real_save = deepspeed_export.save

    def failing_save(obj, fd):  # the third file fails, after two were written and synced
        if len(written) == 2:
            raise OSError(28, "No space left on device (injected)")
        real_save(obj, fd)
        written.append(os.listdir(out / f"global_step{STEPS}"))

    deepspeed_export.save = failing_save
    try:
        with pytest.raises(OSError, match="injected"):
            convert_to_deepspeed(root / "zp_s3", out)
    finally:
        deepspeed_export.save = real_save
    assert len(written) == 2 and len(written[1]) == 2, written  # two files existed when it failed
    assert not out.exists(), "a failed convert left its OUT behind"

    # a corrupt zeroplus shard, through the command line: exit status 2, the file named, no OUT
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    shard = bad / "rank00001.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    os.chmod(shard, 0o600)
    shard.write_bytes(bytes(data))
    from zeroplus.checkpoint.__main__ import main  # in this process: each `python -m` start costs seconds here

    assert main(["convert", "--to", "deepspeed", str(bad), str(tmp_path / "out3")]) == 2
    assert "rank00001.bin" in capsys.readouterr().err
    assert not (tmp_path / "out3").exists()
    for argv, word in ((["--to", "deepspeed", str(src), str(tmp_path / "o4"), "--stage", "0"], "--stage"),
                       (["--to", "deepspeed", str(src), str(tmp_path / "o4"), "--world-size", "0"], "--world-size"),
                       (["--from", "deepspeed", str(src), str(tmp_path / "o4"), "--stage", "2"], "--stage")):
        with pytest.raises(SystemExit) as e:  # argparse's usage error
            main(["convert", *argv])
        assert e.value.code == 2 and word in capsys.readouterr().err, argv
        assert not (tmp_path / "o4").exists()
