"""ZeRO stage 3 beside DDP, zeroplus stages 1-2 and FSDP2: step time and per-rank memory.

    python bench/zero/bench_stage3.py [--worlds 2,4] [--backends gloo,zeroplus] [--dim 512]
        [--layers 16] [--steps 8] [--precision fp32|bf16] [--out PATH]

A TinyGPT (examples/tiny_gpt.py; dim 512 x 16 layers is 50.7M parameters) trained with AdamW
(lr 3e-4, wd 0.01) on every rank's own synthetic batch, one thread per rank:
  ddp_adamw        DDP + torch.optim.AdamW                                  (the stock baseline)
  zeroplus_stage1  zeroplus.initialize(stage=1)
  zeroplus_stage2  zeroplus.initialize(stage=2)
  zeroplus_stage3  zeroplus.initialize(stage=3)   (default knobs: one unit per transformer block)
  fsdp2            torch.distributed.fsdp.fully_shard on every block and the root + AdamW
  deepspeed_stage3 deepspeed.initialize(zero_optimization.stage=3) + torch AdamW   (--deepspeed)
DeepSpeed (PyPI, DS_ACCELERATOR=cpu, installed once into the build directory by
bench/deepspeed_env.py) runs on the launch's default group, so on the backend of the row.
Each variant runs in its own process group launch (so each rank's peak RSS is its own), on the
same backend, twice in alternating order; the step time is the median over both launches of the
slower rank's step. Model-state bytes: zeroplus.memory_report for DDP and zeroplus (after a
backward, with every category live); for FSDP2 the local shards of parameters, gradients and
optimizer state. Writes PATH.json, PATH.md and PATH.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/
from launch import run_ranks  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIANTS = ["ddp_adamw", "zeroplus_stage1", "zeroplus_stage2", "zeroplus_stage3", "fsdp2"]
DS_VARIANTS = ["deepspeed_stage3"]
VOCAB = 256


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _build(name, args):
    import zeroplus
    from tiny_gpt import TinyGPT
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=args.dim, layers=args.layers, heads=args.heads, context=args.context)
    kw = dict(lr=3e-4, weight_decay=0.01)
    precision = None if args.precision == "fp32" else args.precision
    if name == "ddp_adamw":
        ddp = DDP(model)
        return model, ddp, torch.optim.AdamW(ddp.parameters(), **kw)
    if name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else MixedPrecisionPolicy()
        for layer in model.blocks.layers:
            fully_shard(layer, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        return model, model, torch.optim.AdamW(model.parameters(), **kw)
    if name == "deepspeed_stage3":
        import deepspeed
        from bench_stages import _DeepSpeedStep

        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 1 << 30}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **kw),
                                               config=config)
        return engine.module, engine, _DeepSpeedStep(engine)
    stage = int(name[-1])
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, mixed_precision=precision,
                                     **kw, **(json.loads(args.zero_kwargs) if stage == 3 else {}))
    return model, model, opt


def _loss(fwd, tokens, targets):
    logits = fwd(tokens)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _step(fwd, opt, tokens, targets):
    loss = _loss(fwd, tokens, targets)
    opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
    opt.step()
    opt.zero_grad()


def _memory(name, module, fwd, opt, tokens, targets):
    import zeroplus

    loss = _loss(fwd, tokens, targets)
    opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
    if name == "deepspeed_stage3":
        report = _deepspeed3_memory(opt.engine)
    elif name == "fsdp2":
        params = list(module.parameters())
        state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        report = {"parameters": _local_bytes(params), "gradients": _local_bytes([p.grad for p in params]),
                  "master_parameters": 0, "optimizer_state": _local_bytes(state)}
        report["model_state"] = sum(report.values())
    else:
        report = zeroplus.memory_report(module, opt)
    opt.zero_grad()
    return report


def _deepspeed3_memory(engine) -> dict:
    """Model-state bytes of a DeepSpeed ZeRO-3 engine after a backward, from its optimizer's
    attributes: low-precision partitions (ds_tensor views of fp16_partitioned_groups_flat) plus
    persistent full parameters, the fp32 partitions, the inner optimizer's state, and the gradient
    partitions (grad_partitions_flat_buffer) plus anything left in averaged_gradients."""
    from bench_stages import deepspeed_state_bytes

    zopt = engine.optimizer
    params = list(engine.module.parameters())
    low = [getattr(p, "ds_tensor", None) for p in params] + [p.data for p in params if p.data.numel()]
    masters = list(getattr(zopt, "fp32_partitioned_groups_flat", []))
    grads = [getattr(zopt, "grad_partitions_flat_buffer", None)] + [p.grad for p in params if p.grad is not None]
    return deepspeed_state_bytes(zopt, low, masters, grads)


def _worker(rank, world, store_path, backend, name, args, out_queue):
    sys.path.insert(0, str(ROOT / "examples"))
    import zeroplus  # noqa: F401  (registers backend "zeroplus")
    from tiny_gpt import synthetic_batch

    torch.set_num_threads(1)
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    try:
        if name.startswith("deepspeed"):
            # deepspeed.initialize finds the group initialised above and uses it (no launcher).
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
            import logging

            import deepspeed
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, dist_init_required=False)
            deepspeed.utils.logger.setLevel(logging.WARNING)
        module, fwd, opt = _build(name, args)
        built = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kib, dtype=torch.float64)
        dist.all_reduce(built, op=dist.ReduceOp.MAX)
        gen = torch.Generator().manual_seed(rank)
        times = []
        for step in range(args.steps + 2):
            tokens, targets = synthetic_batch(args.batch, args.context, VOCAB, gen)
            dist.barrier()
            t0 = time.perf_counter()
            _step(fwd, opt, tokens, targets)
            dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= 2:
                times.append(dt.item())
        tokens, targets = synthetic_batch(args.batch, args.context, VOCAB, gen)
        memory = _memory(name, module, fwd, opt, tokens, targets)
        peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kib, dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out_queue.put({"rank": rank, "times": times, "memory": memory, "peak_rss_kib": peak.item(),
                       "built_rss_kib": built.item()})
    except Exception as e:  # reported, not hidden: the variant's row says why it could not run
        out_queue.put({"rank": rank, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
    finally:
        dist.destroy_process_group()


class TinyGPTParams:
    @staticmethod
    def count(args):
        from tiny_gpt import TinyGPT
        with torch.device("meta"):
            return list(TinyGPT(vocab=VOCAB, dim=args.dim, layers=args.layers, heads=args.heads,
                                context=args.context).parameters())


def run_variant(backend, world, name, args):
    return run_ranks(_worker, world, backend, name, args)



def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--backends", default="gloo,zeroplus")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--zero-kwargs", default="{}",
                        help="JSON of extra zeroplus.initialize keywords for stage 3, e.g. '{\"prefetch_bucket_size\": 0}'")
    parser.add_argument("--deepspeed", action="store_true",
                        help="add DeepSpeed stage 3 (installed into the build directory once)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "zero_stage3"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "plugin" / "python"))
    sys.path.insert(0, str(ROOT / "examples"))
    variants = args.variants.split(",") + (DS_VARIANTS if args.deepspeed else [])
    if args.deepspeed:
        sys.path.insert(0, str(ROOT / "bench"))
        from deepspeed_env import ensure_deepspeed

        ensure_deepspeed()  # before spawning: the ranks inherit PYTHONPATH and DS_ACCELERATOR
    psi = sum(p.numel() for p in TinyGPTParams.count(args))
    report = {"args": vars(args), "params": psi, "load_average_start": os.getloadavg(), "runs": []}
    results = {}
    for world in map(int, args.worlds.split(",")):
        for backend in args.backends.split(","):
            for rnd in range(2):
                order = variants if rnd == 0 else variants[::-1]
                for name in order:
                    res = run_variant(backend, world, name, args)
                    report["runs"].append({"world": world, "backend": backend, "variant": name, "round": rnd, **res})
                    results.setdefault((world, backend, name), []).append(res)
                    print(f"world {world} {backend} {name} round {rnd}: "
                          + (res["error"] if "error" in res else f"{statistics.median(res['times']) * 1e3:.0f} ms"),
                          flush=True)
    report["load_average_end"] = os.getloadavg()
    rows = []
    for (world, backend, name), runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append({"world": world, "backend": backend, "variant": name, "error": runs[0]["error"]})
            continue
        t = statistics.median([x for r in ok for x in r["times"]])
        rows.append({"world": world, "backend": backend, "variant": name, "step_ms": t * 1e3,
                     "model_state_mib": ok[-1]["memory"]["model_state"] / 2**20,
                     "per_param": ok[-1]["memory"]["model_state"] / psi,
                     "peak_gathered_mib": ok[-1]["memory"].get("peak_gathered_parameters", 0) / 2**20,
                     "peak_comm_mib": ok[-1]["memory"].get("peak_communication_buffers", 0) / 2**20,
                     "peak_rss_mib": max(r["peak_rss_kib"] for r in ok) / 1024,
                     "built_rss_mib": max(r["built_rss_kib"] for r in ok) / 1024})
    for row in rows:
        same = {r["variant"]: r for r in rows if r["world"] == row["world"] and r["backend"] == row["backend"]}
        for ref in ("ddp_adamw", "fsdp2"):
            if "step_ms" in row and "step_ms" in same.get(ref, {}):
                row[f"vs_{ref}"] = row["step_ms"] / same[ref]["step_ms"]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"ZeRO stage 3 vs DDP and FSDP2: TinyGPT {psi / 1e6:.1f}M params (dim {args.dim}, {args.layers} "
             f"layers, context {args.context}, batch {args.batch}/rank), {args.precision}, 1 thread per rank on "
             f"{os.cpu_count()} cores, median of {args.steps} steps x 2 launches; load average "
             f"{report['load_average_start'][0]:.1f} -> {report['load_average_end'][0]:.1f}. 16Ψ/N is the "
             f"stage-3 formula (bytes per parameter per rank: {16 / 2:.0f} at N=2, {16 / 4:.0f} at N=4).", "",
             "| ranks | backend | variant | step ms | / DDP | / FSDP2 | model-state MiB per rank | bytes/param | "
             "peak gathered MiB | peak reduce-scatter buffers MiB | peak RSS growth MiB (after build) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['world']} | {r['backend']} | {r['variant']} | error: {r['error']} | | | | | | | |")
            continue
        lines.append(f"| {r['world']} | {r['backend']} | {r['variant']} | {r['step_ms']:.0f} | "
                     f"{r.get('vs_ddp_adamw', float('nan')):.2f} | {r.get('vs_fsdp2', float('nan')):.2f} | "
                     f"{r['model_state_mib']:.0f} | {r['per_param']:.2f} | {r['peak_gathered_mib']:.0f} | "
                     f"{r['peak_comm_mib']:.0f} | {r['peak_rss_mib']:.0f} ({r['built_rss_mib']:.0f}) |")
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, **report}, indent=1, default=str))
    print(text)
    _plot(rows, out)


def _plot(rows, out):
    sys.path.insert(0, str(ROOT / "bench"))
    from plotting import pyplot  # installs matplotlib when missing (docs/benchmarks.md)

    plt = pyplot()
    if plt is None:
        return
    keys = sorted({(r["world"], r["backend"]) for r in rows})
    names = [v for v in VARIANTS + DS_VARIANTS if any(r["variant"] == v for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(1, len(keys))
    for i, (world, backend) in enumerate(keys):
        sel = {r["variant"]: r for r in rows if r["world"] == world and r["backend"] == backend and "step_ms" in r}
        xs = [j + i * width for j in range(len(names))]
        axes[0].bar(xs, [sel[n]["step_ms"] if n in sel else 0 for n in names], width, label=f"{world} ranks, {backend}")
        axes[1].bar(xs, [sel[n]["model_state_mib"] if n in sel else 0 for n in names], width,
                    label=f"{world} ranks, {backend}")
    for ax, title in zip(axes, ["step time (ms, lower is better)", "model-state MiB per rank"]):
        ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
