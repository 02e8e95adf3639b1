"""The two front-ends of the one ZeRO engine side by side: step time of the C++ front-end
(zeroplus.hpp, zeroplus::zero::initialize) against the Python front-end (zeroplus.initialize) on
the same model, at stages 1-3, 2 CPU ranks.

    python bench/zero/bench_cpp_engine.py [--stages 1,2,3] [--dim 1024] [--layers 8] [--batch 32]
        [--steps 12] [--warmup 3] [--launches 3] [--precision fp32|bf16] [--out PATH]

Model: Linear(dim, dim) + GELU, `layers` times (Sequential: at stage 3 each child is a unit on both
sides; every parameter sharded: Python's param_persistence_threshold 0). AdamW(lr 3e-4, wd 0.01),
mse loss, one intra-op thread per rank on both sides. A step = zero_grad, forward + backward,
step; its time is the slower rank's. The C++ side runs its 2 ranks as threads of one process
($ZEROPLUS_BUILD_DIR/bin/zero_engine_step_bench, bench/zero/cpp_engine_step.cpp), the Python side
as 2 spawned processes (both on zeroplus process groups). `launches` launches of each, alternating
C++ and Python; each launch's median step, then the median over launches. Writes PATH.json,
PATH.md and PATH.png (default bench/results/cpp_engine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "plugin" / "python"))

from launch import run_ranks  # noqa: E402
from plotting import pyplot  # noqa: E402


def _program() -> pathlib.Path:
    build = pathlib.Path(os.environ.get("ZEROPLUS_BUILD_DIR") or ROOT / "build")
    return build / "bin" / "zero_engine_step_bench"


def _python_worker(rank, world, store_path, stage, dim, layers, batch, steps, warmup, precision, q):
    try:
        import torch.distributed as dist
        import torch.nn.functional as F

        import zeroplus

        torch.set_num_threads(1)
        dist.init_process_group("zeroplus", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(dim, dim), torch.nn.GELU()]
        model = torch.nn.Sequential(*mods)
        config = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else None
        model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, lr=3e-4, weight_decay=0.01,
                                         mixed_precision=None if precision == "fp32" else precision, config=config)
        gen = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(batch, dim, generator=gen), torch.randn(batch, dim, generator=gen)
        times = []
        for s in range(warmup + steps):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            opt.backward(F.mse_loss(model(x).float(), y))
            opt.step()
            dt = time.perf_counter() - t0
            if s >= warmup:
                times.append(dt)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
        q.put({"rank": rank, "step_seconds": slowest.tolist()})
    except Exception as e:  # reported, not raised: the other rank must not wait forever
        q.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def _run_cpp(stage, a) -> list[float]:
    out = subprocess.run([str(_program()), str(stage), "2", str(a.dim), str(a.layers), str(a.batch), str(a.steps),
                          str(a.warmup), a.precision], capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout)["step_seconds"]


def _run_python(stage, a) -> list[float]:
    res = run_ranks(_python_worker, 2, stage, a.dim, a.layers, a.batch, a.steps, a.warmup, a.precision,
                    timeout_s=900)
    if "error" in res:
        raise RuntimeError(res["error"])
    return res["step_seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpp_engine"))
    a = p.parse_args()
    if not _program().exists():
        sys.exit(f"{_program()} is missing: run scripts/build.sh (it builds it with the GoogleTests)")
    stages = [int(s) for s in a.stages.split(",")]
    rows = []
    for stage in stages:
        medians = {"cpp": [], "python": []}
        for launch in range(a.launches):
            for side in (("cpp", "python") if launch % 2 == 0 else ("python", "cpp")):
                steps = _run_cpp(stage, a) if side == "cpp" else _run_python(stage, a)
                medians[side].append(statistics.median(steps))
        cpp, py = statistics.median(medians["cpp"]), statistics.median(medians["python"])
        rows.append({"stage": stage, "cpp_step_s": cpp, "python_step_s": py, "cpp_over_python": cpp / py,
                     "cpp_launch_medians": medians["cpp"], "python_launch_medians": medians["python"]})
        print(f"stage {stage}: C++ {cpp * 1e3:.1f} ms, Python {py * 1e3:.1f} ms, C++/Python {cpp / py:.3f}", flush=True)
    params = a.layers * (a.dim * a.dim + a.dim)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "params": params, "world": 2,
            "loadavg": os.getloadavg(), "torch": torch.__version__, **{k: v for k, v in vars(a).items() if k != "out"}}
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# C++ vs Python front-end, {params / 1e6:.1f}M parameters, {a.precision}, 2 ranks ({meta['date']}, "
             f"load {meta['loadavg'][0]:.2f})", "", "| stage | C++ step (ms) | Python step (ms) | C++ / Python |",
             "|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['cpp_step_s'] * 1e3:.1f} | {r['python_step_s'] * 1e3:.1f} | "
              f"{r['cpp_over_python']:.3f} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["cpp_step_s"] * 1e3 for r in rows], 0.4, label="C++ (zeroplus.hpp)")
        ax.bar([x + 0.2 for x in xs], [r["python_step_s"] * 1e3 for r in rows], 0.4, label="Python (zeroplus.initialize)")
        ax.set_xticks(list(xs), [f"stage {r['stage']}" for r in rows])
        ax.set_ylabel("step time (ms, median)")
        ax.set_ylim(0, 1.35 * max(max(r["cpp_step_s"], r["python_step_s"]) for r in rows) * 1e3)  # room for the legend
        ax.set_title(f"ZeRO engine front-ends, {params / 1e6:.1f}M params, {a.precision}, 2 CPU ranks")
        ax.legend(loc="upper left", ncol=2)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
        print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
