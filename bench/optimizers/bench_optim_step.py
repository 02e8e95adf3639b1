"""Optimizer-step benchmark: zeroplus fused CPU kernels vs torch for-loop, foreach=True and
fused=True, and DeepSpeed's DeepSpeedCPUAdam (with --deepspeed, Adam/AdamW only), side by side
in one process (interleaved repetitions, median), with a measured memory-bandwidth roofline.
Writes bench/results/optim_step.{json,md}.

    python bench/optimizers/bench_optim_step.py [--optim adamw] [--reps 15] [--threads N] [--deepspeed]

--deepspeed installs DeepSpeed once into the build directory (bench/deepspeed_env.py; the test
venv is not touched) and JIT-builds its cpu_adam op once into <build>/torch_extensions (minutes on
2 cores; cached after). DeepSpeedCPUAdam keeps fp32 exp_avg/exp_avg_sq (fp32_optimizer_states) for
bf16 parameters, like zeroplus, so it moves the same bytes per parameter.

Roofline: M = measured streaming bandwidth (best of N in-place a.add_(b) / a.addcmul_(b, c)
over 256 MiB tensors, read+write bytes/s, same thread count); time_roof = params * bytes_per_param / M, with bytes_per_param = 28 for fp32
Adam/AdamW (p, g, m, v read; p, m, v written), 22 for bf16 p/g with fp32 state, 20 / 14 for SGD.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

import zeroplus  # noqa: F401  (loads libzeroplus.so)
from zeroplus.optim import SGD, Adam, AdamW

ROOT = pathlib.Path(__file__).resolve().parents[2]
OURS = {"adam": Adam, "adamw": AdamW, "sgd": SGD}
TORCH = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
KWARGS = {"adam": dict(lr=1e-3), "adamw": dict(lr=1e-3, weight_decay=0.01), "sgd": dict(lr=1e-3, momentum=0.9)}
CONFIGS = {"1x16M": [16 << 20], "1000x4096": [4096] * 1000}


def bytes_per_param(optim: str, dtype: torch.dtype) -> int:
    pg = 4 if dtype == torch.float32 else 2  # param and grad element size; state is fp32 in ours
    state = 2 if optim != "sgd" else 1
    return 2 * pg + pg + state * 8  # read p, g; write p; read+write each fp32 state tensor


def measure_bandwidth(reps: int) -> float:
    """Streaming read+write bandwidth M in bytes/s: the best (minimum time) of `reps` runs of
    in-place probes over 256 MiB fp32 arrays, whose access pattern matches a fused optimizer's
    (every written array is also read, so there is no hidden write-allocate traffic that a
    `c.copy_(a)` probe would not count): a.add_(b) moves 12 B/elem, a.addcmul_(b, c) 16 B/elem.
    Same torch thread count as the kernels. A ceiling, so best-of-N rather than a median."""
    n = 64 << 20
    a, b, c = torch.ones(n), torch.full((n,), 1e-30), torch.full((n,), 1e-30)
    best = 0.0
    for traffic, fn in ((12 * n, lambda: a.add_(b)), (16 * n, lambda: a.addcmul_(b, c))):
        fn()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = max(best, traffic / (time.perf_counter() - t0))
    return best


def deepspeed_cpu_adam(params, optim: str, kw: dict):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=optim == "adamw", fp32_optimizer_states=True, **kw)


def make_variant(name: str, optim: str, sizes: list[int], dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g).to(dtype).requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(dtype) * 1e-3
    kw = dict(KWARGS[optim])
    if name == "zeroplus":
        opt = OURS[optim](params, **kw)
    elif name == "deepspeed_cpu_adam":
        opt = deepspeed_cpu_adam(params, optim, kw)
    else:
        flag = {"torch_forloop": dict(foreach=False), "torch_foreach": dict(foreach=True),
                "torch_fused": dict(fused=True)}[name]
        opt = TORCH[optim](params, **kw, **flag)
    opt.step()  # warm-up: allocates state
    return opt


def bench_config(optim: str, cfg: str, dtype: torch.dtype, reps: int, variants: list[str]) -> dict:
    sizes = CONFIGS[cfg]
    opts = {}
    for v in variants:
        try:
            opts[v] = make_variant(v, optim, sizes, dtype)
        except (RuntimeError, ValueError) as e:  # e.g. fused=True unsupported for a dtype
            print(f"  skip {v}: {str(e).splitlines()[0]}")
    times = {v: [] for v in opts}
    for _ in range(reps):  # interleaved A B C D A B C D ... so machine drift cancels
        for v, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[v].append(time.perf_counter() - t0)
    n = sum(sizes)
    return {v: {"t_med_ms": statistics.median(t) * 1e3, "t_min_ms": min(t) * 1e3,
                "t_p10_ms": sorted(t)[len(t) // 10] * 1e3,
                "t_p90_ms": sorted(t)[(len(t) * 9) // 10] * 1e3, "params_per_s": n / statistics.median(t)}
            for v, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optim", choices=sorted(OURS), default="adamw")
    ap.add_argument("--reps", type=int, default=15, help="interleaved steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3,
                    help="independent rounds (fresh optimizers, fresh bandwidth probe); the report "
                         "takes the median over rounds of each round's median, and the best probe")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave default)")
    ap.add_argument("--configs", default="1x16M,1000x4096")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--deepspeed", action="store_true",
                    help="add DeepSpeedCPUAdam (Adam/AdamW; installs DeepSpeed into the build dir once)")
    ap.add_argument("--variants", default="torch_forloop,torch_foreach,torch_fused,zeroplus",
                    help="comma-separated subset (zeroplus is always run: ratios are against it)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "optim_step"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [v for v in args.variants.split(",") if v and v != "zeroplus"] + ["zeroplus"]
    if args.deepspeed and args.optim in ("adam", "adamw"):
        sys.path.insert(0, str(ROOT / "bench"))
        from deepspeed_env import ensure_deepspeed

        ensure_deepspeed()
        import deepspeed

        print(f"deepspeed {deepspeed.__version__}: building/loading cpu_adam (cached in "
              f"{os.environ['TORCH_EXTENSIONS_DIR']})", flush=True)
        variants.insert(len(variants) - 1, "deepspeed_cpu_adam")
    bw = max(measure_bandwidth(max(5, args.reps // 2)) for _ in range(args.rounds))
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "isa": torch.ops.zeroplus.cpu_isa(),
           "cpu": platform.processor() or platform.machine(), "stream_bw_GBps": bw / 1e9, "rounds": args.rounds}
    print(f"env: {env}")
    rows = []
    for cfg in args.configs.split(","):
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            rounds = [bench_config(args.optim, cfg, dtype, args.reps, variants) for _ in range(args.rounds)]
            res = {v: {k: statistics.median(r[v][k] for r in rounds) for k in rounds[0][v]} for v in rounds[0]}
            for v in res:  # best-of-all-rounds: the least disturbed run, for a loaded machine
                res[v]["t_min_ms"] = min(r[v]["t_min_ms"] for r in rounds)
            n = sum(CONFIGS[cfg])
            t_roof = n * bytes_per_param(args.optim, dtype) / bw
            ours = res.get("zeroplus")
            for v, r in res.items():
                row = {"optim": args.optim, "config": cfg, "dtype": dname, "variant": v, **r,
                       "speedup_of_zeroplus": ours["t_med_ms"] / 1e3 and r["t_med_ms"] / ours["t_med_ms"],
                       "speedup_of_zeroplus_best": r["t_min_ms"] / ours["t_min_ms"],
                       "pct_roofline": 100 * t_roof / (r["t_med_ms"] / 1e3),
                       "pct_roofline_best": 100 * t_roof / (r["t_min_ms"] / 1e3), "reps": args.reps}
                rows.append(row)
                print(f"{cfg:>10} {dname:>8} {v:>14}: {r['t_med_ms']:8.2f} ms  "
                      f"zeroplus x{row['speedup_of_zeroplus']:.2f}  roof {row['pct_roofline']:.0f}%")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"# {args.optim} step, {env['threads']} threads, ISA {env['isa']}, streaming BW {bw / 1e9:.1f} GB/s "
             f"(in-place probe, best of N), torch {env['torch']}, median of {args.rounds} rounds x {args.reps} reps", "",
             "| config | dtype | variant | median ms | p10 | p90 | best ms | zeroplus speedup (median) | "
             "(best) | % roofline (median) | (best) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['dtype']} | {r['variant']} | {r['t_med_ms']:.2f} | {r['t_p10_ms']:.2f} | "
                     f"{r['t_p90_ms']:.2f} | {r['t_min_ms']:.2f} | {r['speedup_of_zeroplus']:.2f}x | "
                     f"{r['speedup_of_zeroplus_best']:.2f}x | {r['pct_roofline']:.0f}% | {r['pct_roofline_best']:.0f}% |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and .md")
    plot(rows, env, out.with_suffix(".png"))


def plot(rows: list[dict], env: dict, path: pathlib.Path) -> None:
    """Median step time per variant, one group of bars per (config, dtype), with the bandwidth
    roofline (the time the step's bytes take at the measured memory bandwidth) drawn across each
    group: a bar at the line runs at the machine's memory bandwidth."""
    sys.path.insert(0, str(ROOT / "bench"))
    from plotting import pyplot
    plt = pyplot()
    if plt is None:
        return
    cases = list(dict.fromkeys((r["config"], r["dtype"]) for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(cases)), 4))
    for i, v in enumerate(variants):
        ts = [next((r["t_med_ms"] for r in rows if (r["config"], r["dtype"]) == c and r["variant"] == v), 0)
              for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], ts, width, label=v)
    for j, c in enumerate(cases):
        r = next(r for r in rows if (r["config"], r["dtype"]) == c)
        t_roof_ms = r["t_med_ms"] * r["pct_roofline"] / 100
        ax.hlines(t_roof_ms, j - width / 2, j + width * (len(variants) - 0.5), colors="black", linestyles="dashed",
                  label=f"roofline ({env['stream_bw_GBps']:.0f} GB/s)" if j == 0 else None)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(cases))])
    ax.set_xticklabels([f"{c} {d}" for c, d in cases])
    ax.set_ylabel("median step ms (lower is better)")
    ax.set_yscale("log")
    ax.set_title(f"{rows[0]['optim']} step, {env['threads']} threads, ISA {env['isa']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
