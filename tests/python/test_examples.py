"""The main job (examples/train_ddp.py under torchrun, backend="zeroplus") runs and learns."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _train(stage):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "plugin" / "python"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "examples" / "train_ddp.py"), "--steps", "6", "--stage", str(stage)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 6, proc.stdout
    assert losses[-1] < losses[0], losses
    states = [int(x) for x in re.findall(r"model state (\d+) bytes", proc.stdout)]
    ratios = [float(x) for x in re.findall(r"bytes: (\d+\.\d+)x", proc.stdout)]
    assert len(states) == 2 and len(ratios) == 2, proc.stdout
    return losses, max(ratios)


def test_main_job_trains_identically_at_every_stage_with_less_memory():
    # The default is stage 3. Every stage follows DDP + AdamW's trajectory (losses printed to 4
    # digits), and each holds less model state per rank than the one before (fp32 AdamW at 2
    # ranks: 16, 12, 10 and 8 bytes per parameter).
    runs = {stage: _train(stage) for stage in (0, 1, 2, 3)}
    reference = runs[0][0]
    for stage in (1, 2, 3):
        assert all(abs(a - b) <= 2e-4 for a, b in zip(runs[stage][0], reference)), (stage, runs[stage][0], reference)
    ratios = [runs[stage][1] for stage in (0, 1, 2, 3)]
    assert ratios[0] == 1.0 and ratios == sorted(ratios, reverse=True) and ratios[3] < 0.55, ratios
