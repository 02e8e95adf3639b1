"""offload_param "cpu" on CUDA training (ZeRO-Infinity's parameter offload to host memory): needs a GPU.

Skipped without CUDA. Run on a GPU machine as `python -m pytest tests/python/test_cuda_param_offload.py -q -s`
(-s prints the step times). Every case trains, in one rank process, the same stage-3 model twice on
the same batches: in GPU memory without offload (the reference), and with offload_param
{"device": "cpu", "pin_memory": ...} or {"device": "nvme", ...} (zeroplus.offload.host_params, with
the NVMe parameter swapper under it for "nvme"), with offload_optimizer "cpu" or "nvme" (the
usual ZeRO-Infinity set-up: the step on the CPU, the new master cast into the host shard) or
without it (the step on the GPU, the master copied down). 1 rank, and 2 ranks on one GPU (backend
"zeroplus" with ZEROPLUS_CUDA_TRANSPORT unset: "auto" picks host staging for ranks that share a GPU,
since NCCL refuses them); fp32 and bf16. The model has a layer used twice per forward and a frozen one.

What must hold:
  * placement: between steps every offloaded bucket's parameter shard is in host memory (its
    device tensor and the module's parameters are empty; page-locked with pin_memory) and nothing
    of it is on the GPU (the store's device bytes are 0); inside a unit's forward its parameters are
    full-size CUDA tensors;
  * parity: fp32 parameters, optimizer state and losses equal the reference within 1e-6 (relative
    to the tensor's largest value; with offload_optimizer the step runs on the CPU's fused Adam,
    which rounds differently in the last bit); bf16 within 5 %;
  * a state_dict round trip: a fresh offloaded engine that loads the reference's model and optimizer
    state continues like the reference does;
  * gradients: with offload_param "nvme" and offload_optimizer ("cpu" or "nvme") the offloaded
    buckets' gradient shards are spilled to files (two per bucket once two passes ran), none is
    held in GPU memory or in the host tier's per-bucket buffers; otherwise nothing is spilled.
    Odd steps accumulate a second micro-batch (a spilled gradient read back, added to on the GPU).
A failure says which side failed: "reference" (the in-memory CUDA engine, not this path) or
"offload", with the rank's traceback.
Stream ordering (one process, the store alone, a second or so): a shard's copy up writes a device
buffer the caching allocator just handed out; a kernel still queued on the compute stream behind a
busy GPU (torch.cuda._sleep) that writes that memory must run before the copy, not after it (pinned,
pageable and NVMe mode; skipped when the allocator did not hand out the same block).
Not run on a GPU yet (written 2026-11-26 without one).
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
from offload_fakes import MemorySwapper

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")

STEPS = 4
LR = 1e-3
FP32_RTOL = 1e-6
BF16_RTOL = 5e-2  # a last-bit master difference can flip a bf16 rounding (0.4 %), which the next gradients carry
CONFIG = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}  # every unit's shard offloaded


class Net(nn.Module):
    """Five units; `b` runs twice per forward; `frozen` is never stepped."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)
        self.frozen = nn.Linear(64, 64)
        self.c = nn.Linear(64, 64)
        self.d = nn.Linear(64, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.frozen(h))
        return self.d(torch.tanh(self.c(h)))


def _batch(step: int, rank: int, device):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)


def _build(group, precision, param, optimizer, device):
    import zeroplus

    kw = {}
    if param is not None:
        kw["offload_param"] = param
    if optimizer is not None:
        kw["offload_optimizer"] = optimizer
    return zeroplus.initialize(Net().to(device), torch.optim.AdamW, stage=3, lr=LR, weight_decay=0.01,
                               mixed_precision=precision, process_group=group, config=CONFIG, **kw)


def _train(model, opt, rank, steps, device, start=0):
    """Odd steps accumulate a second micro-batch (a spilled gradient is read back, copied up and
    added to on the GPU)."""
    losses, step_s = [], []
    for step in range(start, start + steps):
        x, y = _batch(step, rank, device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x).float(), y)
        opt.backward(loss)
        if step % 2:
            x2, y2 = _batch(1000 + step, rank, device)
            opt.backward(nn.functional.mse_loss(model(x2).float(), y2))
        opt.clip_grad_norm_(1.0)
        opt.step()
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        opt.zero_grad()
        losses.append(loss.item())
    return losses, step_s


