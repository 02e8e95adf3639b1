"""The two front-ends of the one ZeRO engine train bit-identically (DESIGN.md §2): the Python
engine (zeroplus.initialize, 2 processes on backend "zeroplus") and the C++ engine through its
LibTorch front-end (zeroplus::zero::initialize, 2 ranks as threads in
$ZEROPLUS_BUILD_DIR/bin/zero_engine_crosscheck, tests/cpp/plugin/zero_engine_crosscheck.cpp).

Each case writes one input file (torch.save: the initial parameters, each rank's batches, the
configuration); both sides train on it and the final parameters, every rank's fp32 master shards
and the clip_grad_norm results must be equal (torch.equal; where they are not, the message names
the first gradient shard or parameter that differs, step by step), and so must the loss scale
after every step. Cases cover stages 1 and 2, fp32, bf16 and fp16 (dynamic and static loss
scaling, with an inf injected into one rank's input at some steps: an overflow both engines must
skip on every rank, halving the scale, which then grows back), AdamW and SGD with
momentum (and nesterov), clipping by explicit calls and by the gradient_clipping option,
gradients accumulated in another dtype than the compute dtype over 2 backward passes per step
(ACCUM: fp32 sums of bf16/fp16 gradients, bf16 sums of fp32 ones), and a
bucket size (100 elements) that makes 4 buckets (a parameter is never split between buckets),
each of whose 2 shards cuts through parameters. Stage 3 (every parameter sharded:
param_persistence_threshold 0, or, in the PERSIST cases, the small ones kept whole by the same
threshold on both sides; the Sequential's children are the units on both sides) compares
the full parameters after every step; its buckets are cut per unit on each side in its own way,
so its gradient shards, masters and clip norms (a sum over buckets) are not compared, and its
cases do not clip.

The "holder" cases train a custom module (_TinyLm: an embedding, a Sequential of blocks, a final
norm and a head, with its own forward) on token ids. At stage 3 the C++ engine shards the blocks
(the Sequential's children: the only calls it can intercept) and keeps tok_emb, ln_f and head
whole on every rank; the Python engine is given the same partitioning: its default units (each
block; each other child of the root) with persistent_modules=["tok_emb", "ln_f", "head"] and
param_persistence_threshold 0. Its forward flattens the tokens to 2-D activations
(rows * length, dim): LibTorch's torch::nn::Linear on an input of more than 2 dimensions computes
matmul, then adds the bias (torch::nn::functional::linear), rounding twice in bf16, where Python's
F.linear (at::linear) folds the input into one addmm and rounds once; on 2-D inputs both call
addmm, so bf16 is compared bit for bit too.
"""

import math
import os
import pathlib
import re
import subprocess

import pytest
import torch
import torch.jit._pickle

from harness import run_pooled

STEPS = 4
ROWS = 6  # per rank and step
WORLD = 2
_REPO = pathlib.Path(__file__).resolve().parents[2]

