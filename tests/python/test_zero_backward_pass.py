"""BackwardPass (zeroplus/zero/backward_pass.py) on one process, with recording participants: the
order contract the reducer and the gatherer rely on, and what happens when a backward raises."""

from __future__ import annotations

import pytest
import torch

from zeroplus.zero.backward_pass import BackwardPass, PassState


class Recorder:
    def __init__(self, name: str, log: list, fail_end: bool = False):
        self.name, self.log, self.fail_end = name, log, fail_end

    def begin_backward(self):
        self.log.append((self.name, "begin"))

    def on_grad(self, param):
        self.log.append((self.name, "grad", param.tag))

    def end_backward(self):
        self.log.append((self.name, "end"))
        if self.fail_end:
            raise RuntimeError(f"{self.name} failed at the end of backward")

    def abandon_backward(self):
        self.log.append((self.name, "abandon"))


def _params():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    a.tag, b.tag = "a", "b"
    return a, b


def _loss_whose_backward_raises(a, b):
    """a's gradient is accumulated (its hook runs, the pass opens), then backward raises: the
    raising node is created first, so autograd (later nodes first) reaches it last."""
    raising = _RaiseInBackward.apply(b * 1.0).sum()
    return raising + (a * 2).sum()


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("a backward that raises")


def test_one_hook_per_parameter_and_one_end_in_attach_order():
    log = []
    bp = BackwardPass()
    a, b = _params()
    first, second = Recorder("reducer", log), Recorder("gatherer", log)
    bp.attach(first, [a, b])
    bp.attach(second, [a])
    ((a * 2).sum() + (b * 3).sum()).backward()
    assert bp.state is PassState.IDLE
    assert log[:2] == [("reducer", "begin"), ("gatherer", "begin")]
    grads = [e for e in log if e[1] == "grad"]
    # each parameter: the reducer first, then the gatherer (only for what it attached)
    assert ("reducer", "grad", "a") in grads and ("reducer", "grad", "b") in grads
    assert grads.index(("reducer", "grad", "a")) + 1 == grads.index(("gatherer", "grad", "a"))
    assert ("gatherer", "grad", "b") not in grads
    assert log[-2:] == [("reducer", "end"), ("gatherer", "end")]
    assert sum(1 for e in log if e[1] == "end") == 2  # one callback for the whole backward
    assert len(a._post_accumulate_grad_hooks) == 1  # one hook per parameter, however many participants


def test_a_backward_that_raises_is_abandoned_at_the_next_one():
    log = []
    bp = BackwardPass()
    a, b = _params()
    bp.attach(Recorder("reducer", log), [a, b])
    bp.attach(Recorder("gatherer", log), [a, b])
    with pytest.raises(ValueError, match="raises"):
        _loss_whose_backward_raises(a, b).backward()
    assert bp.state is PassState.RUNNING  # autograd dropped the queued end callback
    assert ("reducer", "end") not in log
    log.clear()
    (a.sum() + b.sum()).backward()
    assert log[:4] == [("reducer", "abandon"), ("gatherer", "abandon"), ("reducer", "begin"), ("gatherer", "begin")]
    assert log[-2:] == [("reducer", "end"), ("gatherer", "end")]
    assert bp.state is PassState.IDLE


def test_close_stale_outside_backward_abandons_and_is_a_no_op_when_idle():
    log = []
    bp = BackwardPass()
    a, b = _params()
    bp.attach(Recorder("reducer", log), [a, b])
    bp.close_stale()
    assert log == []
    with pytest.raises(ValueError):
        _loss_whose_backward_raises(a, b).backward()
    log.clear()
    bp.close_stale()
    assert log == [("reducer", "abandon")] and bp.state is PassState.IDLE


def test_an_end_that_raises_still_ends_the_others_and_propagates():
    log = []
    bp = BackwardPass()
    a, _b = _params()
    bp.attach(Recorder("reducer", log, fail_end=True), [a])
    bp.attach(Recorder("gatherer", log), [a])
    with pytest.raises(RuntimeError, match="reducer failed"):
        a.sum().backward()
    assert log[-2:] == [("reducer", "end"), ("gatherer", "end")]
    assert bp.state is PassState.IDLE


def test_remove_hooks():
    log = []
    bp = BackwardPass()
    a, _b = _params()
    bp.attach(Recorder("reducer", log), [a])
    bp.remove_hooks()
    a.sum().backward()
    assert log == []
