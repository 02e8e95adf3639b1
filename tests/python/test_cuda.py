"""The CUDA paths on a GPU: the backend's collectives on CUDA tensors (NCCL at one rank, the
host-staging transport with two ranks on one GPU), the fused CUDA optimizer kernels against
torch's fused=True, and ZeRO stages 1-3 on CUDA against DDP on the same GPU.

CI machines have no GPU: every test here is skipped there, with the reason. scripts/gpu_check.sh
runs this file on a machine with one (it builds libzeroplus.so with CUDA first); the figures of
the last such run are in docs/gpu.md.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_pooled

_HAS_GPU = torch.cuda.is_available()


def _has_cuda_kernels() -> bool:
    import zeroplus  # noqa: F401  (loads the library)

    return bool(torch.ops.zeroplus.has_cuda_kernels())


pytestmark = [
    pytest.mark.skipif(not _HAS_GPU, reason="needs a CUDA GPU (CI machines have none; scripts/gpu_check.sh runs "
                                            "this file on one)"),
]


@pytest.fixture(scope="module", autouse=True)
def _cuda_build():
    if not _has_cuda_kernels():
        pytest.fail("a GPU is present but libzeroplus.so was built without CUDA (scripts/gpu_check.sh builds it "
                    "with -DZEROPLUS_WITH_CUDA=ON)")


# -- collectives -----------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def _values(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integers (exact in every dtype above), different per rank."""
    base = torch.arange(n, dtype=torch.int64) % 7 + rank * 3 + salt
    return base.to(dtype).cuda()


def _collective_cases(rank: int, world: int) -> dict:
    """Every c10d collective on CUDA tensors; returns {name: None} or raises on the first wrong value."""
    import torch.distributed as dist

    def expect(name, got, want):
        got = got.cpu()
        want = want.cpu() if isinstance(want, torch.Tensor) else want
        if not torch.equal(got, want):
            raise AssertionError(f"{name}: rank {rank} got {got.tolist()[:8]}..., want {want.tolist()[:8]}...")

    done = {}
    for dtype in _DTYPES:
        tag = str(dtype).replace("torch.", "")
        n = 1000 + 3  # not a multiple of anything
        # all_reduce SUM / MAX, sync and async
        t = _values(rank, n, dtype)
        dist.all_reduce(t)
        expect(f"all_reduce/{tag}", t, sum(_values(r, n, dtype).cpu() for r in range(world)))
        t = _values(rank, n, dtype)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True).wait()
        expect(f"all_reduce_max/{tag}", t, _values(world - 1, n, dtype))
        # broadcast from the last rank
        t = _values(rank, n, dtype)
        dist.broadcast(t, src=world - 1)
        expect(f"broadcast/{tag}", t, _values(world - 1, n, dtype))
        # all_gather (list) and all_gather_into_tensor
        outs = [torch.empty(n, dtype=dtype, device="cuda") for _ in range(world)]
        dist.all_gather(outs, _values(rank, n, dtype))
        for r in range(world):
            expect(f"all_gather/{tag}[{r}]", outs[r], _values(r, n, dtype))
        flat = torch.empty(world * n, dtype=dtype, device="cuda")
        dist.all_gather_into_tensor(flat, _values(rank, n, dtype))
        expect(f"all_gather_into_tensor/{tag}", flat, torch.cat([_values(r, n, dtype).cpu() for r in range(world)]))
        # reduce_scatter_tensor: rank r gets the sum of everyone's slice r
        inp = torch.cat([_values(rank, n, dtype, salt=s) for s in range(world)])
        out = torch.empty(n, dtype=dtype, device="cuda")
        dist.reduce_scatter_tensor(out, inp)
        expect(f"reduce_scatter_tensor/{tag}", out, sum(_values(r, n, dtype, salt=rank).cpu() for r in range(world)))
        # reduce to rank 0
        t = _values(rank, n, dtype)
        dist.reduce(t, dst=0)
        if rank == 0:
            expect(f"reduce/{tag}", t, sum(_values(r, n, dtype).cpu() for r in range(world)))
        # all_to_all_single, equal splits
        inp = torch.cat([_values(rank, 5, dtype, salt=10 * d) for d in range(world)])
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp)
        expect(f"all_to_all_single/{tag}", out, torch.cat([_values(s, 5, dtype, salt=10 * rank).cpu()
                                                            for s in range(world)]))
        done[tag] = None
    # gather / scatter (fp32), barrier, send/recv
    t = _values(rank, 17, torch.float32)
    gathered = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
    dist.gather(t, gathered, dst=0)
    if rank == 0:
        for r in range(world):
            expect(f"gather[{r}]", gathered[r], _values(r, 17, torch.float32))
    out = torch.empty(17, device="cuda")
    dist.scatter(out, [_values(r, 17, torch.float32, salt=1) for r in range(world)] if rank == 0 else None, src=0)
    expect("scatter", out, _values(rank, 17, torch.float32, salt=1))
    dist.barrier()
    if world > 1:
        if rank == 0:
            dist.send(_values(0, 33, torch.float32, salt=5), dst=1)
        elif rank == 1:
            got = torch.empty(33, device="cuda")
            dist.recv(got, src=0)
            expect("send/recv", got, _values(0, 33, torch.float32, salt=5))
    # the results are on the caller's stream: a kernel right after an async op sees them
    t = torch.full((1 << 20,), float(rank + 1), device="cuda")
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    total = float(t.sum().item())
    want = float(sum(range(1, world + 1)) * (1 << 20))
    if total != want:
        raise AssertionError(f"async all_reduce then sum: {total} != {want}")
    torch.cuda.synchronize()
    return done


