"""Parameters that get no gradient in a step, at every ZeRO stage and precision.

Reference: DistributedDataParallel(find_unused_parameters=True) + torch.optim.AdamW. torch skips a
parameter whose .grad is None (no weight decay, moments untouched, its own step count); DDP leaves
a parameter no rank used without a gradient and averages one used on some ranks with zeros. Before
the fix, stages 2-3 stepped unused parameters anyway (weight decay, moment decay, one shared step
count) and stage 1 fp32 (DDP without find_unused_parameters) never all-reduced the bucket holding
them, so ranks stepped with their own gradients and clip norms differed per rank.

Sizes: models of a few hundred to a few thousand parameters and six steps: weight_decay=0.1 and
lr=1e-3 make a wrongly stepped parameter move by lr*wd*|w| ~ 1e-5..1e-4 in one step (above the 1e-5
fp32 tolerance after the next update), and a wrong step count changes Adam's bias correction by
far more. Every case of every stage runs in ONE 2-rank launch (module fixture); each is reported
as its own test.

Stage 3 shards what it tests (tests/README.md; asserted on every rank with sharding.assert_sharded).
A model whose every rank runs the same modules (BranchModel: `branch` on odd steps everywhere,
`never` nowhere) is sharded whole (threshold 0). A rank-dependent module (LocalHeadModel's `aux`,
MoEModel's experts) cannot be gathered on some ranks only: stage 3 agrees every gather and raises
RankDivergenceError (docs/zero.md, "Rank-divergent execution"); the documented remedy keeps it
whole with param_persistence_threshold at its largest parameter, so those models keep the
divergent module small (8 and 32 elements) and their trunk larger: the trunk is sharded and
asserted, the divergent module asserted whole, and the result compared with DDP. The same models
with the divergent module sharded too (threshold 0) must raise RankDivergenceError on every rank,
naming the module and the ranks, and leave the group usable.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
from torch import nn

from harness import run_cases_in_own_groups, run_distributed
from sharding import assert_sharded, sharded_names

LR, WD, STEPS = 1e-3, 0.1, 6
STAGES = (1, 2, 3)
PRECISIONS = (None, "bf16")


class BranchModel(nn.Module):
    """`branch` runs on odd steps only (the issue's reproduction); `never` is never used."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.use_branch = False

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if self.use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


class LocalHeadModel(nn.Module):
    """`aux` is used on rank 0 only: DDP averages its gradient with rank 1's zeros. It reads two of
    the trunk's features, so its largest parameter (8) is below every trunk and head weight: at
    stage 3 a threshold of 8 keeps `aux` whole and shards trunk.weight, trunk.bias, head.weight."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(2, 4)
        self.rank = 0

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        return out + self.aux(h[:, :2]) if self.rank == 0 else out


# Experts each step may route to on (rank 0, rank 1) (top-1 among them; a stand-in for capacity
# limits): on every rank expert 3 idles at steps 0-3, expert 2 at steps 0, 1 and 5, expert 0 at
# steps 3 and 5; at steps 1, 3 and 5 rank 1 may use fewer experts than rank 0, so an expert is
# used on one rank and not the other (the test checks that this happened, from the experts the
# reference ran). Within the allowed set the router's choice depends on the data. (One set for
# both ranks routed the same on both at every step: nothing rank-dependent happened.)
MOE_ALLOWED = (((0, 1), (0, 1)), ((0, 1), (1,)), ((0, 1, 2), (0, 1, 2)), ((1, 2), (2,)), ((0, 1, 2, 3), (0, 1, 2, 3)),
               ((1, 3), (1,)))


class MoEModel(nn.Module):
    """Bottleneck experts (16 -> 2 -> 16, largest parameter 32 elements) under a larger trunk: at
    stage 3 a threshold of 32 keeps every expert whole and shards embed, router and head weights."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.router = nn.Linear(16, experts)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(16, 2), nn.GELU(), nn.Linear(2, 16))
                                      for _ in range(experts)])
        self.head = nn.Linear(16, 4)
        self.allowed = tuple(range(experts))

    def forward(self, x):
        h = self.embed(x)
        logits = self.router(h)
        mask = torch.full_like(logits, float("-inf"))
        mask[:, list(self.allowed)] = 0.0
        probs = torch.softmax(logits + mask, dim=-1)
        gate, choice = probs.max(dim=-1)
        out = torch.zeros_like(h)
        for k, expert in enumerate(self.experts):
            rows = (choice == k).nonzero(as_tuple=True)[0]
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]) * gate[rows, None])
        return self.head(h + out)


MODELS = {"branch": BranchModel, "local_head": LocalHeadModel, "moe": MoEModel}

