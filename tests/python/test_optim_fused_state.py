"""Fused Adam/AdamW/SGD: the cached step plan follows the live param_groups, and optimizer state
and hyperparameters are validated before anything moves.

* A parameter replaced in place in `param_groups[i]["params"]` (or the list reordered, grown or
  shrunk) is stepped like torch.optim does, not the tensor the plan cached.
* State loaded without a key torch requires raises KeyError naming it; a state tensor of the
  wrong shape (same numel) raises RuntimeError naming key and shapes; a hyperparameter set out
  of range after construction (NaN or negative lr, ...) raises ValueError naming it and its
  value. In every case params and state, `step` included, are left as they were.
"""

import copy

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


# -- state and hyperparameter validation ---------------------------------------------------------

def _trained(name, steps=2):
    ours_cls, _, kwargs = PAIRS[name]
    params = _params()
    opt = ours_cls(params, **kwargs)
    for seed in range(steps):
        _grads(params, seed)
        opt.step()
    _grads(params, 99)
    return params, opt


def _snapshot(params, opt):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])


def _assert_unchanged(params, opt, snapshot):
    before_params, before_state = snapshot
    for p, q in zip(params, before_params):
        assert torch.equal(p.detach(), q)
    after = opt.state_dict()["state"]
    assert after.keys() == before_state.keys()
    for k in after:
        assert after[k].keys() == before_state[k].keys(), k
        for key in after[k]:
            assert torch.equal(torch.as_tensor(after[k][key]), torch.as_tensor(before_state[k][key])), (k, key)


@pytest.mark.parametrize("missing", ["exp_avg_sq", "exp_avg", "step", "max_exp_avg_sq"])
def test_load_state_missing_a_key_raises_key_error_naming_it(missing):
    params, opt = _trained("adam")
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][1][missing]
    # torch raises KeyError too (the bare key): at load for 'step' (after replacing the state),
    # at the step otherwise. zeroplus raises at the same point, before changing anything.
    at_load = missing == "step"
    ref = torch.optim.Adam(_params(), lr=1e-2, amsgrad=True)
    _grads(ref.param_groups[0]["params"], 0)
    with pytest.raises(KeyError):
        ref.load_state_dict(sd)
        ref.step()
    snapshot = _snapshot(params, opt)
    with pytest.raises(KeyError, match=rf"'{missing}'.*param_groups\[0\]\['params'\]\[1\]"):
        opt.load_state_dict(sd)
        assert not at_load
        snapshot = _snapshot(params, opt)
        opt.step()
    _assert_unchanged(params, opt, snapshot)


@pytest.mark.parametrize("name,key", [("adam", "exp_avg"), ("adamw", "exp_avg_sq"), ("adam", "max_exp_avg_sq"),
                                      ("sgd", "momentum_buffer")])
def test_state_tensor_of_another_shape_is_rejected(name, key):
    params, opt = _trained(name)
    sd = opt.state_dict()
    sd["state"][1][key] = sd["state"][1][key].reshape(4, 3)  # param 1 is (3, 4): same numel
    opt.load_state_dict(sd)
    snapshot = _snapshot(params, opt)
    with pytest.raises(RuntimeError, match=rf"{key}.*param_groups\[0\]\['params'\]\[1\].*\[4, 3\].*\[3, 4\]"):
        opt.step()
    _assert_unchanged(params, opt, snapshot)


BAD_HPARAMS = [
    ("adam", "lr", float("nan")), ("adam", "lr", -1e-3), ("adamw", "eps", -1.0),
    ("adamw", "weight_decay", -0.1), ("adam", "betas", (0.9, 1.0)), ("adamw", "betas", (float("nan"), 0.999)),
    ("sgd", "lr", float("nan")), ("sgd", "lr", -0.5), ("sgd", "momentum", -0.9), ("sgd", "weight_decay", -1.0),
    ("sgd", "dampening", float("nan")),
]


@pytest.mark.parametrize("name,field,value", BAD_HPARAMS)
def test_out_of_range_hyperparameter_raises_and_changes_nothing(name, field, value):
    params, opt = _trained(name)
    opt.param_groups[0][field] = value
    snapshot = _snapshot(params, opt)
    shown = str(value[1] if field == "betas" and value[0] == 0.9 else value[0] if field == "betas" else value)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['{field}'\].*{shown}"):
        opt.step()
    _assert_unchanged(params, opt, snapshot)


@pytest.mark.parametrize("field,value", [("lr", float("nan")), ("lr", -0.1), ("beta1", 1.0), ("beta2", -0.5),
                                         ("eps", -1.0), ("weight_decay", float("nan"))])
def test_adam_op_names_the_bad_hyperparameter_and_keeps_step(field, value):
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    args[field] = value
    p, step = torch.ones(3), torch.tensor(4.0)
    with pytest.raises(ValueError, match=rf"zeroplus.adam_step: {field} is {value:g}"):
        torch.ops.zeroplus.adam_step([p], [torch.ones(3)], [torch.zeros(3)], [torch.zeros(3)], [], [step], **args)
    assert step.item() == 4.0 and torch.equal(p, torch.ones(3))


@pytest.mark.parametrize("index,value", [(0, -0.1), (1, -0.9), (3, float("nan"))])
def test_sgd_op_names_the_bad_hyperparameter(index, value):
    args = [0.1, 0.9, 0.0, 0.0, False, False]
    args[index] = value
    field = ["lr", "momentum", "dampening", "weight_decay"][index]
    p = torch.ones(3)
    with pytest.raises(ValueError, match=rf"zeroplus.sgd_step: {field} is {value:g}"):
        torch.ops.zeroplus.sgd_step([p], [torch.ones(3)], [torch.zeros(3)], [True], *args)
    assert torch.equal(p, torch.ones(3))
