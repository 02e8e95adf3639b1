"""Checkpoints of offloaded optimizer state (docs/checkpoints.md, docs/offload.md), 2 ranks: an
engine whose optimizer state lives in NVMe swap files saves a checkpoint that an in-memory engine
loads, and the reverse; training on from either equals training on from the engine that saved
(bitwise in fp32). The state a checkpoint holds is read through the swap store, never from a stale
buffer. Stages 2 and 3, one launch; stage 3 with sharded parameters (persistence threshold 0
saving, 8 loading; asserted).

Parameter offload (offload_param nvme, stage 3, with and without offload_optimizer): saves stream
one swapped bucket at a time (the parameter pool's peak during sync and async saves stays within
its budget), loads at the same and at another world size and stage, into offloaded and in-memory
engines, continue bit for bit like the in-memory run in fp32 (bf16: like the saver); a load reads
swapped state bucket by bucket; a corrupt checkpoint or a full disk at load changes nothing;
model.load_state_dict changes the swapped records. One launch of 2 ranks (~10 s)."""

from __future__ import annotations

import contextlib
import errno
import os

import torch

import checkpoint_models as cm
from harness import run_pooled


def _engine(stage, nvme_dir, group, persist=None, precision=None, seed=0):
    """persist: stage 3's persistence threshold (the default would keep all of CkptNet whole)."""
    import zeroplus

    offload = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir}} if nvme_dir else {}
    config = {"zero_optimization": {"stage3_param_persistence_threshold": persist}} \
        if stage == 3 and persist is not None else None
    model, opt = zeroplus.initialize(cm.make(seed), torch.optim.AdamW, stage=stage, lr=1e-2, weight_decay=0.1,
                                     mixed_precision=precision, process_group=group, config=config, **offload)
    return model, opt


def _round_trips(rank, world, root):
    import torch.distributed as dist

    import zeroplus

    out = {}
    group = dist.group.WORLD
    for stage in (2, 3):
        nvme = os.path.join(root, f"nvme{stage}")
        if rank == 0:
            os.makedirs(nvme, exist_ok=True)
        dist.barrier()
        saver, saver_opt = _engine(stage, nvme, group, persist=0)
        cm.train(saver, saver_opt, 3, rank)
        path = os.path.join(root, f"ckpt{stage}")
        zeroplus.save_checkpoint(path, saver, saver_opt, extra={"step": 3})
        results = {}
        for label, target_nvme in (("into memory", None), ("into nvme", nvme)):
            model, opt = _engine(stage, target_nvme, group, persist=cm.PERSIST_SOME)
            results[label] = (model, opt, zeroplus.load_checkpoint(path, model, opt))
        cm.train(saver, saver_opt, 2, rank, first_step=3)
        want = cm.full_params("engine", saver)
        for label, (model, opt, extra) in results.items():
            cm.train(model, opt, 2, rank, first_step=3)
            got = cm.full_params("engine", model)
            out[(stage, label)] = (extra, max((got[k].float() - want[k].float()).abs().max().item() for k in want),
                                   (cm.sharded_names(saver, saver_opt), cm.sharded_names(model, opt)))
    return out


def test_offloaded_state_checkpoints_both_ways(tmp_path):
    for per_rank in run_pooled(_round_trips, 2, str(tmp_path), timeout=300):
        assert set(per_rank) == {(s, l) for s in (2, 3) for l in ("into memory", "into nvme")}
        for key, (extra, diff, sharded) in per_rank.items():
            assert extra == {"step": 3}, key
            assert diff == 0.0, (key, diff)
            if key[0] == 3:  # sharded parameters saved (all of them) and loaded (all but the 8-element ones)
                assert sharded == (["emb.weight", "frozen", "lin1.bias", "lin1.weight", "lin2.bias", "lin2.weight"],
                                   ["emb.weight", "lin1.bias", "lin1.weight", "lin2.weight"]), (key, sharded)


# -- parameter offload (offload_param nvme) -----------------------------------------------------------
# Stage 3 with a persistence threshold of 4 elements (every weight and most biases are sharded; the
# frozen 8-element parameter is offloaded too) and a parameter pool of two one-record buffers
# (buffer_size 1 element: without it the pool caches every record, DeepSpeed's default 1e8), so a
# save or a load that held more than a few buckets at once would show in the pool's peak.

_S3 = {"zero_optimization": {"stage3_param_persistence_threshold": 4}}


