"""Tensor parallel x ZeRO against ZeRO-3: model-state bytes, bytes communicated, step time.

    python bench/tensor_parallel/bench_tp_zero.py [--precision fp32|bf16] [--steps 6] [--dim 256]
        [--layers 4] [--heads 8] [--batch 4] [--context 64] [--variants ...] [--out PATH]
    bash bench/tensor_parallel/run.sh            (fp32 and bf16 -> bench/results/tp_zero_{fp32,bf16})

4 CPU ranks on backend zeroplus, the same small GPT (a Hugging Face GPT2LMHeadModel built from a
GPT2Config, no download, dropout off, vocabulary 256) with identical initial weights and the same
global batch in every variant (4 x --batch sequences per step, the learnable synthetic sequences of
examples/tiny_gpt.py):
  dp4_zero1   zeroplus.initialize(stage=1) over the 4-rank world      (data parallel only)
  dp4_zero3   zeroplus.initialize(stage=3) over the 4-rank world
  tp2_zero1   a 2 (dp) x 2 (tp) DeviceMesh ("dp", "tp"): zeroplus.initialize(stage=1,
              tensor_parallel=mesh), i.e. zeroplus.tensor_parallel.auto_plan's Megatron plan (q|k|v
              and c_fc column-parallel, the projections row-parallel, vocabulary-parallel embedding
              and LM head) over mesh["tp"] and ZeRO-1 over mesh["dp"]; each dp replica takes
              2 x --batch sequences
  tp2_zero2   the same with stage=2
Measured per variant, each in its own launch of 4 ranks:
  * model-state bytes per rank: zeroplus.memory_report after a backward (every category live);
    for DTensor parameters these are the local shards; beside them the pooled gather/reduce-scatter
    buffers the engine keeps for the next step (outside model_state, docs/zero.md);
  * bytes communicated per step per rank: zeroplus.comm_stats of every group the variant uses
    (dp, tp), as the difference of snapshots taken right before and right after each training
    step (so the bench's own timing collectives are not in it), averaged over the steps; `bytes`
    is the message size S and `bus` the bytes each rank moves with a bandwidth-optimal algorithm
    (docs/comm_stats.md); the ranks' figures are checked to agree within a group dimension;
  * step time (forward + backward + optimizer step + zero_grad): median over steps of the slower
    rank; on a loaded machine only context.
Beside the measured bytes the table prints the formulas of docs/tensor_parallel_vs_zero3.md.
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
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIANTS = ["dp4_zero1", "dp4_zero3", "tp2_zero1", "tp2_zero2"]
VOCAB = 256
WORLD = 4


def _tp(name: str) -> int:
    return 2 if name.startswith("tp2") else 1


def _gpt(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=args.context, n_embd=args.dim, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return GPT2LMHeadModel(config)


def _build(name, args, mesh):
    import zeroplus

    torch.manual_seed(0)
    model = _gpt(args)
    precision = None if args.precision == "fp32" else args.precision
    return zeroplus.initialize(model, torch.optim.AdamW, stage=int(name[-1]), tensor_parallel=mesh,
                               mixed_precision=precision, lr=3e-4, weight_decay=0.01)


def _local_numel(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def _loss(model, tokens, targets):
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _snapshot(groups):
    import zeroplus

    return {k: zeroplus.comm_stats(g) for k, g in groups.items()}


def _worker(rank, store_path, name, args, out_queue):
    sys.path.insert(0, str(ROOT / "examples"))
    import zeroplus
    from tiny_gpt import synthetic_batch

    torch.set_num_threads(1)
    dist.init_process_group("zeroplus", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=900))
    try:
        tp = _tp(name)
        timing = dist.new_group(backend="gloo")  # barriers and step times: outside every counted group
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (WORLD // tp, tp), mesh_dim_names=("dp", "tp"))
            groups = {"dp": mesh.get_group("dp"), "tp": mesh.get_group("tp")}
            dp_rank = mesh.get_local_rank("dp")
        else:
            groups, dp_rank, mesh = {"dp": dist.group.WORLD}, rank, None
        model, opt = _build(name, args, mesh)
        local_params = _local_numel(model) if tp > 1 else None  # stage 3's are the engine's shards
        # Every dp replica sees its own batch (the tp ranks of a replica the same one); the global
        # batch is WORLD x args.batch sequences in every variant.
        gen = torch.Generator().manual_seed(1000 + dp_rank)
        batch = args.batch * tp
        times, per_step = [], {k: None for k in groups}
        for step in range(args.steps + 2):
            tokens, targets = synthetic_batch(batch, args.context, VOCAB, gen)
            dist.barrier(group=timing)
            before = _snapshot(groups)
            t0 = time.perf_counter()
            loss = _loss(model, tokens, targets)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            after = _snapshot(groups)
            worst = torch.tensor(dt, dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=timing)
            if step >= 2:  # the first steps build buckets and caches
                times.append(worst.item())
                for k in groups:
                    d = after[k] - before[k]
                    per_step[k] = d if per_step[k] is None else per_step[k] + d
        tokens, targets = synthetic_batch(batch, args.context, VOCAB, gen)
        opt.backward(_loss(model, tokens, targets))
        memory = zeroplus.memory_report(model, opt)
        opt.zero_grad()
        comm = {k: {op: {f: v / args.steps for f, v in s.items()} for op, s in per_step[k].as_dict().items()}
                for k in groups}
        out_queue.put({"rank": rank, "times": times, "memory": memory, "comm": comm, "final_loss": loss.item(),
                       "local_params": local_params})
    except Exception as e:  # reported, not hidden: the variant's row says why it could not run
        import traceback

        out_queue.put({"rank": rank, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                       "traceback": traceback.format_exc()})
    finally:
        dist.destroy_process_group()


def run_variant(name, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(d, "store"), name, args, q)) for r in range(WORLD)]
        for p in procs:
            p.start()
        results = sorted((q.get(timeout=3600) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    errors = [r for r in results if "error" in r]
    if errors:
        print(errors[0].get("traceback", ""), file=sys.stderr)
        return {"error": errors[0]["error"]}
    return {"ranks": results}


def formulas(name, args, psi, local, precision):
    """Model-state bytes per rank and bus bytes per step per rank from the formulas of
    docs/tensor_parallel_vs_zero3.md. psi: all parameters; local: those a rank holds under TP."""
    tp = _tp(name)
    dp = WORLD // tp
    lp = 2 if precision == "bf16" else 4  # bytes of a parameter/gradient element in compute
    master = 4 if precision == "bf16" else 0
    stage = int(name[-1])
    if stage == 3:
        memory = (2 * lp + master + 8) * psi / dp
    elif stage == 2:
        memory = lp * local + (lp + master + 8) * local / dp
    else:
        memory = 2 * lp * local + (master + 8) * local / dp
    # Data-parallel traffic per step, in units of the local parameters' bytes x (dp-1)/dp:
    # stage 1 all-reduces the gradients (2) and all-gathers the updated parameters (1); stage 2
    # reduce-scatters them (1) and all-gathers (1); stage 3 all-gathers the parameters for forward
    # and again for backward (2) and reduce-scatters the gradients (1).
    dp_bus = {1: 3, 2: 2, 3: 3}[stage] * (dp - 1) / dp * local * lp
    # Tensor-parallel traffic (Megatron plan): per block 2 all-reduces of the activations forward
    # (row-parallel outputs) and 2 backward (column-parallel inputs' gradients), plus the
    # vocabulary-parallel embedding's forward all-reduce and the LM head's input-gradient
    # all-reduce, each tokens x dim elements (bus factor 2(tp-1)/tp), and the LM head's logits
    # all-gather, tokens x vocab (bus factor (tp-1)/tp). tokens = the replica's batch x context.
    tokens = args.batch * tp * args.context
    tp_bus = 0 if tp == 1 else ((4 * args.layers + 2) * tokens * args.dim * 2 + tokens * VOCAB) * lp * (tp - 1) / tp
    return {"model_state": memory, "dp_bus": dp_bus, "tp_bus": tp_bus}


def _summarise(name, res, args, psi):
    ranks = res["ranks"]
    row = {"variant": name, "step_ms": statistics.median(ranks[0]["times"]) * 1e3,
           "model_state": max(r["memory"]["model_state"] for r in ranks),
           "memory_rank0": ranks[0]["memory"], "final_loss": ranks[0]["final_loss"]}
    for g in ("dp", "tp"):
        per_rank = [r["comm"].get(g, {}).get("total", {"bytes": 0.0, "bus_bytes": 0.0, "calls": 0.0}) for r in ranks]
        row[f"{g}_bytes"] = max(p["bytes"] for p in per_rank)
        row[f"{g}_bus"] = max(p["bus_bytes"] for p in per_rank)
        row[f"{g}_calls"] = max(p["calls"] for p in per_rank)
        row[f"{g}_bytes_min"] = min(p["bytes"] for p in per_rank)
        # Every collective here is symmetric: each rank of a group counts the same message sizes.
        row[f"{g}_ranks_agree"] = len({json.dumps(r["comm"].get(g, {}), sort_keys=True) for r in ranks}) == 1
        row[f"{g}_ops"] = ranks[0]["comm"].get(g, {})
    row["local_params"] = ranks[0]["local_params"] or psi
    row["formula"] = formulas(name, args, psi, row["local_params"], args.precision)
    return row


def _psi(args):
    with torch.device("meta"):
        return sum(p.numel() for p in _gpt(args).parameters())  # parameters() lists the tied wte once


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank (a dp replica of tp ranks takes tp x)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "tp_zero"))
    args = parser.parse_args()
    for flag in ("steps", "dim", "layers", "heads", "batch", "context"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    sys.path.insert(0, str(ROOT / "plugin" / "python"))
    sys.path.insert(0, str(ROOT / "examples"))
    psi = _psi(args)
    report = {"args": vars(args), "params": psi, "load_average_start": os.getloadavg(),
              "rows": []}
    for name in args.variants.split(","):
        if name not in VARIANTS:
            parser.error(f"--variants: unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        res = run_variant(name, args)
        row = {"variant": name, "error": res["error"]} if "error" in res else _summarise(name, res, args, psi)
        report["rows"].append(row)
        print(f"{name}: " + (row["error"] if "error" in row else
                             f"{row['step_ms']:.0f} ms, {row['model_state'] / 2**20:.2f} MiB, "
                             f"dp {row['dp_bytes'] / 2**20:.2f} MiB, tp {row['tp_bytes'] / 2**20:.2f} MiB per step"),
              flush=True)
    report["load_average_end"] = os.getloadavg()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = _table(report, args)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    print(text)
    _plot(report, out)


def _table(report, args):
    mib = 2**20
    psi = report["params"]
    tp_local = next((r["local_params"] for r in report["rows"] if "error" not in r and _tp(r["variant"]) > 1), None)
    lines = [f"Tensor parallel x ZeRO vs ZeRO-3: GPT-2 (HF) {psi / 1e6:.2f}M params"
             + (f" ({tp_local / 1e6:.2f}M per rank under TP2)" if tp_local else "")
             + f", dim {args.dim}, {args.layers} layers, {args.heads} heads, context {args.context}, vocabulary "
             f"{VOCAB}, {args.precision}, {WORLD} CPU ranks on backend zeroplus, global batch "
             f"{WORLD * args.batch} sequences/step, {args.steps} measured steps; load average "
             f"{report['load_average_start'][0]:.1f} -> {report['load_average_end'][0]:.1f} (step times are "
             "context only; bytes are exact).", "",
             "Bytes per step per rank, measured with zeroplus.comm_stats: S = message size (nccl-tests/DeepSpeed "
             "convention), bus = bytes each rank moves with a bandwidth-optimal algorithm; formula = the bus bytes "
             "of docs/tensor_parallel_vs_zero3.md.", "",
             "| variant | model-state MiB/rank (formula) | pooled buffers MiB | dp MiB/step S | dp bus MiB (formula) | "
             "tp MiB/step S | tp bus MiB (formula) | total bus MiB | calls/step dp + tp | step ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error']} | | | | | | | | |")
            continue
        f = r["formula"]
        lines.append(
            f"| {r['variant']} | {r['model_state'] / mib:.2f} ({f['model_state'] / mib:.2f}) | "
            f"{r['memory_rank0'].get('pooled_buffers', 0) / mib:.2f} | {r['dp_bytes'] / mib:.2f} | "
            f"{r['dp_bus'] / mib:.2f} ({f['dp_bus'] / mib:.2f}) | {r['tp_bytes'] / mib:.2f} | "
            f"{r['tp_bus'] / mib:.2f} ({f['tp_bus'] / mib:.2f}) | {(r['dp_bus'] + r['tp_bus']) / mib:.2f} | "
            f"{r['dp_calls']:.0f} + {r['tp_calls']:.0f} | {r['step_ms']:.0f} |")
    disagree = [f"{r['variant']} {g}" for r in report["rows"] if "error" not in r for g in ("dp", "tp")
                if not r[f"{g}_ranks_agree"]]
    lines += ["", "Every rank counted the same calls and bytes per collective in each group." if not disagree else
              "Ranks counted different traffic in: " + ", ".join(disagree) + " (the table shows the largest)."]
    lines += ["", "Per collective, rank 0, per step (S MiB x calls):", ""]
    for r in report["rows"]:
        if "error" in r:
            continue
        for g in ("dp", "tp"):
            ops = {k: v for k, v in r[f"{g}_ops"].items() if k != "total"}
            if ops:
                lines.append(f"* {r['variant']} {g}: " + ", ".join(
                    f"{k} {v['bytes'] / mib:.3f} x {v['calls']:.0f}" for k, v in sorted(ops.items())))
    return "\n".join(lines) + "\n"


def _plot(report, out):
    sys.path.insert(0, str(ROOT / "bench"))
    from plotting import pyplot  # installs matplotlib when missing (docs/benchmarks.md)

    plt = pyplot()
    rows = [r for r in report["rows"] if "error" not in r]
    if plt is None or not rows:
        return
    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    mib = 2**20
    axes[0].bar(names, [r["dp_bus"] / mib for r in rows], label="dp group")
    axes[0].bar(names, [r["tp_bus"] / mib for r in rows], bottom=[r["dp_bus"] / mib for r in rows], label="tp group")
    axes[0].set_ylabel("bus MiB per step per rank (measured)")
    axes[0].set_title("communication per step")
    axes[0].legend()
    axes[1].bar(names, [r["model_state"] / mib for r in rows], color="tab:green")
    axes[1].set_ylabel("MiB per rank (measured)")
    axes[1].set_title("model-state bytes")
    axes[2].bar(names, [r["step_ms"] for r in rows], color="tab:gray")
    axes[2].set_ylabel("ms (loaded machine: context only)")
    axes[2].set_title("step time")
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"TP x ZeRO vs ZeRO-3, {WORLD} CPU ranks, {report['params'] / 1e6:.2f}M params, "
                 f"{report['args']['precision']}")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
