"""Collective benchmark: zeroplus against stock gloo, side by side in one run (nccl-tests style).

    .venv/bin/python bench/collectives/run.py            # default matrix, < 10 min on 2 cores
    .venv/bin/python bench/collectives/run.py --quick    # smoke run (~1 min)

Every rank joins a gloo default group and a zeroplus group (dist.new_group), so both backends
run in the same processes and are measured interleaved (A B A B ... per repetition, order
alternating), each point as the median over repetitions of the slowest rank's time per op.
Cases (docs/benchmarks.md explains the columns):
  allreduce   one fp32 tensor of 4 KiB .. 256 MiB, synchronous calls (latency + bandwidth),
              algbw = bytes / t, busbw = algbw * 2(n-1)/n; the result is checked in the same run
  many-small  1000 x 4 KiB: gloo per-tensor loop (sync and async, the faster is the baseline),
              gloo all_reduce_coalesced, zeroplus async loop, coalescing manager, all_reduce_coalesced
  overlap     a matmul loop while 16 x 1 MiB async allreduces are in flight:
              hidden = (T_comp + T_comm - T_both) / min(T_comp, T_comm)
Writes bench/results/collectives-<stamp>.{json,md,png} and collectives-latest.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

REPO = pathlib.Path(__file__).resolve().parents[2]
KiB, MiB = 1 << 10, 1 << 20


# --------------------------------------------------------------------------------------------
# Rank side


def _timed(dist, gl, fn, k):
    """Runs fn() k times after a barrier; returns the slowest rank's seconds per call."""
    import torch

    dist.barrier(group=gl)
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    dt = torch.tensor([(time.perf_counter() - t0) / k], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=gl)
    return float(dt.item())


def _interleaved(dist, gl, fns, k, reps):
    """fns: {name: callable}; returns {name: [seconds per call, one per repetition]}."""
    names = list(fns)
    out = {n: [] for n in names}
    for r in range(reps):
        for n in names if r % 2 == 0 else reversed(names):
            out[n].append(_timed(dist, gl, fns[n], k))
    return out


def _summary(samples):
    s = sorted(samples)
    q = lambda p: s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"t_med_us": statistics.median(s) * 1e6, "t_p10_us": q(0.1) * 1e6, "t_p90_us": q(0.9) * 1e6, "reps": len(s)}


def _allreduce_sweep(dist, groups, rank, n, sizes, budget_s, rep_s=0.02, max_k=2000, max_reps=25):
    """Allreduce of one fp32 tensor per size on every group in `groups` (a "gloo" group among
    them: it carries the barriers and the result checks), verified, then timed interleaved.
    Also used by multihost_rank.py."""
    import torch

    rows = []
    for nbytes in sizes:
        numel = nbytes // 4
        bufs, verified = {}, {}
        for name, g in groups.items():
            # Correctness in the same run: distinct per-rank values, exact in fp32.
            t = torch.arange(numel, dtype=torch.float32).remainder_(251).add_(rank + 1)
            dist.all_reduce(t, group=g)
            expect = torch.arange(numel, dtype=torch.float32).remainder_(251).mul_(n).add_(n * (n + 1) / 2)
            ok = torch.tensor([1.0 if torch.equal(t, expect) else 0.0])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=groups["gloo"])
            verified[name] = bool(ok.item() == 1.0)
            bufs[name] = torch.zeros(numel)  # zeros keep values (and timing) stable across reps
        # Calibrate k so one repetition lasts >= rep_s, and reps to the time budget.
        one = max(_timed(dist, groups["gloo"], lambda g=g, b=bufs[name]: dist.all_reduce(b, group=g), 1)
                  for name, g in groups.items())
        k = max(1, min(max_k, int(rep_s / max(one, 1e-7))))
        reps = max(5, min(max_reps, int(budget_s / max(len(groups) * k * one, 1e-6))))
        fns = {name: (lambda g=g, b=bufs[name]: dist.all_reduce(b, group=g)) for name, g in groups.items()}
        samples = _interleaved(dist, groups["gloo"], fns, k, reps)
        for name in groups:
            s = _summary(samples[name])
            algbw = nbytes / (s["t_med_us"] * 1e-6) / 1e9
            rows.append({"case": "allreduce", "backend": name, "n": n, "dtype": "float32", "ntensors": 1,
                         "bytes_total": nbytes, "K": k, **s, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * 2 * (n - 1) / n, "verified": verified[name]})
        del bufs
    return rows


