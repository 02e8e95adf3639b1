"""ParameterGatherer (zeroplus/zero/stage3/param_gatherer.py) on one rank, inside a stage-3 engine: the
residency of every unit at each point of a step (released between steps, gathered inside its
forward and again for its backward, released as soon as its gradients are in), what
reshard_after_forward=False keeps, prefetch by the recorded order (one unit ahead by default),
and that what a module sees inside forward is the full parameter. Multi-rank parity, tied
parameters, checkpointing: test_zero_stage3.py and test_zero_engine_contracts.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroplus.zero.stage3.param_gatherer import Residency

WIDTH = 32


class Blocks(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _engine(**knobs):
    import zeroplus

    torch.manual_seed(0)
    model = Blocks()
    # Every parameter sharded (threshold 0), one unit per Linear block.
    return zeroplus.initialize(model, torch.optim.SGD, stage=3, lr=0.1, param_persistence_threshold=0,
                               unit_classes=[nn.Linear], **knobs)


def _residency(opt):
    return {st.unit.name: st.state for st in opt.gatherer.states if st.buckets}


def _step(model, opt, log=None):
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1)).requires_grad_()
    model(x).square().mean().backward()
    if log is not None:
        log.append(("after backward", _residency(opt)))
    opt.step()
    opt.zero_grad()


def _watch(model, opt):
    """Residency seen by each block's forward pre-hook (after the gatherer's) and
    when its weight's gradient is computed."""
    log = []
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: log.append((f"fwd {i}", _residency(opt), m.weight.shape)))
        # The weight's gradient is computed inside the unit's backward, before it is accumulated.
        layer.weight.register_hook(lambda g, i=i: log.append((f"bwd {i}", _residency(opt))))
    return log


def test_units_are_gathered_for_their_forward_and_backward_and_released_after(one_rank_group):
    model, opt = _engine()
    log = _watch(model, opt)
    assert set(_residency(opt).values()) == {Residency.RELEASED}
    _step(model, opt, log)
    assert sorted(t for t, *_ in log) == sorted([f"fwd {i}" for i in range(3)] + [f"bwd {i}" for i in range(3)]
                                                + ["after backward"])
    for tag, residency, *shape in log:
        if tag.startswith("fwd"):
            i = int(tag.split()[1])
            assert residency[f"layers.{i}"] is Residency.GATHERED and shape[0] == (WIDTH, WIDTH), tag
            assert all(residency[f"layers.{j}"] is Residency.RELEASED for j in range(i)), (tag, residency)
        elif tag.startswith("bwd"):
            i = int(tag.split()[1])
            assert residency[f"layers.{i}"] is Residency.GATHERED, tag  # held until its gradients are in
            assert all(residency[f"layers.{j}"] is Residency.RELEASED for j in range(i + 1, 3)), (tag, residency)
    assert set(log[-1][1].values()) == {Residency.RELEASED}  # after backward nothing is gathered
    assert set(_residency(opt).values()) == {Residency.RELEASED} and opt.gatherer.live_elems == 0
    from zeroplus.zero.layout import is_resting  # between steps: resting views, no values held
    assert all(is_resting(p.data, p.shape) and p.dim() == 2 for p in model.parameters() if p.dim() > 1)


def test_reshard_after_forward_false_keeps_units_until_their_backward(one_rank_group):
    model, opt = _engine(reshard_after_forward=False)
    log = _watch(model, opt)
    _step(model, opt, log)
    fwd_last = next(r for t, r, *_ in log if t == "fwd 2")
    assert all(fwd_last[f"layers.{j}"] is Residency.GATHERED for j in range(3))
    assert set(log[-1][1].values()) == {Residency.RELEASED}


@pytest.mark.parametrize("knobs,most_ahead", [({}, 1), ({"prefetch_bucket_size": 0}, 0),
                                               ({"prefetch_bucket_size": 10 ** 9}, 3)])
def test_prefetch_follows_the_recorded_order_as_far_as_the_policy_allows(one_rank_group, knobs, most_ahead):
    model, opt = _engine(**knobs)
    _step(model, opt)  # records the order; nothing to predict yet
    assert opt.gatherer.stats["prefetched"] == 0
    ahead_seen = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, a: ahead_seen.append(
            sum(1 for st in opt.gatherer.states if st.prefetched)))
    _step(model, opt)
    assert (opt.gatherer.stats["prefetched"] > 0) == (most_ahead > 0)
    assert max(ahead_seen) <= most_ahead and (most_ahead == 0 or max(ahead_seen) >= 1), ahead_seen
