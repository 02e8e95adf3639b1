"""offload_optimizer on CUDA training (ZeRO-Offload; ZeRO-Infinity's optimizer part): needs a GPU.

Skipped without CUDA. Run on a GPU machine as `python -m pytest tests/python/test_cuda_offload.py -q -s`
(-s prints the step times). Every case trains, in one rank process, the same model twice on the
same batches: in GPU memory without offload (the reference), and with offload_optimizer
{"device": "cpu", "pin_memory": True} or {"device": "nvme", ...} (the host tier,
zeroplus.offload.host_tier, with the NVMe swapper under it). 1 rank, and 2 ranks on one GPU
(backend "zeroplus" with ZEROPLUS_CUDA_TRANSPORT=host: NCCL refuses two ranks on one device),
stages 1-3, fp32 and bf16.

What must hold:
  * placement: the parameters are on the GPU; the fp32 masters and the optimizer state are on the
    host, the masters page-locked when pin_memory is set;
  * parity: fp32 parameters, optimizer state and losses equal the reference within 1e-6
    (relative to the tensor's largest value): not bitwise, because the step runs on the CPU's
    fused Adam kernel instead of the GPU's, and the two round differently in the last bit; bf16
    parameters and state within 5 % (a last-bit master difference can flip a bf16 rounding, 0.4 %,
    which the next gradients carry); a wrong step is off by ~100 %;
  * a state_dict round trip: a fresh offloaded engine that loads the reference's model and
    optimizer state continues like the reference does;
  * between backward and step no gradient bytes stay on the GPU (they live on the host).
A failure says which side failed: "reference" (the in-memory CUDA engine itself, not the
offload path) or "offload", with the rank's traceback.
Stream ordering (one process, the host tier alone): a gradient shard the step's source makes on
the compute stream (the reducer zero-fills an accumulator that a failed backward freed) is copied
down after its fill, not before (every copy follows the compute stream).
"""

from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time

import pytest
import torch
from torch import nn

from offload_compare import worst_relative as _worst, state_tensors as _state_tensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")

