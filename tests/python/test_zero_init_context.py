"""zeroplus.init_context(): a model built under it holds only shards from the start, has the
values the same code gives without the context, and trains like that model at stage 3.

The oracle is the same constructor run without the context under the same seed: parameters must
be bitwise equal after zeroplus.initialize (and the global generator must end in the same
state), then both copies train 10 stage-3 steps side by side and stay within 1e-5.
"""

import pytest
import torch

from harness import run_distributed, run_pooled

LR = 3e-3
STAGE3 = {"param_persistence_threshold": 100}


def _build(make, seed, context):
    import zeroplus

    torch.manual_seed(seed)
    if not context:
        return make(), torch.get_rng_state()
    with zeroplus.init_context():
        model = make()
    return model, torch.get_rng_state()


def _parity(rank, world, which):
    import zeroplus
    import zero_models as zm

    make = {"init_gpt": zm.InitGPT, "tied_gpt": zm.TiedGPT}[which]
    ref, ref_rng = _build(make, 0, context=False)
    model, rng = _build(make, 0, context=True)
    # Seeded per rank, the context still gives rank 0's values (as DDP's broadcast does).
    other, _ = _build(make, 100 + rank, context=True)
    want_other = _build(make, 100, context=False)[0].state_dict()
    on_meta = all(p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="init_context"):
        zeroplus.initialize(model, torch.optim.AdamW, stage=2, lr=LR)
    want = ref.state_dict()
    ref, ref_opt = zeroplus.initialize(ref, torch.optim.AdamW, stage=3, lr=LR, **STAGE3)
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=LR, **STAGE3)
    other, _ = zeroplus.initialize(other, torch.optim.AdamW, stage=3, lr=LR, **STAGE3)
    built = zeroplus.full_state_dict(model, rank0_only=False)
    built_other = zeroplus.full_state_dict(other, rank0_only=False)
    exact = list(built) == list(want) and all(torch.equal(built[k], v) for k, v in want.items())
    exact_other = all(torch.equal(built_other[k], v) for k, v in want_other.items())
    for step in range(10):
        x, y = zm.batch(step, rank)
        for m, o in ((ref, ref_opt), (model, opt)):
            o.backward(zm.loss_fn(m, x, y))
            o.step()
            o.zero_grad()
    a = zeroplus.full_state_dict(model, rank0_only=False)
    b = zeroplus.full_state_dict(ref, rank0_only=False)
    diff = max((a[k] - b[k]).abs().max().item() for k in b)
    moved = max((a[k] - want[k]).abs().max().item() for k in want)
    return on_meta, exact, torch.equal(rng, ref_rng), exact_other, diff, moved


@pytest.mark.parametrize("which", ["init_gpt", "tied_gpt"])
def test_model_built_under_init_context_matches_and_trains_like_the_plain_build(which):
    for on_meta, exact, same_rng, exact_other, diff, moved in run_pooled(_parity, 2, which,
                                                                                       timeout=300):
        assert on_meta  # between the context and initialize a parameter is a meta tensor
        assert exact, "values differ from the build without the context"
        assert same_rng, "the global generator ended in another state"
        assert exact_other, "a per-rank seed did not give rank 0's values"
        assert diff < 1e-5 and moved > 1e-4


def _bad_input(rank, world):
    import zeroplus
    import zero_models as zm

    out = []
    for kwargs, exc, match in [(dict(process_group=3), TypeError, "process_group"),
                               (dict(enabled="yes"), TypeError, "enabled")]:
        with pytest.raises(exc, match=match):
            with zeroplus.init_context(**kwargs):
                pass
    with zeroplus.init_context():
        with pytest.raises(RuntimeError, match="nest"):
            with zeroplus.init_context():
                pass
        model = zm.InitGPT()
    with zeroplus.init_context(enabled=False):
        plain = zm.InitGPT()
    out.append(all(p.is_meta for p in model.parameters()))
    out.append(not any(p.is_meta for p in plain.parameters()))
    # Outside the context nothing is intercepted any more.
    out.append(torch.nn.Linear(4, 4).weight.device.type == "cpu")
    with pytest.raises(ValueError, match="init_context"):
        zeroplus.initialize(model, torch.optim.AdamW, stage=1, lr=LR, mixed_precision="bf16")
    return out


def test_init_context_bad_arguments_and_other_stages_are_refused():
    for out in run_pooled(_bad_input, 2, timeout=180):
        assert all(out), out


def _vm_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _stack(width: int, depth: int):
    from torch import nn

    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])


def _peak_rss(rank, world, width, depth):
    import zeroplus

    with zeroplus.init_context():
        warm_up = _stack(64, 2)
    # One-off costs (kernel code pages, the backend's buffers) before the measurement.
    zeroplus.initialize(warm_up, torch.optim.SGD, stage=3, lr=0.1, param_persistence_threshold=0)
    full_bytes = width * width * depth * 4
    before = _vm_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset this process's peak RSS (VmHWM) to its current RSS
    with zeroplus.init_context():
        model = _stack(width, depth)
    built = _vm_bytes("VmHWM") - before
    zeroplus.initialize(model, torch.optim.SGD, stage=3, lr=0.1, param_persistence_threshold=0)
    initialized = _vm_bytes("VmHWM") - before
    plain = None
    if rank == 0:  # the same measurement sees a plain build grow by the full model
        before = _vm_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        model = _stack(width, depth)
        plain = _vm_bytes("VmHWM") - before
    return built, initialized, plain, full_bytes


def test_construction_under_init_context_never_holds_the_full_model():
    # 64 Linear(1024, 1024): 256 MiB fp32 in full. Each of 4 ranks keeps 64 MiB of shards and
    # holds one 4 MiB parameter in full at a time while building; initialize then re-lays the
    # shards out one unit at a time.
    for built, initialized, plain, full_bytes in run_distributed(_peak_rss, 4, 1024, 64, timeout=420):
        assert built < 0.35 * full_bytes, (built, full_bytes)
        assert initialized < 0.6 * full_bytes, (initialized, full_bytes)
        if plain is not None:
            assert plain > 0.9 * full_bytes, (plain, full_bytes)
