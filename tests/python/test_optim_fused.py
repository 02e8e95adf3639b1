"""Fused Adam/AdamW/SGD (zeroplus.optim) against torch.optim on one process: every option
combination over 50 steps (fp32: rtol 1e-6), bf16/fp16 params with fp32 state, the generic
fallback, state_dict interchange, and the ops' error messages (_checks)."""

import itertools

import pytest
import torch

import zeroplus  # noqa: F401  (loads libzeroplus.so)
from zeroplus.optim import SGD, Adam, AdamW

STEPS = 50
SHAPES = [(7,), (33, 5), (1,), (1000,), (2, 3, 17)]  # odd sizes exercise the SIMD tails


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def _run_pair(ours_cls, torch_cls, kwargs, dtype=torch.float32, ref_dtype=torch.float32):
    ours = _params(dtype)
    ref = [p.detach().to(ref_dtype).clone().requires_grad_() for p in ours]  # never share storage
    opt_a, opt_b = ours_cls(ours, **kwargs), torch_cls(ref, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p, q in zip(ours, ref):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.to(dtype), grad.to(dtype).to(ref_dtype)
        opt_a.step()
        opt_b.step()
    return ours, ref, opt_a, opt_b


ADAM_COMBOS = list(itertools.product([False, True], [False, True], [0.0, 0.1]))


@pytest.mark.parametrize("amsgrad,maximize,weight_decay", ADAM_COMBOS)
@pytest.mark.parametrize("pair", [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)], ids=["adam", "adamw"])
def test_adam_parity_fp32(pair, amsgrad, maximize, weight_decay):
    kwargs = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, amsgrad=amsgrad, maximize=maximize, weight_decay=weight_decay)
    ours, ref, opt_a, opt_b = _run_pair(*pair, kwargs)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    for p, q in zip(ours, ref):
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys()
        assert sa["step"].dtype == sb["step"].dtype and sa["step"].item() == sb["step"].item() == STEPS
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], rtol=1e-5, atol=1e-6)


SGD_COMBOS = [
    dict(momentum=m, dampening=d, nesterov=n, weight_decay=wd, maximize=mx)
    for (m, d, n), wd, mx in itertools.product(
        [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.3, False), (0.9, 0.0, True)], [0.0, 0.01], [False, True])
]


@pytest.mark.parametrize("kwargs", SGD_COMBOS, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_sgd_parity_fp32(kwargs):
    ours, ref, opt_a, opt_b = _run_pair(SGD, torch.optim.SGD, dict(lr=0.05, **kwargs))
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        if kwargs["momentum"]:
            torch.testing.assert_close(opt_a.state[p]["momentum_buffer"], opt_b.state[q]["momentum_buffer"],
                                       rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pair", [(AdamW, torch.optim.AdamW), (SGD, torch.optim.SGD)], ids=["adamw", "sgd"])
def test_low_precision_params_with_fp32_state(pair, dtype):
    # One step against torch on an fp32 copy: the result is torch's fp32 update rounded once.
    kwargs = dict(lr=1e-2, weight_decay=0.01) if pair[0] is AdamW else dict(lr=0.05, momentum=0.9)
    ours = _params(dtype)
    ref = [p.detach().float().clone().requires_grad_() for p in ours]
    opt_a, opt_b = pair[0](ours, **kwargs), pair[1](ref, **kwargs)
    for p, q in zip(ours, ref):
        p.grad = torch.randn(p.shape).to(dtype)
        q.grad = p.grad.float()
    opt_a.step()
    opt_b.step()
    for p, q in zip(ours, ref):
        assert p.dtype == dtype
        torch.testing.assert_close(p.float(), q.to(dtype).float(), rtol=1e-2, atol=1e-3)
        for key, t in opt_a.state[p].items():
            if key != "step":
                assert t.dtype == torch.float32, key


def test_generic_fallback_for_float64_and_sparse():
    ours, ref, _, _ = _run_pair(AdamW, torch.optim.AdamW, dict(lr=1e-2), dtype=torch.float64, ref_dtype=torch.float64)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # torch's own code ran


def test_closure_runs_before_grads_are_read():
    p = torch.ones(3, requires_grad=True)
    opt = SGD([p], lr=0.5)

    def closure():
        opt.zero_grad()
        loss = (p * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    torch.testing.assert_close(p.detach(), torch.zeros(3))


def test_state_dict_round_trip_with_torch():
    ours, ref, opt_a, opt_b = _run_pair(Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True))
    fresh = torch.optim.Adam([p.detach().clone().requires_grad_() for p in ours], lr=1e-2, amsgrad=True)
    fresh.load_state_dict(opt_a.state_dict())  # ours -> torch
    back = Adam(ours, lr=1e-2, amsgrad=True)
    back.load_state_dict(opt_b.state_dict())  # torch -> ours, then keeps stepping
    for p in ours:
        p.grad = torch.ones_like(p)
    back.step()
    assert back.state[ours[0]]["step"].item() == STEPS + 1


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


def test_op_errors_name_the_argument():
    op = torch.ops.zeroplus.adamw_step
    ok = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    params = [_t(3), _t(3), _t(3), _t(4, dtype=torch.float64)]
    with pytest.raises(RuntimeError, match=r"zeroplus.adamw_step: params\[3\] is .*expected float32/bfloat16/float16"):
        op(params, [_t(3)] * 3 + [_t(4, dtype=torch.float64)], [_t(3)] * 4, [_t(3)] * 4, [], [torch.tensor(0.0)] * 4, **ok)
    with pytest.raises(RuntimeError, match=r"grads\[0\] has 2 elements, expected 3"):
        op([_t(3)], [_t(2)], [_t(3)], [_t(3)], [], [torch.tensor(0.0)], **ok)
    with pytest.raises(RuntimeError, match=r"exp_avgs has 0 tensors, expected 1"):
        op([_t(3)], [_t(3)], [], [_t(3)], [], [torch.tensor(0.0)], **ok)
    with pytest.raises(RuntimeError, match=r"exp_avg_sqs\[0\] is .*expected Float"):
        op([_t(3)], [_t(3)], [_t(3)], [_t(3, dtype=torch.bfloat16)], [], [torch.tensor(0.0)], **ok)
    with pytest.raises(RuntimeError, match="not contiguous"):
        op([_t(3, 2).t()], [_t(2, 3)], [_t(2, 3)], [_t(2, 3)], [], [torch.tensor(0.0)], **ok)
    step = torch.tensor(0.0)
    with pytest.raises(ValueError, match="zeroplus.adamw_step: beta2 is 1.5, expected in"):
        op([_t(3)], [_t(3)], [_t(3)], [_t(3)], [], [step], **dict(ok, beta2=1.5))
    assert step.item() == 0.0  # rejected before the step counter moves
    with pytest.raises(RuntimeError, match=r"nesterov requires"):
        torch.ops.zeroplus.sgd_step([_t(3)], [_t(3)], [_t(3)], [True], 0.1, 0.0, 0.0, 0.0, True, False)


def test_cpu_isa_reports_a_known_name():
    assert torch.ops.zeroplus.cpu_isa() in ("scalar", "avx2", "avx512")
