"""Checkpoint save/load side by side: zeroplus, torch.save/torch.load per rank, DCP, fio; one run.

    .venv/bin/python bench/checkpoint/bench_checkpoint.py [--params 44e6] [--ranks 2] [--reps 3]
        [--deepspeed] [--dir DIR] [--out bench/results/checkpoint-latest]

Each rank holds the sharded state of a ZeRO stage-2 AdamW run (zeroplus.initialize, fp32): its
shard of the fp32 masters plus exp_avg and exp_avg_sq, 12 bytes per parameter / ranks, so the
default 44M parameters make ~530 MB over 2 ranks. Every variant writes those same bytes, per rank,
to a fresh directory under DIR (default: a temporary directory on the file system of /tmp):

  zeroplus_aio     zeroplus.save_checkpoint with its defaults (io_uring through zeroplus.aio, through
                   the page cache; fdatasync of every file, fsync of the directories, manifest,
                   latest) / load_checkpoint
  zeroplus_aio_direct  the same with CheckpointOptions(direct="auto") (O_DIRECT: the load then reads
                   the disk, not the page cache)
  zeroplus_posix   the same with CheckpointOptions(io="posix") (pwrite)
  torch_save       torch.save({"optimizer": opt.state_dict(), "masters": opt.masters}) per rank (the
                   engine's sharded state dict and master shards), no fsync (torch's default) /
                   torch.load, opt.load_state_dict, masters copied back, opt.publish_masters()
  torch_save_sync  the same followed by os.fsync of the file (the durability zeroplus gives)
  dcp              torch.distributed.checkpoint.save with FileSystemWriter of the same tensors under
                   per-rank keys (so each rank writes its own, as sharded tensors would) / dcp.load
                   in place into the live tensors, opt.publish_masters()
  deepspeed        (--deepspeed) DeepSpeed's engine.save_checkpoint / load_checkpoint of the same
                   model, ZeRO stage 2, torch AdamW, after the same step: DeepSpeed 0.19.8 on its
                   CPU accelerator (bench/deepspeed_env.py installs it once into the build
                   directory), on the bench's zeroplus group as bench/zero/bench_stages.py runs it.
                   It writes more than the others: rank 0 also saves the full fp32 weights (its
                   bytes are reported beside the times), and it does not fsync (torch.save)
  async            zeroplus.save_checkpoint(async_=True) followed at once by training iterations
                   (forward, backward, opt.step, zero_grad: the model's own, batch 2) until every
                   rank's save is done (at most 20), against as many iterations without a save (the
                   first one: the median of 3 run just before), and
                   against zeroplus_aio's synchronous save:
                     async_stall    what the training thread was blocked: the call plus the wait
                                    of opt.step for the deferred snapshot (handle.blocked_s)
                     async_call     the call alone
                     async_whole_cost  the iterations with the save minus as many without (the
                                    stall plus what the background copy, checksums and writes
                                    cost the training thread by sharing the cores and memory
                                    bandwidth): issue 41's "whole cost"
                   async_eager: the same with CheckpointOptions(overlap_snapshot=False) (every
                   byte copied before the call returns)

Each load is timed twice: right after the save (what the page cache holds is read from memory) and
again after rank 0 dropped the page cache (sync; echo 3 > /proc/sys/vm/drop_caches, as root; the
column shows - where it cannot), so its reads come from the disk.

Variants run interleaved per repetition; a time is the slowest rank's, the figure the median over
repetitions. Reads come from the page cache (the bench does not drop caches on a shared machine).
fio's sequential 1 MiB write bandwidth on the same directory, one writer per rank with a final fsync,
buffered and O_DIRECT, the better of the two, is the ceiling.
--variants and --async-modes run a subset (the ratios need zeroplus_aio, and dcp for DCP's).
Writes OUT.json, OUT.md and OUT.png (seconds per variant; the async save's cost beside the sync one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugin" / "python"))  # the tree's zeroplus (spawned ranks inherit sys.path)
VARIANTS = ["zeroplus_aio", "zeroplus_aio_direct", "zeroplus_posix", "torch_save", "torch_save_sync", "dcp"]
DS_VARIANTS = ["deepspeed"]


def _deepspeed_engine(rank: int, world: int, params: int, x: torch.Tensor):
    """A DeepSpeed ZeRO-2 engine (torch AdamW) of the same model, after the same one step."""
    import logging

    import deepspeed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    deepspeed.init_distributed(dist_backend="zeroplus", auto_mpi_discovery=False, dist_init_required=False)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = _model(params)
    config = {"train_micro_batch_size_per_gpu": x.shape[0], "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                           config=config)
    engine.backward(engine(x).square().mean())
    engine.step()
    return engine


def _tree_bytes(d: str) -> int:
    return sum(f.stat().st_size for f in pathlib.Path(d).rglob("*") if f.is_file())


def _model(params: int) -> torch.nn.Module:
    width = 4096
    layers = max(1, round(params / (width * width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def _max(t: float) -> float:
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x.item())


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return _max(time.perf_counter() - t0)


_DROP_CACHES = "/proc/sys/vm/drop_caches"


def _can_drop_caches() -> bool:
    return os.access(_DROP_CACHES, os.W_OK)


def _timed_cold(fn) -> float | None:
    """fn timed as _timed after the page cache was dropped (rank 0 syncs and writes 3 to
    /proc/sys/vm/drop_caches: root), so its reads come from the disk; None where it cannot."""
    if not _can_drop_caches():
        return None
    dist.barrier()
    if dist.get_rank() == 0:
        os.sync()
        with open(_DROP_CACHES, "w") as f:
            f.write("3\n")
    return _timed(fn)


_PLAIN_ITERS = 3  # iterations without a save before each async one: their median is the baseline
_MAX_OVERLAP = 20  # iterations an async save may overlap in the bench before it waits for the save


def _all_done(handle) -> bool:
    """Whether every rank's save is done (one small all-reduce)."""
    x = torch.tensor([0.0 if handle.done() else 1.0])
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item() == 0.0