def _params(model) -> dict:
    import zeroplus

    sd = zeroplus.full_state_dict(model, rank0_only=False)
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def _placement(model, opt) -> dict:
    from zeroplus.zero.layout import is_resting

    store = getattr(opt.placement, "param_store", None)
    if store is None:
        return {"store": None}
    buckets = list(opt.buckets) + list(opt.placement.frozen_buckets)
    offloaded = [b for b in buckets if store.offloads(b)]
    store.drain()
    return {
        "store": type(store).__name__,
        "offloaded": len(offloaded),
        "buckets": len(buckets),
        "host_devices": sorted({store.host_shard(b).device.type for b in offloaded}),
        "host_pinned": [bool(store.host_shard(b).is_pinned()) for b in offloaded],
        "shard_devices": sorted({b.shard.device.type for b in offloaded}),
        "device_shard_elems": sum(b.shard.numel() for b in offloaded),
        "device_bytes": store.device_bytes,
        # Elements the module's parameters hold between uses (resting views hold none).
        "module_param_elems": sum(0 if is_resting(p.data) else p.numel() for p in model.parameters()),
        "master_devices": sorted({m.device.type for m in opt.masters}),
        "disk_bytes": store.disk_bytes(),
        **_gradients(opt),
    }


def _gradients(opt) -> dict:
    """Where the gradient shards of offloaded buckets are: spilled (files, none in GPU memory nor in
    the host tier's per-bucket buffers) or on the GPU."""
    import os

    spill = opt.reducer.spill
    spilled = [] if spill is None else [i for i in range(len(opt.buckets)) if spill.spills(i)]
    return {
        "grad_spill": spill is not None,
        "spilled": len(spilled),
        "grad_files": 0 if spill is None else sum(1 for n in os.listdir(spill.directory.path)
                                                  if n.startswith("grad-b")),
        "grad_bytes_written": 0 if spill is None else spill.bytes_written,
        "grads_resident": sum(opt.reducer.accum[i] is not None for i in spilled),
        "host_grad_bytes": 0 if opt.host_tier is None else opt.host_tier.grad_bytes,
    }


def _case(rank, group, precision, pin, optimizer, device="cpu"):
    root = tempfile.mkdtemp(prefix="zp-cuda-param-") if "nvme" in (device, optimizer) else None
    try:
        return _case_in_dir(rank, group, precision, pin, optimizer, device, root)
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


def _case_in_dir(rank, group, precision, pin, optimizer, device, root):
    cuda = torch.device("cuda", torch.cuda.current_device())
    param = {"device": device, "pin_memory": pin}
    if device == "nvme":
        param.update(nvme_path=root, buffer_count=2, buffer_size=1)  # a pool of 2 records
    opt_offload = {"device": optimizer, "pin_memory": True} if optimizer else None
    if optimizer == "nvme":
        opt_offload.update(nvme_path=root, buffer_count=2)
    try:
        ref, ref_opt = _build(group, precision, None, None, cuda)
        ref_losses, ref_step_s = _train(ref, ref_opt, rank, STEPS, cuda)
        ref_params, ref_state = _params(ref), ref_opt.state_dict()
    except Exception as e:
        raise RuntimeError(f"reference: the in-memory CUDA stage-3 engine ({precision or 'fp32'}) failed; this is "
                           f"not the offload path: {type(e).__name__}: {e}") from e
    try:
        model, opt = _build(group, precision, param, opt_offload, cuda)
        before = _placement(model, opt)
        inside = []  # (unit, parameter devices, numel) seen inside forward
        for n in ("a", "b", "frozen", "c", "d"):
            getattr(model, n).register_forward_pre_hook(
                lambda mod, _a, n=n: inside.append((n, sorted({p.device.type for p in mod.parameters()}),
                                                    sum(p.numel() for p in mod.parameters()))))
        losses, step_s = _train(model, opt, rank, STEPS, cuda)
        after = _placement(model, opt)
        full = {n: sum(p.numel() for p in getattr(Net(), n).parameters()) for n in ("a", "b", "frozen", "c", "d")}
        wrong_inside = [e for e in inside if e[1] != ["cuda"] or e[2] != full[e[0]]]
        params, state = _params(model), opt.state_dict()
        ref2, ref_opt2 = _build(group, precision, None, None, cuda)
        model2, opt2 = _build(group, precision, param, opt_offload, cuda)
        import zeroplus
        saved_model = zeroplus.full_state_dict(ref, rank0_only=False)
        for m, o in ((ref2, ref_opt2), (model2, opt2)):
            _train(m, o, rank, 1, cuda, start=20)
            m.load_state_dict(saved_model)
            o.load_state_dict(ref_state)
        _train(ref2, ref_opt2, rank, 2, cuda, start=STEPS)
        _train(model2, opt2, rank, 2, cuda, start=STEPS)
        after_params = _worst(_params(model2), _params(ref2))
        after_state = _worst(_state_tensors(opt2.state_dict()), _state_tensors(ref_opt2.state_dict()))
        after_load = _placement(model2, opt2)
    except Exception as e:
        raise RuntimeError(f"offload: offload_param {param}, offload_optimizer {opt_offload} ({precision or 'fp32'}) "
                           f"failed: {type(e).__name__}: {e}") from e
    return {"before": before, "after": after, "after_load": after_load, "inside": len(inside),
            "wrong_inside": wrong_inside[:5], "params": _worst(params, ref_params),
            "state": _worst(_state_tensors(state), _state_tensors(ref_state)), "losses": (losses, ref_losses),
            "after_params": after_params, "after_state": after_state,
            "step_ms": (1e3 * statistics.median(step_s[1:]), 1e3 * statistics.median(ref_step_s[1:]))}


