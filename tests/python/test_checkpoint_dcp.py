"""zeroplus.checkpoint.AioStorageWriter / AioStorageReader under torch.distributed.checkpoint.

2 ranks (one launch): a state dict with replicated entries (DCP writes them once) and per-rank
entries round-trips through dcp.save/dcp.load with the zeroplus classes; torch's own
FileSystemReader reads the result (same layout) and the zeroplus reader reads torch's writer's;
a second save into the same directory, and a save into a directory where a data file name is a
planted symlink, fail without writing through or over anything.
"""

from __future__ import annotations

import os
import time

import torch

from harness import run_pooled


def _state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"shared": torch.randn(1000, generator=g), "nested": {"ints": torch.arange(10) * seed},
            f"rank{rank}": torch.full((300,), float(rank + seed)), "step": seed}


def _zeros_like(sd):
    return {k: (_zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else v)
            for k, v in sd.items()}


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _run(rank, world, root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from zeroplus.checkpoint import AioStorageReader, AioStorageWriter

    out = {}
    path = os.path.join(root, "ours")
    saved = _state(rank, 7)
    dcp.save(saved, storage_writer=AioStorageWriter(path))
    back = _zeros_like(saved)
    dcp.load(back, storage_reader=AioStorageReader(path))
    out["round_trip"] = _equal(saved, back)
    back = _zeros_like(saved)
    dcp.load(back, storage_reader=dcp.FileSystemReader(path))
    out["torch_reads_ours"] = _equal(saved, back)

    theirs = os.path.join(root, "theirs")
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(theirs))
    back = _zeros_like(saved)
    dcp.load(back, storage_reader=AioStorageReader(theirs))
    out["ours_reads_torch"] = _equal(saved, back)

    try:
        dcp.save(_state(rank, 8), storage_writer=AioStorageWriter(path))
        out["second_save"] = None
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        out["second_save"] = f"{type(e).__name__}: {e}"
    back = _zeros_like(saved)
    dcp.load(back, storage_reader=AioStorageReader(path))
    out["first_intact"] = _equal(saved, back)

    planted = os.path.join(root, "planted")
    victim = os.path.join(root, "victim.txt")
    if rank == 0:
        os.makedirs(planted)
        with open(victim, "w") as f:
            f.write("keep me")
        for r in range(world):
            os.symlink(victim, os.path.join(planted, f"__{r}_0.distcp"))
    dist.barrier()
    try:
        dcp.save(saved, storage_writer=AioStorageWriter(planted))
        out["planted"] = None
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        out["planted"] = f"{type(e).__name__}: {e}"
    with open(victim) as f:
        out["victim"] = f.read()
    dist.barrier()
    return out


def test_dcp_through_zeroplus_storage(tmp_path):
    t0 = time.monotonic()
    results = run_pooled(_run, 2, str(tmp_path), timeout=120)
    print(f"\ndcp storage cases on 2 ranks: {time.monotonic() - t0:.1f} s")
    for rank, r in enumerate(results):
        assert r["round_trip"] and r["torch_reads_ours"] and r["ours_reads_torch"], (rank, r)
        assert r["second_save"] is not None and "File exists" in r["second_save"], (rank, r["second_save"])
        assert r["first_intact"]
        assert r["planted"] is not None, f"rank {rank}: a save wrote through a planted symlink"
        assert r["victim"] == "keep me"
