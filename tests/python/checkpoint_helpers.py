"""What the checkpoint tests share with each other and with bench/checkpoint/kill_trials.py.

* The kill -9 trial (test_checkpoint_crash.py runs it KILLS times in CI, the bench 200+):
  `save_forever` is the child that saves in a loop and `verify_latest` the parent's check after
  each kill. Every parameter, buffer and the `extra` step of save k equal k, so a checkpoint
  verifies itself; three names in turn, so most saves replace a complete checkpoint (the atomic
  swap is killed too).
* The pooled-cases pattern of test_checkpoint_async.py / test_checkpoint_errors.py: every
  `case_<name>(root, rank, group)` function of a test module runs in one 2-rank pool
  (harness.run_pooled, each case in its own group), once per module.

The bench imports this file with tests/python on sys.path; it imports nothing from pytest.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from checkpoint_models import make
from harness import run_pooled


def save_forever(root: str, child: int, store: str, width: int, ready) -> None:
    """Saves ROOT/c<child>_<step % 3> forever (world size 1, stage 2, AdamW), every value equal to step."""
    import torch.distributed as dist

    import zeroplus

    dist.init_process_group("zeroplus", store=dist.FileStore(store, 1), rank=0, world_size=1)
    model, opt = zeroplus.initialize(make(0, width), torch.optim.AdamW, stage=2, lr=1e-3)
    # 4 KiB checksum blocks: ~250 per file, so verifying a file takes many read runs
    options = zeroplus.checkpoint.CheckpointOptions(block_bytes=4096)
    step = 0
    ready.set()
    while True:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                t.fill_(float(step))
        zeroplus.save_checkpoint(os.path.join(root, f"c{child:04d}_{step % 3}"), model, opt,
                                 extra={"step": step, "child": child}, options=options)
        step += 1


def verify_latest(root: str) -> tuple[int, int]:
    """(child, step) of the checkpoint `latest` names, after checking every checksum and value in
    it; AssertionError naming what is wrong (raised explicitly: the bench may run under -O)."""
    from zeroplus.checkpoint.consolidate import inspect, iter_tensors
    from zeroplus.checkpoint.reader import CheckpointReader

    summary = inspect(root)
    if not summary["ok"]:
        raise AssertionError(f"checksums: {summary['files']}")
    extra = summary["extra"]
    with CheckpointReader(root) as reader:
        for name, value in iter_tensors(reader):
            if not torch.all(value == float(extra["step"])):
                raise AssertionError(f"{name} is not all {extra['step']}")
    return extra["child"], extra["step"]


def cases_of(namespace: dict, root: str) -> dict:
    """{name: case(root, ...)} for every case_<name> function in a module's globals()."""
    return {name[5:]: functools.partial(fn, root) for name, fn in namespace.items() if name.startswith("case_")}


def pooled_results(all_cases, root: str, what: str) -> list:
    """Runs all_cases(rank, world, root) on 2 ranks once and prints the wall time."""
    t0 = time.monotonic()
    out = run_pooled(all_cases, 2, root, timeout=300)
    print(f"\n{what} on 2 ranks: {time.monotonic() - t0:.1f} s")
    return out


def ok_values(results, case: str) -> list:
    """Each rank's value of `case`, after asserting it succeeded on both (the child's traceback if not)."""
    values = []
    for rank in range(2):
        status, value = results[rank][case]
        assert status == "ok", f"rank {rank}:\n{value}"
        values.append(value)
    return values


def optimizer_state_diffs(a: dict, b: dict) -> list[str]:
    """Differences between two plain torch.optim state dicts (state tensors exactly, hyperparameters)."""
    diffs = []
    if sorted(a["state"]) != sorted(b["state"]):
        return [f"state indices {sorted(a['state'])} vs {sorted(b['state'])}"]
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        if sorted(sa) != sorted(sb):
            diffs.append(f"state[{i}] keys {sorted(sa)} vs {sorted(sb)}")
            continue
        for k in sa:
            va, vb = sa[k], sb[k]
            if isinstance(va, torch.Tensor):
                if not torch.equal(va.float().cpu().reshape(-1), vb.float().cpu().reshape(-1)):
                    diffs.append(f"state[{i}][{k}]")
            elif va != vb:
                diffs.append(f"state[{i}][{k}] {va} vs {vb}")
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        for k in ("lr", "weight_decay", "betas", "eps"):
            if ga.get(k) != gb.get(k):
                diffs.append(f"param_groups {k}: {ga.get(k)} vs {gb.get(k)}")
    return diffs
