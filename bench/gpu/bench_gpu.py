"""GPU benchmarks, each beside the stock alternative in the same process (run by scripts/gpu_check.sh
on a machine with one GPU; nothing here runs in CI):

  optim    zeroplus.optim.AdamW/Adam/SGD (fused CUDA kernels) against torch's fused=True twins:
           median step time over --reps steps (CUDA events), fp32 and bf16 parameters,
           1 x 16M and 1000 x 4096 elements. ratio = torch / zeroplus (target >= 1.0).
  stage3   one training step (forward, backward, optimizer step) of a GPT on the GPU, world size 1:
           zeroplus.initialize(stage=3) against FSDP2 (fully_shard per block + AdamW) and plain
           AdamW; median step time and peak GPU memory (torch.cuda.max_memory_allocated).
  compile  the stage3 rows' plain AdamW, FSDP2 and zeroplus stage 3 in bf16 again, each
           torch.compile'd (inductor) after it is wrapped, with dynamo's graph-break count: compare
           with the eager stage3 rows (the warm-up steps compile and are not timed).
  offload  GPTs (stage 3, bf16) with the optimizer state in host memory or NVMe
           (offload_optimizer cpu / nvme), with the parameter shards there too (cpu_param,
           nvme_param: offload_param as well) and, where it fits, the same model in GPU memory
           (device none): step time, peak GPU memory during the steps, and model states
           (16 B/parameter) as a multiple of the GPU's memory and of the peak it used.

Each stage3 and offload row runs in a fresh process, so its peak GPU memory is its own.
Writes OUT/gpu_bench.json, OUT/gpu_bench.md and OUT/gpu_bench.png (step times per part).
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

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE.parents[1] / "plugin" / "python"))
sys.path.insert(0, str(_HERE.parents[1] / "tests" / "python"))


def _time_cuda(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over reps calls, each timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# -- optim -------------------------------------------------------------------------------------------

def bench_optim(reps: int) -> list[dict]:
    import zeroplus.optim as zo

    rows = []
    shapes = {"1x16M": [(1 << 24,)], "1000x4096": [(4096,)] * 1000}
    for name, kw in (("AdamW", dict(lr=1e-3, weight_decay=0.01)), ("Adam", dict(lr=1e-3)),
                     ("SGD", dict(lr=1e-2, momentum=0.9))):
        for dtype in (torch.float32, torch.bfloat16):
            for shape_name, shapes_ in shapes.items():
                result = {"part": "optim", "optimizer": name, "dtype": str(dtype).replace("torch.", ""),
                          "shape": shape_name}
                for who, cls, extra in (("zeroplus", getattr(zo, name), {}),
                                        ("torch_fused", getattr(torch.optim, name), {"fused": True})):
                    params = [torch.randn(s, device="cuda", dtype=dtype, requires_grad=True) for s in shapes_]
                    for p in params:
                        p.grad = torch.randn_like(p)
                    opt = cls(params, **kw, **extra)
                    result[f"{who}_ms"] = _time_cuda(opt.step, reps)
                    del opt, params
                    torch.cuda.empty_cache()
                result["ratio"] = result["torch_fused_ms"] / result["zeroplus_ms"]
                elements = sum(torch.Size(s).numel() for s in shapes_)
                result["elements"] = elements
                print(f"optim {name:5s} {result['dtype']:8s} {shape_name:9s} zeroplus {result['zeroplus_ms']:.3f} ms  "
                      f"torch fused {result['torch_fused_ms']:.3f} ms  ratio {result['ratio']:.2f}", flush=True)
                rows.append(result)
    return rows


# -- stage3 ------------------------------------------------------------------------------------------

def _gpt(dim: int, layers: int, vocab: int, context: int):
    from zero_models import TiedGPT

    torch.manual_seed(0)
    return TiedGPT(vocab=vocab, dim=dim, layers=layers, heads=max(1, dim // 64), context=context)


def _one_group():
    import torch.distributed as dist

    import zeroplus  # noqa: F401  (registers the backend)

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("zeroplus", store=store, rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=300))
    return dist


def _train_step_fn(model, opt, tokens, targets):
    import torch.nn.functional as F

    def step():
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def _build(variant: str, size: dict, precision: str, compile_blocks: bool = False):
    """(model, optimizer); compile_blocks: torchtitan's order, every block torch.compile'd in its
    list before the model is wrapped (each compiled block is then one FSDP2 / zeroplus unit)."""
    import zeroplus

    model = _gpt(**size).cuda()
    if compile_blocks:
        layers = model.blocks.layers
        for i, block in enumerate(layers):
            layers[i] = torch.compile(block)
    kw = dict(lr=1e-4, weight_decay=0.01)
    if variant == "adamw":
        if precision == "bf16":
            model = model.to(torch.bfloat16)
        return model, torch.optim.AdamW(model.parameters(), fused=True, **kw)
    if variant == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        nccl = dist.new_group(backend="nccl")
        from torch.distributed.device_mesh import DeviceMesh
        mesh = DeviceMesh.from_group(nccl, "cuda")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else MixedPrecisionPolicy()
        for layer in model.blocks.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model, torch.optim.AdamW(model.parameters(), fused=True, **kw)
    stage = int(variant[-1])
    extra = {"mixed_precision": "bf16"} if precision == "bf16" else {}
    return zeroplus.initialize(model, torch.optim.AdamW, stage=stage, **kw, **extra)


def _run_job(job: dict) -> dict:
    """One row, measured in a process of its own (see _isolated)."""
    _one_group()
    if job["part"] == "stage3":
        return _stage3_row(**{k: v for k, v in job.items() if k != "part"})
    return _offload_row(**{k: v for k, v in job.items() if k != "part"})


def _isolated(job: dict) -> dict:
    """Runs one row in a fresh interpreter: its peak GPU memory is its own (nothing an earlier
    variant left allocated, nothing cached by the allocator) and a crash costs one row."""
    import subprocess

    proc = subprocess.run([sys.executable, __file__, "--job", json.dumps(job)], capture_output=True, text=True,
                          timeout=job.get("timeout_s", 600))
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    return {**{k: v for k, v in job.items() if k in ("part", "variant", "precision", "layers", "device")},
            "error": f"rc {proc.returncode}: {(proc.stderr or proc.stdout)[-300:]}"}


COMPILE_ORDERS = ("after", "blocks")


def _stage3_row(variant: str, precision: str, size: dict, batch: int, reps: int, timeout_s: int = 600,
                compiled: str | None = None) -> dict:
    """compiled: None (eager), "after" (torch.compile of the wrapped model) or "blocks" (each
    block compiled before wrapping)."""
    name = variant + {None: "", "after": "+compile", "blocks": "+compile_blocks"}[compiled]
    try:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, size["vocab"], (batch, size["context"]), generator=g).cuda()
        targets = torch.randint(0, size["vocab"], (batch, size["context"]), generator=g).cuda()
        torch.cuda.reset_peak_memory_stats()
        model, opt = _build(variant, size, precision, compile_blocks=compiled == "blocks")
        params = sum(p.numel() for p in _gpt(**size).parameters())
        breaks = None
        if compiled == "after":
            model = torch.compile(model)
        ms = _time_cuda(_train_step_fn(model, opt, tokens, targets), reps)
        if compiled:
            from torch._dynamo.utils import counters

            breaks = sum(counters["graph_break"].values())
        peak = torch.cuda.max_memory_allocated() / 2**30
        return {"part": "stage3", "variant": name, "precision": precision, "step_ms": ms, "peak_gib": peak,
                "params": params, "graph_breaks": breaks}
    except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
        return {"part": "stage3", "variant": name, "precision": precision, "error": repr(e)[:300]}


def bench_stage3(reps: int, size: dict, batch: int, precisions: tuple[str, ...] = ("fp32", "bf16")) -> list[dict]:
    rows = []
    for precision in precisions:
        for variant in ("adamw", "fsdp2", "zeroplus_stage3", "zeroplus_stage2"):
            row = _isolated({"part": "stage3", "variant": variant, "precision": precision, "size": size,
                             "batch": batch, "reps": reps})
            print("stage3", json.dumps(row), flush=True)
            rows.append(row)
    by = {(r["variant"], r["precision"]): r for r in rows if "step_ms" in r}
    for precision in precisions:
        z, f = by.get(("zeroplus_stage3", precision)), by.get(("fsdp2", precision))
        if z and f:
            print(f"stage3 {precision}: zeroplus stage 3 / FSDP2 step = {z['step_ms'] / f['step_ms']:.2f}, "
                  f"peak {z['peak_gib']:.2f} vs {f['peak_gib']:.2f} GiB", flush=True)
    return rows


def bench_compile(reps: int, size: dict, batch: int, orders: tuple[str, ...] = COMPILE_ORDERS) -> list[dict]:
    rows = []
    for order in orders:
        for variant in ("adamw", "fsdp2", "zeroplus_stage3"):
            row = _isolated({"part": "stage3", "variant": variant, "precision": "bf16", "size": size, "batch": batch,
                             "reps": reps, "compiled": order, "timeout_s": 900})
            print("compile", json.dumps(row), flush=True)
            rows.append(row)
    return rows


def print_compile_speedups(rows: list[dict]) -> None:
    """Eager / compiled step per variant (above 1: compiling made it faster), where both ran."""
    eager = {r["variant"]: r for r in rows if r.get("part") == "stage3" and r.get("precision") == "bf16"
             and "step_ms" in r}
    for r in rows:
        base = eager.get(r["variant"].split("+")[0])
        if "+compile" in r["variant"] and "step_ms" in r and base:
            print(f"compile bf16 {r['variant']}: eager {base['step_ms']:.2f} ms / compiled {r['step_ms']:.2f} ms"
                  f" = {base['step_ms'] / r['step_ms']:.2f}, graph breaks {r['graph_breaks']}", flush=True)


# -- offload -----------------------------------------------------------------------------------------

OFFLOAD_DEVICES = ("none", "cpu", "nvme", "cpu_param", "nvme_param")


def _offload_kwargs(device: str, nvme_path: str | None) -> dict:
    """zeroplus.initialize's offload arguments for one bench row: none (GPU memory), the
    optimizer on the host (cpu) or on NVMe (nvme), and with the parameters too (*_param)."""
    if device not in OFFLOAD_DEVICES:
        raise ValueError(f"offload device must be one of {OFFLOAD_DEVICES}, got {device!r}")
    if device == "none":
        return {}
    medium = device.split("_")[0]
    if medium == "cpu":
        policy = {"device": "cpu", "pin_memory": True}
    else:
        os.makedirs(nvme_path, mode=0o700, exist_ok=True)
        policy = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4}
    out = {"offload_optimizer": policy}
    if device.endswith("_param"):
        out["offload_param"] = dict(policy)
    return out


def _offload_run(text: str) -> tuple[int, str]:
    """One --offload-runs entry, LAYERS:DEVICE."""
    layers, sep, device = text.partition(":")
    if not sep or not layers.isdigit() or int(layers) < 1 or device not in OFFLOAD_DEVICES:
        raise ValueError(f"{text!r} is not LAYERS:DEVICE (LAYERS >= 1, DEVICE one of {', '.join(OFFLOAD_DEVICES)})")
    return int(layers), device


def _offload_row(layers: int, device: str, dim: int, batch: int, context: int, nvme_path: str | None,
                 reps: int, timeout_s: int = 600) -> dict:
    import zeroplus

    vocab = 32000
    total_gpu = torch.cuda.get_device_properties(0).total_memory
    size = dict(dim=dim, layers=layers, vocab=vocab, context=context)
    row = {"part": "offload", "layers": layers, "dim": dim, "device": device}
    try:
        t0 = time.perf_counter()
        with torch.device("cuda"):
            model = _gpt(**size)
        row["params"] = sum(p.numel() for p in model.parameters())
        offload = _offload_kwargs(device, nvme_path)
        model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=1e-4, mixed_precision="bf16",
                                         **offload)
        row["build_s"] = time.perf_counter() - t0
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (batch, context), generator=g).cuda()
        targets = torch.randint(0, vocab, (batch, context), generator=g).cuda()
        torch.cuda.reset_peak_memory_stats()
        row["step_ms"] = _time_cuda(_train_step_fn(model, opt, tokens, targets), reps, warmup=1)
        peak = torch.cuda.max_memory_allocated()
        row["peak_gpu_gib"] = peak / 2**30
        row["model_states_gib"] = 16 * row["params"] / 2**30
        row["states_over_gpu_total"] = 16 * row["params"] / total_gpu
        row["states_over_gpu_peak"] = 16 * row["params"] / peak
    except Exception as e:  # noqa: BLE001 - a run that fails is reported, not fatal
        row["error"] = repr(e)[:400]
    return row


def bench_offload(reps: int, runs: list[tuple[int, str]], dim: int, batch: int, context: int,
                  nvme_path: str | None) -> list[dict]:
    """runs: (layers, offload device) pairs; device "none" is the same model in GPU memory."""
    rows = []
    for layers, device in runs:
        if device.startswith("nvme") and not nvme_path:
            continue
        row = _isolated({"part": "offload", "layers": layers, "device": device, "dim": dim, "batch": batch,
                         "context": context, "nvme_path": nvme_path, "reps": reps})
        print("offload", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _write(rows: list[dict], out: pathlib.Path, header: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    lines = [f"# GPU bench ({header['device']}, torch {header['torch']})", ""]
    optim = [r for r in rows if r["part"] == "optim"]
    if optim:
        lines += ["| optimizer | dtype | shape | zeroplus ms | torch fused ms | torch / zeroplus |", "|---|---|---|---:|---:|---:|"]
        lines += [f"| {r['optimizer']} | {r['dtype']} | {r['shape']} | {r['zeroplus_ms']:.3f} | {r['torch_fused_ms']:.3f} | "
                  f"{r['ratio']:.2f} |" for r in optim]
        lines.append("")
    stage3 = [r for r in rows if r["part"] == "stage3"]
    if stage3:
        lines += ["| variant | precision | step ms | peak GiB | graph breaks |", "|---|---|---:|---:|---:|"]
        lines += [f"| {r['variant']} | {r['precision']} | " + (f"{r['step_ms']:.1f} | {r['peak_gib']:.2f} | "
                                                                f"{'' if r.get('graph_breaks') is None else r['graph_breaks']} |"
                                                                if "step_ms" in r else f"error: {r['error'][:80]} | | |")
                  for r in stage3]
        lines.append("")
    off = [r for r in rows if r["part"] == "offload"]
    if off:
        lines += ["| layers | params | offload | step ms | peak GPU GiB (steps) | model states GiB | states / GPU total | states / GPU peak |",
                  "|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in off:
            if "step_ms" in r:
                lines.append(f"| {r['layers']} | {r['params'] / 1e9:.2f}e9 | {r['device']} | {r['step_ms']:.0f} | "
                             f"{r['peak_gpu_gib']:.1f} | {r['model_states_gib']:.1f} | {r['states_over_gpu_total']:.2f} | "
                             f"{r['states_over_gpu_peak']:.2f} |")
            else:
                lines.append(f"| {r['layers']} | {r.get('params', 0) / 1e9:.2f}e9 | {r['device']} | error: {r['error'][:80]} | | | | |")
    (out / "gpu_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    if optim:
        labels = [f"{r['optimizer']}\n{r['dtype']}\n{r['shape']}" for r in optim]
        x = range(len(optim))
        axes[0].bar([i - 0.2 for i in x], [r["zeroplus_ms"] for r in optim], 0.4, label="zeroplus")
        axes[0].bar([i + 0.2 for i in x], [r["torch_fused_ms"] for r in optim], 0.4, label="torch fused=True")
        axes[0].set_xticks(list(x), labels, fontsize=6)
        axes[0].set_ylabel("ms per step")
        axes[0].set_title("fused optimizer step on the GPU")
        axes[0].legend()
    ok = [r for r in stage3 if "step_ms" in r]
    if ok:
        axes[1].bar(range(len(ok)), [r["step_ms"] for r in ok])
        axes[1].set_xticks(range(len(ok)), [f"{r['variant']}\n{r['precision']}" for r in ok], fontsize=7, rotation=30)
        axes[1].set_ylabel("ms per training step")
        axes[1].set_title("GPT training step, world size 1")
    fig.tight_layout()
    fig.savefig(out / "gpu_bench.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="optim,stage3")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="bench/results/gpu")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precisions", default="fp32,bf16", help="the stage3 part's precisions (fp32, bf16)")
    parser.add_argument("--compile-orders", default=",".join(COMPILE_ORDERS),
                        help="the compile part's orders: after (torch.compile of the wrapped model), blocks "
                             "(each block compiled, then wrapped: torchtitan's)")
    parser.add_argument("--offload-runs", default="8:none,8:cpu,8:nvme,8:cpu_param,8:nvme_param,20:cpu",
                        help="LAYERS:DEVICE pairs, DEVICE one of none (the same model in GPU memory), cpu, nvme "
                             "(offload_optimizer), cpu_param, nvme_param (offload_param too)")
    parser.add_argument("--offload-dim", type=int, default=4096)
    parser.add_argument("--nvme-path", default=None)
    parser.add_argument("--job", help=argparse.SUPPRESS)  # one row in this process (_isolated)
    args = parser.parse_args()
    try:
        runs = [_offload_run(r) for r in args.offload_runs.split(",")]
    except ValueError as e:
        parser.error(f"--offload-runs: {e}")
    orders = tuple(args.compile_orders.split(","))
    if not orders or not set(orders) <= set(COMPILE_ORDERS):
        parser.error(f"--compile-orders: a comma-separated list of {', '.join(COMPILE_ORDERS)}, got {args.compile_orders!r}")
    precisions = tuple(args.precisions.split(","))
    if not precisions or not set(precisions) <= {"fp32", "bf16"}:
        parser.error(f"--precisions: a comma-separated list of fp32, bf16, got {args.precisions!r}")
    if args.job:
        print("ROW " + json.dumps(_run_job(json.loads(args.job))), flush=True)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py: needs a CUDA GPU")
    header = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "gpu_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
              "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print(json.dumps(header), flush=True)
    rows = []
    parts = args.parts.split(",")
    if "optim" in parts:
        rows += bench_optim(args.reps)
    if "stage3" in parts:
        rows += bench_stage3(max(5, args.reps // 2), dict(dim=args.dim, layers=args.layers, vocab=32000,
                                                         context=args.context), args.batch, precisions)
    if "compile" in parts:
        rows += bench_compile(max(5, args.reps // 2), dict(dim=args.dim, layers=args.layers, vocab=32000,
                                                           context=args.context), args.batch, orders)
        print_compile_speedups(rows)
    if "offload" in parts:
        rows += bench_offload(3, runs, args.offload_dim, 2, 512, args.nvme_path)
    _write(rows, pathlib.Path(args.out), header)


if __name__ == "__main__":
    main()
