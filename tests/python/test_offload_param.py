"""Stage-3 parameter offload to NVMe (offload_param): parity, bounded residency, refused records.

Every distributed case trains the in-memory stage-3 engine and NVMe-offloaded ones side by side in
one rank on the same batches (2 ranks, pooled) and requires their full state dicts (gathered
through the swap files) and optimizer states to be equal after 20 steps: the parameter swapper
moves bytes and must never change one. The model is the tiny tied GPT with 4 blocks and a
persistence threshold of 100 elements, so almost every parameter is in a swap file and, with
buffer_count=2, most shards are on disk at any moment. Corruption is injected into a rank's own
parameter record between steps and must be refused, naming the file and the bucket.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import time

import pytest
import torch

from harness import run_cases_in_own_groups, run_pooled

STEPS = 20
LR = 3e-3
CONFIG = {"zero_optimization": {"stage3_param_persistence_threshold": 100}}
BUFFERS = 2
_T0 = time.perf_counter()


def _build(precision, group, root=None, optimizer_too=False, param_buffers=BUFFERS, buffer_size=1):
    """buffer_size 1 (elements): each pooled buffer is one record, so the pool holds
    param_buffers records; None: DeepSpeed's default (1e8 elements: the whole model here)."""
    import zeroplus
    import zero_models as zm

    kw = {}
    if root is not None:
        kw["offload_param"] = {"device": "nvme", "nvme_path": root, "buffer_count": param_buffers}
        if buffer_size is not None:
            kw["offload_param"]["buffer_size"] = buffer_size
        if optimizer_too:
            kw["offload_optimizer"] = {"device": "nvme", "nvme_path": root, "buffer_count": BUFFERS}
    return zeroplus.initialize(zm.make_model(layers=4), torch.optim.AdamW, stage=3, lr=LR, mixed_precision=precision,
                               process_group=group, config=CONFIG, **kw)


def _train(model, opt, rank, steps, start=0):
    """Every fifth step accumulates a second micro-batch (spilled gradients are read back and
    added to)."""
    import zero_models as zm

    for step in range(start, start + steps):
        x, y = zm.batch(step, rank)
        opt.backward(zm.loss_fn(model, x, y))
        if step % 5 == 4:
            x, y = zm.batch(1000 + step, rank)
            opt.backward(zm.loss_fn(model, x, y))
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _max_diff(a, b) -> float:
    import zeroplus

    fa, fb = zeroplus.full_state_dict(a, rank0_only=False), zeroplus.full_state_dict(b, rank0_only=False)
    assert sorted(fa) == sorted(fb)
    return max((fa[k].double() - fb[k].double()).abs().max().item() for k in fa)


def _max_diff_dicts(fa, fb) -> float:
    assert sorted(fa) == sorted(fb)
    return max((fa[k].double() - fb[k].double()).abs().max().item() for k in fa)


def _same_state(sa, sb) -> bool:
    if sorted(sa["state"]) != sorted(sb["state"]):
        return False
    return all(sorted(st) == sorted(sb["state"][i]) and all(torch.equal(torch.as_tensor(st[k]),
                                                                         torch.as_tensor(sb["state"][i][k]))
                                                            for k in st)
               for i, st in sa["state"].items())


def _shard_bytes(opt) -> int:
    """Bytes of the non-persistent stage-3 shards held in memory right now."""
    buckets = list(opt.buckets) + list(opt.placement.frozen_buckets)
    return sum(b.shard.numel() * b.shard.element_size() for b in buckets if b.shard is not None)


# -- parity and memory ----------------------------------------------------------------------------

