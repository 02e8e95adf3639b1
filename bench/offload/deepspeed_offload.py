"""DeepSpeed's own NVMe offload, for bench_offload.py --deepspeed: its variants, their I/O and disk.

    ds = run_phases(args, rank, world)    # in every rank, after zeroplus's variants are freed
    lines = table(results, ds_info)       # in the parent, from the ranks' results by world size

Runs inside bench_offload.py's ranks, on the group they initialised (deepspeed.init_distributed
with dist_init_required=False, as bench/zero/bench_stages.py does), with DeepSpeed 0.19.8 on its
CPU accelerator (bench/deepspeed_env.py installs it and JIT-builds async_io and cpu_adam once).
Every variant is the same TinyGPT from the same seed, trained by deepspeed.initialize with the
client optimizer DeepSpeedCPUAdam(adamw_mode=True, lr 3e-4, wd 0.01): the optimizer DeepSpeed
requires with offload_optimizer (zero_force_ds_cpu_optimizer), used for its in-memory runs too
so that only the offload differs between a variant and its baseline.

  ds3_in_memory    stage 3
  ds3_cpu          stage 3, offload_optimizer cpu (what its NVMe variants are compared with too:
                   equal parameters mean the difference from ds3_in_memory is its offload path,
                   not its I/O)
  ds3_nvme         stage 3, offload_optimizer nvme
  ds3_nvme_param   stage 3, offload_optimizer and offload_param nvme (DeepSpeed's default
                   max_in_cpu, 1e9 elements: the bytes its parameter swap directory holds say
                   how much of the parameters really went to disk)
  ds2_in_memory    stage 2
  ds2_nvme         stage 2, offload_optimizer nvme (the bytes on disk say whether it swaps)
Everything else is DeepSpeed's default for the stage (aio block, buffer sizes), except the
buffer_count values, which are bench_offload.py's (by default DeepSpeed's own 4 and 5), and
offload_param.max_in_cpu when --deepspeed-max-in-cpu is given.

Each variant swaps under its own directory <base>/<variant> (DeepSpeed lays out
zero_stage_3/optimizer/rank<r>/ and zero_stage_3/<dtype>params/rank<r>/ below it); a rank's
bytes on disk are the allocated blocks (st_blocks) of the files in its rank<r> directories,
parameters apart, after the last round.
What this module measures per step, for the ranks' slowest: forward+backward and engine.step()
times; the time the training thread spent inside DeepSpeed's swapper calls (optimizer swapper:
swap_in_optimizer_state / swap_out_optimizer_state / swap_out_gradients; parameter swapper:
swap_in, synchronize_reads, swap_into_buffer / swap_out_and_release, synchronize_writes,
swap_out_partitioned_params; the outermost call only), wrapped per instance; the bytes the process
read from and wrote to storage (/proc/self/io read_bytes / write_bytes, so DeepSpeed's aio
threads count, page-cache hits do not); the loss; and after the last round the full parameters
(gathered at stage 3), compared with the same stage's in-memory run.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB = 256  # bench_offload.py's


@dataclasses.dataclass(frozen=True)
class DsVariant:
    stage: int
    offload_optimizer: str | None = None  # None (in memory), "cpu" or "nvme"
    offload_param: bool = False           # to NVMe

    @property
    def baseline(self) -> str:
        return f"ds{self.stage}_in_memory"

    @property
    def cpu_twin(self) -> str | None:
        """The same stage with the optimizer offloaded to CPU memory, for an NVMe variant."""
        return f"ds{self.stage}_cpu" if self.offload_optimizer == "nvme" else None


VARIANTS = {
    "ds3_in_memory": DsVariant(3),
    "ds3_cpu": DsVariant(3, offload_optimizer="cpu"),
    "ds3_nvme": DsVariant(3, offload_optimizer="nvme"),
    "ds3_nvme_param": DsVariant(3, offload_optimizer="nvme", offload_param=True),
    "ds2_in_memory": DsVariant(2),
    "ds2_nvme": DsVariant(2, offload_optimizer="nvme"),
}

# Run one after the other, each phase's variants interleaved (run_phases):
# DeepSpeed's fixed pinned swap buffers (4 x the partition for the optimizer, 5 x 1e8 elements for
# the parameters, per rank) with every engine of both stages alive would not fit beside the other
# sessions on this 24 GB machine.
PHASES = (("ds2_in_memory", "ds2_nvme"), ("ds3_in_memory", "ds3_cpu", "ds3_nvme", "ds3_nvme_param"))

_OPT_SWAPPER_CALLS = {"swap_in_optimizer_state": "swap_in", "swap_out_optimizer_state": "swap_out",
                      "swap_out_gradients": "swap_out"}
_PARAM_SWAPPER_CALLS = {"swap_in": "swap_in", "synchronize_reads": "swap_in", "swap_into_buffer": "swap_in",
                        "swap_out_and_release": "swap_out", "synchronize_writes": "swap_out",
                        "swap_out_partitioned_params": "swap_out"}


def init_deepspeed(rank: int, world: int, backend: str) -> None:
    """Points DeepSpeed at the process group the caller already initialised."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, dist_init_required=False)
    deepspeed.utils.logger.setLevel(logging.WARNING)


