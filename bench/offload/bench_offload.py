"""Optimizer offload to NVMe beside the in-memory step: time split, swap bandwidth, bit-exactness.

    python bench/offload/bench_offload.py [--worlds 1,2] [--stage 3] [--dim 768] [--layers 15]
        [--steps 4] [--precision fp32|bf16] [--buffer-count 4] [--param-buffer-count 5] [--nvme-path DIR]
        [--deepspeed [--deepspeed-max-in-cpu N]] [--out PATH]

A TinyGPT (examples/tiny_gpt.py; dim 768 x 15 layers is 106.8M parameters) with AdamW (lr 3e-4,
wd 0.01), one torch thread per rank. Every rank builds both variants from the same weights and
runs them interleaved, one step of each per round, on its own synthetic batches:
  in_memory      zeroplus.initialize(stage=S)
  nvme           the same with offload_optimizer={"device": "nvme", "nvme_path": DIR,
                 "buffer_count": N}: fp32 master (bf16) and optimizer state in swap files
  nvme_param     (stage 3) the same plus offload_param={"device": "nvme", ..., "buffer_count": M,
                 "buffer_size": E}: the parameter shards in swap files too, written every step; with
                 DeepSpeed's default pool (5 x 1e8 elements) a 100M model's records stay cached in it
                 after the first step, so they are written but not read again
  nvme_param_stream  the same with a pool of M records only (buffer_size 1): the records are read
                 again in forward, backward and the step (most of them are not in memory)
A round's time is the slower rank's. Per variant: forward+backward ("compute") and opt.step()
medians; for nvme, inside the step, the training thread's waits for swap-in reads and swap-out
writes and the checksum time (zeroplus.offload's counters), bytes read and written per step and
their rate over the step (nvme_param: over forward + backward + step, where its parameters move),
the bytes on disk, and whether the full state dict equals the in-memory run's bit for bit after
the last round. fio (O_DIRECT, 1 MiB, iodepth 32, io_uring) on the same
directory gives the device's figure when fio is installed. Writes PATH.json, PATH.md and PATH.png
(the step-time breakdown: forward+backward, swap-in and swap-out waits, the rest of the step).

--deepspeed adds DeepSpeed 0.19.8's own offload in the same ranks, with the same rounds and data,
swapping under the same nvme_path (bench/offload/deepspeed_offload.py: stage 3 in memory, optimizer
in CPU memory, optimizer on NVMe, optimizer + parameters on NVMe; stage 2 in memory and optimizer
on NVMe), each variant's
step against its own stage's in-memory step, with the time in its swapper calls, the bytes the
rank read and wrote, the bytes on disk, and whether its losses and parameters equal its in-memory
run's. They run after zeroplus's variants are freed, stage 2's then stage 3's (each stage's
variants interleaved), so that the machine's memory holds one phase at a time.
bench/deepspeed_env.py installs DeepSpeed and builds its async_io and cpu_adam ops (once).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The ranks are spawned: they re-import this module, so the source tree's package is found there too.
if str(ROOT / "plugin" / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "plugin" / "python"))
VOCAB = 256


def _fio(directory: str, rw: str) -> float | None:
    """fio's O_DIRECT sequential bandwidth in GB/s (1e9) on `directory`, or None without fio."""
    if shutil.which("fio") is None:
        return None
    path = os.path.join(directory, "fio-offload-bench")
    try:
        out = subprocess.run(["fio", "--name=b", f"--filename={path}", f"--rw={rw}", "--bs=1M", "--iodepth=32",
                              "--ioengine=io_uring", "--direct=1", "--size=1G", "--runtime=10", "--time_based=0",
                              "--output-format=json"], capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            return None
        job = json.loads(out.stdout)["jobs"][0]
        return job["read" if "read" in rw else "write"]["bw_bytes"] / 1e9
    finally:
        if os.path.exists(path) and rw == "read":
            os.unlink(path)


def _build(args, offload, rank, param_offload=None):
    import zeroplus
    from tiny_gpt import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=args.dim, layers=args.layers, heads=args.heads, context=args.context)
    kw = {} if offload is None else {"offload_optimizer": offload}
    if param_offload is not None:
        kw["offload_param"] = param_offload
    precision = None if args.precision == "fp32" else args.precision
    return zeroplus.initialize(model, torch.optim.AdamW, stage=args.stage, lr=3e-4, weight_decay=0.01,
                               mixed_precision=precision, **kw)