def _parity_case(precision):
    def case(rank, group):
        import zeroplus
        from zeroplus.zero.layout import is_resting

        root = tempfile.mkdtemp(prefix="zp-offload-param-")
        ref, ref_opt = _build(precision, group)
        model, opt = _build(precision, group, root)
        # A larger parameter pool here: room to read records ahead of their gather.
        both, both_opt = _build(precision, group, root, optimizer_too=True, param_buffers=8)
        # The default pool (buffer_size 1e8 elements) holds every record of this model: after
        # the first step none is read again (clean records stay cached), all are still written.
        cached, cached_opt = _build(precision, group, root, buffer_size=None)
        cached_store = cached_opt.placement.param_store
        store = opt.placement.param_store
        records = [h.layout.record_bytes for h in store._homes.values()]  # noqa: SLF001 - test introspection
        in_memory_shards = _shard_bytes(ref_opt)
        for step in range(STEPS):
            for m, o in ((ref, ref_opt), (model, opt), (both, both_opt), (cached, cached_opt)):
                _train(m, o, rank, 1, start=step)
            if step == 0:
                cached_io = (cached_store.bytes_read, cached_store.bytes_written)
        # Between backward and step the offloaded buckets' gradients are in files, not memory.
        import zero_models as zm
        x, y = zm.batch(STEPS, rank)
        opt.backward(zm.loss_fn(model, x, y))
        spill = opt.reducer.spill
        spilled = [i for i in range(len(opt.buckets)) if spill.spills(i)]
        grads_resident = sum(opt.reducer.accum[i] is not None for i in spilled)
        grad_records = max(spill._buckets[i].layout.record_bytes for i in spilled)  # noqa: SLF001
        opt.zero_grad()
        out = dict(diff=_max_diff(model, ref), diff_both=_max_diff(both, ref), diff_cached=_max_diff(cached, ref),
                   cached_read=cached_store.bytes_read - cached_io[0],
                   cached_written=cached_store.bytes_written - cached_io[1],
                   store_read=store.bytes_read,
                   state=_same_state(opt.state_dict(), ref_opt.state_dict()),
                   state_both=_same_state(both_opt.state_dict(), ref_opt.state_dict()),
                   n_records=len(records), max_record=max(records), on_disk=sum(records),
                   in_memory_shards=in_memory_shards, shards_at_rest=_shard_bytes(opt),
                   params_at_rest=sum(0 if is_resting(p.data) else p.numel() for p in model.parameters()),
                   peak=store.peak_buffer_bytes, buffer_size=store.buffer_size,
                   disk=store.disk_bytes(), read=store.bytes_read, written=store.bytes_written,
                   ahead=store.reads_ahead, ahead_both=both_opt.placement.param_store.reads_ahead, n_spilled=len(spilled), grads_resident=grads_resident,
                   spill_peak=spill.peak_buffer_bytes, grad_record=grad_records, spill_written=spill.bytes_written,
                   spill_ahead=spill.reads_ahead,
                   # fp32: the master is the shard, so the optimizer's records hold no master.
                   opt_record_keys=sorted({s.key for h in both_opt.offload._homes  # noqa: SLF001
                                           if h.layout for s in h.layout.slots}),
                   report=zeroplus.memory_report(model, opt))
        swap_dir = store.directory.path
        out["mode"] = stat.S_IMODE(os.stat(swap_dir).st_mode)
        out["file_modes"] = {stat.S_IMODE(os.stat(os.path.join(swap_dir, f)).st_mode) for f in os.listdir(swap_dir)}
        for o in (opt, both_opt, cached_opt):
            o.placement.param_store.close()
        both_opt.offload.close()
        out["left"] = os.listdir(root)
        os.rmdir(root)
        return out
    return case


def _parity_cases(rank, world):
    return run_cases_in_own_groups(rank, world, {p or "fp32": _parity_case(p) for p in (None, "bf16")})


