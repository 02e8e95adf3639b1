"""Optimizer-state offload to NVMe (zeroplus.offload): parity, memory bound, faults, files.

Every distributed case trains the in-memory engine and the NVMe-offloaded engine side by side in
one rank on the same batches (2 ranks, pooled) and requires bitwise-equal parameters and
optimizer state: the swapper moves bytes and must never change one. The model is the tiny tied
GPT with small buckets (11 buckets at stage 2), so with buffer_count=2 most of the state is on
disk at any moment. Faults are injected per rank: RLIMIT_FSIZE on one rank makes its swap-out
fail with EFBIG (what a full disk looks like to a write that the preallocation did not cover),
and bytes flipped in a swap file must be refused.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import shutil
import sys
import resource
import signal
import stat
import subprocess
import tempfile
import time

import pytest
import torch

from harness import run_cases_in_own_groups, run_pooled
from sharding import assert_sharded

STEPS = 20
LR = 3e-3
SMALL_BUCKETS = {"zero_optimization": {"reduce_bucket_size": 3000}}
# Stage 3 (the offloaded engine and its in-memory reference alike): every parameter sharded
SHARDED_SMALL_BUCKETS = {"zero_optimization": {"reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0}}
_T0 = time.perf_counter()


def _nvme(path, **extra):
    return {"device": "nvme", "nvme_path": path, "buffer_count": 2, **extra}


def _train(model, opt, rank, steps, start=0, on_step=None):
    import zero_models as zm

    for step in range(start, start + steps):
        x, y = zm.batch(step, rank)
        opt.backward(zm.loss_fn(model, x, y))
        opt.clip_grad_norm_(1.0)
        if on_step is None:
            opt.step()
        else:
            on_step(step, opt)
        opt.zero_grad()


def _build(stage, precision, group, offload=None, optimizer=torch.optim.AdamW):
    import zeroplus
    import zero_models as zm

    kw = {} if offload is None else {"offload_optimizer": offload}
    if optimizer is torch.optim.SGD:
        kw["momentum"] = 0.9
    model, opt = zeroplus.initialize(zm.make_model(), optimizer, stage=stage, lr=LR, mixed_precision=precision,
                                     process_group=group, config=SHARDED_SMALL_BUCKETS if stage == 3 else SMALL_BUCKETS,
                                     **kw)
    if stage == 3:
        assert_sharded(model, opt)
    return model, opt


def _same_params(a, b) -> bool:
    """The full parameters of two engines' models are equal (collective: at stage 3 the parameters
    are shards between uses, gathered by full_state_dict)."""
    full = __import__("zeroplus").full_state_dict
    fa, fb = full(a, rank0_only=False), full(b, rank0_only=False)
    return list(fa) == list(fb) and all(torch.equal(fa[k], fb[k]) for k in fa)


def _same_state(sa, sb) -> bool:
    if sorted(sa["state"]) != sorted(sb["state"]):
        return False
    for i, st in sa["state"].items():
        other = sb["state"][i]
        if sorted(st) != sorted(other) or not all(torch.equal(torch.as_tensor(st[k]), torch.as_tensor(other[k]))
                                                  for k in st):
            return False
    return True


# -- parity, memory, state dicts ------------------------------------------------------------------

def _parity_case(stage, precision, optimizer, **knobs):
    def case(rank, group):
        root = tempfile.mkdtemp(prefix="zp-offload-")
        ref, ref_opt = _build(stage, precision, group, optimizer=optimizer)
        model, opt = _build(stage, precision, group, _nvme(root, **knobs), optimizer=optimizer)
        n_buckets = len(opt.buckets)
        psi = sum(e.numel for b in opt.buckets for e in b.entries)
        max_bucket = max(b.numel for b in opt.buckets)
        _train(ref, ref_opt, rank, STEPS)
        _train(model, opt, rank, STEPS)
        same_params = _same_params(model, ref)
        report = __import__("zeroplus").memory_report(model, opt)
        records = opt.offload.record_bytes()
        on_disk = sum(records)
        resident_state = report["optimizer_state"] + report["master_parameters"]
        in_memory = __import__("zeroplus").memory_report(ref, ref_opt)
        in_memory_state = in_memory["optimizer_state"] + in_memory["master_parameters"]
        # State dicts read through the swap files: sharded and consolidated equal the in-memory ones.
        saved = ref_opt.state_dict()
        sharded_equal = _same_state(opt.state_dict(), saved)
        opt.consolidate_state_dict(0)
        ref_opt.consolidate_state_dict(0)
        consolidated_equal = rank != 0 or _same_state(opt.state_dict(), ref_opt.state_dict())
        # A fresh offloaded engine loads the sharded state (written to its files) and continues
        # exactly like a fresh in-memory one loaded the same way (with bf16 the model's state
        # dict holds rounded weights, so the loaded masters differ from the trained ones).
        # One step first, so that loading the model writes the masters into existing records.
        model2, opt2 = _build(stage, precision, group, _nvme(root), optimizer=optimizer)
        ref2, ref_opt2 = _build(stage, precision, group, optimizer=optimizer)
        # Stage 3 shards every parameter: model.state_dict() raises there (docs/zero.md), the full
        # dict comes from zeroplus.full_state_dict (collective, every rank).
        full = ref.state_dict() if stage < 3 else __import__("zeroplus").full_state_dict(ref, rank0_only=False)
        for m, o in ((model2, opt2), (ref2, ref_opt2)):
            _train(m, o, rank, 1)
            m.load_state_dict(full)
            o.load_state_dict(saved)
        after_load = __import__("zeroplus").memory_report(model2, opt2)
        resident_after_load = after_load["optimizer_state"] + after_load["master_parameters"]
        _train(ref2, ref_opt2, rank, 3, start=STEPS)
        _train(model2, opt2, rank, 3, start=STEPS)
        swap_dir = opt.offload.directory.path
        mode = stat.S_IMODE(os.stat(swap_dir).st_mode)
        file_modes = {stat.S_IMODE(os.stat(os.path.join(swap_dir, f)).st_mode) for f in os.listdir(swap_dir)}
        cache_hits, checked = opt.offload.cache_hits, opt.offload.background_check_s
        opt.offload.close()
        opt2.offload.close()
        left = os.listdir(root)
        os.rmdir(root)
        return dict(params=same_params, cache_hits=cache_hits, checked=checked,
                    continued=_same_params(model2, ref2), sharded=sharded_equal, consolidated=consolidated_equal,
                    n_buckets=n_buckets, peak=report["offload_peak_buffers"], max_record=max(records),
                    on_disk=on_disk, disk=report["offload_disk"], resident=resident_state,
                    in_memory=in_memory_state, after_load=resident_after_load, mode=mode, file_modes=file_modes,
                    left=left, buffers=opt.offload.policy.buffer_count, estimate=__import__("zeroplus").estimate_memory(
                        psi, 2, stage, precision, "adam" if optimizer is torch.optim.AdamW else "sgd", "nvme", 2,
                        max_bucket))
    return case


def _parity_cases(rank, world):
    cases = {(s, p, o.__name__): _parity_case(s, p, o) for s in (2, 3) for p in (None, "bf16")
             for o in (torch.optim.AdamW,)}
    cases[(2, None, "SGD")] = _parity_case(2, None, torch.optim.SGD)  # another key set (momentum_buffer)
    cases[(1, "bf16", "AdamW")] = _parity_case(1, "bf16", torch.optim.AdamW)
    # No read-ahead, every write waited for, one buffer: the unpipelined path.
    cases[(2, "bf16", "AdamW-1buf")] = _parity_case(2, "bf16", torch.optim.AdamW, buffer_count=1, pipeline=False)
    return run_cases_in_own_groups(rank, world, cases)


def test_offloaded_runs_equal_in_memory_runs_and_memory_is_bounded():
    results = run_pooled(_parity_cases, 2, timeout=600)
    for rank, per_rank in enumerate(results):
        for key, (status, r) in per_rank.items():
            assert status == "ok", f"rank {rank} case {key}:\n{r}"
            assert r["params"], (rank, key)
            assert r["sharded"] and r["consolidated"], (rank, key)
            assert r["continued"], (rank, key)
            # The bound is meaningful: more buckets than buffers, more state than the buffers.
            assert r["n_buckets"] > 2 and r["on_disk"] > 2 * r["max_record"], (rank, key, r)
            bound = r["buffers"] * (-(-r["max_record"] // 4096) * 4096)
            assert 0 < r["peak"] <= bound, (rank, key, r["peak"], bound)
            # Between steps the engine holds only per-parameter scalars (Adam's step), not the state.
            assert r["resident"] <= 64 * 4 and r["after_load"] <= 64 * 4, (rank, key, r)
            assert r["in_memory"] > 8 * r["resident"], (rank, key, r)
            assert r["disk"] >= r["on_disk"], (rank, key, r)
            # Every other step runs the buckets in reverse, starting with the records still in
            # the pool from the step before (no read); records read are checked off the
            # training thread.
            assert r["cache_hits"] >= STEPS // 2 and r["checked"] > 0, (rank, key, r["cache_hits"], r["checked"])
            assert r["mode"] == 0o700 and r["file_modes"] == {0o600}, (rank, key, r)
            assert r["left"] == [], (rank, key, r)
            if key[0] == 2 and r["buffers"] == 2:  # stage 2: buckets at most the largest one, as estimated
                est = r["estimate"]
                # Payload without the 4 KiB headers (which dominate in so tiny a model).
                payload = r["on_disk"] - 4096 * r["n_buckets"]
                est_payload = est["master_parameters"] + est["optimizer_state"]
                assert abs(est_payload - payload) <= 0.05 * payload, (rank, key, est_payload, payload)
                assert est["offload_buffers"] >= r["peak"] * 0.9, (rank, key, est, r["peak"])
    print(f"\n[test_offload_nvme] parity: {time.perf_counter() - _T0:.1f}s")


# -- faults ---------------------------------------------------------------------------------------

def _fault_swap_out(rank, group):
    """Rank 1 cannot create its swap files in step 0 (the reservation fails) and its swap-out
    fails in steps 4 and 5 (EFBIG: RLIMIT_FSIZE); it reports the file and bucket each time,
    keeps the state, and continues: after 10 steps both ranks equal the in-memory run bitwise.
    The swap directory goes away with the optimizer."""
    root = tempfile.mkdtemp(prefix="zp-offload-")
    ref, ref_opt = _build(2, None, group)
    model, opt = _build(2, None, group, _nvme(root))
    errors = []
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def step(s, o):
        if rank == 1 and s in (0, 4):
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old[1]))
        try:
            o.step()
        except OSError as e:
            errors.append((s, e.errno, str(e), e.filename))
        finally:
            if rank == 1 and s in (0, 5):
                resource.setrlimit(resource.RLIMIT_FSIZE, old)  # space freed
    try:
        _train(ref, ref_opt, rank, 10)
        _train(model, opt, rank, 10, on_step=step)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)
    peak = opt.offload.peak_buffer_bytes
    same_state = _same_state(opt.state_dict(), ref_opt.state_dict())
    same = _same_params(model, ref) and same_state
    had_dir = len(os.listdir(root)) == 1
    del model, opt
    gc.collect()  # the engine's reference cycles (hooks): the finalizer removes the directory
    left = os.listdir(root)
    os.rmdir(root)
    return dict(errors=errors, same=same, peak=peak, had_dir=had_dir, left=left)


def _fault_corrupt(rank, group, precision):
    """A flipped byte in a swap file of rank 0: that step raises on rank 0 naming the file and the
    bucket, the bucket is not stepped, later steps raise again; load_state_dict repairs it."""
    root = tempfile.mkdtemp(prefix="zp-offload-")
    model, opt = _build(2, precision, group, _nvme(root))
    _train(model, opt, rank, 3)
    saved = opt.state_dict()
    bucket = 3
    path = os.path.join(opt.offload.directory.path, f"optimizer-b{bucket:05d}.swp")
    if rank == 0:
        with open(path, "r+b") as f:
            f.seek(4096 + 100)
            byte = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([byte[0] ^ 0x40]))
    torch.distributed.barrier(group)
    errors = []
    rank0_shard = slice(*opt.buckets[bucket].shard_range(0))
    shard_before = opt.buckets[bucket].flat[rank0_shard].clone()

    def step(s, o):
        try:
            o.step()
        except OSError as e:
            errors.append((s, e.errno, str(e), e.filename))
    _train(model, opt, rank, 2, start=3, on_step=step)
    unchanged = torch.equal(shard_before, opt.buckets[bucket].flat[rank0_shard])
    # State dicts refuse to read it as well.
    try:
        opt.state_dict()
        read_error = None
    except OSError as e:
        read_error = str(e)
    opt.load_state_dict(saved)  # rewrites every record
    after = []
    _train(model, opt, rank, 2, start=5, on_step=lambda s, o: after.append(o.step() is None))
    opt.offload.close()
    os.rmdir(root)  # close() removed the swap directory: nothing is left in the test's root
    return dict(errors=errors, unchanged=unchanged, read_error=read_error, after=after, path=path)


def _fault_cases(rank, world):
    return run_cases_in_own_groups(rank, world, {
        "swap_out": _fault_swap_out, "corrupt": lambda r, g: _fault_corrupt(r, g, None),
        "corrupt_bf16": lambda r, g: _fault_corrupt(r, g, "bf16")})


def test_swap_faults_are_reported_and_training_continues():
    results = run_pooled(_fault_cases, 2, timeout=300)
    for rank, per_rank in enumerate(results):
        for key, (status, r) in per_rank.items():
            assert status == "ok", f"rank {rank} case {key}:\n{r}"
    out = results[1]["swap_out"][1]
    assert [e[0] for e in out["errors"]] == [0, 4, 5], out["errors"]
    for step, code, text, filename in out["errors"]:
        assert code == 27 and "optimizer-b" in filename and "bucket" in text and "rank 1" in text, text
        assert "kept in memory" in text and ("creating" if step == 0 else "writing") in text, text
    for r in (0, 1):
        assert results[r]["swap_out"][1]["had_dir"] and results[r]["swap_out"][1]["left"] == []
    assert results[0]["swap_out"][1]["errors"] == []
    assert out["same"] and results[0]["swap_out"][1]["same"], "state was lost or changed by the failed writes"

    for key in ("corrupt", "corrupt_bf16"):
        bad = results[0][key][1]
        assert [e[0] for e in bad["errors"]] == [3, 4], (key, bad["errors"])
        for _step, code, text, filename in bad["errors"]:
            assert filename == bad["path"] and "bucket 3" in text and "checksum" in text, (key, text)
            assert "not stepped" in text and code == 74, (key, text)
        assert bad["unchanged"], f"{key}: a bucket whose record was refused was stepped"
        assert bad["read_error"] is not None and "bucket 3" in bad["read_error"], key
        assert bad["after"] == [True, True], key
        assert results[1][key][1]["errors"] == [], key
    print(f"\n[test_offload_nvme] faults: {time.perf_counter() - _T0:.1f}s")


# -- configuration --------------------------------------------------------------------------------

@pytest.mark.parametrize("block, match", [
    ({"device": "disk", "nvme_path": "/x"}, "device must be one of"),
    ({"device": "nvme"}, "needs nvme_path"),
    ({"device": "nvme", "nvme_path": "/x", "buffer_count": 0}, "buffer_count"),
    ({"device": "nvme", "nvme_path": "/x", "buffer_count": 2.5}, "buffer_count"),
    ({"device": "nvme", "nvme_path": "/x", "ratio": 0.5}, "ratio"),
    ({"device": "nvme", "nvme_path": "/x", "nvme_pth": "/y"}, "nvme_pth.*did you mean 'nvme_path'"),
    ({"device": "nvme", "nvme_path": ""}, "nvme_path"),
])
def test_bad_offload_settings_name_the_key(block, match):
    from zeroplus.zero import config

    with pytest.raises(ValueError, match=match):
        config.resolve(torch.optim.AdamW, 2, None, None, {"lr": 1e-3, "offload_optimizer": block})
    with pytest.raises(ValueError, match="config\\['zero_optimization'\\]\\['offload_optimizer'\\].*" + match):
        config.resolve(torch.optim.AdamW, 2, None, {"zero_optimization": {"offload_optimizer": block}}, {"lr": 1e-3})


def test_offload_settings_resolve():
    from zeroplus.zero import config

    with pytest.raises(TypeError, match="offload_optimizer.*pin_memory must be true or false"):
        config.resolve(torch.optim.AdamW, 2, None, None,
                       {"offload_optimizer": {"device": "cpu", "pin_memory": "yes"}})
    with pytest.raises(TypeError, match="offload_optimizer=: offload_optimizer: must be a dict"):
        config.resolve(torch.optim.AdamW, 2, None, None, {"offload_optimizer": "nvme"})
    with pytest.raises(ValueError, match="offload_param applies to stage 3 only"):
        config.resolve(torch.optim.AdamW, 2, None, None, {"offload_param": {"device": "cpu"}})
    with pytest.raises(ValueError, match="conflicts with config"):
        config.resolve(torch.optim.AdamW, 2, None, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
                       {"offload_optimizer": {"device": "none"}})
    with pytest.raises(ValueError, match="unknown config key config\\['aio'\\]\\['block_sise'\\]; did you mean 'block_size'"):
        config.resolve(torch.optim.AdamW, 2, None, {"aio": {"block_sise": 1}}, {})
    with pytest.raises(ValueError, match="config\\['aio'\\]: block_size must be >= 4096"):
        config.resolve(torch.optim.AdamW, 2, None, {"aio": {"block_size": 512}}, {})
    s = config.resolve(None, None, None, {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme",
                                                                "buffer_count": 6, "pin_memory": True,
                                                                "pipeline_read": False, "fast_init": False}},
        "aio": {"block_size": 1 << 21, "queue_depth": 16, "intra_op_parallelism": 2, "single_submit": False,
                "overlap_events": True}}, {})
    p = s.options.offload_optimizer
    assert (p.device, p.nvme_path, p.buffer_count, p.pin_memory, p.pipeline_read, p.pipeline_write) == \
        ("nvme", "/nvme", 6, True, False, True)
    assert (p.aio.block_size, p.aio.queue_depth, p.aio.threads) == (1 << 21, 16, 2)
    assert not s.options.offload_param.enabled and s.options.offload_param.buffer_count == 5
    assert "lr" in s.optimizer_defaults and "offload_optimizer" not in s.optimizer_defaults


def test_what_is_built_is_accepted_and_the_rest_refused(tmp_path):
    from zeroplus.offload import prepare_optimizer_store
    from zeroplus.offload.policy import parse_offload

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    none_p = parse_offload("offload_param", None)
    cpu_o = parse_offload("offload_optimizer", {"device": "cpu"})
    cpu_p = parse_offload("offload_param", {"device": "cpu"})
    nvme_o = parse_offload("offload_optimizer", {"device": "nvme", "nvme_path": str(tmp_path)})
    nvme_p = parse_offload("offload_param", {"device": "nvme", "nvme_path": str(tmp_path)})
    # CPU training: 'cpu' is a no-op for both (no store, nothing created).
    assert prepare_optimizer_store(cpu_o, cpu_p, 0, cpu, "E") is None and os.listdir(tmp_path) == []
    prepared = prepare_optimizer_store(nvme_o, none_p, 0, cpu, "E")
    assert prepared is not None and not prepared.host_tier and len(os.listdir(tmp_path)) == 1
    prepared.directory.close()
    # offload_param 'nvme' on CPU training is prepare_param_store's (test_offload_param.py).
    assert prepare_optimizer_store(cpu_o, nvme_p, 0, cpu, "E") is None and os.listdir(tmp_path) == []
    # CUDA training: offload_optimizer takes the host tier (test_offload_host_tier.py); offload_param
    # is prepare_param_store's (host_params.py, test_offload_param_host.py), not a reason to refuse.
    assert prepare_optimizer_store(parse_offload("offload_optimizer", None), nvme_p, 0, cuda, "E") is None
    assert prepare_optimizer_store(cpu_o, nvme_p, 0, cuda, "E").host_tier and os.listdir(tmp_path) == []
    # a device with no offload path is refused, also beside an offload_optimizer that would be accepted
    with pytest.raises(NotImplementedError, match="offload_param device 'nvme' with parameters on meta"):
        prepare_optimizer_store(cpu_o, nvme_p, 0, torch.device("meta"), "E")
    assert os.listdir(tmp_path) == []  # refusals create nothing


def test_estimate_memory_offload_columns():
    import zeroplus

    base = zeroplus.estimate_memory(1e9, 8, 2, "bf16")
    off = zeroplus.estimate_memory(1e9, 8, 2, "bf16", offload_optimizer="nvme", buffer_count=4, bucket_elems=1 << 22)
    moved = base["master_parameters"] + base["optimizer_state"]
    assert off["nvme"] == moved + 4096 * -(-1e9 // (1 << 22))
    assert off["offload_buffers"] == 4 * (4096 + (1 << 22) // 8 * 12)  # whole pages already
    assert off["resident"] == base["model_state"] - moved + off["offload_buffers"]
    fp32 = zeroplus.estimate_memory(1e9, 8, 2, None, offload_optimizer="nvme")
    assert fp32["nvme"] < moved and fp32["master_parameters"] == 0  # fp32: the master is the parameters
    assert zeroplus.estimate_memory(1e9, 8, 2, "bf16", offload_optimizer="cpu")["resident"] == base["model_state"]
    for kw, match in (({"offload_optimizer": "disk"}, "offload_optimizer"), ({"buffer_count": 0}, "buffer_count"),
                      ({"bucket_elems": 1.5}, "bucket_elems")):
        with pytest.raises(ValueError, match=match):
            zeroplus.estimate_memory(1e9, 8, 2, **kw)
    with pytest.raises(ValueError, match="stage=0"):
        zeroplus.estimate_memory(1e9, 8, 0, offload_optimizer="nvme")
    out = subprocess.run([os.sys.executable, "-m", "zeroplus.estimate", "--params", "1.3e9", "--world-size", "8",
                          "--offload-optimizer", "nvme"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "resident" in out.stdout and "nvme" in out.stdout


# -- the swap directory ---------------------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_swap_directory_is_private_exclusive_cleaned_and_reclaims_stale(tmp_path):
    from zeroplus.offload.nvme_store import SwapDirectory, _host

    pid = _dead_pid()
    stale = tmp_path / f"zeroplus-swap-{_host()}-{pid}-{'a' * 16}-rank0"
    stale.mkdir(mode=0o700)
    (stale / "optimizer-b00000.swp").write_bytes(b"x" * 10)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    planted = tmp_path / f"zeroplus-swap-{_host()}-{pid}-{'b' * 16}-rank1"
    planted.symlink_to(victim, target_is_directory=True)
    alive = tmp_path / f"zeroplus-swap-{_host()}-{pid}-{'c' * 16}-rank0"
    alive.mkdir(mode=0o700)
    alive_fd = os.open(alive, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(alive_fd, fcntl.LOCK_EX)  # a live job's lock: its name's pid says nothing (issue 40)

    d = SwapDirectory(str(tmp_path), 0)
    os.close(alive_fd)
    assert d.reclaimed == [stale.name] and not stale.exists()
    assert (victim / "keep.txt").read_text() == "mine" and planted.is_symlink() and alive.exists()
    st = os.stat(d.path)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    io_path = d.create("optimizer-b00000.swp", 10000)
    assert os.path.samefile(io_path, os.path.join(d.path, "optimizer-b00000.swp"))
    assert stat.S_IMODE(os.stat(io_path).st_mode) == 0o600 and os.stat(io_path).st_size >= 10000
    with pytest.raises(FileExistsError, match="optimizer-b00000.swp"):
        d.create("optimizer-b00000.swp", 10)
    # A symlink planted under a file's name is never followed (O_EXCL|O_NOFOLLOW).
    os.symlink(victim / "keep.txt", os.path.join(d.path, "optimizer-b00001.swp"))
    with pytest.raises(FileExistsError):
        d.create("optimizer-b00001.swp", 10)
    assert (victim / "keep.txt").read_text() == "mine"
    d.close()
    assert not os.path.exists(d.path) and (victim / "keep.txt").read_text() == "mine"
    d.close()  # idempotent

    with pytest.raises(FileNotFoundError, match="nvme_path .* does not exist"):
        SwapDirectory(str(tmp_path / "missing"), 0)
    assert not (tmp_path / "missing").exists()  # nvme_path is never created (nor its parents)
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        SwapDirectory(str(tmp_path / "file"), 0)


_NEIGHBOUR = """
import json, sys
from zeroplus.offload.nvme_store import SwapDirectory
d = SwapDirectory(sys.argv[1], 0)
print(json.dumps(d.reclaimed))
d.close()
"""

_CRASH = """
import os, signal, sys
from zeroplus.offload.nvme_store import SwapDirectory
d = SwapDirectory(sys.argv[1], 0)
d.create("optimizer-b00000.swp", 4096)
print(d.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no finalizer runs: the directory stays, its lock goes
"""


def test_swap_directory_liveness_holds_across_pid_namespaces(tmp_path):
    """A neighbour job in another PID namespace (another container: same host name, same
    nvme_path) sees this job's pid as dead; it must still leave this job's swap directory alone,
    and still remove the directory of a job that really died (issue 40)."""
    from zeroplus.offload.nvme_store import SwapDirectory

    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True) \
        if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"unshare --pid --fork --mount-proc is unavailable here: "
                    f"{'no unshare binary' if probe is None else probe.stderr.decode().strip()}")
    live = SwapDirectory(str(tmp_path), 0)
    try:
        live.create("optimizer-b00000.swp", 4096)
        crashed = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path)], capture_output=True, text=True,
                                 timeout=120)
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr
        dead = crashed.stdout.strip()
        assert (tmp_path / dead / "optimizer-b00000.swp").exists()
        neighbour = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", _NEIGHBOUR,
                                    str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert neighbour.returncode == 0, neighbour.stderr
        assert json.loads(neighbour.stdout.strip().splitlines()[-1]) == [dead]
        assert os.path.exists(os.path.join(live.path, "optimizer-b00000.swp")), "a live job's swap files were removed"
        assert not (tmp_path / dead).exists()
    finally:
        live.close()
    assert os.listdir(tmp_path) == []


def test_a_swap_directory_swept_before_its_owner_locked_it_is_made_again(tmp_path, monkeypatch):
    """mkdir, open and flock are three calls: a neighbour's sweep can remove the new directory
    between them (it finds it unlocked). The owner then makes another instead of failing or
    using a removed directory (issue 40)."""
    from zeroplus import files
    from zeroplus.offload.nvme_store import SwapDirectory

    real_make, real_lock, swept = files.make_private_directory_at, files.lock, []

    def make_then_swept(dir_fd, name):  # removed between the mkdir and the open
        if not swept:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
            os.rmdir(name, dir_fd=dir_fd)
            swept.append(name)
            raise FileNotFoundError(2, "No such file or directory", name)
        return real_make(dir_fd, name)

    def swept_then_lock(fd, wait=True):  # removed between the open and the flock
        if len(swept) == 1:
            name = next(n for n in os.listdir(tmp_path) if n not in swept)
            os.rmdir(tmp_path / name)
            swept.append(name)
        return real_lock(fd, wait)

    monkeypatch.setattr(files, "make_private_directory_at", make_then_swept)
    monkeypatch.setattr(files, "lock", swept_then_lock)
    d = SwapDirectory(str(tmp_path), 0)
    monkeypatch.undo()
    try:
        assert len(swept) == 2 and d.name not in swept and os.listdir(tmp_path) == [d.name]
        d.create("optimizer-b00000.swp", 4096)  # a usable, locked directory
        fd = os.open(d.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert files.lock(fd, wait=False) is False
        finally:
            os.close(fd)
    finally:
        d.close()
    assert os.listdir(tmp_path) == []
    os.rmdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="nvme_path .* does not exist"):
        SwapDirectory(str(tmp_path), 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a symbolic link another owner (os.lchown)")
def test_nvme_path_follows_own_and_roots_links_and_refuses_another_users(tmp_path):
    """docs/security.md's one rule for a path the user names (issue 40 item 15): nvme_path may be
    the user's (or root's) link to a directory, never another user's."""
    from zeroplus.offload.nvme_store import SwapDirectory

    target = tmp_path / "nvme0"
    target.mkdir()
    mine = tmp_path / "mine"
    mine.symlink_to(target, target_is_directory=True)
    d = SwapDirectory(str(mine), 0)
    assert os.listdir(target) == [d.name]
    d.close()
    theirs = tmp_path / "theirs"
    theirs.symlink_to(target, target_is_directory=True)
    os.lchown(theirs, 65534, 65534)  # nobody's link, planted in a shared place
    with pytest.raises(PermissionError, match=r"nvme_path .*theirs.* uid 65534") as info:
        SwapDirectory(str(theirs), 0)
    assert info.value.filename == str(theirs) and os.listdir(target) == []


