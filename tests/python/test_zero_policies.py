"""EngineOptions / PrecisionPolicy / Stage3Policy (zeroplus/zero/policies.py) on one process: bad
values raise ValueError/TypeError naming the field before any engine exists, and an engine given
something that is not an EngineOptions says so."""

from __future__ import annotations

import pytest
import torch

from zeroplus.zero import EngineOptions, PrecisionPolicy, Stage2Optimizer, Stage3Policy


@pytest.mark.parametrize("make,exc,field", [
    (lambda: PrecisionPolicy(mixed_precision="fp8"), ValueError, "mixed_precision"),
    (lambda: PrecisionPolicy(grad_accum_dtype=torch.int32), TypeError, "grad_accum_dtype"),
    (lambda: Stage3Policy(prefetch_bucket_size=-1), ValueError, "prefetch_bucket_size"),
    (lambda: Stage3Policy(max_live_parameters=float("nan")), ValueError, "max_live_parameters"),
    (lambda: Stage3Policy(param_persistence_threshold=True), ValueError, "param_persistence_threshold"),
    (lambda: Stage3Policy(reshard_after_forward=1), TypeError, "reshard_after_forward"),
    (lambda: Stage3Policy(param_init_fn=3), TypeError, "param_init_fn"),
    (lambda: EngineOptions(reduce_bucket_elems=0), ValueError, "reduce_bucket_elems"),
    (lambda: EngineOptions(reduce_bucket_elems=2.5), ValueError, "reduce_bucket_elems"),
    (lambda: EngineOptions(gradient_clipping=-1.0), ValueError, "gradient_clipping"),
    (lambda: EngineOptions(precision="bf16"), TypeError, "precision"),
    (lambda: EngineOptions(stage3={}), TypeError, "stage3"),
])
def test_bad_values_name_the_field(make, exc, field):
    with pytest.raises(exc, match=field):
        make()


def test_defaults_are_deepspeeds_and_policies_are_frozen():
    options = EngineOptions()
    assert options.reduce_bucket_elems == 1 << 22 and options.gradient_clipping == 0.0
    assert options.precision.compute_dtype is None and PrecisionPolicy("bf16").compute_dtype is torch.bfloat16
    assert (options.stage3.prefetch_bucket_size, options.stage3.max_live_parameters,
            options.stage3.param_persistence_threshold) == (None, 1_000_000_000, 100_000)
    with pytest.raises(AttributeError):
        options.reduce_bucket_elems = 5  # frozen: an engine's settings cannot change under it


def test_an_engine_refuses_options_of_another_type():
    with pytest.raises(TypeError, match="options must be a zeroplus.zero.EngineOptions"):
        Stage2Optimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.AdamW, options={"reduce_bucket_elems": 4})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_max_abs_and_all_finite_match_the_elementwise_definitions(dtype):
    """clipping.max_abs (one min/max pass) is abs().max() bit for bit, the inf-norm clipping and
    the gradient spill use; all_finite is isfinite().all(), fp16's overflow check."""
    from zeroplus.zero import clipping

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4097, generator=g) * 300).to(dtype)
    assert clipping.max_abs(x).item() == x.abs().max().float().item()
    assert clipping.max_abs(-x.abs()).item() == x.abs().max().float().item()  # the maximum is a negative value
    assert clipping.all_finite(x) and clipping.all_finite(x[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[4000] = bad
        assert not clipping.all_finite(y), bad
        assert clipping.all_finite(y) == bool(torch.isfinite(y).all())
