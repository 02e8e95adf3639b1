"""One rank of a multi-host test (tests/python/netns.py starts it inside a namespace).

Reads the torchrun-style environment plus ZP_CASE, ZP_BACKEND, ZP_OUT and ZP_PG_TIMEOUT, joins
the group over env:// (TCPStore on host 0), runs the case and writes ZP_OUT/rank<r>.pt =
{"status", "value", "finished_at"}: the case's value, or the traceback of what it raised.
A case may also write ZP_OUT/ready<r> to tell the test it reached a point (the link-cut test).
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import torch
import torch.distributed as dist


def _expected_rank_tensor(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 100 * rank


def case_collectives(rank: int, world: int) -> dict:
    """Every collective of the correctness suite; values are exact in float32."""
    out: dict = {}
    for n in (1, 7, 1 << 18):  # one element, odd, 1 MiB (several chunks/buckets)
        t = _expected_rank_tensor(rank, n)
        dist.all_reduce(t)
        out[f"allreduce_{n}"] = t
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["allreduce_max"] = t
    # Sizes past the hierarchical path's flat threshold (1 MiB) that do not split evenly over
    # the local ranks, so the striped phases and their padding run; dtypes Gloo reduces and
    # one it does not (bfloat16 takes the flat path); AVG (the adapter's post-division).
    for name, n in (("allreduce_big_odd", (1 << 18) + 1),):
        t = _expected_rank_tensor(rank, n)
        dist.all_reduce(t)
        out[name] = t
    t = _expected_rank_tensor(rank, 7).to(torch.int64)
    dist.all_reduce(t)
    out["allreduce_int64"] = t
    t = (torch.arange(7) + rank).to(torch.bfloat16)  # small integers: exact in bfloat16
    dist.all_reduce(t)
    out["allreduce_bf16"] = t
    t = _expected_rank_tensor(rank, 7)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["allreduce_avg"] = t
    t = _expected_rank_tensor(rank, (1 << 18) + 3)
    dist.broadcast(t, src=1)  # root on host 0 with local index 1
    out["broadcast_big"] = t
    flat = torch.empty(world * 80001)
    dist.all_gather_into_tensor(flat, _expected_rank_tensor(rank, 80001))
    out["allgather_big"] = flat
    rs = torch.empty(70001)
    dist.reduce_scatter_tensor(rs, _expected_rank_tensor(rank, 70001 * world))
    out["reduce_scatter_big"] = rs
    t = _expected_rank_tensor(rank, 33)
    dist.broadcast(t, src=2)
    out["broadcast"] = t
    parts = [torch.empty(9) for _ in range(world)]
    dist.all_gather(parts, _expected_rank_tensor(rank, 9))
    out["allgather"] = torch.stack(parts)
    flat = torch.empty(world * 9)
    dist.all_gather_into_tensor(flat, _expected_rank_tensor(rank, 9))
    out["allgather_into_tensor"] = flat
    rs = torch.empty(5)
    dist.reduce_scatter_tensor(rs, _expected_rank_tensor(rank, 5 * world))
    out["reduce_scatter_tensor"] = rs
    rs_list = torch.empty(5)
    dist.reduce_scatter(rs_list, list(_expected_rank_tensor(rank, 5 * world).chunk(world)))
    out["reduce_scatter"] = rs_list
    a2a = torch.empty(world * 3)
    dist.all_to_all_single(a2a, _expected_rank_tensor(rank, world * 3))
    out["all_to_all_single"] = a2a
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(outs, list(_expected_rank_tensor(rank, world * 2).chunk(world)))
    out["all_to_all"] = torch.stack(outs)
    dist.barrier()
    # Point to point across hosts: rank r sends to the same local rank of the other host.
    peer = (rank + 2) % world
    got = torch.empty(11)
    if rank < 2:
        dist.send(_expected_rank_tensor(rank, 11), peer)
        dist.recv(got, peer)
    else:
        dist.recv(got, peer)
        dist.send(_expected_rank_tensor(rank, 11), peer)
    out["send_recv"] = got
    if os.environ["ZP_BACKEND"] == "zeroplus":
        import zeroplus

        topo = zeroplus.topology()
        out["topology"] = (topo.host_count, topo.host_of, topo.host_names, topo.local_ranks, topo.leaders)
        out["transport"] = topo.transport
    return out


def case_zero(rank: int, world: int, stage: int) -> float:
    """zeroplus.initialize(stage=2|3) against one process that sees the whole global batch. Stage 3
    shards every parameter (asserted on every rank: the default persistence threshold would keep
    this model whole), and the reference must move by far more than the 1e-5 the test allows."""
    import zeroplus
    from sharding import SHARD_ALL, assert_sharded

    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    ours, ref = model(), model()
    ref.load_state_dict(ours.state_dict())
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    ours, opt = zeroplus.initialize(ours, torch.optim.AdamW, stage=stage, lr=1e-2,
                                    config=SHARD_ALL if stage == 3 else None)
    if stage == 3:
        assert_sharded(ours, opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(world * 6, 8, generator=gen), torch.randn(world * 6, 4, generator=gen)
        opt.backward(torch.nn.functional.mse_loss(ours(x[rank * 6:(rank + 1) * 6]), y[rank * 6:(rank + 1) * 6]))
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    if stage == 3:
        assert_sharded(ours, opt)
    moved = max((v - start[k]).abs().max().item() for k, v in ref.state_dict().items())
    if moved < 1e-2:
        raise AssertionError(f"the reference moved {moved}: a 1e-5 comparison barely tests anything")
    got = zeroplus.full_state_dict(ours, rank0_only=False)
    return max((got[k].float() - v).abs().max().item() for k, v in ref.state_dict().items())


def case_ddp(rank: int, world: int, zero: bool = False) -> float:
    """DDP over the group against one process that sees the whole global batch; with `zero`,
    the DDP model steps through zeroplus's ZeRO-1 optimizer (AdamW) instead of plain SGD."""
    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    ddp = torch.nn.parallel.DistributedDataParallel(model())
    ref = model()
    ref.load_state_dict(ddp.module.state_dict())
    if zero:
        import zeroplus

        opt = zeroplus.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(world * 6, 8, generator=gen), torch.randn(world * 6, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[rank * 6:(rank + 1) * 6]), y[rank * 6:(rank + 1) * 6]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    return max((a - b).abs().max().item() for a, b in zip(ddp.module.parameters(), ref.parameters()))


