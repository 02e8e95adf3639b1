"""The main job (examples/train_ddp.py under torchrun, backend="zeroplus") runs and learns."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _train(optimizer):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "plugin" / "python"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "examples" / "train_ddp.py"), "--steps", "6", "--optimizer", optimizer]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 6, proc.stdout
    assert losses[-1] < losses[0], losses
    shards = [int(x) for x in re.findall(r"optimizer state (\d+) bytes", proc.stdout)]
    assert len(shards) == 2, proc.stdout
    return losses


def test_main_job_zero_and_adamw_train_identically():
    # The main job learns with either optimizer, and ZeRO-1 with the fused kernel does not change
    # the trajectory (losses are printed to 4 digits).
    assert _train("zero") == _train("adamw")
