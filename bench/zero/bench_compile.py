"""torch.compile under zeroplus ZeRO stage 3 beside DDP + compile and FSDP2 + compile.

    python bench/zero/bench_compile.py [--variants plain,ddp,fsdp2,zeroplus_stage3] [--orders after,blocks]
        [--world 2] [--backend zeroplus] [--dim 128] [--layers 4] [--steps 6] [--rounds 2]
        [--compile-backend inductor] [--out PATH]

A TinyGPT (examples/tiny_gpt.py) trained with AdamW on every rank's own synthetic batch, one
thread per rank. Each (variant, order) is one launch of `world` ranks:
  plain             the bare model + torch.optim.AdamW, no communication (what compiling gains
                    on this machine without any data-parallel wrapper)
  ddp               DDP(model) + torch.optim.AdamW
  fsdp2             fully_shard on every block and the root + torch.optim.AdamW
  zeroplus_stage3   zeroplus.initialize(stage=3, param_persistence_threshold=0): every parameter sharded
and the compile order
  after   torch.compile of the whole (wrapped) model (torch.compile(DDP(model)), fully_shard then
          torch.compile(model), zeroplus.initialize then torch.compile(model))
  blocks  torchtitan's: every block torch.compile'd in its list first, then wrapped / sharded.
Inside a launch the same model runs eager and compiled steps in alternating rounds: eager under
torch.compiler.set_stance("force_eager") (every compiled frame runs its Python), compiled
normally. Step time is the median over the rounds of the slower rank's step; the first compiled
steps (compilation) are reported as compile seconds and left out. Graph breaks and compiled graphs
are torch._dynamo.utils.counters["graph_break"] (summed) and counters["stats"]["unique_graphs"] on
rank 0 after the compiled warm-up. speed-up = eager step / compiled step (> 1: compiling pays).
Writes PATH.json, PATH.md and PATH.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/
from launch import run_ranks  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIANTS = ["plain", "ddp", "fsdp2", "zeroplus_stage3"]
ORDERS = ["after", "blocks"]
VOCAB = 256
WARMUP = 2  # compiled steps that compile (and eager steps that warm the allocator), not timed


def _build(variant, order, args):
    """(module to call, optimizer) for the variant in the compile order."""
    import zeroplus
    from tiny_gpt import TinyGPT
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=args.dim, layers=args.layers, heads=args.heads, context=args.context)
    compile_kw = {"backend": args.compile_backend}
    if order == "blocks":
        layers = model.blocks.layers
        for i, block in enumerate(layers):
            layers[i] = torch.compile(block, **compile_kw)
    kw = dict(lr=3e-4, weight_decay=0.01)
    if variant == "plain":
        fwd, opt = model, torch.optim.AdamW(model.parameters(), **kw)
    elif variant == "ddp":
        fwd = DDP(model)
        opt = torch.optim.AdamW(fwd.parameters(), **kw)
    elif variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks.layers:
            fully_shard(block)
        fully_shard(model)
        fwd, opt = model, torch.optim.AdamW(model.parameters(), **kw)
    else:
        fwd, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=3, param_persistence_threshold=0, **kw)
    if order == "after":
        fwd = torch.compile(fwd, **compile_kw)
    return fwd, opt


def _step(fwd, opt, tokens, targets):
    logits = fwd(tokens)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _timed(fwd, opt, gen, args) -> float:
    """One step; the slower rank's seconds."""
    from tiny_gpt import synthetic_batch

    tokens, targets = synthetic_batch(args.batch, args.context, VOCAB, gen)
    dist.barrier()
    t0 = time.perf_counter()
    _step(fwd, opt, tokens, targets)
    dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def _worker(rank, world, store_path, backend, variant, order, args, out_queue):
    sys.path.insert(0, str(ROOT / "examples"))
    import zeroplus  # noqa: F401  (registers backend "zeroplus")
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    try:
        fwd, opt = _build(variant, order, args)
        gen = torch.Generator().manual_seed(rank)
        counters.clear()
        compile_s = sum(_timed(fwd, opt, gen, args) for _ in range(WARMUP))
        breaks = sum(counters["graph_break"].values())
        graphs = counters["stats"]["unique_graphs"]
        reasons = sorted({r.splitlines()[0][:120] for r in counters["graph_break"]})
        with torch.compiler.set_stance("force_eager"):
            for _ in range(WARMUP):
                _timed(fwd, opt, gen, args)
        eager, compiled = [], []
        for _ in range(args.rounds):
            with torch.compiler.set_stance("force_eager"):
                eager += [_timed(fwd, opt, gen, args) for _ in range(args.steps)]
            compiled += [_timed(fwd, opt, gen, args) for _ in range(args.steps)]
        recompiled = counters["stats"]["unique_graphs"] - graphs
        out_queue.put({"rank": rank, "eager": eager, "compiled": compiled, "compile_s": compile_s,
                       "graph_breaks": breaks, "graphs": graphs, "late_graphs": recompiled,
                       "break_reasons": reasons})
    except Exception as e:  # reported, not hidden: the row says why it could not run
        out_queue.put({"rank": rank, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
    finally:
        dist.destroy_process_group()


def run_variant(args, variant, order):
    return run_ranks(_worker, args.world, args.backend, variant, order, args)



def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--orders", default=",".join(ORDERS))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", default="zeroplus")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round and mode")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "zero_compile"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "plugin" / "python"))
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_gpt import TinyGPT

    with torch.device("meta"):
        psi = sum(p.numel() for p in TinyGPT(vocab=VOCAB, dim=args.dim, layers=args.layers, heads=args.heads,
                                             context=args.context).parameters())
    report = {"args": vars(args), "params": psi, "torch": torch.__version__, "load_average_start": os.getloadavg(),
              "rows": []}
    for order in args.orders.split(","):
        for variant in args.variants.split(","):
            res = run_variant(args, variant, order)
            row = {"variant": variant, "order": order}
            if "error" in res:
                row["error"] = res["error"]
            else:
                row.update(eager_ms=statistics.median(res["eager"]) * 1e3,
                           compiled_ms=statistics.median(res["compiled"]) * 1e3,
                           compile_s=res["compile_s"], graph_breaks=res["graph_breaks"], graphs=res["graphs"],
                           late_graphs=res["late_graphs"], break_reasons=res["break_reasons"])
                row["speedup"] = row["eager_ms"] / row["compiled_ms"]
            report["rows"].append(row)
            print(f"{variant} {order}: " + (row["error"] if "error" in row else
                  f"eager {row['eager_ms']:.1f} ms, compiled {row['compiled_ms']:.1f} ms, x{row['speedup']:.2f}, "
                  f"{row['graph_breaks']} breaks, {row['graphs']} graphs"), flush=True)
    report["load_average_end"] = os.getloadavg()
    rows = report["rows"]
    for row in rows:
        fsdp = next((r for r in rows if r["variant"] == "fsdp2" and r["order"] == row["order"] and "speedup" in r), None)
        if "speedup" in row and fsdp is not None:
            row["speedup_vs_fsdp2"] = row["speedup"] / fsdp["speedup"]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"torch.compile ({args.compile_backend}) beside eager: TinyGPT {psi / 1e6:.2f}M params (dim {args.dim}, "
             f"{args.layers} layers, context {args.context}, batch {args.batch}/rank), fp32, {args.world} ranks, "
             f"backend {args.backend}, 1 thread per rank on {os.cpu_count()} cores, torch {torch.__version__}; median of "
             f"{args.steps} steps x {args.rounds} alternating rounds per mode; load average "
             f"{report['load_average_start'][0]:.1f} -> {report['load_average_end'][0]:.1f}.", "",
             "| variant | compile order | eager step ms | compiled step ms | speed-up (eager/compiled) | speed-up / FSDP2's | "
             "compile s (first 2 steps) | graph breaks | graphs | recompiled later |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['order']} | error: {r['error']} | | | | | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['order']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
                     f"{r['speedup']:.2f} | {r.get('speedup_vs_fsdp2', float('nan')):.2f} | {r['compile_s']:.1f} | "
                     f"{r['graph_breaks']} | {r['graphs']} | {r['late_graphs']} |")
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    print(text)
    _plot(rows, out)


def _plot(rows, out):
    sys.path.insert(0, str(ROOT / "bench"))
    from plotting import pyplot  # installs matplotlib when missing (docs/benchmarks.md)

    plt = pyplot()
    if plt is None:
        return
    ok = [r for r in rows if "speedup" in r]
    labels = [f"{r['variant']}\n{r['order']}" for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    xs = range(len(ok))
    axes[0].bar([x - 0.2 for x in xs], [r["eager_ms"] for r in ok], 0.4, label="eager")
    axes[0].bar([x + 0.2 for x in xs], [r["compiled_ms"] for r in ok], 0.4, label="compiled")
    axes[0].set_title("step time (ms, lower is better)")
    axes[0].legend(fontsize=7)
    axes[1].bar(list(xs), [r["speedup"] for r in ok])
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_title("speed-up from torch.compile (eager / compiled)")
    for ax in axes:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