STEPS = 4
LR = 1e-3
FP32_RTOL = 1e-6
BF16_RTOL = 5e-2  # a last-bit master difference can flip a bf16 rounding (0.4 %), which the next gradients carry
CONFIG = {1: {"zero_optimization": {"reduce_bucket_size": 3000}},
          2: {"zero_optimization": {"reduce_bucket_size": 3000}},
          3: {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}


class Net(nn.Module):
    """Several buckets at every stage (a stage-3 unit per layer) and a parameter never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 64)
        self.d = nn.Linear(64, 8)
        self.never = nn.Linear(8, 8)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _batch(step: int, rank: int, device):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)


def _build(group, stage, precision, offload, device):
    import zeroplus

    kw = {} if offload is None else {"offload_optimizer": offload}
    return zeroplus.initialize(Net().to(device), torch.optim.AdamW, stage=stage, lr=LR, weight_decay=0.01,
                               mixed_precision=precision, process_group=group, config=CONFIG[stage], **kw)


def _train(model, opt, rank, steps, device, start=0, device_grads=None):
    """device_grads, a list: memory_report's gradient bytes (on the GPU) after each backward."""
    losses, step_s = [], []
    for step in range(start, start + steps):
        x, y = _batch(step, rank, device)
        loss = nn.functional.mse_loss(model(x).float(), y)
        opt.backward(loss)
        if device_grads is not None:
            device_grads.append(__import__("zeroplus").memory_report(model, opt)["gradients"])
        opt.clip_grad_norm_(1.0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        opt.zero_grad()
        losses.append(loss.item())
    return losses, step_s


def _params(model, stage) -> dict:
    import zeroplus

    if stage == 3:
        sd = zeroplus.full_state_dict(model, rank0_only=False)
    else:
        sd = model.state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def _case(rank, group, stage, precision, device):
    cuda = torch.device("cuda", torch.cuda.current_device())
    root = tempfile.mkdtemp(prefix="zp-cuda-offload-") if device == "nvme" else None
    offload = {"device": device, "pin_memory": device == "cpu"}
    if root is not None:
        offload.update(nvme_path=root, buffer_count=2)
    try:
        try:
            ref, ref_opt = _build(group, stage, precision, None, cuda)
            ref_losses, ref_step_s = _train(ref, ref_opt, rank, STEPS, cuda)
            ref_params, ref_state = _params(ref, stage), ref_opt.state_dict()
        except Exception as e:
            raise RuntimeError(f"reference: the in-memory CUDA engine (stage {stage}, {precision or 'fp32'}) failed; "
                               f"this is not the offload path: {type(e).__name__}: {e}") from e
        try:
            model, opt = _build(group, stage, precision, offload, cuda)
            tier = getattr(opt, "host_tier", None)
            placement = {
                "tier": tier is not None,
                "param_devices": sorted({p.device.type for p in model.parameters()}),
                "master_devices": sorted({m.device.type for m in opt.masters}),
                "masters_pinned": [bool(m.is_pinned()) for m in opt.masters if m.numel()],
            }
            device_grads = []
            losses, step_s = _train(model, opt, rank, STEPS, cuda, device_grads=device_grads)
            placement["device_grads"] = device_grads  # gradient shards on the GPU between backward and step
            # Buckets whose gradient shard the last step found copied during backward, of all.
            placement["found_on_host"] = (tier.found_on_host if tier is not None else None, len(opt.buckets))
            placement["state_devices"] = sorted({t.device.type for bo in opt.bucket_optimizers
                                                 for t in bo.state_tensors()})
            params, state = _params(model, stage), opt.state_dict()
            # Round trip: a fresh offloaded engine and a fresh reference load the reference's model
            # and sharded optimizer state (after a step, so there is state to replace) and go on.
            ref2, ref_opt2 = _build(group, stage, precision, None, cuda)
            model2, opt2 = _build(group, stage, precision, offload, cuda)
            saved_model = ref.state_dict() if stage != 3 else None
            for m, o in ((ref2, ref_opt2), (model2, opt2)):
                _train(m, o, rank, 1, cuda, start=20)
                if stage == 3:
                    import zeroplus
                    m.load_state_dict(zeroplus.full_state_dict(ref, rank0_only=False))
                else:
                    m.load_state_dict(saved_model)
                o.load_state_dict(ref_state)
            _train(ref2, ref_opt2, rank, 2, cuda, start=STEPS)
            _train(model2, opt2, rank, 2, cuda, start=STEPS)
            after_params = _worst(_params(model2, stage), _params(ref2, stage))
            after_state = _worst(_state_tensors(opt2.state_dict()), _state_tensors(ref_opt2.state_dict()))
        except Exception as e:
            raise RuntimeError(f"offload: offload_optimizer {offload} (stage {stage}, {precision or 'fp32'}) failed: "
                               f"{type(e).__name__}: {e}") from e
        return {**placement, "params": _worst(params, ref_params),
                "state": _worst(_state_tensors(state), _state_tensors(ref_state)),
                "losses": (losses, ref_losses), "after_params": after_params, "after_state": after_state,
                "step_ms": (1e3 * statistics.median(step_s[1:]), 1e3 * statistics.median(ref_step_s[1:]))}
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


CASES = ([(stage, None, device) for stage in (1, 2, 3) for device in ("cpu", "nvme")]
         + [(2, "bf16", "cpu"), (3, "bf16", "cpu"), (1, "bf16", "nvme")])


def _case_id(case) -> str:
    stage, precision, device = case
    return f"stage{stage}-{precision or 'fp32'}-{device}"


def _all_cases(rank, world):
    from harness import run_cases_in_own_groups

    torch.cuda.set_device(0)  # one GPU: every rank uses it
    # The two sides' tiny parameter differences must not flip TF32 roundings.
    torch.backends.cuda.matmul.allow_tf32 = False
    return run_cases_in_own_groups(rank, world, {_case_id(c): functools.partial(_case_in, case=c) for c in CASES})


def _case_in(rank, group, case):
    return _case(rank, group, *case)


def _results(world: int) -> list:
    from harness import run_on_one_gpu_once

    return run_on_one_gpu_once(_all_cases, world, timeout=900)


@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cuda_offload_matches_training_in_gpu_memory(world, case):
    stage, precision, device = case
    key = _case_id(case)
    rtol = FP32_RTOL if precision is None else BF16_RTOL
    for r, per_rank in enumerate(_results(world)):
        status, res = per_rank[key]
        assert status == "ok", f"world {world}, rank {r}, {key}:\n{res}"
        where = f"world {world}, rank {r}, {key}"
        assert res["tier"], f"{where}: the engine has no host tier (offload_optimizer was ignored on CUDA)"
        assert res["param_devices"] == ["cuda"], f"{where}: parameters on {res['param_devices']}, expected the GPU"
        assert res["master_devices"] == ["cpu"], f"{where}: fp32 masters on {res['master_devices']}, expected the host"
        assert res["state_devices"] == ["cpu"], f"{where}: optimizer state on {res['state_devices']}, expected the host"
        found, buckets = res["found_on_host"]
        assert found == buckets, f"{where}: the step found {found} of {buckets} gradient shards copied in backward"
        assert res["device_grads"] == [0] * len(res["device_grads"]), \
            f"{where}: gradient bytes left on the GPU after backward {res['device_grads']} (they live on the host)"
        if device == "cpu":  # pin_memory=True
            assert res["masters_pinned"] and all(res["masters_pinned"]), \
                f"{where}: masters not page-locked with pin_memory=True: {res['masters_pinned']}"
        for what in ("params", "state", "after_params", "after_state"):
            worst, at = res[what]
            # fp32: not bitwise: CPU and GPU Adam kernels round differently in the last bit.
            assert worst <= rtol, \
                f"{where}: {what} differ from training in GPU memory by {worst:.3g} (relative) at {at}"
        losses, ref_losses = res["losses"]
        assert losses == pytest.approx(ref_losses, rel=max(rtol, 1e-6)), f"{where}: losses {losses} vs {ref_losses}"
        offload_ms, ref_ms = res["step_ms"]
        print(f"\n{where}: step {offload_ms:.2f} ms offloaded, {ref_ms:.2f} ms in GPU memory (tiny model: latency, "
              f"not bandwidth)")


# -- stream ordering of the host tier alone ---------------------------------------------------------

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: the CPU issues what follows long before it runs


def test_step_copy_of_a_shard_made_at_the_step_runs_after_its_fill():
    from zeroplus.offload.host_tier import HostTier

    cuda = torch.device("cuda", torch.cuda.current_device())
    n = 1 << 19  # 2 MiB of fp32: a large-pool block, the only free one of its size once freed
    tier = HostTier(cuda, [torch.zeros(n, device=cuda)], pin_memory=True)
    # A first step allocates the bucket's page-locked gradient buffer (an allocation there might
    # synchronize); the second reuses it.
    tier.begin_step([0], lambda _b: torch.zeros(n, device=cuda))
    tier.gradient(0)
    tier.end_step()
    torch.cuda.synchronize()
    junk = torch.full((n,), 7.0, device=cuda)
    torch.cuda.synchronize()
    where = junk.data_ptr()
    del junk  # its block holds 7s
    made = []

    def source(_b):  # as reducer.shard() for an accumulator a failed backward freed: zeros, made now
        torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy: the fill below runs late
        t = torch.zeros(n, device=cuda)
        made.append(t)
        return t

    try:
        tier.begin_step([0], source)
        got = tier.gradient(0).clone()
    finally:
        tier.end_step()
    if made[0].data_ptr() != where:
        pytest.skip("the caching allocator handed the shard another block: nothing to order")
    assert torch.equal(got, torch.zeros(n)), \
        f"the step's copy read the shard before its fill ({int((got == 7.0).sum())} of {n} elements are stale)"
