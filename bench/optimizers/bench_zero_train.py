"""ZeRO-1 training-step benchmark: a 2-rank CPU training step of examples/tiny_gpt.py's TinyGPT,
DDP + torch.optim.AdamW (unsharded) vs DDP + torch's ZeroRedundancyOptimizer(AdamW) vs DDP +
zeroplus.ZeroRedundancyOptimizer(AdamW), side by side in one run. Writes
bench/results/zero_train.{json,md,png} (the PNG: step-time breakdown per variant).

    python bench/optimizers/bench_zero_train.py [--backend zeroplus|gloo] [--steps 40]
        [--dim 256] [--layers 4] [--batch 4] [--context 64]

Each rank builds the three variants (identical initial weights) and runs them interleaved, one
step of each per round, so machine drift hits all three alike; a step = forward, backward (DDP
all-reduce), optimizer step (ZeRO: local shard step + parameter broadcast), zero_grad. Reported:
median step time over ranks' max (the slower rank sets the pace), its breakdown (forward +
backward with DDP's all-reduce, optimizer.step() without and with its parameter sync, zero_grad),
and optimizer-state bytes per rank (tensors in the local optimizer's state).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))
VARIANTS = ["ddp_adamw", "ddp_torch_zero", "ddp_zeroplus_zero"]


def _state_bytes(optimizer) -> int:
    local = getattr(optimizer, "optim", optimizer)  # ZeRO: this rank's local optimizer
    return sum(t.numel() * t.element_size() for st in local.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


def _worker(rank: int, world: int, store_path: str, args, out_queue) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import zeroplus  # noqa: F401  registers the backend
    from tiny_gpt import TinyGPT, synthetic_batch
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group(args.backend, store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    kw = dict(lr=3e-4, weight_decay=0.01)
    runs = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        model = TinyGPT(dim=args.dim, layers=args.layers, heads=args.heads, context=args.context)
        ddp = DDP(model)
        if name == "ddp_adamw":
            opt = torch.optim.AdamW(ddp.parameters(), **kw)
        elif name == "ddp_torch_zero":
            opt = TorchZero(ddp.parameters(), torch.optim.AdamW, **kw)
        else:
            opt = zeroplus.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, **kw)
        runs[name] = (ddp, opt, torch.Generator().manual_seed(1000 + rank))
    sync_times = {n: [] for n in VARIANTS}  # the parameter broadcast part of a ZeRO step

    def timed_sync(opt, sink):
        inner = opt._sync_params

        def wrapper():
            t = time.perf_counter()
            inner()
            sink.append(time.perf_counter() - t)
        opt._sync_params = wrapper
    for name in VARIANTS[1:]:
        timed_sync(runs[name][1], sync_times[name])
    times = {n: [] for n in VARIANTS}
    fwd_bwd_times = {n: [] for n in VARIANTS}
    opt_times = {n: [] for n in VARIANTS}
    losses = {n: 0.0 for n in VARIANTS}
    for step in range(args.warmup + args.steps):
        for name, (ddp, opt, gen) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            inputs, targets = synthetic_batch(args.batch, args.context, 256, gen)
            logits = ddp(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if step >= args.warmup:
                times[name].append(t3 - t0)
                fwd_bwd_times[name].append(t1 - t0)
                opt_times[name].append(t2 - t1)
            losses[name] = loss.item()
    n_params = sum(p.numel() for p in runs["ddp_adamw"][0].parameters())
    sync_times = {n: t[args.warmup:] for n, t in sync_times.items()}
    out_queue.put((rank, {"times": times, "fwd_bwd_times": fwd_bwd_times, "opt_times": opt_times, "sync_times": sync_times, "losses": losses, "n_params": n_params,
                          "state_bytes": {n: _state_bytes(runs[n][1]) for n in VARIANTS}}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="zeroplus")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "zero_train"))
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, args.world, os.path.join(tmp, "store"), args, queue))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    # Per step, the slower rank sets the pace; then the median over steps.
    rows = []
    for name in VARIANTS:
        step = [max(results[r]["times"][name][i] for r in results) for i in range(args.steps)]
        opt = [max(results[r]["opt_times"][name][i] for r in results) for i in range(args.steps)]
        fwd_bwd = [max(results[r]["fwd_bwd_times"][name][i] for r in results) for i in range(args.steps)]
        sync = [max(results[r]["sync_times"][name][i] for r in results) for i in range(args.steps)] \
            if name != "ddp_adamw" else [0.0]
        rows.append({"variant": name, "step_ms": statistics.median(step) * 1e3, "sync_ms": statistics.median(sync) * 1e3,
                     "step_p10_ms": sorted(step)[args.steps // 10] * 1e3,
                     "step_p90_ms": sorted(step)[(args.steps * 9) // 10] * 1e3,
                     "opt_step_ms": statistics.median(opt) * 1e3,
                     "fwd_bwd_ms": statistics.median(fwd_bwd) * 1e3,
                     "state_bytes_per_rank": [results[r]["state_bytes"][name] for r in sorted(results)],
                     "final_loss_rank0": results[0]["losses"][name]})
    torch_zero = next(r for r in rows if r["variant"] == "ddp_torch_zero")
    unsharded = next(r for r in rows if r["variant"] == "ddp_adamw")["state_bytes_per_rank"][0]
    for r in rows:
        r["step_vs_torch_zero"] = r["step_ms"] / torch_zero["step_ms"]
        r["state_fraction_of_unsharded"] = max(r["state_bytes_per_rank"]) / unsharded
    n_params = results[0]["n_params"]
    env = {"torch": torch.__version__, "backend": args.backend, "world": args.world, "params": n_params,
           "model": f"TinyGPT(dim={args.dim}, layers={args.layers}, heads={args.heads}, context={args.context})",
           "batch_per_rank": args.batch, "steps": args.steps, "threads_per_rank": 1}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"# ZeRO-1 training step: {env['model']}, {n_params / 1e6:.2f}M params, {args.world} ranks, "
             f"backend {args.backend}, batch {args.batch}/rank, torch {torch.__version__}", "",
             "| variant | step ms (median) | p10 | p90 | forward+backward ms | optimizer.step ms | of which param sync ms | "
             "step vs torch ZeRO | optimizer state bytes per rank | fraction of unsharded |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | {r['step_p10_ms']:.1f} | {r['step_p90_ms']:.1f} | "
                     f"{r['fwd_bwd_ms']:.1f} | {r['opt_step_ms']:.2f} | {r['sync_ms']:.2f} | {r['step_vs_torch_zero']:.2f}x | "
                     f"{', '.join(str(b) for b in r['state_bytes_per_rank'])} | "
                     f"{r['state_fraction_of_unsharded']:.2f} |")
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    print(text)
    plot_breakdown(rows, env, out.with_suffix(".png"))


def plot_breakdown(rows: list[dict], env: dict, path: pathlib.Path) -> None:
    """Stacked bars: where each variant's median step goes. The parts are medians of their own,
    so they need not add up exactly to the step median; the rest is drawn as "other"."""
    from plotting import pyplot
    plt = pyplot()
    if plt is None:
        return
    parts = [("forward + backward (DDP all-reduce)", "fwd_bwd_ms", "tab:blue"),
             ("optimizer step (local)", None, "tab:orange"),
             ("parameter sync", "sync_ms", "tab:green"),
             ("zero_grad + other", None, "tab:gray")]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["variant"] for r in rows]
    bottoms = [0.0] * len(rows)
    for label, key, color in parts:
        if key is not None:
            vals = [r[key] for r in rows]
        elif label.startswith("optimizer"):
            vals = [max(0.0, r["opt_step_ms"] - r["sync_ms"]) for r in rows]
        else:
            vals = [max(0.0, r["step_ms"] - r["fwd_bwd_ms"] - r["opt_step_ms"]) for r in rows]
        ax.bar(names, vals, bottom=bottoms, label=label, color=color)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_ylabel("ms per step (median, slower rank)")
    ax.set_title(f"ZeRO-1 step breakdown, {env['params'] / 1e6:.2f}M params, {env['world']} ranks, "
                 f"backend {env['backend']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
