"""Driver and worker of test_elastic_restart.py: torchrun's own launcher (elastic_launch, the
function `torchrun --standalone --max-restarts 1` calls, with its standalone rendezvous) run
once per try from one interpreter, workers forked from it, so a try costs its two attempts'
set-up and training rather than three interpreter start-ups.

Usage: elastic_driver.py TRIES_JSON  (a list of {"world", "victim", "die_step", "death",
"transport"}); prints one JSON line per try: {"try", "ok", "wall", "ranks", "error"}, or
{"try", "timeout": true} after which it kills its whole process group (the test starts it in a
session of its own). As a torchrun script: elastic_driver.py --worker DIE_STEP VICTIM DEATH prints
"rank R attempt A trained: <parameters>" (the test's one try through the torchrun command line).

The worker trains a tiny model for STEPS steps through DDP and zeroplus.ZeroRedundancyOptimizer
over backend "zeroplus" (an allreduce per step plus the optimizer's broadcasts). In torchrun's
attempt 0 (TORCHELASTIC_RESTART_COUNT) rank `victim` dies before step `die_step`, as `death` says:
  kill   SIGKILL (nothing runs after it: no atexit, no destructor),
  segv   SIGSEGV with the default action (a crash; core dumps are switched off first),
  exit   a Python exception after set-up (the rank exits 1 through the normal teardown),
  stop   SIGSTOP, then SIGKILL 1 s later from a helper process (a hung rank that is killed).
In attempt 1 rank r sleeps stagger[r] seconds before init_process_group, as ranks of a real
launch arrive at different times.
torchrun's agent then restarts every rank on the *same* rendezvous store (the agent store is
shared across attempts), and attempt 1 must train to the end on every rank with equal results.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

import zeroplus

STEPS = 6
PG_TIMEOUT_S = 20.0  # a set-up hang fails the attempt after this; the try's timeout is longer
TRY_TIMEOUT_S = 60.0


def _die(death: str) -> None:
    sys.stdout.flush()
    if death == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif death == "segv":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
    elif death == "exit":
        raise RuntimeError("elastic_driver: this rank fails on purpose after set-up")
    elif death == "stop":
        subprocess.Popen(["sh", "-c", f"sleep 1; kill -KILL {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    raise SystemExit(f"elastic_driver: unknown death {death!r}")


def train(die_step: int, victim: int, death: str, stagger=()):
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    if attempt > 0 and rank < len(stagger):
        # Ranks of a real launch reach init_process_group at different times (imports, data
        # loading); a late rank 0 is when the old attempt's keys used to be read.
        time.sleep(stagger[rank])
    dist.init_process_group("zeroplus", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = zeroplus.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    for step in range(STEPS):
        if attempt == 0 and rank == victim and step == die_step:
            _die(death)
        model(torch.full((3, 8), float(step + rank))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    dist.destroy_process_group()
    return rank, attempt, params


def run_try(index: int, t: dict) -> dict:
    os.environ["ZEROPLUS_SHM"] = "off" if t["transport"] == "tcp" else "on"
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=t["world"], run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # what --standalone sets
        max_restarts=1, monitor_interval=0.1, start_method="fork",
    )
    watchdog = threading.Timer(TRY_TIMEOUT_S, lambda: (print(json.dumps({"try": index, "timeout": True}), flush=True),
                                                       os.killpg(0, signal.SIGKILL)))
    watchdog.start()
    start = time.monotonic()
    try:
        results = elastic_launch(config, train)(t["die_step"], t["victim"], t["death"], t.get("stagger", ()))
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        results, error = {}, f"{type(e).__name__}: {e}"
    finally:
        watchdog.cancel()
    wall = time.monotonic() - start
    finished = sorted(r for r, attempt, _ in results.values() if attempt == 1)
    same = len({tuple(p) for _, _, p in results.values()}) == 1
    ok = error is None and finished == list(range(t["world"])) and same
    return {"try": index, "ok": ok, "wall": round(wall, 1), "ranks": finished, "same": same, "error": error}


def main() -> None:
    if sys.argv[1] == "--worker":
        rank, attempt, params = train(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        print(f"rank {rank} attempt {attempt} trained: {params}", flush=True)
        return
    os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the shared store is the point
    for i, t in enumerate(json.loads(sys.argv[1])):
        print(json.dumps(run_try(i, t)), flush=True)


if __name__ == "__main__":
    main()
