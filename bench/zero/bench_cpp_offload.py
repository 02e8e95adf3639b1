#!/usr/bin/env python3
"""C++ ZeRO engine: step time with the optimizer state in memory vs on NVMe (offload_optimizer
"nvme"). Runs build*/bin/bench_cpp_offload (bench/zero/bench_cpp_offload.cpp), which times
zero_grad + forward + backward + step (the write-behind overlaps the next forward/backward) and
step() alone, in-memory and offloaded interleaved per repetition; this script takes the median
over repetitions, prints a table with the offload/in-memory ratio (issue 41's target: <= 1.10)
and writes bench/results/cpp-offload-<time>.json, .md and .png (and cpp-offload-latest.*).

    python3 bench/zero/bench_cpp_offload.py [--nvme DIR] [--layers 12] [--width 2048] [--worlds 1,2]
"""
import argparse
import datetime
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from plotting import pyplot  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default=None)
    ap.add_argument("--nvme", default=None, help="swap directory (default: a temporary one under /tmp)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    args = ap.parse_args()
    bench = args.bench or max(glob.glob(os.path.join(ROOT, "build*", "bin", "bench_cpp_offload")),
                              key=os.path.getmtime, default=None)
    if not bench:
        sys.exit("bench_cpp_offload not found: bash scripts/build.sh")
    nvme = args.nvme or tempfile.mkdtemp(prefix="zeroplus-cpp-offload-")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = os.path.join(ROOT, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    raw = os.path.join(out_dir, f"cpp-offload-{stamp}.raw.json")
    load_before = os.getloadavg()
    subprocess.run([bench, "--nvme", nvme, "--json", raw, "--layers", str(args.layers), "--width", str(args.width),
                    "--worlds", args.worlds, "--reps", str(args.reps), "--steps", str(args.steps),
                    "--stage", str(args.stage), "--precision", args.precision], check=True)
    if not args.nvme:
        shutil.rmtree(nvme, ignore_errors=True)
    data = json.load(open(raw))
    os.remove(raw)
    rows = []
    for world in sorted({r["world"] for r in data["rows"]}):
        med = {}
        for mode in ("memory", "nvme"):
            sel = [r for r in data["rows"] if r["world"] == world and r["mode"] == mode]
            med[mode] = {k: statistics.median(r[k] for r in sel) for k in ("iter_s", "step_s")}
        rows.append({"world": world, "memory_iter_s": med["memory"]["iter_s"], "nvme_iter_s": med["nvme"]["iter_s"],
                     "iter_ratio": med["nvme"]["iter_s"] / med["memory"]["iter_s"],
                     "memory_step_s": med["memory"]["step_s"], "nvme_step_s": med["nvme"]["step_s"],
                     "step_ratio": med["nvme"]["step_s"] / med["memory"]["step_s"]})
    result = {"params": data["params"], "stage": data["stage"], "precision": data["precision"],
              "reps": data["reps"], "steps": data["steps"], "nvme_path_fs": nvme,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(),
              "rows": rows, "raw": data["rows"]}
    lines = [f"C++ engine, {data['params'] / 1e6:.1f}M parameters, stage {data['stage']}, {data['precision']}, "
             f"AdamW; medians of {data['reps']} repetitions x {data['steps']} iterations; "
             f"load average {load_before[0]:.2f} before, {result['loadavg_after'][0]:.2f} after, "
             f"{os.cpu_count()} CPUs", "",
             "| world | iteration in memory (s) | iteration NVMe (s) | ratio | step() in memory (s) | step() NVMe (s) | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['memory_iter_s']:.3f} | {r['nvme_iter_s']:.3f} | {r['iter_ratio']:.2f}x | "
                     f"{r['memory_step_s']:.3f} | {r['nvme_step_s']:.3f} | {r['step_ratio']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    base = os.path.join(out_dir, f"cpp-offload-{stamp}")
    json.dump(result, open(base + ".json", "w"), indent=1)
    open(base + ".md", "w").write(table + "\n")
    shutil.copy(base + ".md", os.path.join(out_dir, "cpp-offload-latest.md"))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        worlds = [r["world"] for r in rows]
        width = 0.2
        for i, (key, label) in enumerate((("memory_iter_s", "iteration, in memory"), ("nvme_iter_s", "iteration, NVMe"),
                                          ("memory_step_s", "step(), in memory"), ("nvme_step_s", "step(), NVMe"))):
            ax.bar([w + (i - 1.5) * width for w in worlds], [r[key] for r in rows], width, label=label)
        ax.set_xticks(worlds)
        ax.set_xlabel("world size (ranks as threads)")
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"C++ engine optimizer offload, {data['params'] / 1e6:.0f}M params, stage {data['stage']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(base + ".png", dpi=110)
        shutil.copy(base + ".png", os.path.join(out_dir, "cpp-offload-latest.png"))
    print(f"wrote {base}.json/.md/.png")


if __name__ == "__main__":
    main()