def _io_bytes() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process sent to storage so far (all its threads)."""
    values = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            values[key] = int(value)
    return values["read_bytes"], values["write_bytes"]


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def dir_bytes(path: str, only=None) -> int:
    """Allocated bytes of the files under `path` (0 when it does not exist); `only(dirpath)`
    selects directories."""
    total = 0
    for dirpath, _, files in os.walk(path):
        if only is not None and not only(dirpath):
            continue
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class SwapTimer:
    """Seconds the calling thread spends inside a swapper's calls, by kind ("swap_in"/"swap_out").
    Wraps the named methods on the instance; nested calls count once (the outermost)."""

    def __init__(self):
        self.seconds = {"swap_in": 0.0, "swap_out": 0.0}
        self._depth = 0

    def wrap(self, swapper, calls: dict) -> None:
        for method, kind in calls.items():
            inner = getattr(swapper, method, None)
            if inner is not None:
                setattr(swapper, method, self._timed(inner, kind))

    def _timed(self, inner, kind):
        def call(*args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds[kind] += time.perf_counter() - t0
        return call


class DsRun:
    """One DeepSpeed engine of the bench: (forward+backward, step) calls, its swap counters and
    swap directory."""

    def __init__(self, name: str, args, model: torch.nn.Module, nvme_dir: str):
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        self.name, self.variant, self.nvme_dir = name, VARIANTS[name], nvme_dir
        zero = {"stage": self.variant.stage}
        if self.variant.offload_optimizer == "cpu":
            zero["offload_optimizer"] = {"device": "cpu"}
        elif self.variant.offload_optimizer == "nvme":
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": args.buffer_count}
        if self.variant.offload_param:
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": args.param_buffer_count}
            if args.deepspeed_max_in_cpu is not None:
                zero["offload_param"]["max_in_cpu"] = args.deepspeed_max_in_cpu
        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": zero, "steps_per_print": 1 << 30}
        if args.precision == "bf16":
            config["bf16"] = {"enabled": True}
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=3e-4, weight_decay=0.01, adamw_mode=True)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.timer = SwapTimer()
        opt_swapper = getattr(self.engine.optimizer, "optimizer_swapper", None)
        if opt_swapper is not None:
            self.timer.wrap(opt_swapper, _OPT_SWAPPER_CALLS)
        param_swapper = next((p.nvme_swapper for p in self.engine.module.parameters()
                              if getattr(p, "nvme_swapper", None) is not None), None)
        if param_swapper is not None:
            self.timer.wrap(param_swapper, _PARAM_SWAPPER_CALLS)
        self.param_swap_dtype = None if param_swapper is None else str(param_swapper.dtype).replace("torch.", "")
        self.swappers = {"optimizer": opt_swapper is not None, "parameters": param_swapper is not None}

    def counters(self) -> list[float]:
        read, written = _io_bytes()
        return [self.timer.seconds["swap_in"], self.timer.seconds["swap_out"], float(read), float(written)]

    def compute(self, tokens, targets, vocab: int) -> float:
        logits = self.engine(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        self.engine.backward(loss)
        return loss.item()

    def step(self) -> None:
        self.engine.step()  # zeroes the gradients too

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every rank's copy of the full parameters (gathered at stage 3)."""
        import deepspeed

        params = list(self.engine.module.parameters())
        if self.variant.stage == 3:
            with deepspeed.zero.GatheredParameters(params):
                return {n: p.detach().clone() for n, p in self.engine.module.named_parameters()}
        return {n: p.detach().clone() for n, p in self.engine.module.named_parameters()}

    def disk(self, rank: int) -> dict:
        """Allocated bytes of this rank's swap files (DeepSpeed's .../rank<r>/ directories), all and
        parameters (.../<dtype>params/rank<r>/)."""
        mine = f"rank{rank}"
        return {"all": dir_bytes(self.nvme_dir, lambda d: os.path.basename(d) == mine),
                "parameters": dir_bytes(self.nvme_dir, lambda d: os.path.basename(d) == mine
                                        and os.path.basename(os.path.dirname(d)).endswith("params"))}

    def close(self) -> None:
        """Frees the engine: without destroy() its hooks keep it (and its buffers) alive."""
        self.engine.destroy()
        del self.engine