ADAMW = {"optimizer": "adamw", "lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}
SGD = {"optimizer": "sgd", "lr": 5e-2, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01, "nesterov": False}

# name -> (stage, mixed precision, optimizer, bucket elems, clip per step, gradient_clipping[, model])
CASES = {
    "s1_fp32_adamw": (1, "fp32", ADAMW, 100, [0.0] * STEPS, 0.0),
    "s2_fp32_adamw_clip": (2, "fp32", ADAMW, 100, [0.0, 0.05, 0.0, 0.05], 0.0),
    "s2_fp32_adamw_one_bucket": (2, "fp32", ADAMW, 1 << 22, [0.05] * STEPS, 0.0),
    "s1_bf16_adamw_clip": (1, "bf16", ADAMW, 100, [0.05] * STEPS, 0.0),
    "s2_bf16_adamw_auto_clip": (2, "bf16", ADAMW, 100, [0.0] * STEPS, 0.05),
    "s2_fp32_sgd_clip": (2, "fp32", SGD, 100, [0.0, 0.1, 0.1, 0.0], 0.0),
    "s1_fp32_sgd_nesterov": (1, "fp32", {**SGD, "nesterov": True}, 100, [0.0] * STEPS, 0.0),
    "s2_bf16_sgd": (2, "bf16", SGD, 100, [0.1] * STEPS, 0.0),
    "s3_fp32_adamw": (3, "fp32", ADAMW, 100, [0.0] * STEPS, 0.0),
    "s3_bf16_adamw": (3, "bf16", ADAMW, 1 << 22, [0.0] * STEPS, 0.0),
    "s3_fp32_sgd": (3, "fp32", {**SGD, "nesterov": True}, 100, [0.0] * STEPS, 0.0),
    "s3_holder_fp32_adamw": (3, "fp32", ADAMW, 100, [0.0] * STEPS, 0.0, "holder"),
    "s3_holder_bf16_adamw": (3, "bf16", ADAMW, 1 << 22, [0.0] * STEPS, 0.0, "holder"),
    "s2_holder_fp32_adamw_clip": (2, "fp32", ADAMW, 100, [0.05] * STEPS, 0.0, "holder"),
    "s2_holder_bf16_adamw_clip": (2, "bf16", ADAMW, 100, [0.05] * STEPS, 0.0, "holder"),
    "s1_fp16_adamw_clip_overflow": (1, "fp16", ADAMW, 100, [0.0, 0.05, 0.05, 0.0], 0.0),
    "s2_fp16_adamw_auto_clip_overflow": (2, "fp16", ADAMW, 100, [0.0] * STEPS, 0.05),
    "s2_fp16_sgd_static_overflow": (2, "fp16", SGD, 100, [0.1] * STEPS, 0.0),
    "s3_fp16_adamw_overflow": (3, "fp16", ADAMW, 100, [0.0] * STEPS, 0.0),
    "s3_holder_fp16_adamw": (3, "fp16", ADAMW, 1 << 22, [0.0] * STEPS, 0.0, "holder"),
    "s2_holder_fp16_adamw_clip": (2, "fp16", ADAMW, 100, [0.05] * STEPS, 0.0, "holder"),
    "s3_fp32_adamw_persist": (3, "fp32", ADAMW, 100, [0.0] * STEPS, 0.0),
    "s3_holder_bf16_adamw_persist": (3, "bf16", ADAMW, 1 << 22, [0.0] * STEPS, 0.0, "holder"),
    "s1_bf16_sgd_accum_fp32": (1, "bf16", SGD, 100, [0.0] * STEPS, 0.0),
    "s2_bf16_adamw_accum_fp32_clip": (2, "bf16", ADAMW, 100, [0.05] * STEPS, 0.0),
    "s3_bf16_adamw_accum_fp32": (3, "bf16", ADAMW, 100, [0.0] * STEPS, 0.0),
    "s2_fp16_adamw_accum_fp32": (2, "fp16", ADAMW, 100, [0.0] * STEPS, 0.0),
    "s2_holder_bf16_adamw_accum_fp32": (2, "bf16", ADAMW, 100, [0.05] * STEPS, 0.0, "holder"),
    "s2_fp32_adamw_accum_bf16": (2, "fp32", ADAMW, 100, [0.0] * STEPS, 0.0),
    "s1_fp32_sgd_accum_bf16": (1, "fp32", SGD, 100, [0.0] * STEPS, 0.0),
}
# Cases with gradients accumulated in another dtype than the compute dtype (DeepSpeed's
# data_types.grad_accum_dtype; Options::grad_accum_dtype): (that dtype, backward passes per step,
# each on a chunk of the rank's batch, so later passes add into the accumulators).
ACCUM = {name: (re.search(r"_accum_(fp32|bf16|fp16)", name).group(1), 2) for name in CASES if "_accum_" in name}
# Stage-3 cases with a param_persistence_threshold above 0 (default 0: every parameter a unit holds
# is sharded): the parameters of a unit with at most this many elements stay whole on both sides,
# laid out with their unit. mlp: the biases and the last Linear's weight (51); holder: the norms
# and the biases of the blocks.
PERSIST = {"s3_fp32_adamw_persist": 60, "s3_holder_bf16_adamw_persist": 24}
# fp16 cases: (DeepSpeed fp16 block beside "enabled", [step] -> the rank whose first input element
# is inf at that step (an overflow every rank must skip), or -1, the loss scale after each step
# or None). A window of 2 with hysteresis 1 halves the scale at the overflow and doubles it two
# clean steps after it; hysteresis 2 absorbs the first of two overflows.
_DYN = {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
FP16 = {
    "s1_fp16_adamw_clip_overflow": (_DYN, [-1, 1, -1, -1], [256, 128, 128, 256]),
    "s2_fp16_adamw_auto_clip_overflow": (_DYN, [-1, -1, 0, -1], [256, 512, 256, 256]),
    "s2_fp16_sgd_static_overflow": ({"loss_scale": 128}, [-1, 0, -1, -1], [128] * STEPS),
    "s3_fp16_adamw_overflow": ({"initial_scale_power": 8, "loss_scale_window": 2}, [-1, 1, 1, -1],
                               [256, 256, 128, 128]),
    "s3_holder_fp16_adamw": ({"initial_scale_power": 10}, [-1] * STEPS, None),
    "s2_holder_fp16_adamw_clip": ({"initial_scale_power": 10, "loss_scale_window": 3}, [-1] * STEPS, None),
    "s2_fp16_adamw_accum_fp32": (_DYN, [-1, 1, -1, -1], [256, 128, 128, 256]),
}
HOLDER_PERSISTENT = ["tok_emb", "ln_f", "head"]  # what the C++ engine keeps whole at stage 3
VOCAB, DIM, LAYERS, LEN = 13, 12, 3, 5  # as in zero_engine_crosscheck.cpp


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.Tanh(), torch.nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class _TinyLm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.Sequential(*[_Block() for _ in range(LAYERS)])
        self.ln_f = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids):  # 2-D activations: see the module doc
        return self.head(self.ln_f(self.blocks(self.tok_emb(ids).reshape(-1, DIM))))


def _kind(case) -> str:
    return case[6] if len(case) > 6 else "mlp"


def _model(kind="mlp"):
    if kind == "holder":
        return _TinyLm()
    return torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 17), torch.nn.ReLU(),
                               torch.nn.Linear(17, 3))


