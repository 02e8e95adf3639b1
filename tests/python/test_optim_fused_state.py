"""Fused Adam/AdamW/SGD: the cached step plan follows the live param_groups.

* A parameter replaced in place in `param_groups[i]["params"]` (or the list reordered, grown or
  shrunk) is stepped like torch.optim does, not the tensor the plan cached.
"""

import pytest
import torch

import zeroplus  # noqa: F401  (loads libzeroplus.so)
from zeroplus.optim import SGD, Adam, AdamW

PAIRS = {
    "adam": (Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "adamw": (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
}


def _params(seed=0, shapes=((5,), (3, 4), (7,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _step_both(pairs, seed):
    for params, opt in pairs:
        _grads(opt.param_groups[0]["params"], seed)
        opt.step()


# -- the plan follows param_groups -----------------------------------------------------------------

EDITS = {
    "replace": lambda ps, new: ps.__setitem__(0, new),
    "swap": lambda ps, new: ps.__setitem__(slice(0, 2), [ps[1], ps[0]]),
    "append": lambda ps, new: ps.append(new),
    "remove": lambda ps, new: ps.pop(1),
    "replace_all": lambda ps, new: ps.__setitem__(slice(None), [new] + ps[1:]),
}


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("name", PAIRS)
def test_in_place_edit_of_params_list_is_followed(name, edit):
    ours_cls, torch_cls, kwargs = PAIRS[name]
    ours, ref = _params(), _params()
    opt_a, opt_b = ours_cls(ours, **kwargs), torch_cls(ref, **kwargs)
    for seed in range(3):  # the fused plan is cached after the first step
        _step_both([(ours, opt_a), (ref, opt_b)], seed)
    new_a, new_b = torch.full((4, 2), 0.5, requires_grad=True), torch.full((4, 2), 0.5, requires_grad=True)
    EDITS[edit](opt_a.param_groups[0]["params"], new_a)
    EDITS[edit](opt_b.param_groups[0]["params"], new_b)
    old_a, old_b = ours[0].detach().clone(), ref[0].detach().clone()
    for seed in range(3, 6):
        _step_both([(ours, opt_a), (ref, opt_b)], seed)
    for a, b in zip(opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if edit in ("replace", "replace_all"):  # the dropped tensor is no longer stepped, as in torch
        assert torch.equal(ours[0].detach(), old_a) and torch.equal(ref[0].detach(), old_b)
        assert not torch.equal(new_a.detach(), torch.full((4, 2), 0.5))