def _many_small(dist, groups, rank, n, count, nbytes, reps):
    import torch

    gl, zp = groups["gloo"], groups["zeroplus"]
    numel = nbytes // 4
    tensors = {name: [torch.full((numel,), float(rank + 1)) for _ in range(count)] for name in ("gloo", "zeroplus")}

    def loop_sync(g, ts):
        for t in ts:
            dist.all_reduce(t, group=g)

    def loop_async(g, ts):
        works = [dist.all_reduce(t, group=g, async_op=True) for t in ts]
        for w in works:
            w.wait()

    def coalesced(g, ts):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.all_reduce_coalesced(ts, group=g)

    def manager(g, ts):
        with dist._coalescing_manager(group=g, async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t, group=g)
        cm.wait()

    fns = {
        "gloo loop (sync)": lambda: loop_sync(gl, tensors["gloo"]),
        "gloo loop (async)": lambda: loop_async(gl, tensors["gloo"]),
        "gloo all_reduce_coalesced": lambda: coalesced(gl, tensors["gloo"]),
        "zeroplus loop (async, fused)": lambda: loop_async(zp, tensors["zeroplus"]),
        "zeroplus coalescing manager": lambda: manager(zp, tensors["zeroplus"]),
        "zeroplus all_reduce_coalesced": lambda: coalesced(zp, tensors["zeroplus"]),
    }
    # Correctness of every mode once (values are rank + 1, so the sum is n(n+1)/2).
    verified = {}
    for name, fn in fns.items():
        ts = tensors["gloo" if name.startswith("gloo") else "zeroplus"]
        for t in ts:
            t.fill_(float(rank + 1))
        fn()
        ok = all(bool((t == n * (n + 1) / 2).all()) for t in ts)
        flag = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=gl)
        verified[name] = flag.item() == 1.0
    for ts in tensors.values():
        for t in ts:
            t.zero_()
    samples = _interleaved(dist, gl, fns, 1, reps)
    rows = []
    for name in fns:
        s = _summary(samples[name])
        rows.append({"case": "many_small", "backend": name.split()[0], "mode": name, "n": n, "dtype": "float32",
                     "ntensors": count, "bytes_total": count * nbytes, "K": 1, **s, "verified": verified[name]})
    return rows


def _overlap(dist, groups, rank, n, reps):
    import torch

    gl = groups["gloo"]
    a = torch.rand(256, 256)
    rows = []
    for name, g in groups.items():
        bufs = [torch.zeros(256 * KiB) for _ in range(16)]  # 16 x 1 MiB

        def comm():
            works = [dist.all_reduce(b, group=g, async_op=True) for b in bufs]
            for w in works:
                w.wait()

        def compute(iters):
            x = a
            for _ in range(iters):
                x = torch.mm(x, a).mul_(1e-3)
            return x

        comm()
        t_comm = statistics.median(_timed(dist, gl, comm, 1) for _ in range(5))
        t_unit = statistics.median(_timed(dist, gl, lambda: compute(40), 1) for _ in range(5)) / 40
        iters = max(1, int(t_comm / t_unit))  # compute about as long as communication

        def both():
            works = [dist.all_reduce(b, group=g, async_op=True) for b in bufs]
            compute(iters)
            for w in works:
                w.wait()

        samples = _interleaved(dist, gl, {"comm": comm, "comp": lambda: compute(iters), "both": both}, 1, reps)
        tc, tp, tb = (statistics.median(samples[k]) for k in ("comm", "comp", "both"))
        hidden = (tc + tp - tb) / min(tc, tp)
        rows.append({"case": "overlap", "backend": name, "n": n, "bytes_total": 16 * MiB, "t_comm_us": tc * 1e6,
                     "t_comp_us": tp * 1e6, "t_both_us": tb * 1e6, "hidden_fraction": hidden, "reps": reps})
    return rows