def _dcp_state(opt, rank: int) -> dict:
    out = {}
    for b, bo in enumerate(opt.bucket_optimizers):
        for i, seg in enumerate(bo.segments):
            out[f"r{rank}.b{b}.s{i}.master"] = seg.master
            for k, v in bo.segment_state(seg).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out[f"r{rank}.b{b}.s{i}.{k}"] = v
    return out


def _rank(rank: int, world: int, args, store_path: str, results) -> None:
    import zeroplus
    import torch.distributed.checkpoint as dcp
    from zeroplus.checkpoint import CheckpointOptions

    torch.set_num_threads(1)
    dist.init_process_group("zeroplus", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    model, opt = zeroplus.initialize(_model(int(args.params)), torch.optim.AdamW, stage=2, lr=1e-4)
    x = torch.randn(2, 4096)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    shard_bytes = sum(t.numel() * t.element_size() for t in _dcp_state(opt, rank).values())
    sizes = torch.tensor([shard_bytes], dtype=torch.float64)
    dist.all_reduce(sizes)
    total_bytes = int(sizes.item())
    base = args.dir
    variants = args.variants + (DS_VARIANTS if args.deepspeed else [])
    engine = _deepspeed_engine(rank, world, int(args.params), x) if args.deepspeed else None
    ds_bytes = 0
    times = {f"{v}_{op}": [] for v in variants for op in ("save", "load", "load_cold")}
    snapshot_bytes = {}  # async mode -> what its save copied into memory (rank 0)
    for mode in args.async_modes:
        for what in ("stall", "call", "iter_plain", "iter_with_save", "total", "overlapped", "whole_cost", "waited"):
            times[f"{mode}_{what}"] = []

    def iteration():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for rep in range(args.reps):
        for v in variants:
            d = os.path.join(base, f"{v}_{rep}")
            if v.startswith("zeroplus"):
                o = CheckpointOptions(io="posix" if v == "zeroplus_posix" else "aio",
                                      direct="auto" if v == "zeroplus_aio_direct" else "off")
                times[f"{v}_save"].append(_timed(lambda: zeroplus.save_checkpoint(os.path.join(d, "ck"), model, opt,
                                                                                   options=o)))
                times[f"{v}_load"].append(_timed(lambda: zeroplus.load_checkpoint(d, model, opt)))
                times[f"{v}_load_cold"].append(_timed_cold(lambda: zeroplus.load_checkpoint(d, model, opt)))
            elif v.startswith("torch_save"):
                f = os.path.join(d, f"rank{rank}.pt")
                if rank == 0:
                    os.makedirs(d)
                dist.barrier()

                def save():
                    torch.save({"optimizer": opt.state_dict(), "masters": opt.masters}, f)
                    if v == "torch_save_sync":
                        fd = os.open(f, os.O_RDONLY)
                        os.fsync(fd)
                        os.close(fd)
                times[f"{v}_save"].append(_timed(save))
                def load():
                    sd = torch.load(f, weights_only=False)
                    opt.load_state_dict(sd["optimizer"])
                    with torch.no_grad():
                        for m, saved in zip(opt.masters, sd["masters"]):
                            m.copy_(saved)
                    opt.publish_masters()
                times[f"{v}_load"].append(_timed(load))
                times[f"{v}_load_cold"].append(_timed_cold(load))
            elif v == "deepspeed":
                times["deepspeed_save"].append(_timed(lambda: engine.save_checkpoint(d, tag="ck")))
                times["deepspeed_load"].append(_timed(lambda: engine.load_checkpoint(d, tag="ck")))
                if rank == 0:
                    ds_bytes = _tree_bytes(d)
            else:
                state = _dcp_state(opt, rank)
                times["dcp_save"].append(_timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(d))))
                def dcp_load():
                    dcp.load(state, storage_reader=dcp.FileSystemReader(d))  # in place, into the live tensors
                    opt.publish_masters()
                times["dcp_load"].append(_timed(dcp_load))
                times["dcp_load_cold"].append(_timed_cold(dcp_load))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
        for mode in args.async_modes:
            d = os.path.join(base, f"{mode}_{rep}")
            o = CheckpointOptions(overlap_snapshot=mode != "async_eager")
            handles, call = [], []

            def save_and_iterate():
                t0 = time.perf_counter()
                handles.append(zeroplus.save_checkpoint(os.path.join(d, "ck"), model, opt, async_=True, options=o))
                call.append(time.perf_counter() - t0)
                iteration()
            # The iterations the save overlaps: until every rank's save is done (at most
            # _MAX_OVERLAP; the agreement between them is not timed), against as many without a
            # save; the difference is the save's whole cost on the training thread.
            plain_runs = [_timed(iteration) for _ in range(_PLAIN_ITERS)]
            plain_first = statistics.median(plain_runs)
            with_save = _timed(save_and_iterate)
            overlapped = [with_save]
            while not _all_done(handles[0]) and len(overlapped) < _MAX_OVERLAP:
                overlapped.append(_timed(iteration))
            t0 = time.perf_counter()
            handles[0].wait()
            waited = _max(time.perf_counter() - t0)
            plain = [plain_first] + [_timed(iteration) for _ in range(len(overlapped) - 1)]  # as many
            times[f"{mode}_iter_plain"].append(plain_first)
            times[f"{mode}_iter_with_save"].append(with_save)
            times[f"{mode}_stall"].append(_max(handles[0].blocked_s))
            times[f"{mode}_call"].append(_max(call[0]))
            times[f"{mode}_total"].append(sum(overlapped) + waited)
            times[f"{mode}_overlapped"].append(len(overlapped))
            times[f"{mode}_whole_cost"].append(sum(overlapped) - sum(plain))
            times[f"{mode}_waited"].append(waited)
            snapshot_bytes[mode] = handles[0].snapshot_bytes
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
    if rank == 0:
        results.put({"times": times, "total_bytes": total_bytes, "shard_bytes": shard_bytes,
                     "snapshot_bytes": snapshot_bytes, "deepspeed_bytes": ds_bytes})
    dist.destroy_process_group()


