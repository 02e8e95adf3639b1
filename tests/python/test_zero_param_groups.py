"""The user's own torch optimizer and its param groups, at every ZeRO stage (issue 38, item 1).

A DDP fine-tuning script (groups: decay / no decay / embedding at its own lr; torch AdamW with
betas; a LambdaLR warm-up built on the returned optimizer; a frozen positional embedding; torch's
clip_grad_norm_(model.parameters(), ...); model.state_dict() saved) runs with ONLY its wrap line
changed (at stage 3 model.state_dict() raises naming zeroplus.full_state_dict, which it then
calls; with gradients spilled to NVMe torch's clip raises naming opt.clip_grad_norm_),

    model = DDP(model)                                     # reference
    model, opt = zeroplus.initialize(model, opt, stage=S)  # the swap

at stages 1, 2, 3 x fp32/bf16; losses, clip norms, per-group lrs and final weights must equal
DDP + torch AdamW (fp32: 1e-5; bf16: within a quarter of how far the reference moved). Stage 3 uses
param_persistence_threshold=0 and asserts that the parameters really are shards between steps.
Before the change initialize(model, opt) raised TypeError (an instance is not a class), the
shorthand's params= raised "multiple values for argument 'params'", and nothing else below ran.

Further cases in the same launch: the class shorthand with params= groups; a parameter with
requires_grad=True that no group names (never stepped, as under DDP with torch's optimizer); a
scheduler built on the ORIGINAL optimizer before initialize (rebound: it steps the engine's
groups, without torch's "lr_scheduler.step() before optimizer.step()" warning); state the
original already had (one step taken before initialize) taken over; the retired original's
methods and add_param_group raising; ZeroRedundancyOptimizer(groups, stage=2); groups through
zeroplus.save_checkpoint / load_checkpoint, resharded from 2 ranks to 1 and to another stage.
Every case runs in ONE 2-rank launch (module fixture), each in its own process group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import pytest
import torch
from torch import nn

from harness import run_cases_in_own_groups, run_distributed

VOCAB, DIM, SEQ = 24, 16, 6
LR, WD, EMB_LR, BETAS, MAX_NORM = 1e-2, 0.1, 3e-3, (0.9, 0.95), 0.5
STEPS, WARMUP = 6, 3
STAGES = (1, 2, 3)
PRECISIONS = (None, "bf16")


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1, requires_grad=False)  # frozen
        self.up = nn.Linear(DIM, 2 * DIM)
        self.norm = nn.LayerNorm(2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.embed(x) + self.pos
        h = h + self.down(torch.tanh(self.norm(self.up(h))))
        return self.head(h)


def _groups(model):
    """What fine-tuning scripts write: no decay on biases and norms, the embedding at its own lr."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or name.startswith("embed."):
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": WD},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": [model.embed.weight], "lr": EMB_LR, "weight_decay": 0.0}]


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4, SEQ), generator=g)


def _warmup(s):
    return min(1.0, (s + 1) / WARMUP)


def _backward(opt, loss):
    """loss.backward(); fp16 at zeroplus: opt.backward(loss) (it carries the dynamic loss scale)."""
    if getattr(opt, "mixed_precision", None) == "fp16":
        opt.backward(loss)
    else:
        loss.backward()


# -- the script's clip and save lines: torch's own calls, as under DDP ----------------------------