def _loss(kind, out, y):
    if kind == "holder":
        return torch.nn.functional.cross_entropy(out.float().reshape(-1, VOCAB), y.reshape(-1))
    return torch.nn.functional.mse_loss(out.float(), y)


def _write_input(path, seed, case, fp16=None, persist=0, device="cpu", accum=None):
    stage, precision, opt, bucket, clip, auto_clip = case[:6]
    kind = _kind(case)
    gen = torch.Generator().manual_seed(seed)
    params = {name: torch.randn(p.shape, generator=gen) * 0.3 for name, p in _model(kind).named_parameters()}
    if kind == "holder":
        inputs = [[torch.randint(VOCAB, (ROWS, LEN), generator=gen) for _ in range(WORLD)] for _ in range(STEPS)]
        targets = [[torch.randint(VOCAB, (ROWS, LEN), generator=gen) for _ in range(WORLD)] for _ in range(STEPS)]
    else:
        inputs = [[torch.randn(ROWS, 7, generator=gen) for _ in range(WORLD)] for _ in range(STEPS)]
        targets = [[torch.randn(ROWS, 3, generator=gen) for _ in range(WORLD)] for _ in range(STEPS)]
    extra = {} if accum is None else {"grad_accum_dtype": accum[0], "micro_batches": accum[1]}
    if fp16 is not None:
        knobs, inject, _ = fp16
        extra["fp16"] = dict(knobs)
        for step, rank in enumerate(inject):
            if rank >= 0:
                inputs[step][rank][0, 0] = float("inf")
    torch.save({**extra, "model": kind, "params": params, "inputs": inputs, "targets": targets, "stage": stage,
                "mixed_precision": precision, **opt, "bucket_elems": bucket, "clip": [float(c) for c in clip],
                "gradient_clipping": float(auto_clip), "persistence_threshold": persist, "device": device}, path)