def _fio(directory: str, size_mb: int, jobs: int, direct: bool) -> float | None:
    """fio's sequential 1 MiB write bandwidth with a final fsync, `jobs` writers at once (one per
    rank, as the ranks write their shards), aggregate GB/s: buffered (psync) or O_DIRECT (io_uring,
    queue depth 16). The ceiling is the better of the two."""
    if shutil.which("fio") is None:
        return None
    mode = (["--ioengine=io_uring", "--direct=1", "--iodepth=16"] if direct else ["--ioengine=psync"])
    out = subprocess.run(["fio", "--name=ckpt", f"--directory={directory}", "--rw=write", "--bs=1M",
                          f"--size={size_mb}M", f"--numjobs={jobs}", "--group_reporting", "--end_fsync=1", *mode,
                          "--output-format=json"], capture_output=True, text=True, timeout=600)
    for f in pathlib.Path(directory).glob("ckpt*"):
        f.unlink()
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)["jobs"][0]["write"]["bw_bytes"] / 1e9


def _plot(png: pathlib.Path, med: dict, args, gb: float) -> None:
    """Save and load seconds per variant (load warm and with the page cache dropped), and where an
    async save's cost on the training thread goes, beside the synchronous save."""
    sys.path.insert(0, str(ROOT / "bench"))
    from plotting import pyplot  # installs matplotlib when missing (docs/benchmarks.md)

    plt = pyplot()
    if plt is None:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    names = args.variants + (DS_VARIANTS if args.deepspeed else [])
    xs = range(len(names))
    for off, key, label in ((-0.27, "save", "save"), (0.0, "load", "load (warm)"),
                            (0.27, "load_cold", "load (page cache dropped)")):
        ax.bar([x + off for x in xs], [med.get(f"{n}_{key}", 0.0) for n in names], width=0.27, label=label)
    ax.set_xticks(list(xs), [n.replace("_", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel("seconds (slowest rank, median)")
    ax.set_title(f"checkpoint of {gb:.2f} GB, {args.ranks} ranks")
    ax.legend(fontsize=8)
    bars = ["sync save"] + [m for m in args.async_modes]
    blocked = [med.get("zeroplus_aio_save", 0.0)] + [med[f"{m}_stall"] for m in args.async_modes]
    slowed = [0.0] + [max(0.0, med[f"{m}_whole_cost"] - med[f"{m}_stall"]) for m in args.async_modes]
    bx.bar(bars, blocked, label="training blocked")
    bx.bar(bars, slowed, bottom=blocked, label="overlapped iterations slowed")
    bx.set_title("cost on the training thread")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=44e6)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--deepspeed", action="store_true",
                    help="add DeepSpeed's save_checkpoint/load_checkpoint (installed into the build directory once)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated subset of " + ",".join(VARIANTS) + " (ratios need zeroplus_aio and dcp)")
    ap.add_argument("--async-modes", default="async,async_eager",
                    help="comma-separated subset of async,async_eager (empty: none)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint-latest"))
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    args.async_modes = [v for v in args.async_modes.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS) | set(args.async_modes) - {"async", "async_eager"}
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    deepspeed_version = None
    if args.deepspeed:
        sys.path.insert(0, str(ROOT / "bench"))
        from deepspeed_env import ensure_deepspeed

        ensure_deepspeed()  # before spawning: the ranks inherit PYTHONPATH and DS_ACCELERATOR
        import deepspeed

        deepspeed_version = deepspeed.__version__
    load_before = os.getloadavg()
    own_dir = args.dir is None
    args.dir = tempfile.mkdtemp(prefix="zeroplus-ckpt-bench-") if own_dir else args.dir
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(args.dir, "store")
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, args, store, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    res = None
    while res is None:
        try:
            res = results.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - queue.Empty: is every rank still alive?
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit("bench_checkpoint: a rank failed (its traceback is above)")
    for p in procs:
        p.join()
    gb = res["total_bytes"] / 1e9
    fio_size = max(64, int(res["shard_bytes"] / 2**20))
    fio_modes = {"buffered": _fio(args.dir, fio_size, args.ranks, False),
                 "direct": _fio(args.dir, fio_size, args.ranks, True)}
    fio = max((v for v in fio_modes.values() if v), default=None)
    if own_dir:
        shutil.rmtree(args.dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res["times"].items() if v and None not in v}
    rows = []
    for v in args.variants + (DS_VARIANTS if args.deepspeed else []):
        rows.append((v, med[f"{v}_save"], gb / med[f"{v}_save"], med[f"{v}_load"], gb / med[f"{v}_load"],
                     med.get(f"{v}_load_cold")))

    def ratio(num: str, den: str, scale: float = 1.0):
        """med[num] / med[den] (None where the run lacks either: --variants)."""
        return med[num] / med[den] * scale if num in med and den in med else None
    zs = med.get("zeroplus_aio_save")
    ratios = {"save_vs_torch_save": ratio("torch_save_save", "zeroplus_aio_save"),
              "save_vs_torch_save_sync": ratio("torch_save_sync_save", "zeroplus_aio_save"),
              "save_vs_dcp": ratio("dcp_save", "zeroplus_aio_save"),
              "save_GBps_vs_fio": gb / zs / fio if fio and zs else None,
              "save_direct_GBps_vs_fio": (gb / med["zeroplus_aio_direct_save"] / fio
                                          if fio and "zeroplus_aio_direct_save" in med else None),
              "load_vs_torch_load": ratio("torch_save_load", "zeroplus_aio_load"),
              "load_vs_dcp": ratio("dcp_load", "zeroplus_aio_load"),
              "cold_load_vs_dcp": ratio("dcp_load_cold", "zeroplus_aio_load_cold"),
              "cold_load_direct_vs_dcp": ratio("dcp_load_cold", "zeroplus_aio_direct_load_cold")}
    for mode in args.async_modes:
        # The measure: what the training thread lost to the save (blocked time plus the
        # slowdown of every iteration it overlapped), against a synchronous save.
        ratios[f"{mode}_whole_cost_vs_sync_save"] = ratio(f"{mode}_whole_cost", "zeroplus_aio_save")
        ratios[f"{mode}_stall_vs_sync_save"] = ratio(f"{mode}_stall", "zeroplus_aio_save")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "ranks": args.ranks,
              "params": int(args.params), "total_bytes": res["total_bytes"], "reps": args.reps,
              "variants": args.variants, "async_modes": args.async_modes,
              "median_s": med, "raw_s": res["times"], "fio_write_GBps": fio, "fio_write_GBps_by_mode": fio_modes,
              "snapshot_bytes_rank0": res["snapshot_bytes"],
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "deepspeed": {"version": deepspeed_version, "accelerator": os.environ.get("DS_ACCELERATOR"),
                            "bytes_written": res["deepspeed_bytes"]} if args.deepspeed else None,
              "ratios": ratios}
    if args.deepspeed:
        report["ratios"]["save_vs_deepspeed"] = ratio("deepspeed_save", "zeroplus_aio_save")
        report["ratios"]["load_vs_deepspeed"] = ratio("deepspeed_load", "zeroplus_aio_load")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# Checkpoint save/load, {args.ranks} ranks, {gb:.3f} GB sharded state (median of {args.reps})", "",
             "| variant | save s | save GB/s | load s | load GB/s | load s, page cache dropped |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {v} | {s:.3f} | {sg:.2f} | {l:.3f} | {lg:.2f} | {'-' if c is None else f'{c:.3f}'} |"
              for v, s, sg, l, lg, c in rows]
    if args.deepspeed:
        lines += ["", f"deepspeed {deepspeed_version} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')}) wrote "
                  f"{res['deepspeed_bytes'] / 1e9:.3f} GB per checkpoint (GB/s above: of the {gb:.3f} GB the others "
                  f"write)"]
    lines += ["", f"load average: {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after (1 min)"]
    whats = {"async": "overlapped snapshot (default)", "async_eager": "overlap_snapshot=False"}
    for mode in args.async_modes:
        lines += ["", f"async save, {whats[mode]}: training blocked {med[f'{mode}_stall']:.3f} s (the call "
                  f"{med[f'{mode}_call']:.3f} s + opt.step's wait; {res['snapshot_bytes'][mode] / 1e6:.0f} MB copied "
                  f"into memory on rank 0); the iteration after the call {med[f'{mode}_iter_with_save']:.3f} s against "
                  f"{med[f'{mode}_iter_plain']:.3f} s without a save; it overlapped "
                  f"{med[f'{mode}_overlapped']:.0f} iteration(s) and cost them {med[f'{mode}_whole_cost']:.3f} s in all "
                  f"(whole cost; wait() then blocked {med[f'{mode}_waited']:.3f} s more); "
                  f"{med[f'{mode}_total']:.3f} s until wait() returned"]
    lines += ["",
              (f"fio sequential write, 1 MiB, {args.ranks} writers, end fsync: "
               + ", ".join(f"{k} {v:.2f} GB/s" for k, v in fio_modes.items() if v) + f" (ceiling {fio:.2f})")
              if fio else "fio: not available", "",
              "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in report["ratios"].items() if v is not None]
    _plot(out.with_suffix(".png"), med, args, gb)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