CASES = [(None, True, "cpu", "cpu"), ("bf16", True, "cpu", "cpu"), ("bf16", False, "cpu", "cpu"),
         (None, True, None, "cpu"), ("bf16", False, None, "cpu"),
         ("bf16", True, "cpu", "nvme"), (None, True, None, "nvme"),
         (None, True, "cpu", "nvme"), (None, True, "nvme", "nvme"), ("bf16", True, "nvme", "nvme")]


def _case_id(case) -> str:
    precision, pin, optimizer, device = case
    return f"{precision or 'fp32'}-param_{device}-{'pinned' if pin else 'pageable'}-opt_{optimizer or 'gpu'}"


def _all_cases(rank, world):
    from harness import run_cases_in_own_groups

    torch.cuda.set_device(0)  # one GPU: every rank uses it
    torch.backends.cuda.matmul.allow_tf32 = False  # tiny parameter differences must not flip TF32 roundings
    return run_cases_in_own_groups(rank, world, {_case_id(c): functools.partial(_case_in, case=c) for c in CASES})


def _case_in(rank, group, case):
    return _case(rank, group, *case)


_RESULTS: dict[int, list] = {}


def _results(world: int) -> list:
    if world not in _RESULTS:
        from harness import run_distributed

        _RESULTS[world] = run_distributed(_all_cases, world, timeout=900, pg_timeout=300.0, start_method="spawn")
    return _RESULTS[world]