def case_linkcut(rank: int, world: int) -> None:
    """Allreduces until one fails; the test deletes the link once every rank wrote ready<r>.
    2 MiB: past the hierarchical path's flat threshold, so the Gloo phase is what meets the cut."""
    t = torch.ones(1 << 19)
    dist.all_reduce(t)
    open(os.path.join(os.environ["ZP_OUT"], f"ready{rank}"), "w").close()
    stop = time.monotonic() + 120
    while time.monotonic() < stop:
        dist.all_reduce(t)
        time.sleep(0.005)
    raise AssertionError("no collective failed within 120 s of the link cut")


CASES = {
    "collectives": case_collectives, "ddp": case_ddp, "zero1": lambda r, w: case_ddp(r, w, zero=True),
    "zero2": lambda r, w: case_zero(r, w, 2), "zero3": lambda r, w: case_zero(r, w, 3),
    "linkcut": case_linkcut,
    # The barrier: rank 0 hosts the TCPStore, and a rank still reading its peers' addresses from
    # it at the end of init failed with "Failed to recv" when rank 0 had already exited.
    "init": lambda r, w: dist.barrier(),
}


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    outdir = os.environ["ZP_OUT"]
    started = time.time()
    try:
        backend = os.environ["ZP_BACKEND"]
        if backend == "zeroplus":
            import zeroplus  # noqa: F401  (registers the backend)
        started = time.time()
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=float(os.environ["ZP_PG_TIMEOUT"])))
        value = CASES[os.environ["ZP_CASE"]](rank, world)
        dist.destroy_process_group()
        result = {"status": "ok", "value": value}
    except BaseException:
        result = {"status": "error", "value": traceback.format_exc()}
    result["finished_at"] = time.time()
    result["value"] = (result["value"], started) if result["status"] == "error" else result["value"]
    tmp = os.path.join(outdir, f".rank{rank}.pt")
    torch.save(result, tmp)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.pt"))
    os._exit(0)  # a broken group's threads must not keep the rank alive


if __name__ == "__main__":
    main()
