"""ZeRO stages side by side: step time and model-state bytes per rank, 2 CPU ranks, one run.

    python bench/zero/bench_stages.py [--backends zeroplus,gloo] [--steps 30] [--dim 256]
        [--layers 4] [--batch 4] [--context 64] [--precision fp32|bf16] [--out PATH]

Variants, all with AdamW(lr 3e-4, wd 0.01), identical initial weights, on each backend:
  ddp_adamw          DDP + torch.optim.AdamW                        (the stock baseline)
  ddp_torch_zero     DDP + torch ZeroRedundancyOptimizer(AdamW)     (stock ZeRO-1)
  zeroplus_stage1    zeroplus.initialize(stage=1)
  zeroplus_stage2    zeroplus.initialize(stage=2)
Each rank builds every variant and runs them interleaved, one step of each per round, so drift of
the shared machine hits all alike. A step = forward + backward + (clip-free) optimizer step +
zero_grad; the step time of a round is the slower rank's. Model-state bytes are
zeroplus.memory_report, taken with every category live (after a backward, optimizer state
present). Writes PATH.json, PATH.md and PATH.png (step time and bytes per variant).
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
VARIANTS = ["ddp_adamw", "ddp_torch_zero", "zeroplus_stage1", "zeroplus_stage2"]


def _build(name, args):
    import zeroplus
    from tiny_gpt import TinyGPT
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = TinyGPT(dim=args.dim, layers=args.layers, heads=args.heads, context=args.context)
    kw = dict(lr=3e-4, weight_decay=0.01)
    precision = None if args.precision == "fp32" else args.precision
    if name == "ddp_adamw":
        ddp = DDP(model)
        return model, ddp, torch.optim.AdamW(ddp.parameters(), **kw)
    if name == "ddp_torch_zero":
        ddp = DDP(model)
        return model, ddp, TorchZero(ddp.parameters(), optimizer_class=torch.optim.AdamW, **kw)
    stage = 1 if name == "zeroplus_stage1" else 2
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, mixed_precision=precision, **kw)
    return model, model, opt


def _step(model, opt, tokens, targets):
    logits = model(tokens)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if hasattr(opt, "backward"):
        opt.backward(loss)
    else:
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _worker(rank, world, store_path, backend, args, out_queue):
    sys.path.insert(0, str(ROOT / "examples"))
    import zeroplus
    from tiny_gpt import synthetic_batch

    torch.set_num_threads(1)  # two ranks share the machine's two cores
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    runs = {name: _build(name, args) for name in VARIANTS}
    gen = torch.Generator().manual_seed(rank)
    times = {name: [] for name in VARIANTS}
    memory = {}
    for step in range(args.steps + 3):
        tokens, targets = synthetic_batch(args.batch, args.context, 256, gen)
        for name in VARIANTS:
            module, fwd, opt = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            _step(fwd, opt, tokens, targets)
            dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= 3:  # warm-up steps excluded
                times[name].append(dt.item())
    for name in VARIANTS:  # memory with every category live: after a backward, before the step
        module, fwd, opt = runs[name]
        tokens, targets = synthetic_batch(args.batch, args.context, 256, gen)
        logits = fwd(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
        memory[name] = zeroplus.memory_report(module, opt)
        opt.zero_grad()
    psi = sum(p.numel() for p in runs["ddp_adamw"][0].parameters())
    if rank == 0:
        out_queue.put({"times": times, "memory": memory, "params": psi})
    else:
        out_queue.put(None)
    dist.destroy_process_group()


def run_backend(backend, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_worker, args=(r, 2, os.path.join(d, "store"), backend, args, q)) for r in range(2)]
        for p in procs:
            p.start()
        results = [q.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join()
    return next(r for r in results if r is not None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="zeroplus,gloo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "zero_stages"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "plugin" / "python"))
    from zeroplus.zero.memory import estimate_memory

    rows, report = [], {"args": vars(args), "load_average": os.getloadavg(), "backends": {}}
    for backend in args.backends.split(","):
        res = run_backend(backend, args)
        report["backends"][backend] = res
        psi = res["params"]
        base = statistics.median(res["times"]["ddp_adamw"])
        for name in VARIANTS:
            t = statistics.median(res["times"][name])
            mem = res["memory"][name]
            stage = {"ddp_adamw": 0, "ddp_torch_zero": 1, "zeroplus_stage1": 1, "zeroplus_stage2": 2}[name]
            precision = None if args.precision == "fp32" or name.startswith("ddp") else args.precision
            formula = estimate_memory(psi, 2, stage, precision)["model_state"]
            rows.append((backend, name, t * 1e3, base / t, mem["model_state"] / 2**20, mem["model_state"] / formula,
                         mem["model_state"] / (16 * psi if args.precision == "fp32" else 16 * psi)))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"ZeRO stages, TinyGPT {rows and report['backends'][args.backends.split(',')[0]]['params'] / 1e6:.2f}M "
             f"params (dim {args.dim}, {args.layers} layers, context {args.context}, batch {args.batch}/rank), "
             f"{args.precision}, 2 ranks x 1 thread, median of {args.steps} interleaved steps; load average "
             f"{report['load_average'][0]:.1f}.", "",
             "| backend | variant | step ms | DDP+AdamW time / this | model-state MiB per rank | vs ZeRO formula | vs DDP's 16 bytes/param |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for b, n, t, speed, mib, vs_formula, vs_ddp in rows:
        lines.append(f"| {b} | {n} | {t:.1f} | {speed:.2f}x | {mib:.2f} | {vs_formula:.3f} | {vs_ddp:.3f} |")
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, **report}, indent=1, default=str))
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (bench/zero/run.sh installs it)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    backends = args.backends.split(",")
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        sel = [r for r in rows if r[0] == b]
        xs = [j + i * width for j in range(len(sel))]
        axes[0].bar(xs, [r[2] for r in sel], width, label=f"backend {b}")
        axes[1].bar(xs, [r[4] for r in sel], width, label=f"backend {b}")
    for ax, title in zip(axes, ["step time (ms, lower is better)", "model-state MiB per rank"]):
        ax.set_xticks([j + width * (len(backends) - 1) / 2 for j in range(len(VARIANTS))])
        ax.set_xticklabels(VARIANTS, rotation=20, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