def _clip(model, opt):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM), the script's line, under DDP
    and under zeroplus alike (p.grad: views at stage 1, ShardedGrad at stages 2-3)."""
    try:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    except RuntimeError as e:
        # Gradients spilled to files (offload_param "nvme" with offload_optimizer) are not in
        # memory: torch's line raises, before clipping anything, naming the zeroplus call
        # (docs/zero.md's table), which the script then makes.
        if "lives in the offload tier" not in str(e) or "opt.clip_grad_norm_" not in str(e):
            raise
        return float(opt.clip_grad_norm_(MAX_NORM))


def _saved_weights(model):
    """model.state_dict() as the script saves it (DDP: model.module's). At stage 3 that line raises
    naming zeroplus.full_state_dict (parameters are shards between steps; docs/zero.md's table),
    which the script then calls instead."""
    import zeroplus
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return {k: v.detach().float().clone() for k, v in model.module.state_dict().items()}
    if getattr(getattr(model, "_zeroplus_engine", lambda: None)(), "stage", None) == 3:
        with pytest.raises(RuntimeError, match=r"zeroplus\.full_state_dict"):
            model.state_dict()
        return {k: v.float() for k, v in zeroplus.full_state_dict(model, rank0_only=False).items()}
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


# -- the script ---------------------------------------------------------------------------------

def _script(rank, wrap, *, optimizer="instance", scheduler_first=False, pre_step=False, left_out=False, accumulate=1):
    """The fine-tuning script; `wrap(model, opt)` is its one changed line. Returns what it saw."""
    torch.manual_seed(0)
    model = TinyLM()
    groups = _groups(model)
    if left_out:  # requires_grad stays True, but no group names it: never stepped
        groups[0]["params"] = [p for p in groups[0]["params"] if p is not model.up.weight]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, weight_decay=WD)
    if pre_step:  # the original already has state (identical on every rank: same data)
        x, y = _batch(99, 0)
        nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    original, sched = opt, None
    if scheduler_first:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    model, opt = wrap(model, opt if optimizer == "instance" else _groups(model))  # groups: the shorthand's params=
    if sched is None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    sharded = _sharded(model, opt)
    losses, norms, lrs = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            for micro in range(accumulate):  # the first accumulate-1 micro-batches under model.no_sync()
                x, y = _batch(step + 50 * micro, rank)
                with model.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                    loss = nn.functional.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
                    _backward(opt, loss / accumulate)
            norms.append(_clip(model, opt))
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            lrs.append([g["lr"] for g in opt.param_groups])
    sched_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    # The left-out parameter's .grad: DDP averages it over ranks (opt.zero_grad leaves it: it
    # accumulates over the steps under both).
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    left_grad = module.up.weight.grad.detach().float().clone() if left_out else None
    return {"left_out_grad": left_grad, "losses": losses, "norms": norms, "lrs": lrs, "weights": _saved_weights(model), "sharded": sharded,
            "sched_warnings": sched_warnings, "original": original, "opt": opt, "model": model}


def _sharded(model, opt) -> list[str]:
    """The parameters a stage-3 engine holds sharded between steps (checkpoint_models' rule)."""
    from checkpoint_models import sharded_names
    return sharded_names(model, opt)




def _ddp(group):
    def wrap(model, opt):
        return nn.parallel.DistributedDataParallel(model, process_group=group), opt
    return wrap


def _zero(group, stage, precision, offload_dir=None):
    import zeroplus
    kwargs = dict(stage=stage, mixed_precision=precision, process_group=group)
    if offload_dir is not None:  # optimizer state (and at stage 3 the parameters) on NVMe files
        nvme = {"device": "nvme", "nvme_path": offload_dir, "buffer_count": 4}
        kwargs["offload_optimizer"] = dict(nvme)
        if stage == 3:
            kwargs["offload_param"] = dict(nvme)
    if stage == 3:
        kwargs["param_persistence_threshold"] = 0

    def wrap(model, opt):
        if isinstance(opt, torch.optim.Optimizer):
            return zeroplus.initialize(model, opt, **kwargs)  # THE line
        return zeroplus.initialize(model, torch.optim.AdamW, params=opt, lr=LR, betas=BETAS, weight_decay=WD,
                                   **kwargs)
    return wrap


def _summary(run):
    return {k: run[k] for k in ("losses", "norms", "lrs", "weights", "sharded", "sched_warnings", "left_out_grad")}


def _case_reference(rank, group, **script):
    return _summary(_script(rank, _ddp(group), **script))


def _case_swap(rank, group, stage, precision, offload_dir=None, **script):
    if offload_dir is not None:
        offload_dir = os.path.join(offload_dir, f"nvme{stage}_{rank}")
        os.makedirs(offload_dir, exist_ok=True)
    return _summary(_script(rank, _zero(group, stage, precision, offload_dir), **script))


def _case_original_retired(rank, group, stage):
    """The retired original raises on its methods; the engine's add_param_group names why."""
    run = _script(rank, _zero(group, stage, None), scheduler_first=True)
    raised = {}
    for call in ("step", "zero_grad", "state_dict"):
        try:
            getattr(run["original"], call)()
            raised[call] = None
        except RuntimeError as e:
            raised[call] = str(e)
    extra = nn.Parameter(torch.zeros(3))
    for who in ("original", "opt"):
        try:
            run[who].add_param_group({"params": [extra]})
            raised[f"{who}.add_param_group"] = None
        except (RuntimeError, NotImplementedError) as e:
            raised[f"{who}.add_param_group"] = str(e)
    return raised


def _case_zero_redundancy_groups(rank, group, stage):
    """ZeroRedundancyOptimizer(groups, stage=1|2) over the same script's groups: stage 1 is torch's
    class beside the DDP wrap, stage 2 the engine without one."""
    import zeroplus

    def wrap(model, opt):
        if stage == 1:
            model = nn.parallel.DistributedDataParallel(model, process_group=group)
        return model, zeroplus.ZeroRedundancyOptimizer(opt.param_groups, torch.optim.AdamW, process_group=group,
                                                       stage=stage, lr=LR, betas=BETAS, weight_decay=WD)
    return _summary(_script(rank, wrap))


def _case_checkpoint(rank, group, save_stage, load_stage, directory):
    """Groups through save_checkpoint at 2 ranks (stage save_stage) and load_checkpoint on a 1-rank
    group (rank 0, stage load_stage): weights, per-group hyperparameters (the scheduler moved the
    lrs) and the plain optimizer state come back."""
    import torch.distributed as dist
    import zeroplus

    path = os.path.join(directory, f"groups_{save_stage}_{load_stage}")
    run = _script(rank, _zero(group, save_stage, None))
    run["opt"].consolidate_state_dict(0)
    saved_state = run["opt"].state_dict() if rank == 0 else None
    zeroplus.save_checkpoint(path, run["model"], run["opt"])
    solo = dist.new_group([0])
    if rank != 0:
        return None
    torch.manual_seed(1)
    model = TinyLM()
    opt = torch.optim.AdamW(_groups(model), lr=0.5, betas=(0.5, 0.5), weight_decay=0.0)
    model, opt = zeroplus.initialize(model, opt, stage=load_stage, process_group=solo,
                                     **({"param_persistence_threshold": 0} if load_stage == 3 else {}))
    zeroplus.load_checkpoint(path, model, opt)
    opt.consolidate_state_dict(0)
    return {"saved_weights": run["weights"], "loaded_weights": _saved_weights(model),
            "saved_state": saved_state, "loaded_state": opt.state_dict(),
            "groups": [{k: g[k] for k in ("lr", "weight_decay", "betas")} for g in opt.param_groups]}


def _cases(directory):
    cases = {("reference",): functools.partial(_case_reference),
             ("reference", "pre_step"): functools.partial(_case_reference, pre_step=True),
             ("reference", "left_out"): functools.partial(_case_reference, left_out=True),
             ("reference", "left_out_accumulate"): functools.partial(_case_reference, left_out=True, accumulate=2)}
    for stage in STAGES:
        for precision in PRECISIONS:
            cases[("swap", stage, precision)] = functools.partial(_case_swap, stage=stage, precision=precision)
        cases[("shorthand", stage)] = functools.partial(_case_swap, stage=stage, precision=None, optimizer="groups")
        cases[("left_out", stage)] = functools.partial(_case_swap, stage=stage, precision=None, left_out=True)
        cases[("left_out_accumulate", stage)] = functools.partial(_case_swap, stage=stage, precision=None,
                                                                  left_out=True, accumulate=2)
        cases[("scheduler_first", stage)] = functools.partial(_case_swap, stage=stage, precision=None,
                                                              scheduler_first=True)
        cases[("pre_step", stage)] = functools.partial(_case_swap, stage=stage, precision=None, pre_step=True)
        cases[("retired", stage)] = functools.partial(_case_original_retired, stage=stage)
    for stage, precision in ((2, "fp16"), (3, "fp16"), (2, None), (3, "bf16")):
        cases[("offload", stage, precision)] = functools.partial(_case_swap, stage=stage, precision=precision,
                                                                 offload_dir=directory)
    for stage in (1, 2):
        cases[("zero_redundancy", stage)] = functools.partial(_case_zero_redundancy_groups, stage=stage)
    for save_stage, load_stage in ((3, 1), (1, 3), (2, 2)):
        cases[("checkpoint", save_stage, load_stage)] = functools.partial(
            _case_checkpoint, save_stage=save_stage, load_stage=load_stage, directory=directory)
    return cases


def _all_cases(rank, world, directory):
    return run_cases_in_own_groups(rank, world, _cases(directory))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_all_cases, 2, str(tmp_path_factory.mktemp("groups")), timeout=600)


def _ok(results, case):
    out = []
    for r, res in enumerate(results):
        status, value = res[case]
        assert status == "ok", f"rank {r}:\n{value}"
        out.append(value)
    return out


def _assert_like_reference(res, ref, precision, case):
    if precision is None:
        tol = lambda moved: 1e-5  # noqa: E731
    else:  # bf16 compute: within a quarter of how far the reference moved the tensor
        # (plus one bf16 rounding of the tensor's largest value: the parameter itself is bf16)
        tol = lambda moved: 0.25 * moved + 2.0 ** -8 * want.abs().max().item()  # noqa: E731
    rel = 1e-5 if precision is None else 3e-2
    assert res["losses"] == pytest.approx(ref["losses"], rel=rel, abs=1e-6), case
    assert res["norms"] == pytest.approx(ref["norms"], rel=rel if precision is None else 0.1, abs=1e-6), case
    assert res["lrs"] == ref["lrs"], case  # the schedule of every group, exactly
    for name, want in ref["weights"].items():
        got = res["weights"][name]
        assert got.shape == want.shape, (case, name)
        diff = (got - want).abs().max().item()
        moved = max((want - _INITIAL[name]).abs().max().item(), 1e-12)
        assert diff <= tol(moved), f"{case}: {name} differs from DDP by {diff:.3g} (reference moved {moved:.3g})"


def _initial_weights():
    with torch.random.fork_rng():  # the script's seed, without touching this process's RNG
        torch.manual_seed(0)
        return {k: v.detach().float().clone() for k, v in TinyLM().state_dict().items()}


_INITIAL = _initial_weights()
_FULL = sorted(_INITIAL)  # every parameter's name (TinyLM has no buffers)


SWAPS = [("swap", s, p) for s in STAGES for p in PRECISIONS]


@pytest.mark.parametrize("case", SWAPS, ids=lambda c: f"stage{c[1]}-{c[2] or 'fp32'}")
def test_one_line_swap_trains_like_ddp(results, case):
    refs = _ok(results, ("reference",))
    for rank, res in enumerate(_ok(results, case)):
        _assert_like_reference(res, refs[rank], case[2], case)
        assert res["sched_warnings"] == [], res["sched_warnings"]
        # stage 3 really shards every parameter (threshold 0); stages 1-2 keep them whole
        assert res["sharded"] == (_FULL if case[1] == 3 else []), res["sharded"]
    # the groups really differ: decay vs no decay vs the embedding's lr
    assert refs[0]["lrs"][-1] == [LR, LR, EMB_LR]


OFFLOADS = [("offload", 2, "fp16"), ("offload", 3, "fp16"), ("offload", 2, None), ("offload", 3, "bf16")]


@pytest.mark.parametrize("case", OFFLOADS, ids=lambda c: f"stage{c[1]}-{c[2] or 'fp32'}-nvme")
def test_groups_with_fp16_and_offload(results, case):
    """fp16 (dynamic loss scaling, opt.backward) and NVMe offload of optimizer state (and
    parameters at stage 3) with the script's groups: like DDP, to the precision's tolerance."""
    refs = _ok(results, ("reference",))
    for rank, res in enumerate(_ok(results, case)):
        _assert_like_reference(res, refs[rank], case[2], case)
        assert res["sharded"] == (_FULL if case[1] == 3 else []), res["sharded"]


@pytest.mark.parametrize("kind,ref_key", [("shorthand", ("reference",)), ("left_out", ("reference", "left_out")),
                                          ("scheduler_first", ("reference",)),
                                          ("pre_step", ("reference", "pre_step")),
                                          ("left_out_accumulate", ("reference", "left_out_accumulate"))])
@pytest.mark.parametrize("stage", STAGES)
def test_groups_variants_train_like_ddp(results, kind, ref_key, stage):
    refs = _ok(results, ref_key)
    for rank, res in enumerate(_ok(results, (kind, stage))):
        _assert_like_reference(res, refs[rank], None, (kind, stage))
        assert res["sched_warnings"] == [], res["sched_warnings"]
    if kind.startswith("left_out"):  # not in any group: not stepped (under DDP as under zeroplus)
        assert torch.equal(refs[0]["weights"]["up.weight"], _INITIAL["up.weight"])
        for rank, res in enumerate(_ok(results, (kind, stage))):  # its .grad: DDP's average
            want = refs[rank]["left_out_grad"]
            assert (res["left_out_grad"] - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("stage", STAGES)
def test_original_optimizer_is_retired(results, stage):
    for raised in _ok(results, ("retired", stage)):
        for call in ("step", "zero_grad", "state_dict", "original.add_param_group"):
            assert raised[call] is not None and "zeroplus.initialize" in raised[call], (call, raised[call])
        engine_says = raised["opt.add_param_group"]
        assert engine_says is not None and "pass every group up front" in engine_says


@pytest.mark.parametrize("stage", (1, 2))
def test_zero_redundancy_optimizer_groups(results, stage):
    refs = _ok(results, ("reference",))
    for rank, res in enumerate(_ok(results, ("zero_redundancy", stage))):
        _assert_like_reference(res, refs[rank], None, ("zero_redundancy", stage))


@pytest.mark.parametrize("save_stage,load_stage", [(3, 1), (1, 3), (2, 2)])
def test_groups_survive_checkpoint_and_reshard(results, save_stage, load_stage):
    res = _ok(results, ("checkpoint", save_stage, load_stage))[0]
    for name, want in res["saved_weights"].items():
        assert torch.equal(res["loaded_weights"][name], want), name
    assert [g["lr"] for g in res["groups"]] == [LR, LR, EMB_LR]
    assert [g["weight_decay"] for g in res["groups"]] == [WD, 0.0, 0.0]
    assert all(tuple(g["betas"]) == BETAS for g in res["groups"])
    from checkpoint_helpers import optimizer_state_diffs
    assert optimizer_state_diffs(res["saved_state"], res["loaded_state"]) == []


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def _gpt2_groups(model):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.ndim >= 2 and "wte" not in n], "weight_decay": WD},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0},
            {"params": [p for n, p in named if "wte" in n], "lr": EMB_LR, "weight_decay": 0.0}]


