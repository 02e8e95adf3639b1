"""Real clients of the backend: object collectives, subgroups, DETAIL debug mode, DDP features
(join with uneven inputs, unused parameters, stock and custom comm hooks) and
torch.distributed.checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_distributed, run_pooled


def _objects(rank, world):
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "name": f"r{rank}"})
    objs = [f"hello-{rank}", [rank] * 3] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    out = [None] * world if rank == 0 else None
    dist.gather_object(("g", rank), out, dst=0)
    received = [None]
    dist.scatter_object_list(received, [f"to-{r}" for r in range(world)] if rank == 0 else None, src=0)
    return gathered, objs, out, received[0]


def test_object_collectives():
    world = 3
    for rank, (gathered, objs, out, received) in enumerate(run_pooled(_objects, world)):
        assert gathered == [{"rank": r, "name": f"r{r}"} for r in range(world)]
        assert objs == ["hello-0", [0, 0, 0]]
        assert out == ([("g", r) for r in range(world)] if rank == 0 else None)
        assert received == f"to-{rank}"


def _subgroups(rank, world):
    evens = dist.new_group([0, 2])
    low = dist.new_group([0, 1])  # overlaps with evens on rank 0
    t = torch.tensor([float(rank + 1)])
    if rank in (0, 2):
        dist.all_reduce(t, group=evens)
    u = torch.tensor([float(rank + 1)])
    if rank in (0, 1):
        dist.all_reduce(u, group=low)
    # non-members get a sentinel group object and must not take part
    assert (dist.get_rank(evens) == -1) == (rank == 1)
    w = torch.tensor([float(rank + 1)])
    dist.all_reduce(w)
    return t.item(), u.item(), w.item(), dist.get_backend(evens) if rank != 1 else None


def test_new_group_subgroups_overlapping_and_non_members():
    results = run_pooled(_subgroups, 3)
    assert results[0][:3] == (4.0, 3.0, 6.0)
    assert results[1][:3] == (2.0, 3.0, 6.0)
    assert results[2][:3] == (4.0, 3.0, 6.0)
    assert results[0][3] == "zeroplus"


def _detail(rank, world):
    t = torch.ones(3) * rank
    dist.all_reduce(t)
    dist.broadcast(t, src=1)
    dist.barrier()
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    seq = backend._get_sequence_number_for_group()
    # The DETAIL wrapper compares fingerprints before each op: a mismatch is an error, not a hang.
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(3))
        else:
            dist.broadcast(torch.ones(3), src=0)
        mismatch = None
    except RuntimeError as e:
        mismatch = str(e)
    return t, seq, mismatch


def test_torch_distributed_debug_detail():
    results = run_distributed(_detail, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, pg_timeout=20)
    for t, seq, mismatch in results:
        assert torch.equal(t, torch.ones(3))
        assert seq >= 3
        assert mismatch is not None  # every rank raises; none hangs
    # The wrapper names the mismatch on at least one rank; a rank that got past its check then
    # fails cleanly because its peer left.
    assert any("mismatch" in m.lower() for _, _, m in results), [m for _, _, m in results]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(model, rank, steps=3):
    """SGD on a rank-specific random regression task; the loop every client test shares."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 4)).backward()
        opt.step()


def _ddp_join_uneven(rank, world):
    model = torch.nn.parallel.DistributedDataParallel(_model())
    with model.join():
        _train(model, rank, steps=3 + 2 * rank)  # uneven inputs
    return [p.detach() for p in model.parameters()]


def test_ddp_join_with_uneven_inputs():
    results = run_pooled(_ddp_join_uneven, 3)
    for a, b in zip(results[0], results[2]):
        assert torch.equal(a, b)


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x, use_b):
        return self.b(x) if use_b else self.a(x)


def _ddp_unused(rank, world):
    model = torch.nn.parallel.DistributedDataParallel(_Branchy(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        model(torch.ones(2, 8) * (rank + 1), use_b=(step % 2 == 1)).sum().backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_ddp_find_unused_parameters():
    results = run_pooled(_ddp_unused, 2)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _custom_hook(state, bucket):
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _bf16_hook(state, bucket):
    # DDP.register_comm_hook refuses a hook *named* bf16_compress_hook unless CUDA and NCCL are
    # present (a torch-side check, before any backend is involved); the hook itself is generic.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _ddp_hooks(rank, world, hook_name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = torch.nn.parallel.DistributedDataParallel(_model())
    hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": _bf16_hook, "custom": _custom_hook}[hook_name]
    model.register_comm_hook(None, hook)
    _train(model, rank)
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("hook_name", ["fp16", "bf16", "custom"])
def test_ddp_comm_hooks(hook_name):
    results = run_pooled(_ddp_hooks, 2, hook_name)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _dcp_roundtrip(rank, world, path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(10.0) + rank * 0, "step": torch.tensor(7)}
    dcp.save(state, checkpoint_id=path)
    loaded = {"w": torch.zeros(10), "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=path)
    return loaded


def test_distributed_checkpoint_save_and_load(tmp_path):
    for loaded in run_pooled(_dcp_roundtrip, 2, str(tmp_path / "ckpt")):
        assert torch.equal(loaded["w"], torch.arange(10.0))
        assert loaded["step"].item() == 7


def _fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, rank)
    return [p.full_tensor().detach() for p in model.parameters()]


def _ddp_reference(rank, world):
    model = torch.nn.parallel.DistributedDataParallel(_model())
    _train(model, rank)
    return [p.detach() for p in model.parameters()]


def test_fsdp2_fully_shard_on_cpu_matches_ddp():
    fsdp = run_pooled(_fsdp2, 2)
    ddp = run_pooled(_ddp_reference, 2)
    for a, b in zip(fsdp[0], ddp[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