def test_parameter_offload_equals_in_memory_and_residency_is_bounded():
    results = run_pooled(_parity_cases, 2, timeout=300)
    for rank, per_rank in enumerate(results):
        for key, (status, r) in per_rank.items():
            assert status == "ok", f"rank {rank} case {key}:\n{r}"
            assert r["diff"] <= 1e-6 and r["diff_both"] <= 1e-6 and r["diff_cached"] <= 1e-6, (rank, key, r)
            # Cached records: nothing read after the first step, every step still written.
            assert r["cached_read"] == 0 and r["cached_written"] >= (STEPS - 1) * r["on_disk"] // 2, (rank, key, r)
            assert r["state"] and r["state_both"], (rank, key)
            # Most of the model is in records, more than the buffers could hold.
            assert r["n_records"] > BUFFERS and r["on_disk"] > 2 * BUFFERS * r["max_record"], (rank, key, r)
            # Parameter shards in memory: none between steps, at most the pool while training.
            assert r["shards_at_rest"] == 0 and r["params_at_rest"] < r["in_memory_shards"] // 8, (rank, key, r)
            assert r["peak"] <= BUFFERS * r["buffer_size"], (rank, key, r["peak"], r["buffer_size"])
            assert r["report"]["offload_param_peak_buffers"] == r["peak"], (rank, key, r["report"])
            # Gradients of offloaded buckets: none resident after backward; in flight at most
            # buffer_count records.
            assert r["n_spilled"] > BUFFERS and r["grads_resident"] == 0 and r["spill_written"] > 0, (rank, key, r)
            assert 0 < r["spill_peak"] <= BUFFERS * (-(-r["grad_record"] // 4096) * 4096), (rank, key, r)
            assert r["disk"] >= r["on_disk"] and r["read"] > 0 and r["written"] > 0, (rank, key, r)
            assert r["spill_ahead"] > 0, (rank, key, r)  # the step read its next gradients ahead
            # Records were read ahead in the prefetch order, even with a pool of 2 (cached ones
            # are evicted least recently used first). In bf16 a unit's records alone fill that pool.
            assert key != "fp32" or r["ahead"] > 0, (rank, key, r["ahead"])
            assert r["mode"] == 0o700 and r["file_modes"] == {0o600} and r["left"] == [], (rank, key, r)
            if key == "fp32":
                assert "master" not in r["opt_record_keys"], (rank, key, r["opt_record_keys"])
            else:
                assert "master" in r["opt_record_keys"], (rank, key, r["opt_record_keys"])
    print(f"\n[test_offload_param] parity: {time.perf_counter() - _T0:.1f}s")


# -- faults ---------------------------------------------------------------------------------------

def _corrupt_case(rank, group):
    """Each rank damages its own record of the same bucket, so both ranks refuse it in the same
    gather (a refusal on one rank only would leave the other in the all-gather until its timeout).
    With the good record put back, training continues exactly like an undisturbed run."""
    root = tempfile.mkdtemp(prefix="zp-offload-param-")
    ref, ref_opt = _build(None, group)
    model, opt = _build(None, group, root)
    _train(model, opt, rank, 1)
    store = opt.placement.param_store
    path = os.path.join(store.directory.path, "param-b00001.swp")
    with open(path, "rb") as f:
        old = f.read()
    _train(model, opt, rank, 1, start=1)
    with open(path, "rb") as f:
        good = f.read()
    flipped = bytearray(good)
    flipped[4096 + 100] ^= 0x10
    out = {"path": path}
    for what, data in (("stale", old), ("flipped", bytes(flipped))):
        with open(path, "r+b") as f:
            f.write(data)
        try:
            _train(model, opt, rank, 1, start=2)
            out[what] = None
        except OSError as e:
            out[what] = (e.errno, str(e), e.filename)
        with open(path, "r+b") as f:
            f.write(good)
    _train(model, opt, rank, 1, start=2)
    _train(ref, ref_opt, rank, 3)
    out["diff"] = _max_diff(model, ref)
    # A spilled gradient damaged between backward and step: step raises naming its file (after
    # the step's collectives), the bucket is not stepped, and training goes on.
    import zero_models as zm
    x, y = zm.batch(3, rank)
    opt.backward(zm.loss_fn(model, x, y))
    spill = opt.reducer.spill
    b = next(i for i in range(len(opt.buckets)) if spill.spills(i) and spill.has(i))
    gpath = spill.directory.display_path(spill._buckets[b].name(spill._buckets[b].generation))  # noqa: SLF001
    with open(gpath, "r+b") as f:
        f.seek(4096 + 8)
        byte = f.read(1)
        f.seek(4096 + 8)
        f.write(bytes([byte[0] ^ 0x01]))
    try:
        opt.step()
        out["grad"] = None
    except OSError as e:
        out["grad"] = (e.errno, str(e), e.filename, b)
    opt.zero_grad()
    _train(model, opt, rank, 1, start=4)
    out["gpath"] = gpath
    # Loading a model state dict changes the records in place: its own state round-trips exactly,
    # and a state dict of the in-memory run (3 steps behind now) makes the two models equal.
    import zeroplus
    before = zeroplus.full_state_dict(model, rank0_only=False)
    model.load_state_dict(before)
    out["unchanged"] = _max_diff_dicts(before, zeroplus.full_state_dict(model, rank0_only=False))
    model.load_state_dict(zeroplus.full_state_dict(ref, rank0_only=False))
    out["loaded"] = _max_diff(model, ref)
    store.close()
    out["left"] = os.listdir(root)
    os.rmdir(root)
    return out


def _write_fault_case(rank, group):
    """Rank 1's parameter-record writes of step 3 fail (EFBIG: RLIMIT_FSIZE from its step()
    until they are drained; a step's writes finish during the next forward, drain() waits for
    them). The failure names the parameter file; the new shards stay in memory and are written
    again at their buckets' next step, so after 8 steps both ranks equal the in-memory run bit
    for bit. (The limit is lifted before the next backward: its gradient files must be written.)"""
    import resource
    import signal

    import zero_models as zm

    root = tempfile.mkdtemp(prefix="zp-offload-param-")
    ref, ref_opt = _build(None, group)
    model, opt = _build(None, group, root)
    store = opt.placement.param_store
    errors = []
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        for step in range(8):
            for m, o in ((ref, ref_opt), (model, opt)):
                x, y = zm.batch(step, rank)
                o.backward(zm.loss_fn(m, x, y))
                if o is opt and rank == 1 and step == 3:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old[1]))
                try:
                    o.step()
                    if o is opt and rank == 1 and step == 3:
                        store.drain()
                except OSError as e:
                    errors.append((step, e.errno, str(e), e.filename))
                finally:
                    if o is opt and rank == 1 and step == 3:
                        resource.setrlimit(resource.RLIMIT_FSIZE, old)  # space freed
                o.zero_grad()
        try:
            store.drain()
        except OSError as e:
            errors.append((8, e.errno, str(e), e.filename))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)
    out = {"errors": errors, "diff": _max_diff(model, ref), "dir": store.directory.path}
    store.close()
    out["left"] = os.listdir(root)
    os.rmdir(root)
    return out