def _train_python(rank, world, paths):
    """Each case on the Python engine; rank 0 returns {path: (params, norms)}."""
    import zeroplus

    torch.set_num_threads(1)  # as the C++ side: no reduction order depends on the thread count
    out = {}
    for path in paths:
        cfg = torch.load(path)
        kind = cfg["model"]
        device = torch.device(cfg.get("device", "cpu"))
        model = _model(kind)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(cfg["params"][name])
        model.to(device)
        if cfg["optimizer"] == "adamw":
            cls, hyper = torch.optim.AdamW, dict(lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"],
                                                 weight_decay=cfg["weight_decay"])
        else:
            cls, hyper = torch.optim.SGD, dict(lr=cfg["lr"], momentum=cfg["momentum"], dampening=cfg["dampening"],
                                               weight_decay=cfg["weight_decay"], nesterov=cfg["nesterov"])
        config = {"zero_optimization": {"reduce_bucket_size": cfg["bucket_elems"]}}
        if "grad_accum_dtype" in cfg:
            config["data_types"] = {"grad_accum_dtype": cfg["grad_accum_dtype"]}
        if cfg["stage"] == 3:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = cfg["persistence_threshold"]
        if cfg["gradient_clipping"] > 0:
            config["gradient_clipping"] = cfg["gradient_clipping"]
        if cfg["mixed_precision"] == "fp16":
            config["fp16"] = {"enabled": True, **cfg.get("fp16", {})}
        precision = None if cfg["mixed_precision"] == "fp32" else cfg["mixed_precision"]
        if kind == "holder" and cfg["stage"] == 3:
            hyper["persistent_modules"] = HOLDER_PERSISTENT
        model, opt = zeroplus.initialize(model, cls, stage=cfg["stage"], mixed_precision=precision, config=config,
                                         **hyper)
        assert cfg["stage"] == 3 or cfg["bucket_elems"] > 1000 or len(opt.buckets) >= 4, len(opt.buckets)
        if kind == "holder" and cfg["stage"] == 3:  # the C++ engine's partitioning (it checks its own)
            name_of = {id(p): n for n, p in model.named_parameters()}
            whole = sorted(name_of[id(e.param)] for b in opt.buckets if b.persistent for e in b.entries)
            assert whole == sorted(n for n in name_of.values() if not n.startswith("blocks.")
                                   or cfg["params"][n].numel() <= cfg["persistence_threshold"]), whole
        norms, trace, scales = [], {}, []
        for step in range(STEPS):
            x, y = cfg["inputs"][step][rank].to(device), cfg["targets"][step][rank].to(device)
            opt.zero_grad()
            # bf16: the engine's forward pre-hook casts x (the C++ program casts it itself)
            for xm, ym in zip(x.chunk(cfg.get("micro_batches", 1)), y.chunk(cfg.get("micro_batches", 1))):
                opt.backward(_loss(kind, model(xm), ym))
            for b, shard in enumerate(opt.gradient_shards()):
                trace[f"grad.{step}.{b}"] = shard.cpu().clone()
            clip = cfg["clip"][step]
            norms.append(opt.clip_grad_norm_(clip).item() if clip > 0 else math.nan)
            opt.step()
            scales.append(float(opt.loss_scale))
            # full_state_dict: at stage 3 the parameters are shards between uses
            for n, p in zeroplus.full_state_dict(model, rank0_only=False).items():
                trace[f"param.{step}.{n}"] = p.detach().cpu().clone()
        masters = {f"{rank}.{b}": m.detach().cpu().clone() for b, m in enumerate(opt.masters)}
        params = {n: p.cpu() for n, p in zeroplus.full_state_dict(model, rank0_only=False).items()}
        out[path] = (params, norms, trace, masters, scales)
    return out


def _program() -> pathlib.Path:
    build = pathlib.Path(os.environ.get("ZEROPLUS_BUILD_DIR") or _REPO / "build")
    return build / "bin" / "zero_engine_crosscheck"


def _first_difference(py_trace, cpp_trace, params_only=False) -> str:
    """The first gradient shard (after backward) or parameter (after the step) that differs."""
    def order(key):
        kind, step, rest = key.split(".", 2)
        return int(step), kind != "grad", rest
    for key in sorted(py_trace, key=order):
        if params_only and not key.startswith("param."):
            continue
        if key not in cpp_trace:
            return f"{key} is missing on the C++ side"
        a, b = py_trace[key], cpp_trace[key]
        if a.shape != b.shape or not torch.equal(a, b):
            diff = (a.float() - b.float()).abs() if a.shape == b.shape else None
            where = "" if diff is None else f", {int((diff > 0).sum())} elements, max {diff.max().item():.3g}"
            return f"{key} (shapes {tuple(a.shape)}/{tuple(b.shape)}{where})"
    return "none in the trace"


def test_python_and_cpp_engines_train_bit_identically(tmp_path):
    program = _program()
    if not program.exists():
        # scripts/test.sh exports ZEROPLUS_BUILD_DIR after building it: a missing program there is a failure
        message = f"{program} is not built (scripts/build.sh builds it with the GoogleTests)"
        if os.environ.get("ZEROPLUS_BUILD_DIR"):
            pytest.fail(message)
        pytest.skip(message)
    check_engines_agree(tmp_path, list(CASES), "cpu", lambda fn, *args: run_pooled(fn, WORLD, *args, timeout=180))


