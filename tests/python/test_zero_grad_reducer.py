"""GradientReducer (zeroplus/zero/grad_reducer.py) on one rank, driven as the BackwardPass drives
it (begin_backward, on_grad per parameter, end_backward / abandon_backward): what lands in the
accumulators, what is freed, what usage records, no_sync and flush, and that a pass which failed
leaves the accumulators as they were. Multi-rank averaging and ordering: test_zero_stage2.py."""

from __future__ import annotations

import pytest
import torch

from zeroplus.zero.grad_reducer import GradientReducer
from zeroplus.zero.layout import plan_buckets


def _params():
    torch.manual_seed(0)
    # Three parameters, two buckets (cap 40 elements): sizes chosen so that a bucket holds two.
    return [torch.nn.Parameter(torch.randn(n)) for n in (24, 10, 30)]


def _reducer(params, shard_gradients=True, accum_dtype=None):
    buckets = plan_buckets([params], 1, 40, lambda p: p.dtype)
    return GradientReducer(buckets, None, 1, 0, accum_dtype, shard_gradients=shard_gradients), buckets


def _pass(reducer, params, grads, end=True):
    reducer.begin_backward()
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g.clone()
            reducer.on_grad(p)
    if end:
        reducer.end_backward()


def _accumulated(reducer, buckets, p):
    """p's gradient as the accumulators hold it (world size 1: the shard is the whole bucket)."""
    for b, acc in zip(buckets, reducer.accum):
        for e in b.entries:
            if e.param is p:
                return acc[e.offset:e.offset + e.numel]
    raise KeyError


@pytest.mark.parametrize("shard_gradients", [True, False])
def test_two_passes_sum_into_the_accumulators_and_free_each_grad(one_rank_group, shard_gradients):
    params = _params()
    reducer, buckets = _reducer(params, shard_gradients)
    assert len(buckets) == 2
    g1 = [torch.randn(p.numel()) for p in params]
    g2 = [torch.randn(p.numel()) for p in params]
    _pass(reducer, params, g1)
    assert all(p.grad is None for p in params), "a gradient must be freed once its bucket has it"
    _pass(reducer, params, g2)
    for p, a, b in zip(params, g1, g2):
        torch.testing.assert_close(_accumulated(reducer, buckets, p), a + b, rtol=0, atol=0)
    assert reducer.has_grads
    reducer.zero(set_to_none=False)  # zero_grad(set_to_none=False): zero tensors that still exist
    assert all(acc is not None and acc.abs().sum() == 0 for acc in reducer.accum) and not reducer.has_grads
    reducer.zero()  # zero_grad's default: the gradient memory is freed, as torch frees .grad
    assert reducer.accum == [None, None] and not reducer.has_grads
    _pass(reducer, params, g1)  # and allocated again by the next pass
    for p, a in zip(params, g1):
        torch.testing.assert_close(_accumulated(reducer, buckets, p), a, rtol=0, atol=0)


def test_usage_records_only_parameters_that_had_a_gradient(one_rank_group):
    params = _params()
    reducer, buckets = _reducer(params)
    _pass(reducer, params, [torch.ones(24), None, torch.ones(30)])
    stepped = reducer.usage.agree(None)
    used = {id(e.param): stepped[reducer.usage.flag(b.index, i)] for b in buckets for i, e in enumerate(b.entries)}
    assert used == {id(params[0]): True, id(params[1]): False, id(params[2]): True}
    # The unused parameter's region is zero, as DDP's find_unused_parameters contributes.
    assert _accumulated(reducer, buckets, params[1]).abs().sum() == 0


def test_no_sync_keeps_grads_local_until_flush(one_rank_group):
    params = _params()
    reducer, buckets = _reducer(params)
    g = [torch.randn(p.numel()) for p in params]
    reducer.no_sync = True
    _pass(reducer, params, g)
    assert all(p.grad is not None for p in params) and reducer.local_pending
    assert reducer.accum == [None, None]  # nothing reduced: no gradient memory yet
    reducer.no_sync = False
    reducer.flush()
    assert not reducer.local_pending and all(p.grad is None for p in params)
    for p, want in zip(params, g):
        torch.testing.assert_close(_accumulated(reducer, buckets, p), want, rtol=0, atol=0)


def test_an_abandoned_pass_leaves_the_accumulators_as_they_were(one_rank_group):
    params = _params()
    reducer, buckets = _reducer(params)
    g = [torch.randn(p.numel()) for p in params]
    _pass(reducer, params, g)
    before = [acc.clone() for acc in reducer.accum]
    # A backward that raised after some gradients arrived (one bucket already launched).
    _pass(reducer, params[:2], [torch.full((24,), 7.0), torch.full((10,), 7.0)], end=False)
    reducer.abandon_backward()
    for acc, old in zip(reducer.accum, before):
        assert torch.equal(acc, old)
    # A pass abandoned with no gradients before it leaves none (its results went straight in).
    reducer.zero()
    _pass(reducer, params[:2], [torch.full((24,), 7.0), torch.full((10,), 7.0)], end=False)
    reducer.abandon_backward()
    assert reducer.accum == [None, None]
    # The next pass works normally.
    _pass(reducer, params, g)
    for p, want in zip(params, g):
        torch.testing.assert_close(_accumulated(reducer, buckets, p), want, rtol=0, atol=0)


def test_a_second_gradient_after_its_bucket_was_sent_is_refused(one_rank_group):
    params = _params()
    reducer, _ = _reducer(params)
    reducer.begin_backward()
    for p in params:
        p.grad = torch.ones_like(p)
        reducer.on_grad(p)
    params[0].grad = torch.ones_like(params[0])
    with pytest.raises(RuntimeError, match="second gradient"):
        reducer.on_grad(params[0])
    reducer.abandon_backward()


def test_accumulation_dtype_is_honoured(one_rank_group):
    params = [torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))]
    reducer, buckets = _reducer(params, accum_dtype=torch.float32)
    g = torch.randn(8).to(torch.bfloat16)
    _pass(reducer, params, [g])
    assert all(acc.dtype == torch.float32 for acc in reducer.accum)
    _pass(reducer, params, [g])
    torch.testing.assert_close(reducer.accum[0][:8], 2 * g.float(), rtol=0, atol=0)


@pytest.mark.parametrize("shard_gradients", [True, False])
def test_accumulators_allocated_without_zero_fill_are_written_whole(one_rank_group, shard_gradients):
    """The first pass after zero_grad allocates the accumulators it writes whole without zero-filling
    them first. With torch's fill of uninitialised memory on (NaN for floats), every element must still
    be exact: gradients where they arrived, zeros for a parameter without one and for the gaps."""
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        assert torch.empty(4).isnan().all(), "the NaN fill this test relies on is off"
        params = _params()
        reducer, buckets = _reducer(params, shard_gradients)
        grads = [torch.randn(24), None, torch.randn(30)]
        for _ in range(2):  # a fresh allocation, then after zero_grad(set_to_none=True) again
            _pass(reducer, params, grads)
            assert all(not acc.isnan().any() for acc in reducer.accum), "an accumulator element was never written"
            for p, g in zip(params, grads):
                expected = torch.zeros(p.numel()) if g is None else g
                torch.testing.assert_close(_accumulated(reducer, buckets, p), expected, rtol=0, atol=0)
            reducer.zero()
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.utils.deterministic.fill_uninitialized_memory = before[1]
