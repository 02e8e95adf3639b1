#!/usr/bin/env python3
"""zeroplus aio benchmark: our io_uring engine and thread-pool fallback against fio (io_uring).

One command (from the repository root, after building build-aio):
    python3 bench/aio/run.py
Every configuration runs fio --ioengine=io_uring and zeroplus_aio_bench on the same file with
the same rw/bs/iodepth/direct=1, interleaved (the order rotates per repetition), and reports the
median GB/s (1e9 bytes/s) and the ratio to fio. O_DIRECT throughout, so no cache dropping is
needed. Results go to bench/results/aio-<time>.json and .md (and aio-latest.md), and a PNG of
GB/s against queue depth per pattern and block size (aio-<time>.png, aio-latest.png).
"""
import argparse
import datetime
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def human(n):
    for unit, v in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % v == 0:
            return f"{n // v}{unit}"
    return str(n)


def find_bench(explicit):
    if explicit:
        return explicit
    hits = sorted(glob.glob(os.path.join(ROOT, "build*", "bin", "zeroplus_aio_bench")), key=os.path.getmtime)
    if not hits:
        sys.exit("zeroplus_aio_bench not found: build it (see docs/aio.md) or pass --bench")
    return hits[-1]


def run_fio(path, size, rw, bs, qd):
    cmd = ["fio", "--name=zp", f"--filename={path}", f"--size={size}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={qd}", "--direct=1", "--ioengine=io_uring", "--numjobs=1",
           "--randrepeat=1", "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if "write" in rw else "read"]
    return side["bw_bytes"] / 1e9


def run_ours(bench, path, size, rw, bs, qd, engine, seed):
    cmd = [bench, "--file", path, "--size", str(size), "--rw", rw, "--bs", str(bs), "--qd", str(qd),
           "--engine", engine, "--direct", "1", "--seed", str(seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["GBps"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default=os.path.join(ROOT, "bench", "results", "aio-bench.dat"),
                    help="test file on the disk to measure (default: bench/results/, project disk)")
    ap.add_argument("--size", default="1G", help="file size, 1G-4G recommended (default 1G)")
    ap.add_argument("--seq-qds", default="1,4,16,32,64", help="queue depths for sequential 1M")
    ap.add_argument("--other-qds", default="1,16,64", help="queue depths for random and 128K runs")
    ap.add_argument("--patterns", default="read,write,randread,randwrite")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median reported)")
    ap.add_argument("--no-threads", action="store_true", help="skip the thread-pool fallback")
    ap.add_argument("--bench", help="path to zeroplus_aio_bench (default: newest build*/bin)")
    ap.add_argument("--keep-file", action="store_true", help="do not delete the test file")
    args = ap.parse_args()

    if not shutil.which("fio"):
        sys.exit("fio not found (Debian: apt-get install fio)")
    bench = find_bench(args.bench)
    size = parse_size(args.size)
    os.makedirs(os.path.dirname(os.path.abspath(args.file)), exist_ok=True)
    # Fully written (allocated) file, so reads hit real extents and writes are overwrites for
    # both tools, like fio's default fallocate=native.
    subprocess.run(["fio", "--name=prep", f"--filename={args.file}", f"--size={size}", "--rw=write",
                    "--bs=1M", "--iodepth=16", "--direct=1", "--ioengine=io_uring"],
                   check=True, capture_output=True)

    patterns = args.patterns.split(",")
    configs = []
    for rw in patterns:
        seq = not rw.startswith("rand")
        for qd in (args.seq_qds if seq else args.other_qds).split(","):
            configs.append((rw, 1 << 20, int(qd)))
    for rw in [p for p in patterns if not p.startswith("rand")]:
        for qd in args.other_qds.split(","):
            configs.append((rw, 128 << 10, int(qd)))

    tools = ["fio", "io_uring"] + ([] if args.no_threads else ["threads"])
    rows = []
    for rw, bs, qd in configs:
        samples = {t: [] for t in tools}
        for rep in range(args.reps):
            order = tools[rep % len(tools):] + tools[:rep % len(tools)]
            for t in order:
                if t == "fio":
                    samples[t].append(run_fio(args.file, size, rw, bs, qd))
                else:
                    samples[t].append(run_ours(bench, args.file, size, rw, bs, qd, t, rep + 1))
        med = {t: statistics.median(v) for t, v in samples.items()}
        row = {"rw": rw, "bs": bs, "qd": qd, "samples_GBps": samples, "median_GBps": med}
        rows.append(row)
        pct = " ".join(f"{t}={med[t]:.2f}" for t in tools)
        print(f"{rw:9s} bs={human(bs):4s} qd={qd:<3d} {pct}  io_uring/fio={100 * med['io_uring'] / med['fio']:.1f}%",
              flush=True)

    if not args.keep_file:
        os.unlink(args.file)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    outdir = os.path.join(ROOT, "bench", "results")
    os.makedirs(outdir, exist_ok=True)
    meta = {"time": stamp, "kernel": platform.release(), "file": args.file, "size": size,
            "reps": args.reps, "fio": subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip(),
            "bench": bench, "unit": "GB/s = 1e9 bytes/s, median of reps"}
    with open(os.path.join(outdir, f"aio-{stamp}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# zeroplus aio vs fio ({meta['fio']}, ioengine=io_uring, direct=1)", "",
             f"kernel {meta['kernel']}, file {human(size)} at {args.file}, median of {args.reps} interleaved reps, GB/s = 1e9 B/s", "",
             "| rw | bs | QD | fio GB/s | zeroplus io_uring GB/s | % of fio |" +
             (" thread-pool GB/s | % of fio |" if "threads" in tools else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if "threads" in tools else "")]
    for r in rows:
        m = r["median_GBps"]
        line = f"| {r['rw']} | {human(r['bs'])} | {r['qd']} | {m['fio']:.2f} | {m['io_uring']:.2f} | {100 * m['io_uring'] / m['fio']:.0f} % |"
        if "threads" in tools:
            line += f" {m['threads']:.2f} | {100 * m['threads'] / m['fio']:.0f} % |"
        lines.append(line)
    md = "\n".join(lines) + "\n"
    for name in (f"aio-{stamp}.md", "aio-latest.md"):
        with open(os.path.join(outdir, name), "w") as f:
            f.write(md)
    print("\n" + md)
    print(f"wrote {outdir}/aio-{stamp}.json and .md")
    plot(rows, tools, meta, [os.path.join(outdir, f"aio-{stamp}.png"), os.path.join(outdir, "aio-latest.png")])


def plot(rows, tools, meta, paths):
    """One panel per (pattern, block size): median GB/s against queue depth, one line per tool."""
    from plotting import pyplot
    plt = pyplot()
    if plt is None:
        return
    panels = sorted({(r["rw"], r["bs"]) for r in rows}, key=lambda k: (-k[1], k[0]))
    cols = min(3, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    colors = {"fio": "tab:gray", "io_uring": "tab:blue", "threads": "tab:orange"}
    for ax, (rw, bs) in zip(axes.flat, panels):
        pts = sorted((r["qd"], r["median_GBps"]) for r in rows if r["rw"] == rw and r["bs"] == bs)
        for t in tools:
            label = "fio (io_uring)" if t == "fio" else f"zeroplus {t}"
            ax.plot([q for q, _ in pts], [m[t] for _, m in pts], marker="o", color=colors[t], label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{rw}, bs {human(bs)}", fontsize=9)
        ax.set_xlabel("queue depth")
        ax.set_ylabel("GB/s")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"zeroplus aio vs fio, O_DIRECT, kernel {meta['kernel']}", fontsize=10)
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=110)
    print(f"wrote {paths[0]}")


if __name__ == "__main__":
    main()