def _corrupt_cases(rank, world):
    return run_cases_in_own_groups(rank, world, {"corrupt": _corrupt_case, "write_fault": _write_fault_case})


def test_damaged_parameter_record_is_refused_naming_file_and_bucket():
    results = run_pooled(_corrupt_cases, 2, timeout=120)
    for rank, per_rank in enumerate(results):
        status, r = per_rank["corrupt"]
        assert status == "ok", f"rank {rank}:\n{r}"
        for what, why in (("stale", "generation"), ("flipped", "payload checksum")):
            assert r[what] is not None, (rank, what)
            code, msg, filename = r[what]
            assert code == errno.EBADMSG and filename == r["path"], (rank, what, r[what])
            assert "parameter bucket 1" in msg and why in msg and f"rank {rank}" in msg, (rank, what, msg)
        assert r["diff"] <= 1e-6 and r["left"] == [], (rank, r)
        code, msg, filename, b = r["grad"]
        assert code == errno.EBADMSG and filename == r["gpath"], (rank, r["grad"])
        assert f"gradient bucket {b}" in msg and "payload checksum" in msg, (rank, msg)
        assert r["unchanged"] == 0.0 and r["loaded"] == 0.0, (rank, r)
        status, w = per_rank["write_fault"]
        assert status == "ok", f"rank {rank}:\n{w}"
        assert w["diff"] == 0.0 and w["left"] == [], (rank, w)
        if rank == 0:
            assert w["errors"] == [], w["errors"]
        else:
            assert w["errors"], "rank 1's failed parameter writes were not reported"
            for step, code, msg, filename in w["errors"]:
                # drain() raises the first failure; one kept from the same batch may come with the next step.
                assert step in (3, 4) and code == errno.EFBIG, [(e[0], e[3]) for e in w["errors"]]
                assert os.path.basename(filename).startswith("param-b") and "parameter bucket" in msg, msg
                assert filename.startswith(w["dir"]) and "rank 1" in msg and "written again" in msg, msg
    print(f"\n[test_offload_param] faults: {time.perf_counter() - _T0:.1f}s")


