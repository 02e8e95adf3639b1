"""Multi-host allreduce benchmark: 2 hosts x 2 ranks in network namespaces joined by a veth pair
(tests/python/netns.py), plain gloo vs zeroplus flat (own TCP mesh between every pair of ranks,
ZEROPLUS_INTERHOST=tcp) vs zeroplus hierarchical (shared memory within a host, torch's Gloo
between hosts), side by side in one run: all three groups live in the same four processes and
are timed interleaved, median of the slowest rank (as bench/collectives/run.py).

    sudo ZEROPLUS_BUILD_DIR=build .venv/bin/python bench/collectives/multihost.py           # ~3 min
    sudo ZEROPLUS_BUILD_DIR=build .venv/bin/python bench/collectives/multihost.py --quick   # smoke run

Needs root, iproute2 and util-linux (as the multi-host tests). Writes
bench/results/multihost-<stamp>.{json,md,png} and multihost-latest.md. docs/multihost.md
quotes the figures and models 8 hosts x 8 ranks from them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
KiB, MiB = 1 << 10, 1 << 20
BACKENDS = ("gloo", "zeroplus flat", "zeroplus hier")


def _fmt_size(b):
    return f"{b // MiB} MiB" if b >= MiB else f"{b // KiB} KiB"


def render_markdown(result, env):
    rows = result["rows"]
    out = [f"# Multi-host allreduce: gloo vs zeroplus flat vs zeroplus hierarchical ({env['stamp']})", "",
           f"2 hosts x 2 ranks (network namespaces, veth, {env['nproc']} CPUs for all four ranks: {env['cpu']}); "
           f"torch {env['torch']}; load average before/after: {env['load_before']} / {result['loadavg'][0]:.2f}. "
           f"zeroplus transports: flat = {result['transports']['zeroplus flat']!r}, "
           f"hier = {result['transports']['zeroplus hier']!r}. "
           "fp32, synchronous calls; medians over interleaved repetitions of the slowest rank; "
           "busbw = bytes/t * 2(n-1)/n, GB = 1e9 B.", "",
           "| size | gloo us | flat us | hier us | gloo busbw | flat busbw | hier busbw | hier/gloo busbw | "
           "hier/gloo time | verified |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for size in sorted({r["bytes_total"] for r in rows}):
        g, f, h = (next(r for r in rows if r["bytes_total"] == size and r["backend"] == b) for b in BACKENDS)
        ok = all(r["verified"] for r in (g, f, h))
        out.append(f"| {_fmt_size(size)} | {g['t_med_us']:.0f} | {f['t_med_us']:.0f} | {h['t_med_us']:.0f} | "
                   f"{g['busbw_GBps']:.3f} | {f['busbw_GBps']:.3f} | {h['busbw_GBps']:.3f} | "
                   f"{h['busbw_GBps'] / g['busbw_GBps']:.2f}x | {h['t_med_us'] / g['t_med_us']:.2f}x | "
                   f"{'yes' if ok else 'NO'} |")
    p = result["phases"]
    hier = next(r for r in rows if r["bytes_total"] == p["bytes"] and r["backend"] == "zeroplus hier")
    model = p["intra_allreduce_S"] + p["inter_gloo_allreduce_S_over_L"] + p["intra_allgather_S"]
    out += ["", f"## Phases of the hierarchical allreduce at {_fmt_size(p['bytes'])} (S), each timed alone, "
            f"every host / stripe at once", "",
            "| phase | us | bandwidth GB/s |", "|---|---:|---:|",
            f"| 1. intra-host allreduce of S ({p['local']} ranks, shm) | {p['intra_allreduce_S']:.0f} | "
            f"{p['bytes'] / p['intra_allreduce_S'] / 1e3:.2f} (S/t) |",
            f"| 2. inter-host allreduce of S/{p['local']} per stripe (Gloo, {p['hosts']} hosts) | "
            f"{p['inter_gloo_allreduce_S_over_L']:.0f} | "
            f"{p['bytes'] / p['local'] / p['inter_gloo_allreduce_S_over_L'] / 1e3:.2f} (S/L/t per stripe) |",
            f"| 2'. the same over zeroplus's own TCP | {p['inter_tcp_allreduce_S_over_L']:.0f} | "
            f"{p['bytes'] / p['local'] / p['inter_tcp_allreduce_S_over_L'] / 1e3:.2f} |",
            f"| 3. intra-host allgather of S (shm) | {p['intra_allgather_S']:.0f} | "
            f"{p['bytes'] / p['intra_allgather_S'] / 1e3:.2f} (S/t) |",
            f"| sum 1+2+3 (model) vs measured hierarchical | {model:.0f} vs {hier['t_med_us']:.0f} | "
            f"ratio {hier['t_med_us'] / model:.2f} |"]
    return "\n".join(out) + "\n"


def render_plot(result, path):
    sys.path.insert(0, str(REPO / "bench"))
    from plotting import busbw_and_time_axes, pyplot
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for backend, color in zip(BACKENDS, ("tab:orange", "tab:gray", "tab:blue")):
        pts = sorted((r["bytes_total"], r["busbw_GBps"], r["t_med_us"]) for r in result["rows"] if r["backend"] == backend)
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1] for p in pts], color=color, marker="o", label=backend)
        axes[1].plot(xs, [p[2] for p in pts], color=color, marker="o", label=backend)
    busbw_and_time_axes(axes, ", 2 hosts x 2 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 KiB and 1 MiB only, short budget (smoke run)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    sizes = [4 * KiB, 1 * MiB] if args.quick else [4 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
    sys.path.insert(0, str(REPO / "tests" / "python"))
    import netns

    reason = netns.skip_reason()
    if reason:
        sys.exit(f"multihost bench: {reason}")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(REPO / "tests" / "python"), str(REPO / "plugin" / "python"), os.environ.get("PYTHONPATH", "")])
    import platform

    import torch

    env = {"stamp": time.strftime("%Y%m%d-%H%M%S"), "nproc": os.cpu_count(), "torch": torch.__version__,
           "cpu": platform.processor() or platform.machine(), "load_before": round(os.getloadavg()[0], 2),
           "sizes": sizes}
    try:
        env["cpu"] = next(l for l in open("/proc/cpuinfo") if l.startswith("model name")).split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    t0 = time.time()
    with netns.two_hosts() as hosts:
        launch = netns.Launch(hosts, "bench", "gloo", module="multihost_rank", pg_timeout=600, env={
            "GLOO_SOCKET_IFNAME": netns.IFNAME, "ZP_BENCH_SIZES": ",".join(map(str, sizes)),
            "ZP_BENCH_BUDGET_S": "1.5" if args.quick else "6",
            "ZP_BENCH_PHASE_BYTES": str(1 * MiB if args.quick else 64 * MiB)}).start()
        try:
            launch.wait(1500)
        finally:
            launch.kill()
        path = os.path.join(launch.outdir, "bench.json")
        if not os.path.exists(path):
            sys.exit(f"multihost bench: no result; the ranks said:\n{launch.output}")
        result = json.load(open(path))
    print(f"done in {time.time() - t0:.0f} s", file=sys.stderr)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"multihost-{env['stamp']}"
    base.with_suffix(".json").write_text(json.dumps({"env": env, **result}, indent=1))
    md = render_markdown(result, env)
    if render_plot(result, base.with_suffix(".png")):
        md += f"\n![busbw and time per op]({base.with_suffix('.png').name})\n"
    base.with_suffix(".md").write_text(md)
    (out / "multihost-latest.md").write_text(md)
    print(md)
    print(f"wrote {base}.json/.md/.png", file=sys.stderr)


if __name__ == "__main__":
    main()
