"""zeroplus.ZeroRedundancyOptimizer API surface beyond step parity:
  * _checks: bad constructor inputs raise torch's exception types with messages naming the
    argument; state_dict() before consolidation; functional classes without overlap;
  * Join with uneven inputs (DDP + ZeRO in one Join) matches torch's ZeRO on 2 (gloo) and
    3 (zeroplus) ranks;
  * overlap_with_ddp=True: torch's hook_with_zero_step drives our optimizer on the zeroplus
    backend (parameters equal DDP + plain AdamW once the hook is initialised) and refuses Gloo
    with a clear RuntimeError;
  * DDP training with ours equals DDP training with torch's ZeRO.
"""

import pytest
import torch
from torch import nn

import zeroplus  # noqa: F401
from harness import run_pooled


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=g)


# -- _checks --------------------------------------------------------------------------------------

def _checks(rank, world_size):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.distributed.optim.utils import functional_optim_map

    from zeroplus import ZeroRedundancyOptimizer as Z

    p = torch.randn(3, requires_grad=True)
    q = torch.randn(2, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(2, 2).to_sparse().requires_grad_()
    functional_sgd = functional_optim_map[torch.optim.SGD]
    cases = [  # (constructor call for class Z, expected exception type)
        (lambda Z: Z(p, torch.optim.SGD, lr=0.1), TypeError),                          # bare tensor
        (lambda Z: Z(1.5, torch.optim.SGD, lr=0.1), TypeError),                        # not iterable
        (lambda Z: Z([], torch.optim.SGD, lr=0.1), ValueError),                        # empty
        (lambda Z: Z([p, 42], torch.optim.SGD, lr=0.1), TypeError),                    # non-tensor
        (lambda Z: Z([p, {"params": [p]}], torch.optim.SGD, lr=0.1), TypeError),       # mixed
        (lambda Z: Z([{"lr": 0.1}], torch.optim.SGD, lr=0.1), ValueError),             # no "params"
        (lambda Z: Z([p, q], torch.optim.SGD, lr=0.1), ValueError),                    # mixed dtypes
        (lambda Z: Z([sparse], torch.optim.SGD, lr=0.1), ValueError),                  # sparse
        (lambda Z: Z([p], functional_sgd, lr=0.1), ValueError),                        # functional w/o overlap
        (lambda Z: Z([p], torch.optim.LBFGS, overlap_with_ddp=True, lr=0.1), ValueError),  # no functional twin
        (lambda Z: Z([p], torch.optim.SGD, lr=-1.0), ValueError),                      # optimizer's own check
    ]
    out = []
    for make, exc in cases:
        got = []
        for cls in (Z, TorchZero):
            try:
                make(cls)
                got.append(None)
            except Exception as e:  # noqa: BLE001
                got.append((type(e), str(e)))
        out.append((exc, got[0], got[1]))
    # state_dict() before any step answers without consolidation (accelerate's prepare calls it),
    # in torch's consolidated format; after a step it needs consolidation again (torch's error,
    # with zeroplus's hint appended).
    w = torch.randn(2, requires_grad=True)
    z, t = Z([w], torch.optim.SGD, lr=0.1), TorchZero([w], torch.optim.SGD, lr=0.1)
    t.consolidate_state_dict(to=0)
    early = (z.state_dict(), t.state_dict())
    w.grad = torch.ones(2)
    z.step()
    try:
        z.state_dict()
        out.append((RuntimeError, None, None))
    except RuntimeError as e:
        torch_text = str(e).split(" zeroplus: ")[0]
        out.append((RuntimeError, (RuntimeError, torch_text), (RuntimeError, torch_text)))
    return out, early


def test_checks_raise_torch_errors_naming_the_argument():
    ((results, early),) = run_pooled(_checks, 1, backend="gloo", timeout=60)
    assert early[0] == early[1]
    for exc, ours, theirs in results:
        assert ours is not None, f"expected {exc.__name__}"
        assert issubclass(ours[0], exc), ours
        assert ours == theirs  # torch's type and text, word for word
    messages = [r[1][1] for r in results]
    assert "params" in messages[0] and "params" in messages[1] and "params" in messages[3]
    assert "not been consolidated" in messages[-1]
    assert "functional optimizer" in messages[8] and "functional optimizer" in messages[9]


# -- Join with uneven inputs ----------------------------------------------------------------------

def _join(rank, world_size):
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zeroplus import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    results = []
    for cls in (ZeroRedundancyOptimizer, TorchZero):
        ddp = DDP(_model())
        zero = cls(ddp.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
        with Join([ddp, zero]):
            for step in range(3 + 2 * rank):  # uneven: rank r sees 3 + 2r batches
                ddp(_batch(step, rank)).square().sum().backward()
                zero.step()
                zero.zero_grad()
        results.append([p.detach().clone() for p in ddp.parameters()])
    return results


@pytest.mark.parametrize("world_size,backend", [(2, "gloo"), (3, "gloo"), (3, "zeroplus")])
def test_join_uneven_inputs_matches_torch(world_size, backend):
    reports = run_pooled(_join, world_size, backend=backend, timeout=120)
    for ours, theirs in reports:
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for ours, _ in reports[1:]:
        for a, b in zip(ours, reports[0][0]):
            assert torch.equal(a, b)


# -- overlap_with_ddp -----------------------------------------------------------------------------

def _overlap(rank, world_size, expect_error):
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zeroplus import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    ddp = DDP(_model(), bucket_cap_mb=0.001)  # several buckets, so several ranks own some
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=1e-2)
    if expect_error:
        try:
            ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        except RuntimeError as e:
            return str(e)
        return None
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    ref = DDP(_model())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(8):
        x = _batch(step, rank)
        ddp(x).square().sum().backward()
        ref(x).square().sum().backward()
        if step >= 2:  # the hook initialises during the first two iterations and updates nothing
            ref_opt.step()
        ref_opt.zero_grad()
        ddp.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()], [p.detach().clone() for p in ref.parameters()]


def test_overlap_with_ddp_runs_on_zeroplus_backend():
    for ours, ref in run_pooled(_overlap, 2, False, backend="zeroplus", timeout=120):
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_overlap_with_ddp_refuses_gloo_clearly():
    for message in run_pooled(_overlap, 2, True, backend="gloo", timeout=120):
        assert message is not None and "Gloo" in message


# -- DDP training ---------------------------------------------------------------------------------

def _ddp_training(rank, world_size, bucket_view):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zeroplus import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    models = []
    for cls in (ZeroRedundancyOptimizer, TorchZero):
        ddp = DDP(_model())
        zero = cls(ddp.parameters(), torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=1e-2)
        for step in range(20):
            ddp(_batch(step, rank)).square().sum().backward()
            zero.step()
            zero.zero_grad()
        models.append([p.detach().clone() for p in ddp.parameters()])
    return models


@pytest.mark.parametrize("bucket_view", [False, True])
def test_ddp_training_matches_torch_zero(bucket_view):
    for ours, theirs in run_pooled(_ddp_training, 3, bucket_view, backend="zeroplus", timeout=120):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