def compare(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """Bit-equality and the largest absolute difference of two full parameter sets."""
    diff = max(((params[k].float() - ref[k].float()).abs().max().item() for k in ref), default=0.0)
    return {"bit_exact": all(torch.equal(params[k], ref[k]) for k in ref), "max_abs_diff": diff}


def _slowest(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def _runs(args, names):
    """DeepSpeed's variants `names`, each from the same initial weights."""
    from tiny_gpt import TinyGPT

    runs = {}
    for name in names:
        torch.manual_seed(0)
        model = TinyGPT(vocab=VOCAB, dim=args.dim, layers=args.layers, heads=args.heads, context=args.context)
        runs[name] = DsRun(name, args, model, os.path.join(args.deepspeed_dir, name))
    return runs


def _round(runs, gen, args, record):
    """One interleaved round of every DeepSpeed variant; `record` is None in the untimed round."""
    from tiny_gpt import synthetic_batch

    for name, run in runs.items():
        tokens, targets = synthetic_batch(args.batch, args.context, VOCAB, gen[name])
        before = run.counters()
        dist.barrier()
        t0 = time.perf_counter()
        try:
            loss = run.compute(tokens, targets, VOCAB)
            t1 = time.perf_counter()
            run.step()
        except Exception as e:  # the table's error row names the variant
            raise RuntimeError(f"DeepSpeed variant {name}: {type(e).__name__}: {e}") from e
        t2 = time.perf_counter()
        compute, step = _slowest(t1 - t0), _slowest(t2 - t1)
        moved = [_slowest(a - b) for a, b in zip(run.counters(), before)]
        if record is None:
            continue
        r = record[name]
        r["compute"].append(compute)
        r["step"].append(step)
        r["loss"].append(loss)
        for key, value in zip(("swap_in_s", "swap_out_s", "bytes_read", "bytes_written"), moved):
            r[key].append(value)


def _summary(runs, record):
    """Per variant: parameters and losses against the same stage's in-memory run, parameters
    against its CPU-offload twin when it ran (all ranks), this rank's bytes on disk, and what
    DeepSpeed chose (swappers, parameter swap dtype)."""
    params = {name: run.full_parameters() for name, run in runs.items()}
    out = {}
    for name, run in runs.items():
        base, twin = run.variant.baseline, run.variant.cpu_twin
        same = compare(params[name], params[base])
        loss_diff = max(abs(a - b) for a, b in zip(record[name]["loss"], record[base]["loss"]))
        out[name] = {"bit_exact": _slowest(0.0 if same["bit_exact"] else 1.0) == 0.0,
                     "max_abs_diff": _slowest(same["max_abs_diff"]), "loss_max_abs_diff": _slowest(loss_diff),
                     "disk": run.disk(dist.get_rank()), "swappers": run.swappers,
                     "param_swap_dtype": run.param_swap_dtype}
        if twin in params:
            out[name]["equals_cpu_offload"] = _slowest(0.0 if compare(params[name], params[twin])["bit_exact"]
                                                       else 1.0) == 0.0
    return out


def run_phases(args, rank: int, world: int):
    """DeepSpeed's PHASES, one after the other in the calling rank (its default group is set up,
    the zeroplus backend, `args.deepspeed_dir` the swap base directory): each
    phase's variants built, run interleaved for the same rounds and data as zeroplus's, compared
    and freed, so that only one phase's engines and swap buffers are in memory at a time."""
    init_deepspeed(rank, world, "zeroplus")
    record, summary, rss = {}, {}, {}
    for names in PHASES:
        runs = _runs(args, names)
        gen = {name: torch.Generator().manual_seed(rank) for name in runs}
        phase = {name: {k: [] for k in ("compute", "step", "loss", "swap_in_s", "swap_out_s", "bytes_read",
                                        "bytes_written")} for name in runs}
        for round_ in range(args.steps + 1):  # round 0 creates the state: not timed
            _round(runs, gen, args, phase if round_ else None)
        summary.update(_summary(runs, phase))
        record.update(phase)
        rss[" + ".join(names)] = rss_bytes()
        for run in runs.values():
            run.close()
        del runs
        gc.collect()
    return {"deepspeed": record, "deepspeed_summary": summary, "rss": rss}


def table(results, ds_info) -> list[str]:
    """Markdown lines: DeepSpeed's variants in bench_offload's `results` (by world), each against
    its own stage's in-memory run."""
    lines = [f"DeepSpeed {ds_info['version']} (DS_ACCELERATOR={ds_info['accelerator']}), DeepSpeedCPUAdam, same model, "
             "ranks, data and nvme_path; swap s: the training thread inside its swapper calls; GB: what the rank "
             "read / wrote to storage per step (/proc/self/io, fwd+bwd+step); disk: allocated bytes of its swap "
             "files, all ranks (of which parameters)", "",
             "| ranks | variant | fwd+bwd s | step s | step / in-memory step | (fwd+bwd+step) / in-memory | "
             "swap-in s | swap-out s | GB read | GB written | disk GB (params GB) | losses max abs diff | "
             "params equal in-memory (max abs diff) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for world, r in results.items():
        if "error" in r:
            lines.append(f"| {world} | — | error: {r['error']} |")
            continue
        rec, summary = r["deepspeed"], r["deepspeed_summary"]
        for name, row in rec.items():
            base = rec[VARIANTS[name].baseline]
            ref_step, step = _med(base["step"]), _med(row["step"])
            ref_total, total = ref_step + _med(base["compute"]), step + _med(row["compute"])
            s = summary[name]
            disk = s["disk_all_ranks"]
            same = "yes" if s["bit_exact"] else f"NO ({s['max_abs_diff']:.2e})"
            lines.append(f"| {world} | {name} | {_med(row['compute']):.3f} | {step:.3f} | {step / ref_step:.2f} | "
                         f"{total / ref_total:.2f} | {_med(row['swap_in_s']):.3f} | {_med(row['swap_out_s']):.3f} | "
                         f"{_med(row['bytes_read']) / 1e9:.3f} | {_med(row['bytes_written']) / 1e9:.3f} | "
                         f"{disk['all'] / 1e9:.3f} ({disk['parameters'] / 1e9:.3f}) | {s['loss_max_abs_diff']:.2e} | "
                         f"{same} |")
        notes = [f"{n}: swappers {s['swappers']}, parameter swap dtype {s['param_swap_dtype']}"
                 + ("" if "equals_cpu_offload" not in s else
                    f", parameters equal {VARIANTS[n].cpu_twin}'s bit for bit: {s['equals_cpu_offload']}")
                 for n, s in summary.items() if "nvme" in n]
        notes.append("resident memory at the end of each phase (largest rank): " + ", ".join(
            f"{phase} {rss / 2**30:.2f} GiB" for phase, rss in r["rss_max_rank"].items()))
        lines += [f"- ranks {world}: {note}" for note in notes]
    return lines
