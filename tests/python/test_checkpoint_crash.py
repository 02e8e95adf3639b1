"""Crash consistency and the offline tools of zeroplus checkpoints.

* kill -9: a child saving in a loop (every value of step k is k, so a checkpoint verifies itself;
  three names in turn, so most saves replace a checkpoint) is SIGKILLed at random points, KILLS times; after each kill the checkpoint `latest` names is
  complete (every checksum), holds one step's values throughout, and never goes backwards, and
  the staging directories of killed saves do not pile up (the next save removes them); at
  the end load_checkpoint (2 ranks, stage 3 with sharded parameters: another world size and stage)
  loads it.
* consolidate (of a 2-rank stage-3 checkpoint, every parameter sharded):
  `python -m zeroplus.checkpoint consolidate` output loads with
  torch.load(weights_only=True) into a fresh plain model that gives the trained model's logits;
  the safetensors output holds the same tensors; `inspect` reports OK, and exit status 1 naming
  the file after a byte is flipped.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import time

import pytest
import torch

from checkpoint_helpers import save_forever, verify_latest
from checkpoint_models import PERSIST_SOME, batch, build, make, sharded_names, train
from harness import _context, run_pooled

KILLS = 20
WIDTH = 4096  # ~1 MB per checkpoint: saves take long enough for kills to land inside them


def _load_latest(rank, world, root):
    import zeroplus

    model, _call, opt = build("engine", 3, None, None, seed=5, width=WIDTH, persist=PERSIST_SOME)
    extra = zeroplus.load_checkpoint(root, model, opt)
    full = zeroplus.full_state_dict(model, rank0_only=False)
    return extra, all(torch.all(v == float(extra["step"])) for v in full.values()), sharded_names(model, opt)


def test_kill_minus_9_during_saves_leaves_latest_complete(tmp_path):
    t0 = time.monotonic()
    ctx = _context("forkserver")
    rng = random.Random(1234)
    root = str(tmp_path / "ckpts")
    verified, previous, mid_save, staged = 0, None, 0, set()
    child = 0
    while verified < KILLS:
        child += 1
        ready = ctx.Event()
        p = ctx.Process(target=save_forever, args=(root, child, str(tmp_path / f"store{child}"), WIDTH, ready),
                        daemon=True)
        p.start()
        assert ready.wait(60), f"child {child} did not start"
        time.sleep(rng.uniform(0.0, 0.3))  # a random point of the save loop
        p.kill()
        p.join()
        assert p.exitcode == -9, f"child {child} exited with {p.exitcode} before the kill"
        if not os.path.exists(os.path.join(root, "latest")):
            assert child < KILLS, "no save completed in 0.3 s, several times"
            continue  # killed before the first save completed
        got = verify_latest(root)
        assert previous is None or got >= previous, f"latest went backwards: {previous} -> {got}"
        previous = got
        verified += 1
        leftovers = {n for n in os.listdir(root) if n.startswith(".")}  # staging directories of cut saves
        mid_save += bool(leftovers - staged)
        staged = leftovers
        # A save removes the staging directories of killed saves: at most this child's and, when
        # it was killed before its first save started, the previous child's are left. (A killed
        # update of `latest` leaves a few-byte temporary file, removed once 10 minutes old.)
        dirs = sorted(n for n in leftovers if os.path.isdir(os.path.join(root, n)))
        assert len(dirs) <= 2, f"stale staging directories pile up: {dirs}"
        assert all(n.startswith(".latest.tmp-") for n in leftovers if n not in dirs), sorted(leftovers)
    extra_and_ok = run_pooled(_load_latest, 2, root, timeout=120)
    for extra, ok, sharded in extra_and_ok:
        assert extra["step"] == previous[1] and ok
        assert sharded == ["emb.weight", "lin1.bias", "lin1.weight", "lin2.weight"], sharded  # into shards
    print(f"\nkill -9: {verified} kills verified ({mid_save} left a partial save behind), "
          f"{time.monotonic() - t0:.1f} s")


def _train_and_save(rank, world, root):
    import zeroplus

    model, call, opt = build("engine", 3, None, None, seed=0, persist=0)  # every parameter sharded
    train(call, opt, 3, rank)
    zeroplus.save_checkpoint(os.path.join(root, "ck"), model, opt, extra={"step": 3})
    with torch.no_grad():
        logits = call(batch(99, 0))
    return logits, sharded_names(model, opt)


def _cli(*args, subprocess_=False):
    """The CLI's exit status and output: in this process (main(argv)), or once as a real
    `python -m zeroplus.checkpoint` (an interpreter start costs seconds on two cores)."""
    if subprocess_:
        return subprocess.run([sys.executable, "-m", "zeroplus.checkpoint", *args], capture_output=True, text=True,
                              timeout=120)
    import contextlib
    import io
    import types

    from zeroplus.checkpoint.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def _read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        assert v["dtype"] == "F32"
        out[k] = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32).reshape(v["shape"])
    return out


def test_consolidate_and_inspect(tmp_path):
    root = str(tmp_path)
    logits, sharded = run_pooled(_train_and_save, 2, root, timeout=120)[0]
    assert sharded == ["emb.weight", "frozen", "lin1.bias", "lin1.weight", "lin2.bias", "lin2.weight"], sharded
    path = os.path.join(root, "ck")
    out = str(tmp_path / "full.pt")
    r = _cli("consolidate", path, out)
    assert r.returncode == 0, r.stderr
    state = torch.load(out, weights_only=True)
    plain = make(7)
    plain.load_state_dict(state)  # strict: every key, tied ones included
    assert state["head.weight"].data_ptr() == state["emb.weight"].data_ptr()
    with torch.no_grad():
        assert torch.equal(plain(batch(99, 0)), logits)
    again = _cli("consolidate", path, out)
    assert again.returncode == 2 and "exists" in again.stderr

    st = str(tmp_path / "full.safetensors")
    r = _cli("consolidate", root, st, "--format", "safetensors")  # the root: follows latest
    assert r.returncode == 0, r.stderr
    tensors = _read_safetensors(st)
    assert tensors.keys() == state.keys() and all(torch.equal(tensors[k], state[k]) for k in state)

    r = _cli("inspect", path)
    assert r.returncode == 0 and "OK" in r.stdout and "stage 3, world size 2" in r.stdout, r.stdout + r.stderr
    f = os.path.join(path, "rank00001.bin")
    data = bytearray(open(f, "rb").read())
    data[7] ^= 1
    os.chmod(f, 0o600)
    open(f, "wb").write(data)
    r = _cli("inspect", path, subprocess_=True)
    assert r.returncode == 1 and "CORRUPT" in r.stdout and "rank00001.bin" in r.stdout
    r = _cli("consolidate", path, str(tmp_path / "bad.pt"))
    assert r.returncode == 2 and "rank00001.bin" in r.stderr and "checksum" in r.stderr
    assert not os.path.exists(tmp_path / "bad.pt")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".bad.pt")]
