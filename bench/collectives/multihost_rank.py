"""One rank of bench/collectives/multihost.py (started inside a network namespace by
tests/python/netns.py). Joins a gloo default group and two zeroplus groups over the same ranks:
"zeroplus flat" (BackendOptions(interhost="tcp"): zeroplus's own TCP mesh between every pair)
and "zeroplus hier" (interhost="gloo": shared memory within a host, torch's Gloo between hosts),
then times allreduce on all three interleaved (run.py's sweep) and writes rows to
ZP_OUT/bench.json from rank 0."""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist

import zeroplus
from run import _allreduce_sweep, _interleaved, _summary


def _phases(rank: int, n: int, nbytes: int, gl) -> dict:
    """The hierarchical allreduce's phases on their own, at `nbytes`, each run by every host (or
    every stripe) at once as in the real thing: the inputs of the model in docs/multihost.md."""
    local = 2
    hosts = n // local
    mine = {}
    for h in range(hosts):  # every rank takes part in creating every group
        g = dist.new_group([h * local + i for i in range(local)], backend="zeroplus")
        if rank // local == h:
            mine["intra"] = g
    for i in range(local):
        g = dist.new_group([h * local + i for h in range(hosts)], backend="gloo")
        t = dist.new_group([h * local + i for h in range(hosts)], backend="zeroplus")
        if rank % local == i:
            mine["inter_gloo"], mine["inter_tcp"] = g, t
    numel = nbytes // 4
    full, part = torch.zeros(numel), torch.zeros(numel // local)
    gathered = torch.zeros(numel)
    fns = {
        "intra_allreduce_S": lambda: dist.all_reduce(full, group=mine["intra"]),
        "inter_gloo_allreduce_S_over_L": lambda: dist.all_reduce(part, group=mine["inter_gloo"]),
        "inter_tcp_allreduce_S_over_L": lambda: dist.all_reduce(part, group=mine["inter_tcp"]),
        "intra_allgather_S": lambda: dist.all_gather_into_tensor(gathered, part, group=mine["intra"]),
    }
    for fn in fns.values():
        fn()
    samples = _interleaved(dist, gl, fns, 1, 7)
    return {"bytes": nbytes, "local": local, "hosts": hosts,
            **{name: _summary(v)["t_med_us"] for name, v in samples.items()}}


def main() -> None:
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sizes = [int(s) for s in os.environ["ZP_BENCH_SIZES"].split(",")]
    budget = float(os.environ["ZP_BENCH_BUDGET_S"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=float(os.environ["ZP_PG_TIMEOUT"])))
    groups = {
        "gloo": dist.group.WORLD,
        "zeroplus flat": dist.new_group(backend="zeroplus", pg_options=zeroplus.BackendOptions(interhost="tcp")),
        "zeroplus hier": dist.new_group(backend="zeroplus", pg_options=zeroplus.BackendOptions(interhost="gloo")),
    }
    gl = groups["gloo"]
    transports = {name: zeroplus.topology(g).transport for name, g in groups.items() if name != "gloo"}
    rows = _allreduce_sweep(dist, groups, rank, n, sizes, budget, rep_s=0.05, max_k=500, max_reps=21)
    phases = _phases(rank, n, int(os.environ["ZP_BENCH_PHASE_BYTES"]), gl)
    if rank == 0:
        with open(os.path.join(os.environ["ZP_OUT"], "bench.json"), "w") as f:
            json.dump({"rows": rows, "transports": transports, "phases": phases, "loadavg": os.getloadavg()}, f)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
