"""zeroplus.comm_stats / reset_comm_stats: a known sequence of collectives on 2 ranks gives exactly
the calls and bytes of docs/comm_stats.md (sync, async, coalesced, functional and point-to-point
ops), rejected ops are not counted, groups count separately, and bad groups are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_pooled


def _known_sequence(rank, world_size):
    import torch.distributed._functional_collectives as funcol

    import zeroplus

    group = dist.new_group(list(range(world_size)))  # fresh counters, untouched by other cases
    other = dist.new_group(list(range(world_size)))
    n = world_size
    assert zeroplus.comm_stats(group).total.calls == 0

    dist.all_reduce(torch.ones(1024), group=group)  # 4096 B
    dist.all_reduce(torch.ones(10, dtype=torch.bfloat16), group=group, async_op=True).wait()  # 20 B
    funcol.all_reduce(torch.ones(3, dtype=torch.float64), "sum", group).wait()  # 24 B (DTensor's path)
    dist.reduce_scatter_tensor(torch.empty(6), torch.ones(6 * n), group=group)  # S = input, 48 B
    dist.all_gather_into_tensor(torch.empty(5 * n), torch.ones(5), group=group, async_op=True).wait()  # 40 B
    dist.broadcast(torch.zeros(7, dtype=torch.int64), src=0, group=group)  # 56 B
    dist.all_gather([torch.empty(3) for _ in range(n)], torch.ones(3), group=group)  # 24 B
    dist.reduce_scatter(torch.empty(2), [torch.ones(2) for _ in range(n)], group=group)  # 16 B
    dist.all_to_all_single(torch.empty(4 * n), torch.ones(4 * n), group=group)  # 32 B
    dist.reduce(torch.ones(4), dst=0, group=group)  # 16 B
    gathered = [torch.empty(3) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.ones(3), gathered, dst=0, group=group)  # S = n x input, 24 B on both ranks
    pieces = [torch.ones(2) for _ in range(n)] if rank == 0 else None
    dist.scatter(torch.empty(2), pieces, src=0, group=group)  # S = n x output, 16 B
    dist.barrier(group=group)
    # Coalesced: the coalescing manager turns these into one *_coalesced op each.
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        dist.all_reduce(torch.ones(8), group=group)
        dist.all_reduce(torch.ones(8), group=group)
    cm.wait()  # 32 + 32 = 64 B
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        dist.all_gather_into_tensor(torch.empty(2 * n), torch.ones(2), group=group)
        dist.all_gather_into_tensor(torch.empty(3 * n), torch.ones(3), group=group)
    cm.wait()  # 8n + 12n = 40 B
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        dist.reduce_scatter_tensor(torch.empty(1), torch.ones(n), group=group)
        dist.reduce_scatter_tensor(torch.empty(5), torch.ones(5 * n), group=group)
    cm.wait()  # 4n + 20n = 48 B
    # Point to point, blocking and batched: rank 0 sends 5 floats and receives 3 doubles.
    peer = 1 - rank
    if rank == 0:
        dist.send(torch.ones(5), dst=peer, group=group)
        dist.recv(torch.empty(3, dtype=torch.float64), src=peer, group=group)
    else:
        dist.recv(torch.empty(5), src=peer, group=group)
        dist.send(torch.ones(3, dtype=torch.float64), dst=peer, group=group)
    ops = [dist.P2POp(dist.isend, torch.ones(6), peer, group=group),
           dist.P2POp(dist.irecv, torch.empty(6), peer, group=group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()  # one send and one recv of 24 B each on both ranks
    after_sequence = zeroplus.comm_stats(group)

    # Rejected by the backend's argument checks (output not input / n): not counted.
    try:
        dist.reduce_scatter_tensor(torch.empty(5), torch.ones(6 * n), group=group)
        rejected = ""
    except (RuntimeError, ValueError) as e:
        rejected = str(e)
    after_reject = zeroplus.comm_stats(group)
    dist.all_reduce(torch.ones(2), group=other)  # the other group's counters only
    dist.barrier(group=group)  # both ranks are past the rejected op before the group is used on
    zeroplus.reset_comm_stats(group)
    after_reset = zeroplus.comm_stats(group)
    dist.all_reduce(torch.ones(2), group=group)
    after_one = zeroplus.comm_stats(group)
    out = {
        "sequence": after_sequence.as_dict(),
        "bus_all_reduce": after_sequence["all_reduce"].bus_bytes,
        "bus_all_gather_into_tensor": after_sequence["all_gather_into_tensor"].bus_bytes,
        "rejected": rejected,
        "unchanged_after_reject": after_reject == after_sequence,
        "other": zeroplus.comm_stats(other).as_dict(),
        "after_reset_total": after_reset.total.calls,
        "delta": (after_one - after_reset).as_dict(),
        "sum": ((after_one - after_reset) + (after_one - after_reset)).as_dict(),
    }
    dist.destroy_process_group(other)
    dist.destroy_process_group(group)
    return out


def _op(calls, nbytes, bus):
    return {"calls": calls, "bytes": nbytes, "bus_bytes": float(bus)}


def test_known_sequence_counts_exactly():
    results = run_pooled(_known_sequence, 2, timeout=120)
    for rank, r in enumerate(results):
        got = r["sequence"]
        expected = {
            # n = 2: bus factors 2(n-1)/n = 1 for all_reduce, (n-1)/n = 0.5 for gathers/scatters.
            "all_reduce": _op(3, 4096 + 20 + 24, 4140),
            "all_reduce_coalesced": _op(1, 64, 64),
            "reduce_scatter_tensor": _op(1, 48, 24),
            "all_gather_into_tensor": _op(1, 40, 20),
            "all_gather_into_tensor_coalesced": _op(1, 40, 20),
            "reduce_scatter_tensor_coalesced": _op(1, 48, 24),
            "broadcast": _op(1, 56, 56),
            "all_gather": _op(1, 24, 12),
            "reduce_scatter": _op(1, 16, 8),
            "all_to_all_single": _op(1, 32, 16),
            "reduce": _op(1, 16, 16),
            "gather": _op(1, 24, 12),
            "scatter": _op(1, 16, 8),
            "barrier": _op(1, 0, 0),
            "send": _op(2, (20 if rank == 0 else 24) + 24, (20 if rank == 0 else 24) + 24),
            "recv": _op(2, (24 if rank == 0 else 20) + 24, (24 if rank == 0 else 20) + 24),
        }
        expected["total"] = _op(sum(v["calls"] for v in expected.values()), sum(v["bytes"] for v in expected.values()),
                                sum(v["bus_bytes"] for v in expected.values()))
        assert got == expected, f"rank {rank}"
        assert r["bus_all_reduce"] == 4140.0 and r["bus_all_gather_into_tensor"] == 20.0
        # Refused by the backend's own check (its messages start "zeroplus <op>:"), yet not counted.
        assert r["rejected"].startswith("zeroplus _reduce_scatter_base:"), r["rejected"]
        assert r["unchanged_after_reject"], f"rank {rank}: a rejected op was counted"
        assert r["other"] == {"all_reduce": _op(1, 8, 8), "total": _op(1, 8, 8)}
        assert r["after_reset_total"] == 0
        assert r["delta"] == {"all_reduce": _op(1, 8, 8), "total": _op(1, 8, 8)}
        assert r["sum"] == {"all_reduce": _op(2, 16, 16), "total": _op(2, 16, 16)}


def _bad_groups(rank, world_size):
    import zeroplus

    out = {}
    gloo = dist.new_group(backend="gloo")
    for name, fn in (("comm_stats", zeroplus.comm_stats), ("reset_comm_stats", zeroplus.reset_comm_stats)):
        for key, arg in (("type", "world"), ("gloo", gloo)):
            try:
                fn(arg)
                out[(name, key)] = None
            except (TypeError, ValueError) as e:
                out[(name, key)] = (type(e).__name__, str(e))
    stats = zeroplus.comm_stats()  # the default group
    single = dist.new_group([0])  # a group of another size; every rank takes part in creating it
    out["mixed"] = None
    if rank == 0:
        try:
            stats - zeroplus.comm_stats(single)
        except ValueError as e:
            out["mixed"] = str(e)
        dist.destroy_process_group(single)
    try:
        stats["allreduce"]
        out["key"] = None
    except KeyError as e:
        out["key"] = str(e)
    dist.destroy_process_group(gloo)
    return out


def test_bad_groups_are_refused():
    for rank, out in enumerate(run_pooled(_bad_groups, 2, timeout=60)):
        for name in ("comm_stats", "reset_comm_stats"):
            assert out[(name, "type")] == (
                "TypeError", f"zeroplus.{name}: group must be a ProcessGroup or None, got str")
            assert out[(name, "gloo")] == (
                "ValueError", f"zeroplus.{name}: group must use the zeroplus backend, got 'gloo'")
        assert "unknown collective 'allreduce'" in out["key"] and "all_reduce" in out["key"]
        if rank == 0:
            assert out["mixed"] == "CommStats: can only subtract snapshots of groups of one size"


def test_uninitialized_is_refused():
    import zeroplus

    with pytest.raises(RuntimeError, match="zeroplus.comm_stats: torch.distributed is not initialized"):
        zeroplus.comm_stats()