# -- settings -------------------------------------------------------------------------------------

def test_param_store_preparation(tmp_path):
    from zeroplus.offload import prepare_param_store
    from zeroplus.offload.policy import parse_offload

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    nvme = parse_offload("offload_param", {"device": "nvme", "nvme_path": str(tmp_path)})
    assert prepare_param_store(parse_offload("offload_param", None), 3, 0, cpu, "E") is None
    # 'cpu' (pin_memory or not) on CPU training is a no-op, like offload_optimizer's.
    for block in ({"device": "cpu"}, {"device": "cpu", "pin_memory": True}):
        assert prepare_param_store(parse_offload("offload_param", block), 3, 0, cpu, "E") is None
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="stage 3 only"):
        prepare_param_store(nvme, 2, 0, cpu, "E")
    with pytest.raises(NotImplementedError, match="offload_param device 'nvme' with parameters on meta is not built"):
        prepare_param_store(nvme, 3, 0, torch.device("meta"), "E")
    assert os.listdir(tmp_path) == []  # refusals create nothing
    on_cuda = prepare_param_store(nvme, 3, 0, cuda, "E")  # CUDA training: host_params.py over the swapper
    assert on_cuda.directory is not None and len(os.listdir(tmp_path)) == 1
    on_cuda.directory.close()
    assert os.listdir(tmp_path) == []
    prepared = prepare_param_store(nvme, 3, 0, cpu, "E")
    assert prepared is not None and len(os.listdir(tmp_path)) == 1
    prepared[2].close()
    assert os.listdir(tmp_path) == []


def test_offload_param_refusals_name_the_key(tmp_path):
    from zeroplus.offload import prepare_param_store
    from zeroplus.offload.policy import parse_offload

    with pytest.raises(ValueError, match="offload_param: device 'nvme' needs nvme_path"):
        parse_offload("offload_param", {"device": "nvme"})
    with pytest.raises(ValueError, match="offload_param: unknown keys"):
        parse_offload("offload_param", {"device": "nvme", "nvme_path": str(tmp_path), "bufer_count": 2})
    with pytest.raises(ValueError, match="offload_param: buffer_count"):
        parse_offload("offload_param", {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 0})
    for size in (0, 2.5, True, float("nan")):
        with pytest.raises(ValueError, match="offload_param: buffer_size must be an integer >= 1"):
            parse_offload("offload_param", {"device": "nvme", "nvme_path": str(tmp_path), "buffer_size": size})
    assert parse_offload("offload_param", {"device": "nvme", "nvme_path": str(tmp_path), "buffer_size": 1e3}).buffer_size == 1000
    missing = parse_offload("offload_param", {"device": "nvme", "nvme_path": str(tmp_path / "missing")})
    with pytest.raises(FileNotFoundError, match="offload_param: nvme_path"):
        prepare_param_store(missing, 3, 0, torch.device("cpu"), "E")


