"""Rank-divergent execution at ZeRO stage 3 fails fast on every rank (issue 38 item 5).

A sharded module that rank 0 runs and rank 1 skips (param_persistence_threshold=0, so its
parameters really are sharded and gathered by collectives), and a no-grad generation loop that
runs 5 steps on rank 0 and 3 on rank 1 before both train. Before the fix both failed with the
backend's "collective mismatch ... size differs" (where the paired gathers had equal sizes they
would have exchanged the wrong parameters silently), naming no module and leaving the group
unusable. Now every rank raises RankDivergenceError within seconds, naming the module, the ranks
that ran and skipped it and the remedy, and the group stays usable.

The remedy the error names (param_persistence_threshold >= 64: aux and head kept whole, trunk
still sharded) then trains as DDP with find_unused_parameters=True. Before the fix that setting
hung (no result within 240 s): rank 0 launched the reduce-scatter of aux's gradient where rank 1
gathered trunk, a pairing the backend does not detect.

The other remedy it names, persistent_modules (the module list kept whole, issue 38 item 5), keeps
aux whole and shards every other parameter at threshold 0: by qualified name, instance or class
it trains as DDP with find_unused_parameters=True. Before it existed the keyword reached the
optimizer (TypeError) and the error named only the threshold. Bad values raise naming it.

Model: 3 small Linear layers (~150 parameters). One 2-rank launch runs every case, each in its
own group.
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch
from torch import nn

from harness import run_cases_in_own_groups, run_pooled

LR = 1e-2


class AuxHead(nn.Linear):
    """The rank-conditional head's own class (persistent_modules=[AuxHead] picks it alone)."""


class LocalHead(nn.Module):
    """`aux` runs on rank 0 only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.aux = AuxHead(16, 4)
        self.rank = 0

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        return out + self.aux(h) if self.rank == 0 else out


def _batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _initialize(model, group, threshold, **knobs):
    import zeroplus
    return zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=LR, process_group=group,
                               param_persistence_threshold=threshold, **knobs)


def _after_error(group) -> bool:
    """The group still works after the error (every rank raised at the same collective)."""
    t = torch.ones(1)
    torch.distributed.all_reduce(t, group=group)
    return t.item() == 2.0


def _local_head_case(rank, group):
    model = LocalHead()
    model.rank = rank
    model, opt = _initialize(model, group, 0)
    from zeroplus.zero.layout import is_resting
    sharded = all(is_resting(p.data, p.shape) for p in model.parameters())
    start = time.monotonic()
    error = None
    try:
        for step in range(3):
            x, y = _batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    return {"sharded": sharded, "error": error, "seconds": time.monotonic() - start, "usable": _after_error(group)}


def _generation_case(rank, group):
    model = LocalHead()
    model.rank = 1  # every rank runs the same modules; the number of steps differs
    model, opt = _initialize(model, group, 0)
    start = time.monotonic()
    error = None
    try:
        with torch.no_grad():
            x, _ = _batch(0, rank)
            for _ in range(5 if rank == 0 else 3):  # a decode loop that stops early on rank 1
                x = torch.cat([x[:, 4:], model(x)], dim=1)
        x, y = _batch(1, rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.monotonic() - start, "usable": _after_error(group)}


def _remedy_case(rank, group, threshold):
    """The remedy the error names: the divergent head's parameters kept whole trains as DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zeroplus
    model = LocalHead()
    model.rank = rank
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model, find_unused_parameters=True, process_group=group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    model, opt = _initialize(model, group, threshold)
    for step in range(3):
        x, y = _batch(step, rank)
        for m, o in ((ref, ref_opt), (model, opt)):
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    mine = zeroplus.full_state_dict(model, rank0_only=False)
    return max((mine[k] - v).abs().max().item() for k, v in ref_model.state_dict().items())