def _rank_main(rank, n, store_path, cfg, out_q):
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        import zeroplus  # noqa: F401  (registers the backend)

        store = dist.FileStore(store_path, n)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=300))
        zp = dist.new_group(backend="zeroplus")
        groups = {"gloo": dist.group.WORLD, "zeroplus": zp}
        rows = _allreduce_sweep(dist, groups, rank, n, cfg["sizes"], cfg["budget_s"])
        if cfg["many_small"]:
            rows += _many_small(dist, groups, rank, n, 1000, 4 * KiB, cfg["small_reps"])
        if cfg["overlap"]:
            rows += _overlap(dist, groups, rank, n, cfg["overlap_reps"])
        dist.destroy_process_group()
        if rank == 0:
            out_q.put(("ok", rows))
    except BaseException:
        import traceback

        out_q.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def run_world(n, cfg):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="zeroplus-bench-") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, n, os.path.join(tmp, "store"), cfg, q)) for r in range(n)]
        for p in procs:
            p.start()
        status, payload = q.get(timeout=cfg["timeout_s"])
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


# --------------------------------------------------------------------------------------------
# Reporting


def _fmt_size(b):
    return f"{b // MiB} MiB" if b >= MiB else f"{b // KiB} KiB"


def render_markdown(rows, env):
    out = [f"# Collectives: zeroplus vs gloo ({env['stamp']})", "",
           f"Host: {env['nproc']} CPUs, {env['cpu']}; torch {env['torch']}; zeroplus transport with all ranks on "
           f"one host: {env['transport']}. Times are medians over repetitions of the slowest rank; GB = 1e9 B.", ""]
    for n in sorted({r["n"] for r in rows}):
        ar = [r for r in rows if r["case"] == "allreduce" and r["n"] == n]
        if ar:
            out += [f"## allreduce, fp32, {n} ranks (synchronous calls)", "",
                    "| size | gloo us | zeroplus us | speedup | gloo busbw GB/s | zeroplus busbw GB/s | busbw ratio | verified |",
                    "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
            for size in sorted({r["bytes_total"] for r in ar}):
                g = next(r for r in ar if r["bytes_total"] == size and r["backend"] == "gloo")
                z = next(r for r in ar if r["bytes_total"] == size and r["backend"] == "zeroplus")
                out.append(f"| {_fmt_size(size)} | {g['t_med_us']:.1f} | {z['t_med_us']:.1f} | "
                           f"{g['t_med_us'] / z['t_med_us']:.2f}x | {g['busbw_GBps']:.2f} | {z['busbw_GBps']:.2f} | "
                           f"{z['busbw_GBps'] / g['busbw_GBps']:.2f}x | {'yes' if g['verified'] and z['verified'] else 'NO'} |")
            out.append("")
        ms = [r for r in rows if r["case"] == "many_small" and r["n"] == n]
        if ms:
            base = min((r for r in ms if r["mode"].startswith("gloo loop")), key=lambda r: r["t_med_us"])
            coal = next(r for r in ms if r["mode"] == "gloo all_reduce_coalesced")
            out += [f"## 1000 x 4 KiB allreduce, {n} ranks", "",
                    "| mode | ms | p10-p90 ms | vs best gloo loop | vs gloo coalesced | verified |",
                    "|---|---:|---:|---:|---:|:---:|"]
            for r in ms:
                out.append(f"| {r['mode']} | {r['t_med_us'] / 1e3:.2f} | {r['t_p10_us'] / 1e3:.2f}-{r['t_p90_us'] / 1e3:.2f} | "
                           f"{base['t_med_us'] / r['t_med_us']:.1f}x | {coal['t_med_us'] / r['t_med_us']:.2f}x | "
                           f"{'yes' if r['verified'] else 'NO'} |")
            out.append("")
        ov = [r for r in rows if r["case"] == "overlap" and r["n"] == n]
        if ov:
            out += [f"## overlap, {n} ranks: 256x256 matmul loop while 16 x 1 MiB async allreduces are in flight", "",
                    "| backend | T_comm ms | T_comp ms | T_both ms | hidden fraction of min(T_comp, T_comm) |",
                    "|---|---:|---:|---:|---:|"]
            for r in ov:
                out.append(f"| {r['backend']} | {r['t_comm_us'] / 1e3:.2f} | {r['t_comp_us'] / 1e3:.2f} | "
                           f"{r['t_both_us'] / 1e3:.2f} | {100 * r['hidden_fraction']:.0f} % |")
            out.append("")
    return "\n".join(out)


def render_plot(rows, path):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
    from plotting import busbw_and_time_axes, pyplot
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for n, style in ((2, "-"), (4, "--")):
        for backend, color in (("gloo", "tab:orange"), ("zeroplus", "tab:blue")):
            pts = sorted((r["bytes_total"], r["busbw_GBps"], r["t_med_us"]) for r in rows
                         if r["case"] == "allreduce" and r["n"] == n and r["backend"] == backend)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            axes[0].plot(xs, [p[1] for p in pts], style, color=color, marker="o", label=f"{backend}, {n} ranks")
            axes[1].plot(xs, [p[2] for p in pts], style, color=color, marker="o", label=f"{backend}, {n} ranks")
    busbw_and_time_axes(axes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--max-bytes", type=int, default=256 * MiB)
    ap.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke run)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()

    sizes, s = [], 4 * KiB
    while s <= (4 * MiB if args.quick else args.max_bytes):
        sizes.append(s)
        s *= 4
    env = {
        "stamp": time.strftime("%Y%m%d-%H%M%S"),
        "nproc": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.path.insert(0, str(REPO / "plugin" / "python"))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "plugin" / "python"), os.environ.get("PYTHONPATH", "")])
    import torch

    env["torch"] = torch.__version__
    env["transport"] = "shm+tcp" if os.environ.get("ZEROPLUS_SHM", "auto") != "off" else "tcp"
    env["knobs"] = {k: v for k, v in os.environ.items() if k.startswith("ZEROPLUS_")}
    try:
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
        env["cpu_flags"] = [f for f in ("avx2", "avx512f", "avx512_bf16") if f in flags]
        env["cpu"] = next(l for l in open("/proc/cpuinfo") if l.startswith("model name")).split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass

    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        cfg = {
            "sizes": sizes if n == 2 or args.quick else [x for x in sizes],
            "budget_s": 0.4 if args.quick else (2.0 if n == 2 else 1.2),
            "many_small": True,
            "small_reps": 5 if args.quick else (15 if n == 2 else 7),
            "overlap": True,
            "overlap_reps": 3 if args.quick else (9 if n == 2 else 5),
            "timeout_s": 900,
        }
        t0 = time.time()
        rows += run_world(n, cfg)
        print(f"[{n} ranks] done in {time.time() - t0:.0f} s", file=sys.stderr)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"collectives-{env['stamp']}"
    base.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    md = render_markdown(rows, env)
    if render_plot(rows, base.with_suffix(".png")):
        md += f"\n![busbw and time per op]({base.with_suffix('.png').name})\n"
    base.with_suffix(".md").write_text(md)
    (out / "collectives-latest.md").write_text(md)
    print(md)
    print(f"\nwrote {base}.json/.md/.png", file=sys.stderr)


if __name__ == "__main__":
    main()
