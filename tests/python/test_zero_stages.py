"""The stage classes (zeroplus/zero/stages.py): each is the one engine composed with a parameter
placement, not a subclass of another stage, and every stage trains to the same parameters as
torch.optim.AdamW. Stages 1 and 2 run on a one-rank group in this process (the reducer runs its
whole path, the collectives are identities); stage 3 runs on two pooled ranks with every
parameter sharded (asserted: at world size 1 the one shard is the whole model, which shards
nothing)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from harness import run_pooled
from sharding import SHARD_ALL, assert_sharded

from zeroplus.zero import Stage1Optimizer, Stage2Optimizer, Stage3Optimizer
from zeroplus.zero.engine import ZeroEngine
from zeroplus.zero.replicated_params import ReplicatedParams
from zeroplus.zero.stage3.sharded_params import ShardedParams


def test_stages_are_one_engine_composed_not_a_subclass_chain():
    for cls in (Stage1Optimizer, Stage2Optimizer, Stage3Optimizer):
        assert cls.__mro__[1] is ZeroEngine, cls.__mro__
    assert not issubclass(Stage3Optimizer, Stage2Optimizer) and not issubclass(Stage1Optimizer, Stage2Optimizer)
    with pytest.raises(TypeError, match="stage class"):
        ZeroEngine([torch.nn.Parameter(torch.ones(2))], torch.optim.AdamW)


def _train_against_adamw(stage, config=None):
    """(zeroplus model, engine, reference) after 4 steps on the same data (every rank the same,
    so the engine's averaged gradient is the reference's)."""
    import zeroplus

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, lr=1e-2, weight_decay=0.1, config=config)
    for step in range(4):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).square().mean().backward()
            o.step()
            # DDP scripts often clear through the model: it must clear the engine's gradients too.
            (m.zero_grad if step % 2 else o.zero_grad)()
    moved = max((v - start[k]).abs().max().item() for k, v in ref.state_dict().items())
    assert moved > 1e-2, f"the reference barely moved ({moved}): the comparison could not fail"
    return model, opt, ref


def _assert_matches(model, ref):
    import zeroplus

    full = zeroplus.full_state_dict(model, rank0_only=False)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage,placement", [(1, ReplicatedParams), (2, ReplicatedParams)])
def test_each_stage_picks_its_placement_and_matches_torch(one_rank_group, stage, placement):
    model, opt, ref = _train_against_adamw(stage)
    assert type(opt.placement) is placement and opt.stage == stage
    _assert_matches(model, ref)


def _stage3_matches_torch(rank, world):
    model, opt, ref = _train_against_adamw(3, SHARD_ALL)
    assert type(opt.placement) is ShardedParams and opt.stage == 3
    sharded = assert_sharded(model, opt)
    _assert_matches(model, ref)
    return sharded


def test_stage3_picks_its_placement_shards_and_matches_torch():
    for sharded in run_pooled(_stage3_matches_torch, 2, timeout=180):
        assert sharded == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_a_deepcopy_of_the_model_is_not_managed_by_the_engine(one_rank_group):
    import zeroplus

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model, opt = zeroplus.initialize(model, torch.optim.SGD, stage=2, lr=0.1)
    ema = copy.deepcopy(model)  # an EMA copy: plain torch behaviour, no copy of the engine
    model(torch.ones(2, 4)).sum().backward()
    ema.zero_grad()  # must not clear the original's gradients
    with ema.no_sync():
        pass
    before = model[0].weight.detach().clone()
    opt.step()
    assert not torch.equal(model[0].weight, before)
    assert all(not isinstance(v, torch.optim.Optimizer) for v in vars(ema).values())


def _moved_model_is_refused(stage):
    import zeroplus

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, opt = zeroplus.initialize(model, torch.optim.SGD, stage=stage, lr=0.1)
    model.to(torch.device("cpu", 0))  # accelerate's CPU device: the parameters get new storage
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"parameter [01]\.(weight|bias) no longer lives in zeroplus's buffers"):
        opt.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_model_moved_after_initialize_is_refused_at_step_not_silently_frozen(one_rank_group, stage):
    """Stages 1-2, and stage 3's persistent (whole) parameters: refused at the step."""
    _moved_model_is_refused(stage)


def _sharded_moved_model_is_refused(rank, world):
    import zeroplus

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, opt = zeroplus.initialize(model, torch.optim.SGD, stage=3, lr=0.1, config=SHARD_ALL)
    sharded = assert_sharded(model, opt)
    model.to(torch.device("cpu", 0))
    try:
        model(torch.ones(2, 4))
    except RuntimeError as e:
        return sharded, str(e)
    return sharded, None


def test_a_sharded_model_moved_after_initialize_is_refused_at_its_gather():
    """Stage 3, every parameter sharded: the next gather would point the parameters back into the
    engine's shards and silently drop the move (it did: training went on with the user's
    model.to(...) undone); it raises on every rank before any collective, naming the parameter."""
    for sharded, error in run_pooled(_sharded_moved_model_is_refused, 2, timeout=120):
        assert sharded == ["0.bias", "0.weight", "1.bias", "1.weight"], sharded
        assert error is not None, "the move was silently undone"
        assert re.search(r"parameter 0\.(weight|bias) no longer lives in zeroplus's shard buffers", error), error


def _dropped_model_is_freed(stage, config=None):
    """(sharded parameter names at stage 3) after checking that a dropped model and engine are freed."""
    import gc
    import weakref

    import zeroplus
    from zero_models import batch, loss_fn, make_model

    def build_and_step():
        model, opt = zeroplus.initialize(make_model(), torch.optim.AdamW, stage=stage, lr=1e-3, config=config)
        sharded = assert_sharded(model, opt) if stage == 3 else []
        tokens, targets = batch(0, 0)
        loss_fn(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        return weakref.ref(model), weakref.ref(opt), [weakref.ref(m) for m in opt.masters], sharded

    model_ref, opt_ref, master_refs, sharded = build_and_step()
    gc.collect()
    assert opt_ref() is None, "the engine outlived its last user reference"
    assert model_ref() is None, f"the stage-{stage} model outlived its last user reference"
    assert all(r() is None for r in master_refs), "the masters outlived the engine"
    return sharded


@pytest.mark.parametrize("stage", [1, 2])
def test_model_and_engine_are_freed_when_the_user_drops_them(one_rank_group, stage):
    """Nothing zeroplus registers keeps a model alive: each parameter's gradient hook holds its
    backward pass weakly. Before, at stage 3 the cycle parameter -> hook -> engine parts -> module
    ran through autograd's C++ AccumulateGrad node, which Python's collector cannot see, so a
    dropped model and its engine (parameters, masters, optimizer state: GPU memory on CUDA)
    stayed allocated for the life of the process."""
    _dropped_model_is_freed(stage)


def _stage3_dropped_model_is_freed(rank, world):
    return _dropped_model_is_freed(3, SHARD_ALL)


def test_a_sharded_model_and_engine_are_freed_when_the_user_drops_them():
    """As above at stage 3 (the stage whose cycle ran through AccumulateGrad), every parameter
    sharded."""
    for sharded in run_pooled(_stage3_dropped_model_is_freed, 2, timeout=180):
        assert "embed.weight" in sharded and len(sharded) > 10