# Stage 3: (param_persistence_threshold, the prefixes of the modules some ranks only run, kept
# whole by it). Every other parameter above the threshold is sharded and asserted so.
STAGE3 = {"branch": (0, ()), "local_head": (8, ("aux.",)), "moe": (32, ("experts.",))}


def _configure(model, name: str, step: int, rank: int) -> None:
    if name == "branch":
        model.use_branch = step % 2 == 1
    elif name == "local_head":
        model.rank = rank
    else:
        model.allowed = MOE_ALLOWED[step][rank]


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _full_parameters(model, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:
        import zeroplus
        return {k: v.float() for k, v in zeroplus.full_state_dict(model, rank0_only=False).items()}
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def _recording(model):
    """Yields the sorted list of the rank-dependent modules (`aux`, `experts.k`) run inside."""
    used = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: used.append(n) if n not in used else None)
             for n, m in model.named_modules() if n == "aux" or (n.startswith("experts.") and n.count(".") == 1)]
    try:
        yield used
    finally:
        for h in hooks:
            h.remove()
        used.sort()


def _run_case(rank: int, group, stage: int, precision, name: str, set_to_none: bool) -> dict:
    import zeroplus
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = MODELS[name]()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model, find_unused_parameters=True, process_group=group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    threshold, divergent = STAGE3[name]
    knobs = {"param_persistence_threshold": threshold} if stage == 3 else {}
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, lr=LR, weight_decay=WD,
                                     mixed_precision=precision, process_group=group, **knobs)
    norms, ref_norms, ran = [], [], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        _configure(ref_model, name, step, rank)
        _configure(model, name, step, rank)
        with _recording(ref_model) as used:
            nn.functional.mse_loss(ref(x), y).backward()
        ran.append(used)
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=set_to_none)
        opt.backward(nn.functional.mse_loss(model(x).float(), y))
        norms.append(opt.clip_grad_norm_(1.0).item())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    sharded = None
    if stage == 3:
        names = [n for n, _ in model.named_parameters()]
        whole = [n for n in names if n.startswith(divergent)] if divergent else []
        sizes = {n: p.numel() for n, p in ref_model.named_parameters()}
        sharded = assert_sharded(model, opt, [n for n in names if n not in whole and sizes[n] > threshold],
                                 at_least=3)
        kept = set(sharded_names(model, opt)) & set(whole)
        assert not kept, f"rank {rank}: the rank-dependent parameters {sorted(kept)} are sharded"
    mine = _full_parameters(model, stage)
    diff = {k: (mine[k] - v.float()).abs().max().item() for k, v in ref_model.state_dict().items()}
    compute = {None: torch.float32, "bf16": torch.bfloat16}[precision]
    unchanged = {k: bool(torch.equal(mine[k], initial[k].to(compute).float())) for k in initial}
    opt.consolidate_state_dict(0)
    steps = None
    if rank == 0:
        plain = opt.state_dict()["state"]
        ref_state = ref_opt.state_dict()["state"]
        steps = {i: (float(plain[i]["step"]) if i in plain else None,
                     float(ref_state[i]["step"]) if i in ref_state else None)
                 for i in range(len(list(ref_model.parameters())))}
    return {"diff": diff, "unchanged": unchanged, "norms": norms, "ref_norms": ref_norms, "steps": steps,
            "sharded": sharded, "ran": ran}


def _run_divergent(rank: int, group, name: str) -> dict:
    """Stage 3 with the rank-dependent module sharded too: RankDivergenceError on every rank at
    the first gather where the ranks differ; the group is still usable after it."""
    import torch.distributed as dist

    import zeroplus
    from zeroplus.zero import RankDivergenceError

    torch.manual_seed(0)
    model, opt = zeroplus.initialize(MODELS[name](), torch.optim.AdamW, stage=3, lr=LR, weight_decay=WD,
                                     process_group=group, param_persistence_threshold=0)
    sharded = assert_sharded(model, opt)  # every parameter, the rank-dependent ones included
    error, step, ran = None, None, []
    for step in range(STEPS):
        _configure(model, name, step, rank)
        x, y = _batch(step, rank)
        try:
            with _recording(model) as used:
                ran.append(used)
                opt.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        except RankDivergenceError as e:
            error = str(e)
            break
    probe = torch.tensor([rank + 1.0])
    dist.all_reduce(probe, group=group)
    return {"error": error, "step": step, "ran": ran, "probe": probe.item(), "sharded": sharded}


CASES = ([(stage, precision, name, True) for stage in STAGES for precision in PRECISIONS for name in MODELS]
         + [(stage, None, "branch", False) for stage in STAGES])  # zero_grad(set_to_none=False): DDP steps zeros


DIVERGENT = ("local_head", "moe")


