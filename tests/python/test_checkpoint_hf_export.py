"""Export of a checkpoint as an HF folder of sharded safetensors (zeroplus.checkpoint.export_hf,
`consolidate --output-dir`), read back by transformers' from_pretrained and by safetensors.

* a tiny GPT-2 (tied lm_head, one frozen parameter) trained one step and saved: exported in
  several files under a small max_shard_size, the folder (files 0644, folder 0755 under umask
  077) loads with GPT2LMHeadModel.from_pretrained equal to the trained model; the tied weight is
  written once; bf16 output is one model.safetensors without index; trainable_only writes the
  trainable parameters only; load_fp32_state_dict gives the same tensors;
* refusals that change nothing: an existing output_dir, bad dtype / size / mode, OUT and
  --output-dir together; a failure in the second file leaves no folder and no temporary;
* memory: exporting 96 MiB of parameters in 16 MB files grows the exporting process's peak
  resident set by far less than a shard plus the whole model (one tensor at a time).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _gpt2(tmp_path):
    import zeroplus

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.wpe.weight.requires_grad_(False)  # frozen: left out by trainable_only
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=2, lr=1e-2)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    path = str(tmp_path / "ck")
    zeroplus.save_checkpoint(path, model, opt)
    return model, config, path


@pytest.fixture(scope="module")
def gpt2(one_rank_group, tmp_path_factory):
    import zeroplus

    model, config, path = _gpt2(tmp_path_factory.mktemp("hf"))
    full = {k: v.float() for k, v in zeroplus.full_state_dict(model, rank0_only=False).items()}
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return config, path, full, trainable


def test_sharded_folder_loads_with_from_pretrained(gpt2, tmp_path):
    from zeroplus.checkpoint import export_hf

    config, path, full, _ = gpt2
    out = tmp_path / "hf"
    old = os.umask(0o077)
    try:
        res = export_hf(path, out, max_shard_size=20_000)
    finally:
        os.umask(old)
    n = len(res["files"]) - 1
    assert n >= 3, res
    assert res["files"] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)] + [
        "model.safetensors.index.json"]
    assert sorted(os.listdir(out)) == sorted(res["files"])
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755
    for f in res["files"]:
        assert stat.S_IMODE(os.stat(out / f).st_mode) == 0o644, f
    index = json.loads((out / "model.safetensors.index.json").read_text())
    # The tied lm_head is written once, under the embedding's name.
    assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
    assert set(index["weight_map"]) == set(full) - {"lm_head.weight"}
    seen = {}
    for f in res["files"][:-1]:
        part = safetensors_torch.load_file(out / f)
        tensors = len(part)
        assert os.path.getsize(out / f) <= 20_000 + 4096 or tensors == 1, f  # the header, or one large tensor
        for k, v in part.items():
            assert index["weight_map"][k] == f
            seen[k] = v
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in seen.values())
    config.save_pretrained(out)  # the user adds the config (and tokenizer) files
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).state_dict()
    for k, v in full.items():
        assert torch.equal(loaded[k], v), k
    assert torch.equal(loaded["lm_head.weight"], loaded["transformer.wte.weight"])


def test_dtype_trainable_only_and_fp32_state_dict(gpt2, tmp_path):
    from zeroplus.checkpoint import export_hf, load_fp32_state_dict

    _config, path, full, trainable = gpt2
    res = export_hf(path, tmp_path / "bf16", dtype="bf16")
    assert res["files"] == ["model.safetensors"]  # one file: no index, as save_pretrained
    part = safetensors_torch.load_file(tmp_path / "bf16" / "model.safetensors")
    assert {v.dtype for v in part.values()} == {torch.bfloat16}
    for k, v in part.items():
        assert torch.equal(v, full[k].bfloat16()), k
    res = export_hf(path, tmp_path / "adapters", trainable_only=True)
    part = safetensors_torch.load_file(tmp_path / "adapters" / "model.safetensors")
    assert sorted(part) == [n for n in trainable if n != "lm_head.weight"]
    assert "transformer.wpe.weight" not in part
    state = load_fp32_state_dict(path)
    assert set(state) >= set(full)
    for k, v in full.items():
        assert torch.equal(state[k], v), k


def test_refusals_change_nothing(gpt2, tmp_path, monkeypatch):
    from zeroplus.checkpoint import consolidate, export_hf, hf_export

    _config, path, _full, _ = gpt2
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="output_dir exists"):
        export_hf(path, existing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileExistsError):
        export_hf(path, empty)  # not even an empty folder is replaced
    assert os.listdir(empty) == [] and (existing / "mine.txt").read_text() == "keep"
    with pytest.raises(ValueError, match="dtype"):
        export_hf(path, tmp_path / "a", dtype="int8")
    with pytest.raises(ValueError, match="max_shard_size"):
        export_hf(path, tmp_path / "a", max_shard_size="5XB")
    with pytest.raises(ValueError, match="max_shard_size"):
        export_hf(path, tmp_path / "a", max_shard_size=0)
    with pytest.raises(ValueError, match="mode"):
        export_hf(path, tmp_path / "a", mode=0o4755)
    with pytest.raises(ValueError, match="not both"):
        consolidate(path, str(tmp_path / "x.pt"), output_dir=tmp_path / "a")
    with pytest.raises(TypeError, match="output_dir= only"):
        consolidate(path, str(tmp_path / "x.pt"), max_shard_size="1GB")
    assert not (tmp_path / "a").exists() and not (tmp_path / "x.pt").exists()

    real, calls = hf_export._write_shard, []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (injected)")
        return real(*args, **kwargs)
    monkeypatch.setattr(hf_export, "_write_shard", fail_second)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(OSError, match="injected"):
        export_hf(path, tmp_path / "partial", max_shard_size=20_000)
    assert sorted(os.listdir(tmp_path)) == before  # no folder, no temporary


def test_cli_output_dir(gpt2, tmp_path):
    _config, path, _full, _ = gpt2

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "zeroplus.checkpoint", *map(str, args)], capture_output=True,
                              text=True, timeout=120)
    r = cli("consolidate", path, "--output-dir", tmp_path / "hf", "--max-shard-size", "20KB", "--dtype", "fp16")
    assert r.returncode == 0, r.stderr
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "hf") and "fp16" in r.stdout
    r = cli("consolidate", path, tmp_path / "x.pt", "--output-dir", tmp_path / "hf2")
    assert r.returncode == 2 and "exactly one" in r.stderr
    r = cli("consolidate", path, "--output-dir", tmp_path / "hf")
    assert r.returncode == 2 and "exists" in r.stderr
    r = cli("consolidate", path, "--output-dir", tmp_path / "hf3", "--mode", "rw")
    assert r.returncode == 2 and "--mode" in r.stderr


_PEAK_CHILD = r"""
import os, sys, torch
from zeroplus.checkpoint import export_hf
from zeroplus.checkpoint.consolidate import read_tensor
from zeroplus.checkpoint.reader import CheckpointReader

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
with CheckpointReader(sys.argv[1]) as r:  # warm up: imports, the reader's first allocations
    read_tensor(r, next(iter(r.manifest["tensors"])), torch.float32)
