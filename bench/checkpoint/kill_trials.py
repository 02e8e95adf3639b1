"""kill -9 trials of zeroplus checkpoints: the 200-trial version of tests/python/test_checkpoint_crash.py.

    .venv/bin/python bench/checkpoint/kill_trials.py [--trials 200] [--width 4096] [--out PATH]

A child process (world size 1, stage 2, AdamW; tests/python/checkpoint_helpers.py's
save_forever, the same child as the CI test's) saves in a loop under three names in turn (so
most saves replace a complete checkpoint by the atomic swap), every parameter, buffer and the
`extra` step equal to the step number. The parent SIGKILLs it at a random point 0-300 ms after it
is ready, TRIALS times. After each kill it checks that the checkpoint `latest` names passes
`inspect` (every checksum), that every value in it equals its `extra` step, that (child, step)
never goes backwards, and that staging directories of killed saves do not pile up. Prints and
writes PATH.json / PATH.md: trials, how many kills landed inside a save (a new staging directory
was left), failures (must be 0), wall time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugin" / "python"))
sys.path.insert(0, str(ROOT / "tests" / "python"))  # the child and the check are the CI test's

from checkpoint_helpers import save_forever, verify_latest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint-kill-latest"))
    args = ap.parse_args()
    import zeroplus  # noqa: F401  (the parent verifies; the library must load here too)

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "zeroplus"])
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="zeroplus-kill-")
    root = os.path.join(work, "ckpts")
    t0 = time.monotonic()
    trials = verified = inside = 0
    failures, previous, staged, max_left, max_files_left = [], None, set(), 0, 0
    child = 0
    try:
        while trials < args.trials:
            child += 1
            ready = ctx.Event()
            p = ctx.Process(target=save_forever, args=(root, child, os.path.join(work, f"store{child}"), args.width, ready),
                            daemon=True)
            p.start()
            if not ready.wait(120):
                p.kill()
                sys.exit(f"child {child} did not start")
            time.sleep(rng.uniform(0.0, 0.3))
            p.kill()
            p.join()
            trials += 1
            if not os.path.exists(os.path.join(root, "latest")):
                continue
            try:
                got = verify_latest(root)
                if previous is not None and got < previous:
                    raise AssertionError(f"latest went backwards: {previous} -> {got}")
                previous = got
                verified += 1
            except Exception as e:  # noqa: BLE001 - counted and reported
                failures.append(f"trial {trials}: {type(e).__name__}: {e}")
            left = {n for n in os.listdir(root) if n.startswith(".")}
            inside += bool(left - staged)
            staged = left
            # directories: removed by the next save; `latest`'s temporary files: after 10 minutes
            max_left = max(max_left, sum(os.path.isdir(os.path.join(root, n)) for n in left))
            max_files_left = max(max_files_left, sum(not os.path.isdir(os.path.join(root, n)) for n in left))
            if trials % 20 == 0:
                print(f"{trials} trials, {verified} verified, {len(failures)} failures", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = time.monotonic() - t0
    report = {"trials": trials, "verified": verified, "kills_inside_a_save": inside, "failures": failures,
              "max_staging_dirs_left": max_left, "max_temp_files_left": max_files_left, "wall_s": round(wall, 1), "seed": args.seed, "width": args.width}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    text = (f"kill -9 trials: {trials}, verified after the kill: {verified}, kills inside a save: {inside}, "
            f"failures: {len(failures)}, staging directories left at most: {max_left}, temporary files of "
            f"latest left at most: {max_files_left}, {wall:.0f} s")
    out.with_suffix(".md").write_text(text + "\n" + "".join(f"* {f}\n" for f in failures))
    print(text)
    for f in failures:
        print(f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