def _all_cases(rank: int, world: int) -> dict:
    cases = {case: functools.partial(_run_case_in, case=case) for case in CASES}
    cases.update({("divergent", name): functools.partial(_run_divergent, name=name) for name in DIVERGENT})
    return run_cases_in_own_groups(rank, world, cases)


def _run_case_in(rank, group, case):
    return _run_case(rank, group, *case)


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_cases, 2, timeout=600)


def _case_id(case) -> str:
    stage, precision, name, set_to_none = case
    return f"stage{stage}-{precision or 'fp32'}-{name}" + ("" if set_to_none else "-zero_grad_keep")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_unused_parameters_follow_ddp(results, case):
    for r, (status, res) in enumerate(r[case] for r in results):
        assert status == "ok", f"rank {r}:\n{res}"
    per_rank = [r[case][1] for r in results]
    stage, precision, name, set_to_none = case
    # The reference itself: every rank's DDP model is the same.
    assert per_rank[0]["ref_norms"] == pytest.approx(per_rank[1]["ref_norms"], rel=1e-6)
    tolerance = 1e-5 if precision is None else 2e-2
    for r, res in enumerate(per_rank):
        # clip_grad_norm_ returns DDP's norm on every rank (the same norm everywhere).
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=max(tolerance, 1e-5), abs=1e-7), f"rank {r}"
        worst = max(res["diff"].items(), key=lambda kv: kv[1])
        assert worst[1] <= tolerance, f"rank {r}: {worst[0]} differs from DDP by {worst[1]:.3g}"
    assert per_rank[0]["norms"] == per_rank[1]["norms"]
    # Per-parameter step counts equal torch's (a parameter without a gradient keeps its count).
    mismatched = {i: s for i, s in per_rank[0]["steps"].items() if s[0] != s[1]}
    assert not mismatched, f"(zeroplus, torch) step counts differ: {mismatched}"
    if name == "branch" and set_to_none:
        # Never used: not even weight decay moved it (bitwise the initial value, in the compute dtype).
        assert per_rank[0]["unchanged"]["never.weight"] and per_rank[0]["unchanged"]["never.bias"]
    ran = [res["ran"] for res in per_rank]
    if name == "local_head":
        assert ran == [[["aux"]] * STEPS, [[]] * STEPS], ran
    elif name == "moe":
        # What the test is for happened: an expert used on one rank only, and one on no rank.
        assert any(ran[0][s] != ran[1][s] for s in range(STEPS)), ran
        assert any(len(set(ran[0][s]) | set(ran[1][s])) < 4 for s in range(STEPS)), ran
    if stage == 3:
        # Sharded on every rank (asserted there): everything above the threshold but the rank-dependent module.
        assert per_rank[0]["sharded"] == per_rank[1]["sharded"] and len(per_rank[0]["sharded"]) >= 3


@pytest.mark.parametrize("name", DIVERGENT)
def test_sharded_rank_dependent_module_raises_naming_module_and_ranks(results, name):
    for r, (status, res) in enumerate(r[("divergent", name)] for r in results):
        assert status == "ok", f"rank {r}:\n{res}"
    per_rank = [r[("divergent", name)][1] for r in results]
    assert per_rank[0]["sharded"] == sorted(n for n, _ in MODELS[name]().named_parameters())
    errors = [res["error"] for res in per_rank]
    assert errors[0] is not None and errors == [errors[0]] * len(errors), errors  # every rank, the same error
    step = per_rank[0]["step"]
    assert [res["step"] for res in per_rank] == [step] * len(per_rank)
    assert all(res["probe"] == 3.0 for res in per_rank)  # the group still works after it
    message = errors[0]
    assert "param_persistence_threshold >= " in message and "now 0)" in message, message
    if name == "local_head":
        assert step == 0
        assert "So module 'aux' ran on rank 0 and was skipped on rank 1" in message, message
    else:
        # The ranks first route to different experts at step `first` (the experts they ran, as the
        # DDP reference of the fp32 stage-3 case also did). The error comes then or one step later:
        # from step 1 on the gathers follow the order recorded in the step before, so a step whose
        # first difference is an expert one rank skipped can still gather the same units on both
        # ranks (prefetched where unused: measured, the parameters then still equal DDP's) and the
        # differing recorded orders meet in the next step's gathers.
        ref_ran = [r[(3, None, "moe", True)][1]["ran"] for r in results]
        first = next(s for s in range(STEPS) if ref_ran[0][s] != ref_ran[1][s])
        assert first <= step <= first + 1, (first, step, ref_ran)
        for r, res in enumerate(per_rank):  # the steps completed routed as the reference did
            assert res["ran"][:step] == ref_ran[r][:step], (r, res["ran"], ref_ran[r])
        assert "rank 0: module 'experts." in message and "rank 1: module '" in message, message