def test_estimate_memory_offload_param_columns():
    import subprocess
    import sys

    import zeroplus

    kw = dict(offload_optimizer="nvme", buffer_count=2, bucket_elems=1 << 22)
    opt_only = zeroplus.estimate_memory(2e9, 2, 3, None, **kw)
    both = zeroplus.estimate_memory(2e9, 2, 3, None, offload_param="nvme", param_buffer_count=3,
                                    param_buffer_size=1, **kw)
    buckets = -(-2e9 // (1 << 22))
    record = -(-(4096 + (1 << 21) * 4) // 4096) * 4096
    assert both["offload_param_buffers"] == 3 * record and opt_only["offload_param_buffers"] == 0
    # DeepSpeed's default pool, 3 x 1e8 elements of fp32 (page-rounded), and a model smaller than
    # the pool: every record, no more.
    default = zeroplus.estimate_memory(2e9, 2, 3, None, offload_param="nvme", param_buffer_count=3, **kw)
    assert default["offload_param_buffers"] == 3 * -(-400_000_000 // 4096) * 4096, default
    small = zeroplus.estimate_memory(1e8, 1, 3, None, offload_param="nvme", bucket_elems=1 << 22)
    assert small["offload_param_buffers"] == 4e8 + 4096 * -(-1e8 // (1 << 22)), small
    assert both["nvme"] == opt_only["nvme"] + opt_only["parameters"] + 2 * opt_only["gradients"] + 3 * 4096 * buckets
    assert both["resident"] == opt_only["resident"] - opt_only["parameters"] - opt_only["gradients"] + 3 * record
    assert zeroplus.estimate_memory(2e9, 2, 3, None, offload_param="cpu")["resident"] == \
        zeroplus.estimate_memory(2e9, 2, 3, None)["model_state"]  # "cpu" on CPU training: no effect
    for bad, match in (({"offload_param": "disk"}, "offload_param must be"),
                       ({"offload_param": "nvme", "stage": 2}, "stage 3 only"),
                       ({"param_buffer_count": 0}, "param_buffer_count"),
                       ({"param_buffer_size": 0}, "param_buffer_size")):
        args = {"num_params": 1e9, "world_size": 2, "stage": 3, **bad}
        with pytest.raises(ValueError, match=match):
            zeroplus.estimate_memory(**args)
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "..", "plugin", "python")}
    out = subprocess.run([sys.executable, "-m", "zeroplus.estimate", "--params", "2e9", "--world-size", "1", "--fp32",
                          "--offload-param", "nvme", "--offload-optimizer", "nvme"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and "resident" in out.stdout and "nvme" in out.stdout, out.stderr


# -- the swappers on the C++ store: owned gradient copies, half-stepped shards, replacement errors -

def _gradient_shards_case(rank, group):
    """gradient_shards() are the caller's: after step, another backward and close they still hold
    the gradients they were (not the store's buffers, reused by the next backward)."""
    import shutil

    import zero_models as zm

    root = tempfile.mkdtemp(prefix="zp-offload-param-")
    model, opt = _build(None, group, root)
    _train(model, opt, rank, 1)
    x, y = zm.batch(1, rank)
    opt.backward(zm.loss_fn(model, x, y))
    spill = opt.reducer.spill
    spilled = [i for i in range(len(opt.buckets)) if spill.spills(i) and spill.has(i)]
    shards = opt.gradient_shards()
    taken = [s.clone() for s in shards]
    again = opt.gradient_shards()  # read back once more: what the step reads
    opt.step()
    opt.zero_grad()
    x, y = zm.batch(2, rank)
    opt.backward(zm.loss_fn(model, x, y))
    later = opt.gradient_shards()
    out = dict(n=len(spilled), was=all(torch.equal(again[i], taken[i]) for i in spilled),
               kept=[i for i in spilled if torch.equal(shards[i], taken[i])],
               changed=any(not torch.equal(later[i], taken[i]) for i in spilled))
    opt.zero_grad()
    opt.placement.param_store.close()
    out["after_close"] = all(torch.equal(shards[i], taken[i]) for i in spilled)
    out["spilled"] = spilled
    shutil.rmtree(root, ignore_errors=True)
    return out


def _half_step_case(rank, group):
    """fp32: the step changes a pinned shard in place, then publish raises (before the write).
    The half-stepped bytes must not stay cached under the old generation: the next pin shows
    what the file holds, and training goes on."""
    import shutil

    import zero_models as zm

    root = tempfile.mkdtemp(prefix="zp-offload-param-")
    model, opt = _build(None, group, root, buffer_size=None)  # a pool that caches every record
    _train(model, opt, rank, 1)
    store, placement = opt.placement.param_store, opt.placement
    real, failed = placement.publish, []

    def publish(i):
        if not failed and store.offloads(opt.buckets[i]) and store.pinned(opt.buckets[i]):
            failed.append(i)
            raise RuntimeError("injected publish failure")
        return real(i)

    placement.publish = publish
    x, y = zm.batch(1, rank)
    opt.backward(zm.loss_fn(model, x, y))
    raised = None
    try:
        opt.step()
    except RuntimeError as e:
        raised = str(e)
    placement.publish = real
    opt.zero_grad()
    b = opt.buckets[failed[0]]
    h = store._homes[id(b)]  # noqa: SLF001 - test introspection
    shard = store.pin(b).clone()
    store.unpin(b)
    with open(store.directory.display_path(h.name), "rb") as f:
        data = bytearray(f.read())
    on_file = h.layout.view(torch.frombuffer(data, dtype=torch.uint8)[4096:], h.layout.slots[0])
    out = dict(raised=raised, failed=failed, equal=torch.equal(shard, on_file))
    _train(model, opt, rank, 2, start=2)  # training goes on
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    return out


def _optimizer_buffer_fault_case(rank, group):
    """The optimizer swapper cannot hold a buffer for bucket 0's first record: the error is
    raised by end_step (every bucket stepped), the state stays in memory, and training goes on
    equal to the in-memory run."""
    import errno as _errno
    import shutil

    import zero_models as zm

    root = tempfile.mkdtemp(prefix="zp-offload-param-")
    ref, ref_opt = _build(None, group)
    model, opt = _build(None, group, root, optimizer_too=True)
    swapper = opt.offload

    class _Failing:
        def __init__(self, inner):
            self.inner, self.failed = inner, False

        def overwrite(self, rid, nbytes):
            if not self.failed:
                self.failed = True
                return torch.empty(0, dtype=torch.uint8), _errno.ENOMEM, "no buffer for the record"
            return self.inner.overwrite(rid, nbytes)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    real_store = swapper._store  # noqa: SLF001
    swapper._store = _Failing(real_store)  # noqa: SLF001
    errors = []
    for step in range(4):
        _train(ref, ref_opt, rank, 1, start=step)
        try:
            _train(model, opt, rank, 1, start=step)
        except OSError as e:
            errors.append((step, e.errno, str(e), e.filename))
            opt.zero_grad()
    swapper._store = real_store  # noqa: SLF001
    out = dict(errors=errors, diff=_max_diff(model, ref), path=swapper.directory.display_path("optimizer-b00000.swp"))
    opt.placement.param_store.close()
    swapper.close()
    shutil.rmtree(root, ignore_errors=True)
    return out


def _replace_fault_case(rank, group):
    """commit_replacements: the rename of the second staged bucket fails; the OSError names its
    file, bucket and rank, and the bucket already replaced."""
    import shutil

    root = tempfile.mkdtemp(prefix="zp-offload-param-")
    model, opt = _build(None, group, root)
    _train(model, opt, rank, 1)
    store = opt.placement.param_store
    buckets = [b for b in opt.buckets if store.offloads(b)][:2]
    for b in buckets:
        values = store.pin(b).clone()
        store.unpin(b)
        store.stage_replacement(b, values)
    real, calls = store.directory.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src)
        return real(src, dst)

    store.directory.replace = replace
    try:
        store.commit_replacements()
        out = None
    except OSError as e:
        out = dict(errno=e.errno, msg=str(e), filename=e.filename)
    store.directory.replace = real
    store.discard_replacements()
    homes = [store._homes[id(b)] for b in buckets]  # noqa: SLF001
    res = dict(err=out, indices=[h.index for h in homes], path=store.directory.display_path(homes[1].name))
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    return res


def _swap_defect_cases(rank, world):
    return run_cases_in_own_groups(rank, world, {"shards": _gradient_shards_case, "half_step": _half_step_case,
                                                 "opt_buffer": _optimizer_buffer_fault_case,
                                                 "replace": _replace_fault_case})


def test_swappers_on_the_store_own_copies_forget_half_steps_and_name_faults():
    (results,) = run_pooled(_swap_defect_cases, 1, timeout=120)
    status, r = results["shards"]
    assert status == "ok", r
    assert r["n"] > 0 and r["was"] and r["changed"], r
    assert r["kept"] == r["spilled"] and r["after_close"], r  # owned copies, not the store's buffers
    status, r = results["half_step"]
    assert status == "ok", r
    assert r["raised"] == "injected publish failure" and r["failed"], r
    assert r["equal"], "the half-stepped shard stayed cached under the old generation"
    status, r = results["opt_buffer"]
    assert status == "ok", r
    assert len(r["errors"]) == 1 and r["errors"][0][1] == errno.ENOMEM, r["errors"]
    step, _code, msg, filename = r["errors"][0]
    assert step == 0 and filename == r["path"] and "bucket 0" in msg and "rank 0" in msg, r["errors"]
    assert "no buffer for the record" in msg and "kept in memory" in msg, msg
    assert r["diff"] == 0.0, r  # every bucket stepped; the state kept in memory was written later
    status, r = results["replace"]
    assert status == "ok", r
    err = r["err"]
    assert err is not None and err["errno"] == errno.EXDEV and err["filename"] == r["path"], r
    first, second = r["indices"]
    assert f"parameter bucket {second}, rank 0" in err["msg"] and f"buckets [{first}]" in err["msg"], err
    assert os.strerror(errno.EXDEV) in err["msg"] and "already replaced" in err["msg"], err


def _master_home_case(rank, group):
    """Each configuration's buckets report where their fp32 master lives (BucketOptimizer.master_home,
    the one answer the step, publish and checkpoints use): the set of homes per configuration, and
    whether every PARAM_RECORD bucket is one the parameter store offloads."""
    from zeroplus.zero.bucket_optimizer import MasterHome

    out = {}
    with tempfile.TemporaryDirectory() as root:
        for key, precision, kw in [("fp32", None, {}), ("bf16", "bf16", {}),
                                   ("fp32_param_nvme", None, {"root": root}),
                                   ("bf16_param_nvme", "bf16", {"root": root}),
                                   ("bf16_both_nvme", "bf16", {"root": root, "optimizer_too": True})]:
            model, opt = _build(precision, group, **kw)
            store = opt.placement.param_store
            homes = {bo.master_home for bo in opt.bucket_optimizers if bo.segments}
            consistent = all((bo.master_home is MasterHome.PARAM_RECORD) == (store is not None and store.offloads(b)
                                                                             and bo.master is b.shard)
                             for b, bo in zip(opt.buckets, opt.bucket_optimizers))
            out[key] = (sorted(h.name for h in homes), consistent)
            del model, opt
    return out


def _gradient_home_case(rank, group):
    """GradientReducer.home(b) through a step's life: NONE before backward and after
    zero_grad, then ACCUMULATOR in memory, SPILL for the buckets whose parameters live in swap
    files (offload_param nvme), HOST where the host tier took the gradient (ZeRO-Offload's path,
    forced on CPU)."""
    import zero_models as zm
    from zeroplus.offload.host_tier import force_on_cpu_for_tests

    def homes(opt):
        return sorted({opt.reducer.home(b).name for b in range(len(opt.buckets))})

    def life(model, opt):
        out = [homes(opt)]
        x, y = zm.batch(0, rank)
        opt.backward(zm.loss_fn(model, x, y))
        out.append(homes(opt))
        opt.zero_grad()
        out.append(homes(opt))
        return out

    out = {}
    with tempfile.TemporaryDirectory() as root:
        out["memory"] = life(*_build(None, group))
        out["param_nvme"] = life(*_build(None, group, root=root))
    import zeroplus
    with force_on_cpu_for_tests():
        model, opt = zeroplus.initialize(zm.make_model(layers=2), torch.optim.AdamW, stage=2, lr=LR,
                                         process_group=group, offload_optimizer={"device": "cpu"})
        out["host_tier"] = life(model, opt)
    return out


def _master_home_cases(rank, world):
    return run_cases_in_own_groups(rank, world, {"homes": _master_home_case, "gradients": _gradient_home_case})


def test_master_and_gradient_homes_name_where_each_bucket_lives():
    results = run_pooled(_master_home_cases, 2, timeout=120)
    for r in results:
        status, grads = r["gradients"]
        assert status == "ok", grads
        assert grads == {"memory": [["NONE"], ["ACCUMULATOR"], ["NONE"]],
                         "param_nvme": [["NONE", "SPILL"], ["ACCUMULATOR", "SPILL"], ["NONE", "SPILL"]],
                         "host_tier": [["NONE"], ["HOST"], ["NONE"]]}, grads
        status, homes = r["homes"]
        assert status == "ok", homes
        assert homes == {"fp32": (["PARAMS"], True), "bf16": (["COPY"], True),
                         "fp32_param_nvme": (["PARAMS", "PARAM_RECORD"], True),
                         "bf16_param_nvme": (["COPY"], True),
                         "bf16_both_nvme": (["OPTIMIZER_RECORD"], True)}, homes