def test_swap_paths_under_umask_000_create_no_parents_and_stay_private(tmp_path):
    """Issue 40 item 18 as it applies to swap files: nvme_path and its parents are never created
    (a missing one raises, leaving nothing behind), and under umask 000 the rank directory is
    still 0700 and its files 0600. Passes before and after issue 40: a guard, not a fix."""
    from zeroplus.offload.nvme_store import SwapDirectory

    old = os.umask(0)
    try:
        with pytest.raises(FileNotFoundError, match="nvme_path .* does not exist"):
            SwapDirectory(str(tmp_path / "a" / "b"), 0)
        assert os.listdir(tmp_path) == []
        d = SwapDirectory(str(tmp_path), 0)
        try:
            io_path = d.create("optimizer-b00000.swp", 4096)
            assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(io_path).st_mode) == 0o600
        finally:
            d.close()
    finally:
        os.umask(old)


def test_store_fault_keeps_the_stores_explanation():
    """record.fault: an errno other than EBADMSG keeps the store's `what` (which call failed,
    where) beside strerror; EBADMSG says why the record is invalid."""
    import errno as _errno

    from zeroplus.offload import record

    e = record.fault(_errno.EIO, "write failed at offset 8192: short write", "/d/x.swp", "ctx bucket 3, rank 1")
    assert isinstance(e, OSError) and e.errno == _errno.EIO and e.filename == "/d/x.swp"
    assert os.strerror(_errno.EIO) in str(e) and "write failed at offset 8192: short write" in str(e), str(e)
    assert "ctx bucket 3, rank 1 failed: " in str(e), str(e)
    bad = record.fault(_errno.EBADMSG, "read refused: generation 2, expected 3", "/d/x.swp", "ctx")
    assert "the record is invalid: generation 2, expected 3" in str(bad), str(bad)
