"""Checkpoints of CUDA training: save_checkpoint / load_checkpoint round trips; needs a GPU.

Skipped without CUDA. Run on a GPU machine as `python -m pytest tests/python/test_cuda_checkpoint.py -q`.
The shard writer (optimizers/core/checkpoint/shard_file_writer, driven by checkpoint/shard_io.py)
gets a host copy of every CUDA piece (masters, optimizer state, stage-3 shards) and holds it only
while it still reads it; the loader reads into host tensors and copies them up. Every case, in one
rank process, at 1 rank and at 2 ranks on one GPU (backend "zeroplus", host-staged transport):

  * trains STEPS steps, saves (synchronously, or async_=True with training going on at once), trains
    STEPS more: the reference;
  * builds a fresh engine, loads the checkpoint and trains the same STEPS steps;
  * requires the parameters (full state dict) and the optimizer state to equal the reference's
    bit for bit (same device, same kernels, same batches: a checkpoint must not change one bit),
    and the loaded model's parameters to stay on the GPU.

Stages 1-3, fp32 and bf16 mixed precision; a failure names the case and the rank's traceback.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")

STEPS = 3
LR = 1e-3
CONFIG = {1: {"zero_optimization": {"reduce_bucket_size": 3000}},
          2: {"zero_optimization": {"reduce_bucket_size": 3000}},
          3: {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
CASES = [(stage, precision, async_) for stage in (1, 2, 3) for precision in (None, "bf16") for async_ in (False, True)]


class Net(nn.Module):
    """Several buckets at every stage (a stage-3 unit per layer), a piece over 1 MiB (the writer's
    large-piece path) and a parameter never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 640)
        self.b = nn.Linear(640, 640)  # 409,600 weights: 1.6 MB in fp32
        self.c = nn.Linear(640, 8)
        self.never = nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _batch(step: int, rank: int, device):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)


def _build(group, stage, precision, device):
    import zeroplus

    return zeroplus.initialize(Net().to(device), torch.optim.AdamW, stage=stage, lr=LR, weight_decay=0.01,
                               mixed_precision=precision, process_group=group, config=CONFIG[stage])


def _train(model, opt, rank, device, start):
    for step in range(start, start + STEPS):
        x, y = _batch(step, rank, device)
        opt.backward(nn.functional.mse_loss(model(x).float(), y))
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _params(model, stage) -> dict:
    import zeroplus

    sd = zeroplus.full_state_dict(model, rank0_only=False) if stage == 3 else model.state_dict()
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def _state(opt) -> list:
    """Every tensor of the optimizer's sharded state dict, on the host, in a fixed order."""
    out = []
    for i, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            if isinstance(v, torch.Tensor):
                out.append((f"{i}.{k}", v.detach().cpu().clone()))
    return out


def roundtrip_case(rank, group, stage, precision, async_, device):
    """The module doc's case on `device`; returns what the test compares (device-agnostic, so the
    same function can be run on CPU by hand)."""
    import torch.distributed as dist
    import zeroplus

    root = tempfile.mkdtemp(prefix="zp-cuda-ckpt-") if rank == 0 else None
    box = [root]
    dist.broadcast_object_list(box, src=0, group=group)
    root = box[0]
    try:
        model, opt = _build(group, stage, precision, device)
        _train(model, opt, rank, device, 0)
        handle = zeroplus.save_checkpoint(os.path.join(root, "ck"), model, opt, async_=async_)
        _train(model, opt, rank, device, STEPS)  # an async save's writes overlap these steps
        handle.wait()
        ref_params, ref_state = _params(model, stage), _state(opt)
        del model, opt

        model, opt = _build(group, stage, precision, device)
        zeroplus.load_checkpoint(root, model, opt)
        devices = sorted({p.device.type for p in model.parameters()})
        _train(model, opt, rank, device, STEPS)
        params, state = _params(model, stage), _state(opt)
        bad_params = [k for k in ref_params if not torch.equal(ref_params[k], params[k])]
        bad_state = [a for (a, x), (_b, y) in zip(ref_state, state) if not torch.equal(x, y)]
        return {"bad_params": bad_params, "bad_state": bad_state, "state_keys": len(ref_state) == len(state),
                "devices": devices}
    finally:
        dist.barrier(group)
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def _case_id(case) -> str:
    stage, precision, async_ = case
    return f"stage{stage}-{precision or 'fp32'}-{'async' if async_ else 'sync'}"


def _all_cases(rank, world):
    from harness import run_cases_in_own_groups

    torch.cuda.set_device(0)  # one GPU: every rank uses it
    return run_cases_in_own_groups(rank, world, {
        _case_id(c): functools.partial(_case_in, case=c) for c in CASES})


def _case_in(rank, group, case):
    return roundtrip_case(rank, group, *case, device="cuda")


def _results(world: int) -> list:
    from harness import run_on_one_gpu_once

    return run_on_one_gpu_once(_all_cases, world, timeout=600)


@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cuda_checkpoint_resumes_bit_for_bit(world, case):
    key = _case_id(case)
    for r, per_rank in enumerate(_results(world)):
        status, res = per_rank[key]
        where = f"world {world}, rank {r}, {key}"
        assert status == "ok", f"{where}:\n{res}"
        assert res["devices"] == ["cuda"], f"{where}: loaded parameters on {res['devices']}, expected the GPU"
        assert res["state_keys"], f"{where}: the resumed optimizer state has other tensors than the reference's"
        assert res["bad_params"] == [], f"{where}: parameters differ from the run that never checkpointed: " \
                                        f"{res['bad_params']}"
        assert res["bad_state"] == [], f"{where}: optimizer state differs: {res['bad_state'][:5]}"
