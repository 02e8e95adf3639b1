"""ZeRO stages side by side: step time and model-state bytes per rank, 2 CPU ranks, one run.

    python bench/zero/bench_stages.py [--backends zeroplus,gloo] [--steps 30] [--dim 256]
        [--layers 4] [--batch 4] [--context 64] [--precision fp32|bf16] [--deepspeed] [--out PATH]

Variants, all with AdamW(lr 3e-4, wd 0.01), identical initial weights, on each backend:
  ddp_adamw          DDP + torch.optim.AdamW                        (the stock baseline)
  ddp_torch_zero     DDP + torch ZeroRedundancyOptimizer(AdamW)     (stock ZeRO-1)
  zeroplus_stage1    zeroplus.initialize(stage=1)
  zeroplus_stage2    zeroplus.initialize(stage=2)
  deepspeed_stage1   deepspeed.initialize(zero_optimization.stage=1), torch AdamW   (--deepspeed)
  deepspeed_stage2   deepspeed.initialize(zero_optimization.stage=2), torch AdamW   (--deepspeed)
DeepSpeed (PyPI, DS_ACCELERATOR=cpu, installed once into the build directory by
bench/deepspeed_env.py) runs in the same processes on the already-initialised default group, so
its collectives go through the same backend as the other variants (its CPU accelerator would pick
gloo, or ccl with oneCCL installed, if it initialised the group itself). Its configuration is its
default for the stage (contiguous_gradients, overlap_comm off on CPU, reduce/allgather bucket
5e8 elements), plus bf16.enabled for --precision bf16. Its model-state bytes: parameters, fp32
master partition, optimizer state, and the gradients it holds after backward (p.grad plus its
partitioned/averaged gradient buffers).
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
DS_VARIANTS = ["deepspeed_stage1", "deepspeed_stage2"]
STAGE = {"ddp_adamw": 0, "ddp_torch_zero": 1, "zeroplus_stage1": 1, "zeroplus_stage2": 2,
         "deepspeed_stage1": 1, "deepspeed_stage2": 2}


class _DeepSpeedStep:
    """DeepSpeed's engine behind the (backward, step, zero_grad) calls _step makes."""

    def __init__(self, engine):
        self.engine = engine

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()  # also zeroes the gradients

    def zero_grad(self):
        pass


def _tensors_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _deepspeed_memory(engine) -> dict:
    """Model-state bytes of a DeepSpeed ZeRO-1/2 engine, found in its optimizer's attributes."""
    zopt = engine.optimizer
    params = list(engine.module.parameters())
    masters = list(getattr(zopt, "single_partition_of_fp32_groups", []))
    return deepspeed_state_bytes(zopt, params, masters, [p.grad for p in params if p.grad is not None])


def deepspeed_state_bytes(zopt, params, masters, grads) -> dict:
    """Model-state bytes of a DeepSpeed ZeRO optimizer after a backward: `params` (what holds the
    low-precision or full parameters), `masters` (fp32 partitions), the inner optimizer's state,
    and `grads` plus the gradients DeepSpeed keeps in averaged_gradients and on the masters.
    Shared with bench_stage3.py (which passes its stage-3 partitions)."""
    inner = getattr(zopt, "optimizer", zopt)
    state = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.numel() > 1]
    grads = list(grads)
    averaged = getattr(zopt, "averaged_gradients", {})
    for v in (averaged.values() if isinstance(averaged, dict) else averaged):
        grads += [g for g in (v or []) if isinstance(g, torch.Tensor)]
    grads += [m.grad for m in masters if m.grad is not None]
    report = {"parameters": _tensors_bytes(params), "gradients": _tensors_bytes(grads),
              "master_parameters": _tensors_bytes(masters), "optimizer_state": _tensors_bytes(state)}
    report["model_state"] = sum(report.values())
    return report


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
    if name.startswith("deepspeed"):
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": STAGE[name]}, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 1 << 30}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **kw),
                                               config=config)
        return engine.module, engine, _DeepSpeedStep(engine)
    config = {"zero_optimization": {"reduce_bucket_size": args.reduce_bucket}} if args.reduce_bucket else None
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=STAGE[name], mixed_precision=precision,
                                     config=config, **kw)
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
    variants = VARIANTS + (DS_VARIANTS if args.deepspeed else [])
    if args.variants:
        variants = [v for v in variants if v == "ddp_adamw" or v in args.variants.split(",")]
    if args.deepspeed:
        # deepspeed.initialize finds the group initialised above and uses it (no launcher needed).
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        import logging

        import deepspeed
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, dist_init_required=False)
        deepspeed.utils.logger.setLevel(logging.WARNING)
    runs = {name: _build(name, args) for name in variants}
    gen = torch.Generator().manual_seed(rank)
    times = {name: [] for name in variants}
    memory = {}
    for step in range(args.steps + 3):
        tokens, targets = synthetic_batch(args.batch, args.context, 256, gen)
        for name in variants:
            module, fwd, opt = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            _step(fwd, opt, tokens, targets)
            dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= 3:  # warm-up steps excluded
                times[name].append(dt.item())
    for name in variants:  # memory with every category live: after a backward, before the step
        module, fwd, opt = runs[name]
        tokens, targets = synthetic_batch(args.batch, args.context, 256, gen)
        logits = fwd(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
        if isinstance(opt, _DeepSpeedStep):
            memory[name] = _deepspeed_memory(opt.engine)
            opt.engine.zero_grad()
        else:
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
    parser.add_argument("--reduce-bucket", type=int, default=0,
                        help="zeroplus reduce_bucket_size in elements (0: its default)")
    parser.add_argument("--variants", default="",
                        help="comma-separated subset of the variants (default: all; ddp_adamw always runs)")
    parser.add_argument("--deepspeed", action="store_true",
                        help="add DeepSpeed stage 1 and 2 (installed into the build directory once)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "zero_stages"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "plugin" / "python"))
    if args.deepspeed:
        sys.path.insert(0, str(ROOT / "bench"))
        from deepspeed_env import ensure_deepspeed

        ensure_deepspeed()  # before spawning: the ranks inherit PYTHONPATH and DS_ACCELERATOR
        import deepspeed
    from zeroplus.zero.memory import estimate_memory

    rows, report = [], {"args": vars(args), "load_average": os.getloadavg(), "backends": {}}
    if args.deepspeed:
        report["deepspeed"] = {"version": deepspeed.__version__, "accelerator": os.environ.get("DS_ACCELERATOR"),
                               "process_group": "the benchmark's default group (backend of the row)"}
    for backend in args.backends.split(","):
        res = run_backend(backend, args)
        report["backends"][backend] = res
        psi = res["params"]
        base = statistics.median(res["times"]["ddp_adamw"])
        for name in res["times"]:
            t = statistics.median(res["times"][name])
            mem = res["memory"][name]
            stage = STAGE[name]
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
    sys.path.insert(0, str(ROOT / "bench"))
    from plotting import pyplot  # installs matplotlib when missing (docs/benchmarks.md)

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    backends = args.backends.split(",")
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        sel = [r for r in rows if r[0] == b]
        xs = [j + i * width for j in range(len(sel))]
        axes[0].bar(xs, [r[2] for r in sel], width, label=f"backend {b}")
        axes[1].bar(xs, [r[4] for r in sel], width, label=f"backend {b}")
    names = list(dict.fromkeys(r[1] for r in rows))
    for ax, title in zip(axes, ["step time (ms, lower is better)", "model-state MiB per rank"]):
        ax.set_xticks([j + width * (len(backends) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