def _collectives_in_rank(rank, world):
    torch.cuda.set_device(0)
    return _collective_cases(rank, world)


def test_collectives_on_cuda_tensors_nccl_one_rank():
    """World size 1 through the NCCL transport (the default in CUDA builds)."""
    (out,) = run_pooled(_collectives_in_rank, 1, timeout=300)
    assert set(out) == {str(d).replace("torch.", "") for d in _DTYPES}


def test_collectives_on_cuda_tensors_two_ranks_one_gpu_host_transport():
    """Two ranks on the one GPU (NCCL refuses that): the host-staging transport."""
    outs = run_pooled(_collectives_in_rank, 2, timeout=300, env={"ZEROPLUS_CUDA_TRANSPORT": "host"})
    assert all(set(o) == {str(d).replace("torch.", "") for d in _DTYPES} for o in outs)


def test_collectives_two_ranks_one_gpu_default_transport():
    """Two ranks on one GPU with cuda_transport left at "auto": NCCL would refuse the duplicate
    GPU, so auto must notice it (process_group/adapter/cuda_transport.cpp) and stage through host."""
    outs = run_pooled(_collectives_in_rank, 2, timeout=300)
    assert all(set(o) == {str(d).replace("torch.", "") for d in _DTYPES} for o in outs)


# -- fused CUDA optimizers against torch's fused=True ----------------------------------------------

_SHAPES = {"1x16M": [(1 << 24,)], "1000x4096": [(4096,)] * 1000}
_KWARGS = {"Adam": dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01),
           "AdamW": dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01),
           "SGD": dict(lr=1e-2, momentum=0.9, weight_decay=0.01)}


