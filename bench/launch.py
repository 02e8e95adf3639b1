"""Spawning a bench's ranks: run_ranks(worker, world, *args) starts `world` spawned processes
running worker(rank, world, store_path, *args, queue) over a FileStore in a temporary directory,
and returns rank 0's result dict, or {"error": the first rank's error} when a rank reported one.
Each worker puts exactly one dict with "rank" (and "error" when it failed) on the queue.
"""

from __future__ import annotations

import os
import tempfile

import torch.multiprocessing as mp


def run_ranks(worker, world: int, *args, timeout_s: float = 3600) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=worker, args=(r, world, os.path.join(d, "store"), *args, q)) for r in range(world)]
        for p in procs:
            p.start()
        results = [q.get(timeout=timeout_s) for _ in procs]
        for p in procs:
            p.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    return next(r for r in results if r["rank"] == 0)