def _run_cpp(program, names, paths, outs, tmp_path, processes: bool) -> dict:
    """The C++ engine on every case: {name: rank 0's result, with every rank's "masters"}. Ranks as
    threads of one process, or (processes) one process per rank meeting through a FileStore, which
    CUDA training needs (zero_engine_crosscheck.cpp says why)."""
    def load(path):
        # torch::pickle_save tags typed containers (Dict[str, Tensor]) for TorchScript
        with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
            return torch.load(path)
    if not processes:
        argv = [str(program)]
        for name in names:
            argv += [paths[name], outs[name]]
        cpp = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert cpp.returncode == 0, f"{program} failed ({cpp.returncode}):\n{cpp.stdout}\n{cpp.stderr}"
        return {name: load(outs[name]) for name in names}
    store = tmp_path / "cpp.store"
    procs = []
    for rank in range(WORLD):
        argv = [str(program), "--rank", str(rank), "--world", str(WORLD), "--store", str(store)]
        for name in names:
            argv += [paths[name], f"{outs[name]}.{rank}"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"{program} rank {rank} failed ({p.returncode}):\n{logs[rank]}"
    results = {}
    for name in names:
        per_rank = [load(f"{outs[name]}.{rank}") for rank in range(WORLD)]
        for rank in range(1, WORLD):
            for key, value in per_rank[0]["params"].items():
                assert torch.equal(value, per_rank[rank]["params"][key]), f"{name}: C++ ranks 0 and {rank} ended " \
                                                                          f"with different values of {key}"
            per_rank[0]["masters"].update(per_rank[rank]["masters"])
        results[name] = per_rank[0]
    return results


def check_engines_agree(tmp_path, names, device, run_ranks, cpp_processes=False):
    """Trains the cases `names` on `device` through both engines (the C++ program, with its ranks
    as threads or, cpp_processes, as processes; then the Python engine on WORLD ranks started by
    run_ranks(fn, *args)) and asserts they agree bit for bit."""
    program = _program()
    paths, outs = {}, {}
    for seed, (name, case) in enumerate(CASES.items()):
        if name not in names:
            continue
        paths[name] = str(tmp_path / f"{name}.in.pt")
        outs[name] = str(tmp_path / f"{name}.out.pt")
        _write_input(paths[name], seed, case, FP16.get(name), PERSIST.get(name, 0), device, ACCUM.get(name))
    cpp_results = _run_cpp(program, names, paths, outs, tmp_path, cpp_processes)
    ranks = run_ranks(_train_python, list(paths.values()))
    python = ranks[0]

    mismatches = []
    for name in names:
        py_params, py_norms, py_trace, py_masters, py_scales = python[paths[name]]
        py_masters = {k: v for r in ranks for k, v in r[paths[name]][3].items()}
        result = cpp_results[name]
        cpp_params, cpp_norms = result["params"], result["norms"].tolist()
        assert set(cpp_params) == set(py_params), name
        for key, value in py_params.items():
            if not torch.equal(value, cpp_params[key]):
                diff = (value.float() - cpp_params[key].float()).abs().max().item()
                mismatches.append(f"{name}: {key} differs (dtype {value.dtype}/{cpp_params[key].dtype}, max |diff| "
                                  f"{diff:.3g})")
        stage3 = CASES[name][0] == 3
        cpp_masters = result["masters"]
        if not stage3:  # stage 3's buckets are cut differently on each side (module doc)
            assert set(cpp_masters) == set(py_masters), (name, sorted(cpp_masters), sorted(py_masters))
            for key, value in py_masters.items():
                if value.dtype != torch.float32 or not torch.equal(value, cpp_masters[key]):
                    mismatches.append(f"{name}: master shard {key} (rank.bucket) differs")
        if any(not torch.equal(v, cpp_params[k]) for k, v in py_params.items()):
            mismatches.append(f"{name}: first difference: {_first_difference(py_trace, result['trace'], stage3)}")
        elif stage3:  # every step's parameters, not only the last
            first = _first_difference(py_trace, result["trace"], params_only=True)
            if first != "none in the trace":
                mismatches.append(f"{name}: first difference: {first}")
        same_norms = all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(py_norms, cpp_norms))
        if len(py_norms) != len(cpp_norms) or not same_norms:
            mismatches.append(f"{name}: clip norms differ: python {py_norms}, C++ {cpp_norms}")
        if result["scales"].tolist() != py_scales:
            mismatches.append(f"{name}: loss scales differ: python {py_scales}, C++ {result['scales'].tolist()}")
        if name in FP16 and FP16[name][2] is not None:  # the injected overflows were skipped, the scale moved
            assert py_scales == [float(x) for x in FP16[name][2]], (name, py_scales)
        assert any(not math.isnan(n) for n in py_norms) == any(c > 0 for c in CASES[name][4])
    assert not mismatches, "\n".join(mismatches)