def _params_and_grads(shapes, steps, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    grads = [[torch.randn(s, device="cuda", generator=g) for s in shapes] for _ in range(steps)]
    return params, grads


def _run(cls, params, grads, kwargs):
    ps = [p.clone().requires_grad_(True) for p in params]
    opt = cls(ps, **kwargs)
    for step_grads in grads:
        for p, gr in zip(ps, step_grads):
            p.grad = gr.to(p.dtype)
        opt.step()
    torch.cuda.synchronize()
    return [p.detach() for p in ps], opt


@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("name", list(_KWARGS))
def test_fused_cuda_optimizer_matches_torch_fused_fp32(name, shape):
    import zeroplus.optim as zo

    params, grads = _params_and_grads(_SHAPES[shape], steps=3)
    ours, opt = _run(getattr(zo, name), params, grads, _KWARGS[name])
    ref, _ = _run(getattr(torch.optim, name), params, grads, {**_KWARGS[name], "fused": True})
    for a, b in zip(ours, ref):
        assert a.device.type == "cuda"
        err = (a - b).abs().max().item()
        assert err <= 2e-6, f"{name} {shape}: max |ours - torch fused| = {err}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(_KWARGS))
def test_fused_cuda_optimizer_16bit_params(name, dtype):
    """16-bit parameters keep fp32 state in zeroplus (torch keeps it in the parameter dtype, so
    torch is no reference here): the CUDA kernel must match zeroplus's CPU kernel, whose 16-bit
    semantics tests/python/test_optim_fused.py checks, within 2 units in the last place (CUDA's
    sqrt/div are correctly rounded like the CPU's; a rounding that flips once may move later steps by one more
    ulp). The sizes include an odd tail and a view at an odd offset (the kernels' scalar loops)."""
    import zeroplus.optim as zo

    shapes = [(4096,)] * 8 + [(1 << 20,), (4099,), (3,)]
    params, grads = _params_and_grads(shapes, steps=3)
    low = [p.to(dtype) for p in params]
    low_grads = [[g.to(dtype) for g in s] for s in grads]
    ours, _ = _run(getattr(zo, name), low, low_grads, _KWARGS[name])
    cpu, _ = _run(getattr(zo, name), [p.cpu() for p in low], [[g.cpu() for g in s] for s in low_grads], _KWARGS[name])
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    for a, b in zip(ours, cpu):
        assert a.dtype == dtype and a.device.type == "cuda"
        a, b = a.float().cpu(), b.float()
        ulps = ((a - b).abs() / (b.abs().clamp_min(tiny) * eps)).max().item()
        assert ulps <= 2, f"{name} {dtype}: CUDA vs CPU kernel differ by {ulps:.1f} ulp"


def test_fused_cuda_optimizer_odd_offsets_fp32():
    """Parameters that are views at offsets not a multiple of 4 elements (the scalar loop) and an
    odd length: equal to torch's fused=True like the packed path."""
    import zeroplus.optim as zo

    base, grads = _params_and_grads([(70001,)], steps=3)
    views = [base[0][1:70001]]
    ours, _ = _run(zo.AdamW, views, [[g[0][1:70001]] for g in grads], _KWARGS["AdamW"])
    ref, _ = _run(torch.optim.AdamW, views, [[g[0][1:70001]] for g in grads], {**_KWARGS["AdamW"], "fused": True})
    err = (ours[0] - ref[0]).abs().max().item()
    assert err <= 2e-6, f"odd-offset AdamW: max |ours - torch fused| = {err}"


def test_fused_cuda_kernels_take_the_fused_path():
    """The CUDA kernel (optimizers/cuda/adam_kernels.cu), not torch's generic fallback, updates
    CUDA parameters."""
    import zeroplus.optim as zo

    p = torch.zeros(1024, device="cuda", requires_grad=True)
    opt = zo.AdamW([p], lr=0.1)
    p.grad = torch.ones_like(p)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = [k for k in kernels if "adamKernel" in k]
    assert ours, f"zeroplus's adamKernel did not run; CUDA kernels seen: {kernels[:20]}"
    assert torch.allclose(p.detach(), torch.full_like(p, -0.1), atol=1e-6)


# -- ZeRO stages 1-3 on CUDA against DDP -----------------------------------------------------------

def _train_on_cuda(rank, world, stage, dtype_name, steps=4):
    import torch.distributed as dist
    import torch.nn.functional as F

    import zeroplus
    from zero_models import batch, make_model

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)

    def data(step):
        tokens, targets = batch(step, rank)
        return tokens.to(dev), targets.to(dev)

    def loss_of(model, tokens, targets):
        logits = model(tokens)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    ref = torch.nn.parallel.DistributedDataParallel(make_model().to(dev), device_ids=None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    kwargs = {} if dtype_name == "fp32" else {"mixed_precision": dtype_name}
    if stage == 3:  # every parameter sharded (tests/README.md: a stage-3 test shards; asserted below)
        kwargs["param_persistence_threshold"] = 0
    model, opt = zeroplus.initialize(make_model().to(dev), torch.optim.AdamW, stage=stage, lr=1e-2,
                                     weight_decay=0.01, **kwargs)
    losses, ref_losses = [], []
    for step in range(steps):
        tokens, targets = data(step)
        loss = loss_of(model, tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ref_loss = loss_of(ref, tokens, targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    if stage == 3 and world > 1:  # at world size 1 the one shard is the whole parameter
        from sharding import assert_sharded

        assert_sharded(model, opt)
    devices = {p.device.type for p in model.parameters()}
    state_devices = {t.device.type for b in opt.bucket_optimizers for t in b.state_tensors() if t.dim() > 0}
    full = {k: v.detach().float().cpu() for k, v in zeroplus.full_state_dict(model, rank0_only=False).items()}
    ref_full = {k.removeprefix("module."): v.detach().float().cpu() for k, v in ref.state_dict().items()}
    dist.barrier()
    return {"losses": losses, "ref_losses": ref_losses, "devices": devices, "state_devices": state_devices,
            "params": full, "ref_params": ref_full}


@pytest.mark.parametrize("world", [1, 2])
def test_zero_stages_on_cuda_match_ddp(world):
    """fp32: every stage equals DDP + torch AdamW on the GPU within 1e-4 (zeroplus steps with its
    CUDA kernel, torch with its own). bf16 mixed precision: within what bf16 compute allows of
    the fp32 DDP run, and the three stages agree with each other closely (same arithmetic,
    different sharding). Every configuration runs; the failures are reported together."""
    env = {"ZEROPLUS_CUDA_TRANSPORT": "host"} if world > 1 else None
    failures, bf16 = [], {}
    for stage in (1, 2, 3):
        for dtype_name in ("fp32", "bf16"):
            where = f"stage {stage} {dtype_name} world {world}"
            try:
                outs = run_pooled(_train_on_cuda, world, stage, dtype_name, timeout=300, env=env)
            except Exception as e:  # noqa: BLE001 - reported with the others
                failures.append(f"{where}: {str(e)[:2000]}")
                continue
            for rank, out in enumerate(outs):
                if out["devices"] != {"cuda"}:
                    failures.append(f"{where} rank {rank}: parameters on {out['devices']}")
                if not out["state_devices"] <= {"cuda"}:
                    failures.append(f"{where} rank {rank}: optimizer state on {out['state_devices']}")
                loss_tol, param_tol = (1e-4, 1e-4) if dtype_name == "fp32" else (5e-2, 0.1)
                if any(abs(a - b) > loss_tol * max(1.0, abs(b)) for a, b in zip(out["losses"], out["ref_losses"])):
                    failures.append(f"{where} rank {rank}: losses {out['losses']} vs DDP {out['ref_losses']}")
                for k, v in out["ref_params"].items():
                    err = (out["params"][k] - v).abs().max().item()
                    if err > param_tol:
                        failures.append(f"{where} rank {rank}: {k} differs from DDP by {err:.3g}")
            if dtype_name == "bf16":
                bf16[stage] = outs[0]
    for stage in (2, 3):
        if 1 in bf16 and stage in bf16:
            a, b = bf16[stage], bf16[1]
            worst = max((a["params"][k] - b["params"][k]).abs().max().item() for k in b["params"])
            if worst > 2e-2 or any(abs(x - y) > 1e-2 for x, y in zip(a["losses"], b["losses"])):
                failures.append(f"bf16 world {world}: stage {stage} vs stage 1: params differ by {worst:.3g}, "
                                f"losses {a['losses']} vs {b['losses']}")
    assert not failures, "\n".join(failures)
