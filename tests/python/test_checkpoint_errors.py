"""Checkpoints on bad input and failing disks: every error names the file or key, and leaves the
model, the optimizer and the previous checkpoint untouched.

One 2-rank launch (stage 2, fp32) runs every case in its own process group: a corrupted byte, a
truncated file, a missing shard, a manifest from a newer version, names escaping the directory
(in the manifest and in `latest`), a mismatched model (missing/unexpected keys, size mismatch),
a save over an existing checkpoint, a non-JSON extra, and RLIMIT_FSIZE (EFBIG, the same path as
ENOSPC) hit mid-save on every rank and on one rank only. Issue 40: one digit of a chunk offset
flipped in manifest.json (still valid JSON, in range) is refused by load_checkpoint, inspect and
consolidate; a save whose `latest` cannot be replaced leaves the checkpoint it would replace; an
fp16 loss scaler value that cannot be installed is refused naming the manifest, nothing changed.
"""

from __future__ import annotations

import functools
import json
import os
import time

import pytest
import torch
from torch import nn

from checkpoint_models import CkptNet, build, fsize_limited, full_params, make, train
from checkpoint_helpers import cases_of, ok_values, pooled_results
from harness import run_cases_in_own_groups


def _state(model, opt):
    """Everything a failed load must leave alone: full parameters, sharded optimizer state, lr."""
    sd = opt.state_dict()
    state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
             for i, st in sd["state"].items()}
    return full_params("engine", model), state, [g["lr"] for g in opt.param_groups]


def _same(a, b) -> bool:
    pa, sa, la = a
    pb, sb, lb = b
    return (la == lb and pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
            and sa.keys() == sb.keys()
            and all(torch.equal(sa[i][k], sb[i][k]) if isinstance(sa[i][k], torch.Tensor) else sa[i][k] == sb[i][k]
                    for i in sa for k in sa[i]))


def _saved(root, name, rank, group, steps=2, **options):
    """A trained model, saved to root/name; returns (model, opt, path)."""
    import zeroplus
    from zeroplus.checkpoint import CheckpointOptions

    model, call, opt = build("engine", 2, None, group, seed=0)
    train(call, opt, steps, rank)
    path = os.path.join(root, name)
    zeroplus.save_checkpoint(path, model, opt, extra={"step": steps}, options=CheckpointOptions(**options))
    return model, opt, path


def _load_fails(path, rank, group, model=None):
    """load_checkpoint into a fresh model; returns (error text, whether state was untouched)."""
    import zeroplus

    model = make(1) if model is None else model
    model, call, opt = build("engine", 2, None, group, seed=1, lr=1e-3, model=model)
    before = _state(model, opt)
    try:
        zeroplus.load_checkpoint(path, model, opt)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}", _same(before, _state(model, opt))
    return None, _same(before, _state(model, opt))


def _edit_manifest(path, rank, group, fn):
    """A crafted (not a corrupted) manifest: edited, then checksummed again as zeroplus writes it."""
    import torch.distributed as dist
    from zeroplus.checkpoint import format as fmt

    if rank == 0:
        with open(os.path.join(path, "manifest.json")) as f:
            m = json.load(f)
        fn(m)
        os.chmod(os.path.join(path, "manifest.json"), 0o600)
        with open(os.path.join(path, "manifest.json"), "wb") as f:
            f.write(getattr(fmt, "encode_manifest", fmt.dumps)(m))  # (format 1 had no checksum)
    dist.barrier(group=group)


def _on_rank0(rank, group, fn):
    import torch.distributed as dist

    if rank == 0:
        fn()
    dist.barrier(group=group)