def test_groups_with_tensor_parallel(one_rank_group):
    """tensor_parallel=mesh replaces the model's Parameters with DTensor ones: the instance's groups
    (and a scheduler built on it before initialize) must follow them (a (1, 1) mesh: one process).
    Before: the engine stepped the replaced Parameters and the model never moved."""
    import copy

    import zeroplus
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    ref = _tiny_gpt2()
    model = copy.deepcopy(ref)
    # SGD: Adam would amplify c_attn's key bias's gradient, rounding noise around an exact zero
    # (softmax ignores it), into full-size steps of either sign.
    ref_opt = torch.optim.SGD(_gpt2_groups(ref), lr=LR, momentum=0.9)
    opt = torch.optim.SGD(_gpt2_groups(model), lr=LR, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _warmup)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)  # on the original, before initialize
    model, opt = zeroplus.initialize(model, opt, stage=1, tensor_parallel=mesh)
    assert any(isinstance(p, DTensor) for p in model.parameters())
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        for m, o, s in ((model, opt, sched), (ref, ref_opt, ref_sched)):
            m(ids, labels=ids).loss.backward()
            o.step()
            s.step()
            o.zero_grad()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    diffs = {n: ((p.full_tensor() if isinstance(p, DTensor) else p) - q).abs().max().item()
             for (n, p), q in zip(model.named_parameters(), ref.parameters())}
    moved = {n: (q - p0).abs().max().item() for (n, q), p0 in zip(ref.named_parameters(), _tiny_gpt2().parameters())}
    assert max(diffs.values()) <= 1e-5, sorted(((d, n, moved[n]) for n, d in diffs.items()), reverse=True)[:4]


