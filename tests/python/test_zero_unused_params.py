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
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from harness import run_cases_in_own_groups, run_distributed

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
    """`aux` is used on rank 0 only: DDP averages its gradient with rank 1's zeros."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)
        self.rank = 0

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        return out + self.aux(h) if self.rank == 0 else out


# Experts each step may route to (top-1 among them): expert 3 idles for four steps, expert 2 for
# two, expert 0 at steps 3 and 5. Within the allowed set the router's choice depends on the data,
# so an expert can be used on one rank and not the other.
MOE_ALLOWED = ((0, 1), (0, 1), (0, 1, 2), (1, 2), (0, 1, 2, 3), (1, 3))


class MoEModel(nn.Module):
    def __init__(self, experts: int = 4):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.router = nn.Linear(16, experts)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
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


def _configure(model, name: str, step: int, rank: int) -> None:
    if name == "branch":
        model.use_branch = step % 2 == 1
    elif name == "local_head":
        model.rank = rank
    else:
        model.allowed = MOE_ALLOWED[step]


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _full_parameters(model, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:
        import zeroplus
        return {k: v.float() for k, v in zeroplus.full_state_dict(model, rank0_only=False).items()}
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _run_case(rank: int, group, stage: int, precision, name: str, set_to_none: bool) -> dict:
    import zeroplus
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = MODELS[name]()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model, find_unused_parameters=True, process_group=group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, lr=LR, weight_decay=WD,
                                     mixed_precision=precision, process_group=group)
    norms, ref_norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        _configure(ref_model, name, step, rank)
        _configure(model, name, step, rank)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=set_to_none)
        opt.backward(nn.functional.mse_loss(model(x).float(), y))
        norms.append(opt.clip_grad_norm_(1.0).item())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
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
    return {"diff": diff, "unchanged": unchanged, "norms": norms, "ref_norms": ref_norms, "steps": steps}


CASES = ([(stage, precision, name, True) for stage in STAGES for precision in PRECISIONS for name in MODELS]
         + [(stage, None, "branch", False) for stage in STAGES])  # zero_grad(set_to_none=False): DDP steps zeros


def _all_cases(rank: int, world: int) -> dict:
    return run_cases_in_own_groups(rank, world, {case: functools.partial(_run_case_in, case=case) for case in CASES})


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