def _slowest(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _worker(rank, world, store_path, args, out_queue):
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "bench" / "offload"))
    import zeroplus  # noqa: F401  (registers backend "zeroplus")
    import deepspeed_offload  # (bench/offload) imports deepspeed only when its variants run
    from tiny_gpt import synthetic_batch

    torch.set_num_threads(1)
    dist.init_process_group("zeroplus", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    try:
        offload = {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": args.buffer_count}
        variants = {"in_memory": _build(args, None, rank), "nvme": _build(args, offload, rank)}
        if args.stage == 3:  # parameters too (offload_param), with the optimizer state
            param = {**offload, "buffer_count": args.param_buffer_count, "buffer_size": args.param_buffer_size}
            variants["nvme_param"] = _build(args, offload, rank, param)
            variants["nvme_param_stream"] = _build(args, offload, rank, {**param, "buffer_size": 1})
        swapper = variants["nvme"][1].offload

        def counters(name):
            stores = [variants[name][1].offload]
            if name.startswith("nvme_param"):  # + the parameter records and the spilled gradients
                stores += [variants[name][1].placement.param_store, variants[name][1].reducer.spill]
            return [sum(getattr(s, k, 0.0) for s in stores)
                    for k in ("read_wait_s", "write_wait_s", "checksum_s", "bytes_read", "bytes_written",
                              "background_check_s")]

        rows = {name: {"compute": [], "step": []} for name in variants}
        swaps = {name: {"read_wait": [], "write_wait": [], "checksum": [], "bytes_read": [], "bytes_written": [],
                        "background_check": []}
                 for name in variants if name != "in_memory"}
        swap = swaps["nvme"]
        gen = {name: torch.Generator().manual_seed(rank) for name in variants}
        for round_ in range(args.steps + 1):  # round 0 creates the state: not timed
            for name, (model, opt) in variants.items():
                tokens, targets = synthetic_batch(args.batch, args.context, VOCAB, gen[name])
                before = counters(name) if name != "in_memory" else None
                dist.barrier()
                t0 = time.perf_counter()
                logits = model(tokens)
                F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
                t1 = time.perf_counter()
                opt.step()
                opt.zero_grad()
                t2 = time.perf_counter()
                compute, step = _slowest(t1 - t0), _slowest(t2 - t1)
                if round_ == 0:
                    continue
                rows[name]["compute"].append(compute)
                rows[name]["step"].append(step)
                if name != "in_memory":
                    for key, a, b in zip(swaps[name], counters(name), before):
                        swaps[name][key].append(_slowest(a - b))
        ref_full = zeroplus.full_state_dict(variants["in_memory"][0], rank0_only=False)
        bit_exact = {}
        for name in swaps:
            full = zeroplus.full_state_dict(variants[name][0], rank0_only=False)
            same = all(torch.equal(full[k], ref_full[k]) for k in ref_full)
            bit_exact[name] = _slowest(0.0 if same else 1.0) == 0.0
        same = bit_exact["nvme"]
        disk = {name: variants[name][1].offload.disk_bytes() for name in swaps}
        for name in ("nvme_param", "nvme_param_stream"):
            if name in variants:
                disk[name] += variants[name][1].placement.param_store.disk_bytes()
        report = zeroplus.memory_report(*variants["nvme"])
        ref_report = zeroplus.memory_report(*variants["in_memory"])
        result = {"rank": rank, "rows": rows, "swap": swap, "swaps": swaps, "bit_exact": same,
                  "bit_exact_by_variant": bit_exact, "disk_by_variant": disk,
                  "disk_bytes": swapper.disk_bytes(), "offload_peak_buffers": report["offload_peak_buffers"],
                  "optimizer_state_in_memory": ref_report["optimizer_state"] + ref_report["master_parameters"],
                  "engine": swapper.engine, "rss": {"zeroplus": deepspeed_offload.rss_bytes()}}
        for name in swaps:
            variants[name][1].offload.close()
        for name in ("nvme_param", "nvme_param_stream"):
            if name in variants:
                variants[name][1].placement.param_store.close()
        if args.deepspeed:  # after zeroplus's variants, in the same ranks (deepspeed_offload.run_phases)
            # Everything of zeroplus's that is still referenced goes first: the last loop's model and
            # optimizer and the two full state dicts kept about 4 GiB per rank alive (106.8M params).
            del variants, swapper, model, opt, logits, ref_full, full
            gc.collect()
            ds = deepspeed_offload.run_phases(args, rank, world)
            result["rss"].update(ds.pop("rss"))
            result.update(ds)
        out_queue.put(result)
    except Exception as e:  # reported, not hidden
        traceback.print_exc()
        out_queue.put({"rank": rank, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
    finally:
        dist.destroy_process_group()


def run_world(world, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        if args.deepspeed:  # DeepSpeed's swap directories for this launch: <nvme_path>/<temp>/<variant>
            args = argparse.Namespace(**vars(args), deepspeed_dir=tempfile.mkdtemp(prefix="ds-offload-bench-",
                                                                                  dir=args.nvme_path))
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(d, "store"), args, q)) for r in range(world)]
        for p in procs:
            p.start()
        results = [q.get(timeout=7200) for _ in procs]
        for p in procs:
            p.join()
        if args.deepspeed:
            shutil.rmtree(args.deepspeed_dir, ignore_errors=True)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    out = next(r for r in results if r["rank"] == 0)
    out["disk_bytes_all_ranks"] = sum(r["disk_bytes"] for r in results)
    out["disk_all_ranks_by_variant"] = {name: sum(r["disk_by_variant"][name] for r in results)
                                        for name in out["disk_by_variant"]}
    out["rss_max_rank"] = {phase: max(r["rss"][phase] for r in results) for phase in out["rss"]}
    if out.get("deepspeed_summary"):
        for name, summary in out["deepspeed_summary"].items():
            summary["disk_all_ranks"] = {k: sum(r["deepspeed_summary"][name]["disk"][k] for r in results)
                                         for k in summary["disk"]}
    return out


def _gbps(v):
    return "n/a (no fio)" if v is None else f"{v:.2f} GB/s"


def _engine(results):
    return next((r["engine"] for r in results.values() if "engine" in r), "?")


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def plot_breakdown(results: dict, path, title: str) -> None:
    """PATH (PNG): per world size, one stacked bar per zeroplus variant: forward+backward, the
    step's swap-in and swap-out waits, and the rest of the step (medians, seconds)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    worlds = [w for w, r in results.items() if "error" not in r]
    fig, axes = plt.subplots(1, len(worlds), figsize=(5.5 * len(worlds), 4.5), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        r = results[world]
        names = list(r["rows"])
        parts = {"forward + backward": [], "step: swap-in wait": [], "step: swap-out wait": [], "step: rest": []}
        for name in names:
            step = _med(r["rows"][name]["step"])
            s = r["swaps"].get(name)
            read = _med(s["read_wait"]) if s else 0.0
            write = _med(s["write_wait"]) if s else 0.0
            parts["forward + backward"].append(_med(r["rows"][name]["compute"]))
            parts["step: swap-in wait"].append(read)
            parts["step: swap-out wait"].append(write)
            parts["step: rest"].append(max(step - read - write, 0.0))
        bottom = [0.0] * len(names)
        for label, values in parts.items():
            ax.bar(names, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(f"{title}, {world} rank{'s' if int(world) > 1 else ''}")
        ax.set_ylabel("seconds per training step (median)")
        ax.tick_params(axis="x", rotation=20)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(args, psi, fio, results, ds_info) -> str:
    """The markdown tables of `results` so far."""
    lines = [f"# Optimizer offload to NVMe: {psi / 1e6:.1f}M-parameter TinyGPT, stage {args.stage}, {args.precision}, "
             f"AdamW, buffer_count {args.buffer_count}, offload_param pool {args.param_buffer_count} x "
             f"{args.param_buffer_size:g} elements (stream: {args.param_buffer_count} records), {args.steps} timed "
             f"rounds (medians, slowest rank)", "",
             f"nvme_path {args.nvme_path}; fio O_DIRECT 1 MiB QD32 io_uring: read {_gbps(fio['read'])}, "
             f"write {_gbps(fio['write'])}; swap engine {_engine(results)}", "",
             "| ranks | variant | compute s | step s | step / in-memory step | (compute + step) / in-memory | "
             "swap-in wait s | swap-out wait s | checksum s | checked in background s | GB read per step | "
             "GB written per step | GB/s | disk GB (all ranks) | bit-exact |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for world, r in results.items():
        if "error" in r:
            lines.append(f"| {world} | — | error: {r['error']} |")
            continue
        ref_step = _med(r["rows"]["in_memory"]["step"])
        ref_total = ref_step + _med(r["rows"]["in_memory"]["compute"])
        for name in r["rows"]:
            row = r["rows"][name]
            step = _med(row["step"])
            total = step + _med(row["compute"])
            if name != "in_memory":
                s = r["swaps"][name]
                read, written = _med(s["bytes_read"]) / 1e9, _med(s["bytes_written"]) / 1e9
                seconds = step if name == "nvme" else total  # parameters move in forward and backward too
                extra = (f"{_med(s['read_wait']):.3f} | {_med(s['write_wait']):.3f} | {_med(s['checksum']):.3f} | "
                         f"{_med(s['background_check']):.3f} | {read:.3f} | {written:.3f} | "
                         f"{(read + written) / seconds:.2f} | {r['disk_all_ranks_by_variant'][name] / 1e9:.3f} | "
                         f"{'yes' if r['bit_exact_by_variant'][name] else 'NO'}")
            else:
                extra = "— | — | — | — | — | — | — | — | —"
            lines.append(f"| {world} | {name} | {_med(row['compute']):.3f} | {step:.3f} | {step / ref_step:.2f} | "
                         f"{total / ref_total:.2f} | {extra} |")
    if args.deepspeed:
        from deepspeed_offload import table as deepspeed_table

        lines += [""] + deepspeed_table(results, ds_info)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--param-buffer-count", type=int, default=5, help="offload_param.buffer_count (stage 3)")
    parser.add_argument("--param-buffer-size", type=int, default=100_000_000,
                        help="offload_param.buffer_size in elements (DeepSpeed's default 1e8)")
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--deepspeed", action="store_true",
                        help="add DeepSpeed's own offload (stage 3 and 2; installed into the build directory once)")
    parser.add_argument("--deepspeed-max-in-cpu", type=int, default=None,
                        help="offload_param.max_in_cpu of ds3_nvme_param (default: DeepSpeed's, 1e9)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "offload"))
    args = parser.parse_args()
    if args.deepspeed_max_in_cpu is not None and (args.deepspeed_max_in_cpu < 0 or not args.deepspeed):
        parser.error("--deepspeed-max-in-cpu: needs --deepspeed and a count >= 0")
    ds_info = None
    if args.deepspeed:
        sys.path.insert(0, str(ROOT / "bench"))
        from deepspeed_env import ensure_deepspeed_ops

        ops = ensure_deepspeed_ops(["async_io", "cpu_adam"])  # before spawning: the ranks inherit the env
        import deepspeed

        ds_info = {"version": deepspeed.__version__, "accelerator": os.environ.get("DS_ACCELERATOR"), "ops": ops}
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_gpt import TinyGPT

    with torch.device("meta"):
        psi = sum(p.numel() for p in TinyGPT(vocab=VOCAB, dim=args.dim, layers=args.layers, heads=args.heads,
                                             context=args.context).parameters())
    fio = {"write": _fio(args.nvme_path, "write")}  # first: it creates the file the read reads
    fio["read"] = _fio(args.nvme_path, "read")
    out = pathlib.Path(args.out + "-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for world in [int(w) for w in args.worlds.split(",")]:
        print(f"[bench_offload] {psi / 1e6:.1f}M parameters, stage {args.stage}, {args.precision}, world {world} ...",
              flush=True)
        t0 = time.perf_counter()
        results[world] = run_world(world, args)
        table = _table(args, psi, fio, results, ds_info)
        print(f"[bench_offload] world {world} took {time.perf_counter() - t0:.0f} s; load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        # Written after every world, so that a run cut short keeps what it measured.
        out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "params": psi, "fio_gbps": fio,
                                                        "load_average": os.getloadavg(), "deepspeed": ds_info,
                                                        "results": results}, indent=1, default=str))
        out.with_suffix(".md").write_text(table + "\n")
    plot_breakdown(results, out.with_suffix(".png"), f"{psi / 1e6:.0f}M params, stage {args.stage}, {args.precision}")
    print(table)
    print(f"[bench_offload] wrote {out}.json and .md")


if __name__ == "__main__":
    main()