def _offloaded(nvme, group, precision=None, seed=0, param=True, optimizer=True):
    import zeroplus

    kw = {}
    if param:
        kw["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2, "buffer_size": 1}
    if optimizer:
        kw["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}
    return zeroplus.initialize(cm.make(seed), torch.optim.AdamW, stage=3, lr=1e-2, weight_decay=0.1,
                               mixed_precision=precision, process_group=group, config=_S3, **kw)


def _in_memory(stage, group, precision=None, seed=0):
    import zeroplus

    return zeroplus.initialize(cm.make(seed), torch.optim.AdamW, stage=stage, lr=1e-2, weight_decay=0.1,
                               mixed_precision=precision, process_group=group,
                               config=_S3 if stage == 3 else None)


def _diff(a, b) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _side_files(opt) -> list:
    store = opt.placement.param_store
    return [n for n in os.listdir(store.directory.path) if n.endswith(".new")]


@contextlib.contextmanager
def _largest_read():
    """[largest bytes one CheckpointReader.read_many call returned, total bytes]: a load that
    streams never holds much more than its largest call."""
    from zeroplus.checkpoint.reader import CheckpointReader

    real, seen = CheckpointReader.read_many, [0, 0]

    def counting(self, requests):
        values = real(self, requests)
        n = sum(v.numel() * v.element_size() for v in values)
        seen[0], seen[1] = max(seen[0], n), seen[1] + n
        return values
    CheckpointReader.read_many = counting
    try:
        yield seen
    finally:
        CheckpointReader.read_many = real


def _param_offload(rank, world, root):
    """Saver: offloaded parameters and optimizer state (fp32); ref: the in-memory stage-3 run.
    Both train 3 steps, the saver saves (sync and async), then one more step from every loaded
    engine must equal ref's fourth step bit for bit."""
    import torch.distributed as dist

    import zeroplus

    group = dist.group.WORLD
    nvme = os.path.join(root, "nvme")
    if rank == 0:
        os.makedirs(nvme, exist_ok=True)
    dist.barrier()
    out = {}
    saver, saver_opt = _offloaded(nvme, group)
    ref, ref_opt = _in_memory(3, group)
    cm.train(saver, saver_opt, 3, rank)
    cm.train(ref, ref_opt, 3, rank)
    store = saver_opt.placement.param_store
    # What the pool would hold with every record resident at once (each buffer is page-rounded).
    out["records"] = sum(-(-h.layout.record_bytes // 4096) * 4096 for h in store._homes.values())  # noqa: SLF001
    out["budget"] = store.budget_bytes
    store.peak_buffer_bytes = store.buffer_bytes  # the pool's peak during the saves only
    zeroplus.save_checkpoint(os.path.join(root, "sync"), saver, saver_opt, extra={"step": 3})
    handle = zeroplus.save_checkpoint(os.path.join(root, "async"), saver, saver_opt, extra={"step": 3}, async_=True)
    out["async_snapshot"] = handle.snapshot_bytes
    cm.train(saver, saver_opt, 1, rank, first_step=3)  # training goes on while the async save writes
    handle.wait()
    out["peak"] = store.peak_buffer_bytes
    want3 = cm.full_params("engine", ref)
    cm.train(ref, ref_opt, 1, rank, first_step=3)
    want = cm.full_params("engine", ref)
    out["saver"] = _diff(cm.full_params("engine", saver), want)
    for label, make in (("offloaded", lambda: _offloaded(nvme, group, seed=1)),
                        ("param only", lambda: _offloaded(nvme, group, seed=1, optimizer=False)),
                        ("memory s3", lambda: _in_memory(3, group, seed=1)),
                        ("memory s2", lambda: _in_memory(2, group, seed=1))):
        for ck in ("sync", "async"):
            model, opt = make()
            with _largest_read() as reads:
                extra = zeroplus.load_checkpoint(os.path.join(root, ck), model, opt)
            out[(label, ck, "reads")] = reads
            loaded = _diff(cm.full_params("engine", model), want3)
            cm.train(model, opt, 1, rank, first_step=3)
            out[(label, ck)] = (extra, loaded, _diff(cm.full_params("engine", model), want))
            if label == "offloaded":
                out[(label, ck, "side files")] = _side_files(opt)
    # model.load_state_dict of a full state dict: offloaded (records changed in place) and in-memory
    # engines take ref's step-3 state; one step from each (fresh optimizers) is the same.
    for precision in (None, "bf16"):
        stepped = []
        for make in (lambda: _offloaded(nvme, group, precision=precision, seed=1),
                     lambda: _in_memory(3, group, precision=precision, seed=1)):
            model, opt = make()
            model.load_state_dict(want3)
            loaded = _diff(cm.full_params("engine", model), want3)
            cm.train(model, opt, 1, rank, first_step=3)
            stepped.append((loaded, cm.full_params("engine", model)))
        out[("load_state_dict", precision)] = (stepped[0][0], stepped[1][0], _diff(stepped[0][1], stepped[1][1]))
    # The other way: an in-memory stage-2 checkpoint into the offloaded engine.
    s2, s2_opt = _in_memory(2, group)
    cm.train(s2, s2_opt, 3, rank)
    zeroplus.save_checkpoint(os.path.join(root, "s2"), s2, s2_opt)
    model, opt = _offloaded(nvme, group, seed=1)
    zeroplus.load_checkpoint(os.path.join(root, "s2"), model, opt)
    cm.train(model, opt, 1, rank, first_step=3)
    cm.train(s2, s2_opt, 1, rank, first_step=3)
    out["from s2"] = _diff(cm.full_params("engine", model), cm.full_params("engine", s2))
    return out


def _param_offload_one_rank(rank, world, root):
    """World size 2 -> 1: rank 0 alone loads the 2-rank checkpoint into an offloaded and an in-memory
    engine (a group of one); one step from each is the same."""
    import torch.distributed as dist

    import zeroplus

    solo = dist.new_group([0])
    if rank != 0:
        return None
    nvme = os.path.join(root, "nvme")
    results = {}
    for label, make in (("offloaded", lambda: _offloaded(nvme, solo, seed=2)),
                        ("memory", lambda: _in_memory(3, solo, seed=2))):
        model, opt = make()
        zeroplus.load_checkpoint(os.path.join(root, "sync"), model, opt)
        loaded = cm.full_params("engine", model)
        cm.train(model, opt, 1, rank, first_step=3)
        results[label] = (loaded, cm.full_params("engine", model))
    return {"loaded": _diff(results["offloaded"][0], results["memory"][0]),
            "stepped": _diff(results["offloaded"][1], results["memory"][1])}


def _corrupt_and_bf16(rank, world, root):
    """A checkpoint with a damaged block inside an offloaded shard's bytes: the load raises on
    every rank and the offloaded model (parameters in swap files) and its optimizer are exactly
    as before, no side record left. Then bf16: the saver's checkpoint loaded into offloaded and
    in-memory engines continues exactly like the saver."""
    import json

    import torch.distributed as dist

    import zeroplus

    group = dist.group.WORLD
    nvme = os.path.join(root, "nvme")
    out = {}
    model, opt = _offloaded(nvme, group, seed=3)
    cm.train(model, opt, 2, rank)
    bad = os.path.join(root, "bad")
    # 64-byte checksum blocks: the damaged block is touched only by the read of the frozen
    # parameter's shard, the last bucket the load stages (after the trainable ones).
    zeroplus.save_checkpoint(bad, model, opt, options=zeroplus.checkpoint.CheckpointOptions(block_bytes=64))
    cm.train(model, opt, 1, rank, first_step=2)  # the model moves on: a load would change it
    if rank == 0:
        with open(os.path.join(bad, "manifest.json")) as f:
            manifest = json.load(f)
        for fi, entry in enumerate(manifest["files"]):
            for c in manifest["chunks"]:
                if c[5] == fi and c[1] == "param" and c[0] == "frozen":
                    with open(os.path.join(bad, entry["name"]), "r+b") as f:
                        f.seek(c[6] + 1)
                        byte = f.read(1)
                        f.seek(c[6] + 1)
                        f.write(bytes([byte[0] ^ 0x40]))
    dist.barrier()
    before = cm.full_params("engine", model)
    opt_before = cm.consolidated_optimizer(opt, rank)
    try:
        zeroplus.load_checkpoint(bad, model, opt)
        out["bad"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["bad"] = f"{type(e).__name__}: {e}"
    out["unchanged"] = _diff(cm.full_params("engine", model), before)
    opt_after = cm.consolidated_optimizer(opt, rank)
    if rank == 0:
        out["opt unchanged"] = all(torch.equal(opt_before["state"][i][k], opt_after["state"][i][k])
                                   for i in opt_before["state"] for k in opt_before["state"][i])
    out["side files"] = _side_files(opt)
    # A disk that takes no side record (RLIMIT_FSIZE below one record: EFBIG, as ENOSPC would):
    # the load raises naming the swap file and changes nothing either.
    try:
        cm.fsize_limited(lambda: zeroplus.load_checkpoint(os.path.join(root, "sync"), model, opt), 2048)
        out["full"] = None
    except OSError as e:
        out["full"] = (e.errno, str(e))
    out["unchanged after full"] = _diff(cm.full_params("engine", model), before)
    out["side files after full"] = _side_files(opt)
    # bf16
    saver, saver_opt = _offloaded(nvme, group, precision="bf16")
    cm.train(saver, saver_opt, 3, rank)
    zeroplus.save_checkpoint(os.path.join(root, "bf16"), saver, saver_opt)
    loaded = []
    for make in (lambda: _offloaded(nvme, group, precision="bf16", seed=1),
                 lambda: _offloaded(nvme, group, precision="bf16", seed=1, optimizer=False),
                 lambda: _in_memory(3, group, precision="bf16", seed=1),
                 lambda: _engine(2, nvme, group, precision="bf16", seed=1)):  # masters in optimizer records
        m, o = make()
        zeroplus.load_checkpoint(os.path.join(root, "bf16"), m, o)
        loaded.append((m, o))
    cm.train(saver, saver_opt, 2, rank, first_step=3)
    want = cm.full_params("engine", saver)
    out["bf16"] = []
    for m, o in loaded:
        cm.train(m, o, 2, rank, first_step=3)
        out["bf16"].append(_diff(cm.full_params("engine", m), want))
    return out


def _param_offload_all(rank, world, root):
    t0 = __import__("time").perf_counter()
    out = {"main": _param_offload(rank, world, root)}
    out["one rank"] = _param_offload_one_rank(rank, world, root)
    out["corrupt"] = _corrupt_and_bf16(rank, world, root)
    out["seconds"] = __import__("time").perf_counter() - t0
    return out


def test_offloaded_parameters_checkpoint_stream_and_load_anywhere(tmp_path):
    results = run_pooled(_param_offload_all, 2, str(tmp_path), timeout=300)
    print(f"\n[test_checkpoint_offload] parameter offload: {results[0]['seconds']:.1f}s; a full disk at load: "
          f"{results[0]['corrupt']['full']}")
    for rank, r in enumerate(results):
        m = r["main"]
        # Streaming: the records are more than the pool; the saves never held more than the pool.
        assert m["records"] >= 2 * m["budget"] and m["peak"] <= m["budget"], (rank, m)
        assert m["saver"] == 0.0, (rank, m["saver"])
        for label in ("offloaded", "param only", "memory s3", "memory s2"):
            for ck in ("sync", "async"):
                extra, loaded, stepped = m[(label, ck)]
                assert extra == {"step": 3} and loaded == 0.0 and stepped == 0.0, (rank, label, ck, m[(label, ck)])
            assert m.get((label, "sync", "side files"), []) == []
        # Into the offloaded engine every parameter shard and optimizer state is read bucket by
        # bucket (once: staged as side records before anything changes), never all in one call.
        for ck in ("sync", "async"):
            largest, total = m[("offloaded", ck, "reads")]
            assert largest * 3 <= total, (rank, ck, largest, total)
        assert m["from s2"] == 0.0, (rank, m["from s2"])
        assert m[("load_state_dict", None)] == (0.0, 0.0, 0.0), (rank, m[("load_state_dict", None)])
        # bf16: the loaded parameters are the fp32 values rounded, exactly as in memory
        lo, lm, stepped = m[("load_state_dict", "bf16")]
        assert lo == lm and stepped == 0.0, (rank, m[("load_state_dict", "bf16")])
        c = r["corrupt"]
        assert c["bad"] is not None and "checksum" in c["bad"], (rank, c["bad"])
        assert c["unchanged"] == 0.0 and c["side files"] == [], (rank, c)
        assert c["full"] is not None and c["full"][0] == errno.EFBIG and "param-b" in c["full"][1], (rank, c["full"])
        assert c["unchanged after full"] == 0.0 and c["side files after full"] == [], (rank, c)
        assert all(d == 0.0 for d in c["bf16"]), (rank, c["bf16"])
    assert results[0]["corrupt"]["opt unchanged"] is True
    assert results[0]["one rank"] == {"loaded": 0.0, "stepped": 0.0}, results[0]["one rank"]