def case_corrupt_byte(root, rank, group, block_bytes=4 << 20):
    _m, _o, path = _saved(root, f"corrupt{block_bytes}", rank, group, block_bytes=block_bytes)

    def flip():
        f = os.path.join(path, "rank00001.bin")
        data = bytearray(open(f, "rb").read())
        data[len(data) // 2] ^= 0x40
        os.chmod(f, 0o600)
        open(f, "wb").write(data)
    _on_rank0(rank, group, flip)
    return _load_fails(path, rank, group)


def case_truncated(root, rank, group):
    _m, _o, path = _saved(root, "truncated", rank, group)
    _on_rank0(rank, group, lambda: os.truncate(os.path.join(path, "rank00000.bin"),
                                               os.path.getsize(os.path.join(path, "rank00000.bin")) - 1))
    return _load_fails(path, rank, group)


def case_missing_file(root, rank, group):
    _m, _o, path = _saved(root, "missing", rank, group)
    _on_rank0(rank, group, lambda: os.unlink(os.path.join(path, "rank00001.bin")))
    return _load_fails(path, rank, group)


def case_no_manifest(root, rank, group):
    _m, _o, path = _saved(root, "nomanifest", rank, group)
    _on_rank0(rank, group, lambda: os.unlink(os.path.join(path, "manifest.json")))
    return _load_fails(path, rank, group)


def case_newer_version(root, rank, group):
    _m, _o, path = _saved(root, "newer", rank, group)
    _edit_manifest(path, rank, group, lambda m: m.update(version=99))
    return _load_fails(path, rank, group)


def case_escaping_file_name(root, rank, group):
    _m, _o, path = _saved(root, "escape", rank, group)
    _edit_manifest(path, rank, group, lambda m: m["files"][1].update(name="../escape2/rank00001.bin"))
    return _load_fails(path, rank, group)


def case_escaping_latest(root, rank, group):
    _m, _o, path = _saved(root, "latest_root/ck", rank, group)

    def point_outside():
        with open(os.path.join(root, "latest_root", "latest"), "w") as f:
            f.write("../escape\n")
    _on_rank0(rank, group, point_outside)
    return _load_fails(os.path.join(root, "latest_root"), rank, group)


def case_flipped_manifest_offset(root, rank, group):
    """One bit of one digit of a chunk offset flipped (a failing disk or RAM): the manifest is still
    valid JSON and every range in it still in bounds, so only its own checksum can tell."""
    import torch.distributed as dist
    from zeroplus.checkpoint.consolidate import consolidate, inspect

    _m, _o, path = _saved(root, "flipped", rank, group)
    readers = {}
    if rank == 0:
        mf = os.path.join(path, "manifest.json")
        data = bytearray(open(mf, "rb").read())
        m = json.loads(data)
        sizes = [f["bytes"] for f in m["files"]]
        es = {"float32": 4, "bfloat16": 2, "float16": 2}
        for name, key, lo, hi, dtype, fi, off in m["chunks"]:
            new = off ^ 1  # the last decimal digit's lowest bit: 4096 -> 4097
            if key == "param" and off > 0 and new + (hi - lo) * es[dtype] <= sizes[fi]:
                old = json.dumps([name, key, lo, hi, dtype, fi, off], separators=(",", ":")).encode()
                at = data.index(old) + len(old) - 2
                data[at] ^= 1
                break
        else:
            raise AssertionError("no chunk offset can be flipped in range")
        json.loads(data)  # still valid JSON
        os.chmod(mf, 0o600)
        open(mf, "wb").write(bytes(data))
        for what, fn in (("inspect", lambda: inspect(path)),
                         ("consolidate", lambda: consolidate(path, os.path.join(root, "flipped.pt")))):
            try:
                fn()
                readers[what] = None
            except Exception as e:  # noqa: BLE001 - the error is the result
                readers[what] = f"{type(e).__name__}: {e}"
        readers["output_written"] = os.path.exists(os.path.join(root, "flipped.pt"))
    dist.barrier(group=group)
    err, untouched = _load_fails(path, rank, group)
    return err, (untouched, readers)


def case_latest_not_replaceable(root, rank, group):
    """`latest` cannot be replaced (a directory is in its place): a save over NAME raises and NAME
    still holds the checkpoint it held (it was replaced and deleted before the fix)."""
    import zeroplus

    root = os.path.join(root, "latest_dir")
    model, opt, path = _saved(root, "ck", rank, group)
    saved = full_params("engine", model)

    def latest_becomes_a_directory():
        os.unlink(os.path.join(root, "latest"))
        os.makedirs(os.path.join(root, "latest", "mine"))
    _on_rank0(rank, group, latest_becomes_a_directory)
    train(model, opt, 2, rank, first_step=20)
    try:
        zeroplus.save_checkpoint(path, model, opt, extra={"step": 4})
        err = None
    except Exception as e:  # noqa: BLE001 - the error is the result
        err = f"{type(e).__name__}: {e}"
    model_b, _call, opt_b = build("engine", 2, None, group, seed=1)
    extra = zeroplus.load_checkpoint(path, model_b, opt_b)
    loaded = full_params("engine", model_b)
    kept = extra == {"step": 2} and all(torch.equal(saved[k], loaded[k]) for k in saved)
    return err, (kept, sorted(os.listdir(root)), sorted(os.listdir(os.path.join(root, "latest"))))


def case_fp16_loss_scale_not_a_number(root, rank, group):
    import zeroplus

    model, call, opt = build("engine", 2, "fp16", group, seed=0)
    train(call, opt, 2, rank)
    path = os.path.join(root, "fp16scale")
    zeroplus.save_checkpoint(path, model, opt)
    _edit_manifest(path, rank, group, lambda m: m["optimizer"]["loss_scaler"].update(scale="lots"))
    model_b, call_b, opt_b = build("engine", 2, "fp16", group, seed=1, lr=1e-3)
    train(call_b, opt_b, 1, rank)  # optimizer state a failed load must leave alone
    before = _state(model_b, opt_b), opt_b.scaler.state_dict()
    try:
        zeroplus.load_checkpoint(path, model_b, opt_b)
        err = None
    except Exception as e:  # noqa: BLE001 - the error is the result
        err = f"{type(e).__name__}: {e}"
    return err, _same(before[0], _state(model_b, opt_b)) and before[1] == opt_b.scaler.state_dict()


def case_ranks_read_different_checkpoints(root, rank, group):
    """As if `latest` moved between two ranks' reads: each rank is given another checkpoint."""
    _m, _o, path_a = _saved(root, "disagree_a", rank, group)
    _m, _o, path_b = _saved(root, "disagree_b", rank, group, steps=3)
    return _load_fails(path_a if rank == 0 else path_b, rank, group)


class Wider(CkptNet):
    def __init__(self):
        super().__init__(width=32)


class WithExtra(CkptNet):
    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(2, 2)


class Fewer(CkptNet):
    def __init__(self):
        super().__init__()
        del self.frozen

    def forward(self, x):
        return self.head(self.lin2(nn.functional.gelu(self.lin1(self.emb(x)))))


def case_size_mismatch(root, rank, group):
    _m, _o, path = _saved(root, "size", rank, group)
    torch.manual_seed(1)
    return _load_fails(path, rank, group, model=Wider())


def case_missing_keys(root, rank, group):
    _m, _o, path = _saved(root, "keys", rank, group)
    torch.manual_seed(1)
    return _load_fails(path, rank, group, model=WithExtra())


def case_unexpected_keys(root, rank, group):
    _m, _o, path = _saved(root, "unexpected", rank, group)
    torch.manual_seed(1)
    return _load_fails(path, rank, group, model=Fewer())


def case_exists(root, rank, group):
    """A save over a complete checkpoint replaces it (swapped in whole); a save over a directory
    that is not a checkpoint is refused and leaves its files alone."""
    import torch.distributed as dist

    import zeroplus

    model, opt, path = _saved(root, "exists", rank, group)
    train(model, opt, 2, rank, first_step=20)
    zeroplus.save_checkpoint(path, model, opt, extra={"step": 4})
    model_b, _call, opt_b = build("engine", 2, None, group, seed=1)
    extra = zeroplus.load_checkpoint(path, model_b, opt_b)
    a, b = full_params("engine", model), full_params("engine", model_b)
    replaced = extra == {"step": 4} and all(torch.equal(a[k], b[k]) for k in a)
    leftovers = sorted(n for n in os.listdir(root) if n.startswith(".exists"))

    foreign = os.path.join(root, "foreign")
    if rank == 0:
        os.makedirs(foreign)
        with open(os.path.join(foreign, "notes.txt"), "w") as f:
            f.write("mine")
    dist.barrier(group=group)
    try:
        zeroplus.save_checkpoint(foreign, model, opt)
        err = None
    except FileExistsError as e:
        err = f"FileExistsError: {e}"
    return err, (replaced, leftovers, sorted(os.listdir(foreign)), open(os.path.join(foreign, "notes.txt")).read())


def case_extra_not_json(root, rank, group):
    import zeroplus

    model, call, opt = build("engine", 2, None, group, seed=0)
    try:
        zeroplus.save_checkpoint(os.path.join(root, "badextra"), model, opt, extra={"step": 1, "when": object()})
    except TypeError as e:
        return f"TypeError: {e}", not os.path.exists(os.path.join(root, "badextra"))
    return None, False


def case_hyperparameter_no_reader_reads(root, rank, group):
    """A param-group value JSON writes but no reader accepts (an int beyond int64): the save
    raises naming it on every rank and publishes nothing (it used to write a checkpoint every
    load then refused as corrupt)."""
    import zeroplus

    model, call, opt = build("engine", 2, None, group, seed=0)
    opt.param_groups[0]["seed"] = 2**64 - 1
    path = os.path.join(root, "hugeint")
    try:
        zeroplus.save_checkpoint(path, model, opt)
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        return f"{type(e).__name__}: {e}", not os.path.exists(path)
    return None, os.path.exists(path)


def case_unsavable_state_on_one_rank(root, rank, group):
    """A failure after the collective start on one rank only (state that cannot be stored):
    both ranks raise at once (rank 0 does not wait for the missing shard), nothing is left."""
    import zeroplus

    root = os.path.join(root, "unsavable")
    model, call, opt = build("engine", 2, None, group, seed=0)
    train(call, opt, 1, rank)
    if rank == 1:  # fault injection: a non-elementwise state tensor too large for the manifest
        bo = next(bo for bo in opt.bucket_optimizers if bo.segments)
        bo.inner.state[bo.segments[0].master]["factor"] = torch.zeros(5000)
    t0 = time.monotonic()
    try:
        zeroplus.save_checkpoint(os.path.join(root, "ck"), model, opt)
        err = None
    except Exception as e:  # noqa: BLE001 - the error is the result
        err = f"{type(e).__name__}: {e}"
    return err, (time.monotonic() - t0, sorted(os.listdir(root)))


def case_unsavable_hyperparameter_on_rank0(root, rank, group):
    import zeroplus

    root = os.path.join(root, "unsavable_hyper")
    model, call, opt = build("engine", 2, None, group, seed=0)
    if rank == 0:
        opt.param_groups[0]["note"] = object()
    try:
        zeroplus.save_checkpoint(os.path.join(root, "ck"), model, opt)
        err = None
    except Exception as e:  # noqa: BLE001 - the error is the result
        err = f"{type(e).__name__}: {e}"
    return err, os.path.exists(root) and sorted(os.listdir(root))


def _disk_full(root, rank, group, name, limited_ranks):
    import zeroplus

    root = os.path.join(root, name)
    model, opt, first = _saved(root, "first", rank, group)
    train(model, opt, 1, rank, first_step=5)

    def save():
        try:
            zeroplus.save_checkpoint(os.path.join(root, "second"), model, opt)
        except Exception as e:  # noqa: BLE001 - the error is the result
            return f"{type(e).__name__}: {e}"
        return None
    err = fsize_limited(save, 1000) if rank in limited_ranks else save()
    leftovers = sorted(os.listdir(root))
    loaded_err, _untouched = _load_fails(root, rank, group)  # via latest: must still be `first`
    with open(os.path.join(root, "latest")) as f:
        latest = f.read().strip()
    return err, (leftovers, loaded_err, latest)


def _all(rank, world, root):
    cases = cases_of(globals(), root)
    # 64-byte blocks: the corrupt byte sits in a block read straight into the destination tensor
    cases["corrupt_byte_small_blocks"] = functools.partial(case_corrupt_byte, root, block_bytes=64)
    cases["disk_full_everywhere"] = functools.partial(_disk_full, root, name="full_all", limited_ranks=(0, 1))
    cases["disk_full_one_rank"] = functools.partial(_disk_full, root, name="full_one", limited_ranks=(1,))
    cases["disk_full_rank0"] = functools.partial(_disk_full, root, name="full_rank0", limited_ranks=(0,))
    return run_cases_in_own_groups(rank, world, cases)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return pooled_results(_all, str(tmp_path_factory.mktemp("errors")), "checkpoint error cases")


@pytest.mark.parametrize("case, words", [
    ("corrupt_byte", ["checksum mismatch", "rank00001.bin"]),
    ("corrupt_byte_small_blocks", ["checksum mismatch", "rank00001.bin"]),
    ("truncated", ["truncated", "rank00000.bin"]),
    ("missing_file", ["rank00001.bin"]),
    ("no_manifest", ["manifest.json", "not a checkpoint"]),
    ("newer_version", ["version 99", "upgrade zeroplus"]),
    ("escaping_file_name", ["escape"]),
    ("escaping_latest", ["escape", "latest"]),
    ("ranks_read_different_checkpoints", ["read different checkpoints", "disagree_a", "disagree_b"]),
    ("size_mismatch", ["size mismatch for lin1.weight", "torch.Size([24, 8])", "torch.Size([32, 8])"]),
    ("missing_keys", ['Missing key(s) in state_dict: "extra.weight", "extra.bias"']),
    ("unexpected_keys", ['Unexpected key(s) in state_dict: "frozen"']),
    ("fp16_loss_scale_not_a_number", ["CheckpointError", "optimizer.loss_scaler.scale is 'lots'", "manifest.json"]),
])
def test_bad_checkpoint_is_refused_and_changes_nothing(results, case, words):
    for rank, (err, untouched) in enumerate(ok_values(results, case)):
        assert err is not None, f"rank {rank}: the load succeeded"
        for w in words:
            assert w in err, f"rank {rank}: {w!r} not in {err!r}"
        assert untouched, f"rank {rank}: a failed load changed the model or the optimizer"


def test_save_replaces_a_checkpoint_whole_and_refuses_other_directories(results):
    for err, (replaced, leftovers, foreign, notes) in ok_values(results, "exists"):
        assert replaced, "the second save to the same path did not replace the checkpoint"
        assert leftovers == []
        assert err is not None and "not a zeroplus checkpoint" in err
        assert foreign == ["notes.txt"] and notes == "mine"


def test_extra_must_be_json(results):
    for err, nothing_written in ok_values(results, "extra_not_json"):
        assert err is not None and "extra['when']" in err and "object" in err
        assert nothing_written


def test_a_value_no_reader_reads_fails_the_save_not_the_load(results):
    errors = []
    for err, nothing_written in ok_values(results, "hyperparameter_no_reader_reads"):
        assert err is not None, "the save wrote a checkpoint no reader accepts"
        assert "int64" in err and nothing_written, err
        errors.append(err)
    assert errors[0].startswith("ValueError: checkpoint: the manifest this save would write"), errors[0]


@pytest.mark.parametrize("case", ["disk_full_everywhere", "disk_full_one_rank", "disk_full_rank0"])
def test_disk_full_mid_save_keeps_previous_checkpoint(results, case):
    for rank, (err, (leftovers, loaded_err, latest)) in enumerate(ok_values(results, case)):
        assert err is not None, f"rank {rank}: the save succeeded despite the file size limit"
        assert leftovers == ["first", "latest"], f"rank {rank}: {leftovers}"
        assert latest == "first"
        assert loaded_err is None, f"rank {rank}: the previous checkpoint no longer loads: {loaded_err}"


def test_failure_on_one_rank_after_the_start_fails_every_rank_at_once(results):
    (err0, (secs0, left0)), (err1, (secs1, left1)) = ok_values(results, "unsavable_state_on_one_rank")
    assert err1 is not None and "TypeError" in err1 and "'factor'" in err1
    assert err0 is not None and "rank 1 failed" in err0 and "'factor'" in err0
    assert max(secs0, secs1) < 30, "a rank waited for a shard that was never coming"
    assert left0 == left1 == []


def test_rank0_failure_before_the_start_reaches_every_rank(results):
    (err0, left0), (err1, left1) = ok_values(results, "unsavable_hyperparameter_on_rank0")
    assert err0 is not None and err0.startswith("TypeError") and "object" in err0
    assert err1 is not None and "rank 0 could not start the save" in err1
    assert not left0 and not left1


def test_one_flipped_bit_in_the_manifest_is_refused_by_every_reader(results):
    for rank, (err, (untouched, readers)) in enumerate(ok_values(results, "flipped_manifest_offset")):
        assert err is not None, f"rank {rank}: load_checkpoint loaded the damaged manifest"
        assert "checksum mismatch in the manifest" in err and "manifest.json" in err, err
        assert untouched, f"rank {rank}: the refused load changed the model or the optimizer"
        if rank == 0:
            for what in ("inspect", "consolidate"):
                assert readers[what] is not None and "checksum mismatch in the manifest" in readers[what], \
                    f"{what}: {readers[what]}"
            assert not readers["output_written"]


def test_save_whose_latest_cannot_be_replaced_keeps_the_checkpoint_it_would_replace(results):
    for rank, (err, (kept, listing, latest_dir)) in enumerate(ok_values(results, "latest_not_replaceable")):
        assert err is not None and "latest" in err, f"rank {rank}: {err}"
        assert kept, f"rank {rank}: NAME no longer holds the checkpoint it held before the failed save"
        assert listing == ["ck", "latest"] and latest_dir == ["mine"], listing