def test_refusals_name_the_argument_and_change_nothing(one_rank_group):
    """Every refused combination raises ValueError/TypeError naming what to do; the model and the
    user's optimizer are untouched (the optimizer still steps as plain torch)."""
    import zeroplus

    torch.manual_seed(0)
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(_groups(model), lr=LR)
    stranger = nn.Parameter(torch.zeros(3))
    init, adamw = zeroplus.initialize, torch.optim.AdamW
    not_in_model = "param group 0 has a parameter of shape \\(3,\\) that is not a parameter of model"
    cases = [
        (lambda: init(model, opt, stage=2, lr=0.5), ValueError, r"\['lr'\] given beside an optimizer instance"),
        (lambda: init(model, opt, stage=2, params=_groups(model)), ValueError, "params= is for an optimizer class"),
        (lambda: init(model, opt, stage=2, config={"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}),
         ValueError, r"config\['optimizer'\] and an optimizer instance"),
        (lambda: init(model, adamw, stage=1, lr=LR, params=[{"params": [stranger]}]), ValueError, not_in_model),
        (lambda: init(model, adamw, stage=1, lr=LR, params=[{"params": [("x", stranger)]}]), ValueError, not_in_model),
        (lambda: init(model, adamw, stage=1, lr=LR, params={"params": []}), TypeError, "params must be an iterable"),
        (lambda: init(model, adamw, stage=1, lr=LR, params=[]), ValueError, "params is empty"),
        (lambda: zeroplus.ZeroRedundancyOptimizer(_groups(model), adamw, stage=3, lr=LR), ValueError,
         r"stage=3 needs the model .* zeroplus.initialize\(model, opt, stage=3\)"),
    ]
    for call, kind, match in cases:
        with pytest.raises(kind, match=match):
            call()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert not any(getattr(p, "_zeroplus_managed", False) for p in model.parameters())
    x, y = _batch(0, 0)
    nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    opt.step()  # not retired: still the user's torch optimizer
    assert not torch.equal(model.state_dict()["head.weight"], before["head.weight"])


def test_named_parameter_groups(one_rank_group):
    """torch.optim's (name, parameter) form, as the shorthand's params= and inside an instance
    (one rank: the engine against plain torch AdamW on a copy, two steps)."""
    import copy

    import zeroplus

    for stage, form in ((1, "shorthand"), (3, "instance")):
        torch.manual_seed(0)
        model = TinyLM()
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.named_parameters(), lr=LR)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if form == "shorthand":
            model, opt = zeroplus.initialize(model, torch.optim.AdamW, params=named, lr=LR, stage=stage)
        else:
            model, opt = zeroplus.initialize(model, torch.optim.AdamW(named, lr=LR), stage=stage,
                                             param_persistence_threshold=0)
        _two_steps_side_by_side((model, opt), (ref, ref_opt))
        mine = _saved_weights(model)
        worst = max((mine[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        assert worst <= 1e-6, (stage, form, worst)


def _two_steps_side_by_side(*runs):
    """Two one-rank steps of each (model, optimizer) on the same batches."""
    for step in range(2):
        x, y = _batch(step, 0)
        for m, o in runs:
            nn.functional.cross_entropy(m(x).float().reshape(-1, VOCAB), y.reshape(-1)).backward()
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_foreach_and_fused_flags_are_taken(one_rank_group, flag):
    """An instance built with foreach=True or fused=True: its groups carry the flag; the engine
    runs (zeroplus's fused kernel for AdamW) and steps as torch's AdamW does (one rank, two steps)."""
    import copy

    import zeroplus

    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=LR, betas=BETAS)
    model, opt = zeroplus.initialize(model, torch.optim.AdamW(_groups(model), lr=LR, betas=BETAS, **{flag: True}),
                                     stage=2)
    assert all(g[flag] is True for g in opt.param_groups)
    _two_steps_side_by_side((model, opt), (ref, ref_opt))
    worst = max((model.state_dict()[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    assert worst <= 1e-6, worst
