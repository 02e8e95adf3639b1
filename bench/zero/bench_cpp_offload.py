#!/usr/bin/env python3
"""C++ ZeRO engine: step time with the optimizer state in memory vs on NVMe (offload_optimizer
"nvme"), and where the offloaded iteration's extra time goes. Runs build*/bin/bench_cpp_offload
(bench/zero/bench_cpp_offload.cpp), which times zero_grad + forward + backward + step (the
write-behind overlaps the next forward/backward) and step() alone, in-memory and offloaded side
by side in each launch, and reads the swap store's counters: time the training thread was
blocked on reads and on writes, CRC time, reads ahead vs on demand.

Each repetition launches every variant once per stage (interleaved: drift in the machine's load
hits all of them); the tables give medians over repetitions, the offload/in-memory ratio against
the in-memory runs of the same launches (issue 41's target: <= 1.10) and the load average. With
fio on PATH (nothing is installed) the disk's read and write bandwidth is measured on the same
directory with the records' file sizes (io_uring, O_DIRECT, 1 MiB, queue depth 32, one job per
rank): "disk floor" is the time the iteration's reads and writes take at those rates, and "of
fio" is floor / offloaded iteration (the swap bandwidth as a fraction of fio's). Without fio
those columns are left out. Writes bench/results/cpp-offload-<time>.json, .md and .png (and
cpp-offload-latest.*).

    python3 bench/zero/bench_cpp_offload.py [--nvme DIR] [--stages 2,3] [--worlds 1,2]
        [--variant LABEL=BINARY[:BUFFERS]]...   (default: one variant, the newest build)
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
KEYS = ("iter_s", "step_s", "fwdbwd_s", "read_wait_s", "write_wait_s", "checksum_s", "reads_ahead",
        "reads_on_demand", "bytes_read", "bytes_written")


def parse_variants(specs, default_bench):
    out = []
    for spec in specs or []:
        label, _, rest = spec.partition("=")
        path, _, buffers = rest.partition(":")
        out.append({"label": label, "bench": path, "buffers": int(buffers or 0)})
    if not out:
        out.append({"label": "current", "bench": default_bench, "buffers": 0})
    return out


def fio_rate(directory, rw, jobs, files, file_bytes):
    """MiB/s of one fio run (io_uring, O_DIRECT, 1 MiB, QD 32) over jobs x files files."""
    cmd = ["fio", "--name=swap", f"--directory={directory}", f"--rw={rw}", "--bs=1M", "--iodepth=32",
           "--direct=1", "--ioengine=io_uring", f"--numjobs={jobs}", f"--nrfiles={files}",
           f"--filesize={file_bytes}", f"--size={files * file_bytes}", "--group_reporting",
           "--output-format=json"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return None
    job = json.loads(res.stdout)["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default=None)
    ap.add_argument("--variant", action="append", help="LABEL=BINARY[:BUFFERS] (offload_buffer_count; 0: default)")
    ap.add_argument("--nvme", default=None, help="swap directory (default: a temporary one under /tmp)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--stages", default="2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--no-fio", action="store_true")
    args = ap.parse_args()
    default_bench = args.bench or max(glob.glob(os.path.join(ROOT, "build*", "bin", "bench_cpp_offload")),
                                      key=os.path.getmtime, default=None)
    variants = parse_variants(args.variant, default_bench)
    for v in variants:
        if not v["bench"] or not os.path.exists(v["bench"]):
            sys.exit(f"bench_cpp_offload not found ({v['bench']}): bash scripts/build.sh")
    stages = [int(s) for s in args.stages.split(",")]
    nvme = args.nvme or tempfile.mkdtemp(prefix="zeroplus-cpp-offload-")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = os.path.join(ROOT, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    raw_path = os.path.join(nvme, f"raw-{stamp}.json")
    load_before = os.getloadavg()
    rows, params = [], None
    for rep in range(args.reps):
        for stage in stages:
            for v in variants:
                cmd = [v["bench"], "--nvme", nvme, "--json", raw_path, "--layers", str(args.layers), "--width",
                       str(args.width), "--worlds", args.worlds, "--reps", "1", "--steps", str(args.steps),
                       "--stage", str(stage), "--precision", args.precision]
                if v["buffers"]:
                    cmd += ["--buffers", str(v["buffers"])]
                print(f"# rep {rep} stage {stage} {v['label']} (load {os.getloadavg()[0]:.2f})", flush=True)
                subprocess.run(cmd, check=True)
                data = json.load(open(raw_path))
                params = data["params"]
                for r in data["rows"]:
                    rows.append(dict(r, rep=rep, stage=stage, variant=v["label"], loadavg=os.getloadavg()[0]))
    os.remove(raw_path)
    load_after = os.getloadavg()

    fio = None
    nvme_rows = [r for r in rows if r["mode"] == "nvme" and r.get("record_bytes")]
    if args.no_fio:
        print("fio: skipped (--no-fio)")
    elif shutil.which("fio") is None:
        print("fio: not on PATH, the disk-floor columns are left out (apt-get install fio to get them)")
    elif nvme_rows:
        fio = {}
        for world in sorted({r["world"] for r in nvme_rows}):
            r = next(x for x in nvme_rows if x["world"] == world)
            files, size = int(r["records"]), int(r["record_bytes"])
            fdir = tempfile.mkdtemp(prefix="fio-", dir=nvme)
            w = fio_rate(fdir, "write", world, files, size)
            rd = fio_rate(fdir, "read", world, files, size)
            shutil.rmtree(fdir, ignore_errors=True)
            fio[world] = {"write_mib_s": w, "read_mib_s": rd, "files_per_rank": files, "file_bytes": size}
            print(f"fio world {world}: {world} x {files} files of {size / 2**20:.1f} MiB: "
                  f"write {w:.0f} MiB/s, read {rd:.0f} MiB/s")
    if not args.nvme:
        shutil.rmtree(nvme, ignore_errors=True)

    table = []
    for stage in stages:
        for world in sorted({r["world"] for r in rows}):
            for v in variants:
                sel = [r for r in rows if r["stage"] == stage and r["world"] == world and r["variant"] == v["label"]]
                mem = [r for r in sel if r["mode"] == "memory"]
                off = [r for r in sel if r["mode"] == "nvme"]
                if not mem or not off:
                    continue
                med = {k: statistics.median(r.get(k, 0) for r in off) for k in KEYS}
                mem_iter = statistics.median(r["iter_s"] for r in mem)
                mem_step = statistics.median(r["step_s"] for r in mem)
                mem_fwdbwd = statistics.median(r["fwdbwd_s"] for r in mem)
                pooled = [r for r in rows if r["stage"] == stage and r["world"] == world and r["mode"] == "memory"]
                row = {"stage": stage, "world": world, "variant": v["label"], "buffers": v["buffers"] or 6,
                       "memory_iter_s": mem_iter, "memory_step_s": mem_step, "memory_fwdbwd_s": mem_fwdbwd,
                       # every variant's in-memory runs of this stage and world (the plot's bar)
                       "memory_all_iter_s": statistics.median(r["iter_s"] for r in pooled),
                       "memory_all_fwdbwd_s": statistics.median(r["fwdbwd_s"] for r in pooled),
                       "iter_ratio": med["iter_s"] / mem_iter, "step_ratio": med["step_s"] / mem_step,
                       **{"nvme_" + k: val for k, val in med.items()}}
                if fio and world in fio and fio[world]["read_mib_s"] and fio[world]["write_mib_s"]:
                    total_r, total_w = med["bytes_read"] * world, med["bytes_written"] * world
                    floor = total_r / (fio[world]["read_mib_s"] * 2**20) + total_w / (fio[world]["write_mib_s"] * 2**20)
                    row["disk_floor_s"] = floor
                    row["of_fio"] = floor / med["iter_s"]
                table.append(row)

    has_fio = any("disk_floor_s" in r for r in table)
    lines = [f"C++ engine, {params / 1e6:.1f}M parameters, {args.precision}, AdamW; medians of {args.reps} "
             f"launches x {args.steps} iterations (rank 0); load average {load_before[0]:.2f} before, "
             f"{load_after[0]:.2f} after, {os.cpu_count()} CPUs; swap directory {args.nvme or '/tmp'}", "",
             "| stage | world | variant | buffers | iteration in memory (s) | iteration NVMe (s) | ratio | step() in memory (s) "
             "| step() NVMe (s) | ratio | blocked on reads (s) | blocked on writes (s) | CRC (s) | reads ahead / on demand"
             + (" | disk floor (s) | of fio |" if has_fio else " |"),
             "|---" * (14 + 2 * has_fio) + "|"]
    for r in table:
        line = (f"| {r['stage']} | {r['world']} | {r['variant']} | {r['buffers']} | {r['memory_iter_s']:.3f} | "
                f"{r['nvme_iter_s']:.3f} | {r['iter_ratio']:.2f}x | {r['memory_step_s']:.3f} | {r['nvme_step_s']:.3f} | "
                f"{r['step_ratio']:.2f}x | {r['nvme_read_wait_s']:.3f} | {r['nvme_write_wait_s']:.3f} | "
                f"{r['nvme_checksum_s']:.3f} | {r['nvme_reads_ahead']:.0f} / {r['nvme_reads_on_demand']:.0f}")
        if has_fio:
            line += (f" | {r['disk_floor_s']:.3f} | {100 * r['of_fio']:.0f} % |" if "disk_floor_s" in r else " | | |")
        else:
            line += " |"
        lines.append(line)
    if fio:
        lines.append("")
        for world, f in sorted(fio.items()):
            lines.append(f"fio (io_uring, O_DIRECT, 1 MiB, QD 32), world {world}: {world} job(s) x {f['files_per_rank']} "
                         f"files of {f['file_bytes'] / 2**20:.1f} MiB: write {f['write_mib_s']:.0f} MiB/s, "
                         f"read {f['read_mib_s']:.0f} MiB/s")
    else:
        lines.append("")
        lines.append("fio not measured (not on PATH or --no-fio): no disk-floor columns")
    text = "\n".join(lines)
    print(text)
    base = os.path.join(out_dir, f"cpp-offload-{stamp}")
    json.dump({"params": params, "precision": args.precision, "reps": args.reps, "steps": args.steps,
               "loadavg_before": load_before, "loadavg_after": load_after, "cpus": os.cpu_count(), "fio": fio,
               "variants": variants, "table": table, "raw": rows}, open(base + ".json", "w"), indent=1)
    open(base + ".md", "w").write(text + "\n")
    shutil.copy(base + ".md", os.path.join(out_dir, "cpp-offload-latest.md"))
    plot(table, variants, params, base, out_dir)
    print(f"wrote {base}.json/.md" + ("/.png" if os.path.exists(base + ".png") else ""))


def plot(table, variants, params, base, out_dir):
    try:  # the bench installs nothing: no matplotlib, no PNG
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    groups = sorted({(r["stage"], r["world"]) for r in table})
    fig, ax = plt.subplots(figsize=(max(7, 2.2 * len(groups) * (1 + len(variants)) / 2), 4.5))
    width = 0.8 / (1 + len(variants))
    parts = (("fwdbwd", "forward + backward", "#4c72b0"), ("step", "step (compute)", "#55a868"),
             ("read", "step blocked on reads", "#c44e52"), ("write", "blocked on writes", "#8172b2"))
    seen = set()
    for gi, (stage, world) in enumerate(groups):
        sel = [r for r in table if r["stage"] == stage and r["world"] == world]
        if not sel:
            continue
        bars = [("in memory", {"fwdbwd": sel[0]["memory_all_fwdbwd_s"],
                               "step": max(0.0, sel[0]["memory_all_iter_s"] - sel[0]["memory_all_fwdbwd_s"]),
                               "read": 0, "write": 0})]
        for r in sel:
            bars.append((r["variant"], {"fwdbwd": r["nvme_fwdbwd_s"],
                                        "step": max(0.0, r["nvme_step_s"] - r["nvme_read_wait_s"] - r["nvme_write_wait_s"]),
                                        "read": r["nvme_read_wait_s"], "write": r["nvme_write_wait_s"]}))
        for bi, (label, seg) in enumerate(bars):
            x = gi + (bi - (len(bars) - 1) / 2) * width
            bottom = 0.0
            for key, name, color in parts:
                ax.bar(x, seg[key], width * 0.9, bottom=bottom, color=color, label=name if name not in seen else None)
                seen.add(name)
                bottom += seg[key]
            ax.text(x, bottom, label, rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"stage {s}, world {w}" for s, w in groups])
    ax.set_ylabel("seconds per iteration (median; rank 0)")
    ax.set_title(f"C++ engine, optimizer on NVMe vs in memory, {params / 1e6:.0f}M params", fontsize=10)
    ax.margins(y=0.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=110)
    shutil.copy(base + ".png", os.path.join(out_dir, "cpp-offload-latest.png"))


if __name__ == "__main__":
    main()