open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current size
base = rss("VmRSS:")
export_hf(sys.argv[1], sys.argv[2], max_shard_size=int(sys.argv[3]))
print("GROWTH", rss("VmHWM:") - base)
"""


def test_export_memory_is_one_tensor_not_a_shard_or_the_model(one_rank_group, tmp_path):
    import zeroplus

    width, depth = 1024, 24  # 24 x 4 MiB fp32 = 96 MiB
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])
    model, opt = zeroplus.initialize(model, torch.optim.SGD, stage=2, lr=0.1)
    zeroplus.save_checkpoint(str(tmp_path / "ck"), model, opt)
    del model, opt
    tensor_bytes, shard_bytes, total = width * width * 4, 16 * 2**20, depth * width * width * 4
    r = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(tmp_path / "ck"), str(tmp_path / "hf"),
                        str(shard_bytes)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    growth = int(r.stdout.split("GROWTH")[1])
    files = [f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]
    assert len(files) == 6 and sum(os.path.getsize(tmp_path / "hf" / f) for f in files) > total
    # The bound is one output shard plus the largest tensor; one tensor at a time stays
    # well below it (the slack is the reader's block buffers and the allocator).
    print(f"peak growth {growth / 2**20:.1f} MiB for {total / 2**20:.0f} MiB in 16 MB files")
    assert growth <= shard_bytes + tensor_bytes, growth