@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cuda_param_offload_matches_training_in_gpu_memory(world, case, monkeypatch):
    # 2 ranks on one GPU: the transport's "auto" must pick host staging by itself.
    monkeypatch.delenv("ZEROPLUS_CUDA_TRANSPORT", raising=False)
    precision, pin, optimizer, device = case
    key = _case_id(case)
    rtol = FP32_RTOL if precision is None else BF16_RTOL
    for r, per_rank in enumerate(_results(world)):
        status, res = per_rank[key]
        assert status == "ok", f"world {world}, rank {r}, {key}:\n{res}"
        where = f"world {world}, rank {r}, {key}"
        for when in ("before", "after", "after_load"):
            pl = res[when]
            assert pl["store"] == "HostParamStore", f"{where} ({when}): no host parameter store ({pl['store']})"
            assert pl["offloaded"] == pl["buckets"] == 5, f"{where} ({when}): {pl['offloaded']} of {pl['buckets']} " \
                                                          f"buckets offloaded, expected all 5"
            assert pl["host_devices"] == ["cpu"], f"{where} ({when}): host shards on {pl['host_devices']}"
            assert pl["shard_devices"] == ["cuda"] and pl["device_shard_elems"] == 0 and pl["device_bytes"] == 0, \
                f"{where} ({when}): parameter shards left on the GPU: {pl}"
            assert pl["module_param_elems"] == 0, f"{where} ({when}): module parameters not empty between uses"
            if pin and device == "cpu":  # (nvme: host_shard() returns copies of the records)
                assert all(pl["host_pinned"]), f"{where} ({when}): host shards not page-locked: {pl['host_pinned']}"
            if device == "nvme":
                assert pl["disk_bytes"] >= 5 * 4096, f"{where} ({when}): parameter records not on disk: {pl}"
            assert pl["master_devices"] == (["cpu"] if optimizer else ["cuda"]), \
                f"{where} ({when}): masters on {pl['master_devices']}"
            # "nvme" with the step on the host: gradients spilled to files as on CPU training;
            # else (the step on the GPU, or "cpu") they stay on the GPU (host_params.py)
            spills = device == "nvme" and optimizer is not None
            assert pl["grad_spill"] == spills, f"{where} ({when}): gradient spill {pl['grad_spill']}, expected {spills}"
            if spills:
                assert pl["spilled"] == 4 and pl["grads_resident"] == 0 and pl["host_grad_bytes"] == 0, \
                    f"{where} ({when}): spilled gradients held in GPU or host-tier memory: {pl}"
                if when != "before":
                    assert pl["grad_files"] == 2 * 4 and pl["grad_bytes_written"] > 0, \
                        f"{where} ({when}): gradient files missing: {pl}"
        assert res["inside"] >= STEPS * 6 and res["wrong_inside"] == [], \
            f"{where}: a unit's parameters inside its forward were not its full CUDA tensors: {res['wrong_inside']}"
        for what in ("params", "state", "after_params", "after_state"):
            worst, at = res[what]
            assert worst <= rtol, f"{where}: {what} differ from training in GPU memory by {worst:.3g} (relative) at {at}"
        losses, ref_losses = res["losses"]
        assert losses == pytest.approx(ref_losses, rel=max(rtol, 1e-6)), f"{where}: losses {losses} vs {ref_losses}"
        offload_ms, ref_ms = res["step_ms"]
        print(f"\n{where}: training step {offload_ms:.2f} ms with parameters on the host, {ref_ms:.2f} ms in GPU "
              f"memory (tiny model: latency, not bandwidth)")


# -- stream ordering of the store alone ------------------------------------------------------------

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: the CPU issues what follows long before it runs


class _Bucket:
    def __init__(self, n, device):
        self.shard = torch.arange(n, dtype=torch.float32, device=device)
        self.shard_numel, self.dtype = n, torch.float32


@pytest.mark.parametrize("mode", ("pinned", "pageable", "nvme"))
def test_copy_up_runs_after_the_queued_kernels_that_use_its_buffer(mode, tmp_path):
    from zeroplus.offload.host_params import HostParamStore
    from zeroplus.offload.policy import parse_offload

    cuda = torch.device("cuda", torch.cuda.current_device())
    n = 1 << 19  # 2 MiB of fp32: a large-pool block, the only free one of its size once freed
    bucket = _Bucket(n, cuda)
    knobs, swapper_for = {"device": "cpu", "pin_memory": mode == "pinned", "buffer_count": 1}, None
    if mode == "nvme":
        knobs, swapper_for = {"device": "nvme", "nvme_path": str(tmp_path)}, (lambda _proxies: MemorySwapper())
    store = HostParamStore(parse_offload("offload_param", knobs), cuda, [bucket], swapper_for=swapper_for)
    store.put_initial(bucket, bucket.shard)  # the device copy is freed: its block goes back to the allocator
    store.finish_initial()
    for _ in range(2):  # page-locked staging buffers allocated now (an allocation there might synchronize)
        store.pin(bucket)
        store.unpin(bucket)
    torch.cuda.synchronize()
    junk = torch.empty(n, dtype=torch.float32, device=cuda)
    where = junk.data_ptr()
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy; the fill below runs after it
    junk.fill_(-1.0)
    del junk  # freed while its fill is still queued: the next allocation of this size may get the block
    shard = store.pin(bucket)
    try:
        if shard.data_ptr() != where:
            pytest.skip("the caching allocator handed the copy up another block: nothing to order")
        got = shard.clone().cpu()  # after pin's wait for the copy (compute stream)
    finally:
        store.unpin(bucket)
    assert torch.equal(got, torch.arange(n, dtype=torch.float32)), \
        f"{mode}: the copy up ran before a kernel queued earlier wrote its buffer " \
        f"({int((got == -1.0).sum())} of {n} elements are the kernel's)"