def _persistent_modules_case(rank, group, spelling):
    """persistent_modules keeps aux whole while trunk and head really shard (threshold 0): trains
    as DDP with find_unused_parameters=True. Returns (distance from DDP, how far DDP moved, the
    parameters kept whole)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sharding
    import zero_models as zm
    import zeroplus
    model = LocalHead()
    model.rank = rank
    ref_model = copy.deepcopy(model)
    start = {k: v.clone() for k, v in ref_model.state_dict().items()}
    ref = DDP(ref_model, find_unused_parameters=True, process_group=group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    listed = {"name": ["aux"], "instance": model.aux, "class": [AuxHead]}[spelling]
    model, opt = _initialize(model, group, 0, persistent_modules=listed)
    sharded = ["trunk.weight", "trunk.bias", "head.weight", "head.bias"]
    sharding.assert_sharded(model, opt, sharded)
    for step in range(3):
        x, y = _batch(step, rank)
        for m, o in ((ref, ref_opt), (model, opt)):
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    sharding.assert_sharded(model, opt, sharded)  # still sharded after steps
    whole = sorted(set(n for n, _ in model.named_parameters()) - set(sharding.sharded_names(model, opt)))
    distance, moved = zm.parity(zeroplus.full_state_dict(model, rank0_only=False), ref_model.state_dict(), start)
    return distance, moved, whole


def _bad_persistent_modules_case(rank, group):
    """Each bad value raises naming persistent_modules, before the model is touched."""
    import zeroplus
    model = LocalHead()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cases = [(dict(persistent_modules=3), TypeError), (dict(persistent_modules=[int]), TypeError),
             (dict(persistent_modules=["aux", 2.5]), TypeError), (dict(persistent_modules=["auxx"]), ValueError),
             (dict(persistent_modules=[nn.Conv2d]), ValueError),
             (dict(persistent_modules=[nn.Linear(2, 2)]), ValueError),
             (dict(stage=2, persistent_modules=["aux"]), ValueError)]
    out = []
    for kwargs, exc in cases:
        kwargs = {"stage": 3, **kwargs}
        try:
            zeroplus.initialize(model, torch.optim.AdamW, lr=LR, process_group=group, **kwargs)
            out.append((repr(kwargs), None, None))
        except Exception as e:  # noqa: BLE001 - the type and text are the result
            out.append((repr(kwargs), type(e) is exc, str(e)))
    untouched = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    managed = any(getattr(p, "_zeroplus_managed", False) for p in model.parameters())
    return {"errors": out, "untouched": untouched and not managed}


def _hf_generate_case(rank, group, synced):
    """model.generate on a Hugging Face GPT-2 at stage 3, 5 new tokens on rank 0 and 3 on rank 1,
    then a training step on both. Without synced_gpus: RankDivergenceError on every rank; with
    synced_gpus=True (the remedy the error names): the tokens of the unsharded model."""
    import integration_common as ic

    plain = ic.tiny_gpt2()
    model, opt = _initialize(ic.tiny_gpt2(), group, 0)
    prompt = torch.tensor([[1, 2, 3, 4]])
    new = 5 if rank == 0 else 3
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    start = time.monotonic()
    error, tokens = None, None
    try:
        with torch.no_grad():
            tokens = model.generate(prompt, synced_gpus=synced, **kwargs)[0].tolist()
        ids = torch.randint(0, ic.VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
        model(ids, labels=ids).loss.backward()
        opt.step()
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    with torch.no_grad():
        expected = plain.generate(prompt, **kwargs)[0].tolist()
    return {"error": error, "seconds": time.monotonic() - start, "tokens": tokens, "expected": expected}


REMEDY_THRESHOLD = 64  # aux's largest parameter (16 x 4): what the error must name


def _all_cases(rank, world):
    out = run_cases_in_own_groups(rank, world, {
        "local_head": _local_head_case, "generation": _generation_case,
        "hf_generate": functools.partial(_hf_generate_case, synced=False),
        "hf_generate_synced": functools.partial(_hf_generate_case, synced=True)})
    # The remedy the error names. Without the agreement on gradient launches this setting hung
    # (trunk still sharded: rank 0 launched aux's reduce-scatter where rank 1 gathered trunk).
    out.update(run_cases_in_own_groups(rank, world, {"remedy": functools.partial(_remedy_case,
                                                                                   threshold=REMEDY_THRESHOLD)}))
    # The module list kept whole (persistent_modules), in each spelling, and its bad values.
    out.update(run_cases_in_own_groups(rank, world, {
        **{f"persistent_{s}": functools.partial(_persistent_modules_case, spelling=s)
           for s in ("name", "instance", "class")},
        "persistent_bad": _bad_persistent_modules_case}))
    return out


@pytest.fixture(scope="module")
def results():
    return run_pooled(_all_cases, 2, timeout=240)


def _ok(results, key):
    for r, res in enumerate(results):
        status, value = res[key]
        assert status == "ok", f"rank {r}:\n{value}"
    return [res[key][1] for res in results]


def test_rank_only_module_raises_fast_on_every_rank(results):
    for r, res in enumerate(_ok(results, "local_head")):
        assert res["sharded"], "the case needs the parameters sharded"
        assert res["error"] is not None, f"rank {r} did not raise"
        assert res["error"].startswith("RankDivergenceError"), res["error"]
        for needle in ("module 'aux' ran on rank 0 and was skipped on rank 1", "persistent_modules=['aux']",
                       f"param_persistence_threshold >= {REMEDY_THRESHOLD}", "synced"):
            assert needle in res["error"], (needle, res["error"])
        assert res["seconds"] < 10, res["seconds"]
        assert res["usable"], f"rank {r}: the group no longer works after the error"


def test_generation_loop_of_different_lengths_raises_fast(results):
    for r, res in enumerate(_ok(results, "generation")):
        assert res["error"] is not None and res["error"].startswith("RankDivergenceError"), res["error"]
        assert "no grad" in res["error"] and "synced_gpus=True" in res["error"], res["error"]
        assert res["seconds"] < 10, res["seconds"]
        assert res["usable"], f"rank {r}: the group no longer works after the error"


def test_named_remedy_trains_as_ddp(results):
    for r, diff in enumerate(_ok(results, "remedy")):
        assert diff <= 1e-5, f"rank {r}: differs from DDP by {diff:.3g}"


def test_hf_generate_of_different_lengths_raises_or_runs_synced(results):
    for r, res in enumerate(_ok(results, "hf_generate")):
        assert res["error"] is not None and res["error"].startswith("RankDivergenceError"), res["error"]
        assert "synced_gpus=True" in res["error"] and res["seconds"] < 20, res
    for r, res in enumerate(_ok(results, "hf_generate_synced")):
        assert res["error"] is None, f"rank {r}: {res['error']}"
        assert res["tokens"] == res["expected"] and len(res["tokens"]) == 4 + (5 if r == 0 else 3), res


@pytest.mark.parametrize("spelling", ["name", "instance", "class"])
def test_persistent_modules_keep_the_rank_only_module_whole_and_train_as_ddp(results, spelling):
    for r, (distance, moved, whole) in enumerate(_ok(results, f"persistent_{spelling}")):
        assert whole == ["aux.bias", "aux.weight"], f"rank {r}: kept whole {whole}"
        assert moved > 1e-3, f"rank {r}: DDP moved {moved:.3g}: the comparison cannot fail"
        assert distance <= 1e-5 * max(1.0, moved), f"rank {r}: {distance:.3g} from DDP (it moved {moved:.3g})"


def test_bad_persistent_modules_raise_naming_the_argument(results):
    for r, res in enumerate(_ok(results, "persistent_bad")):
        for kwargs, right_type, text in res["errors"]:
            assert text is not None, f"rank {r}: {kwargs} did not raise"
            assert right_type, f"rank {r}: {kwargs}: wrong exception type: {text}"
            wanted = "stage 3 only" if "'stage': 2" in kwargs else "persistent_modules"
            assert wanted in text and ("persistent_modules" in text), f"rank {r}: {kwargs}: {text}"
        assert res["untouched"], f"rank {r}: a refused initialize changed the model"
