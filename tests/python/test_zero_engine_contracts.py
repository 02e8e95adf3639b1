"""ZeRO stage 2/3 engine contracts beyond plain parity (test_zero_stage2.py, test_zero_stage3.py):
recomputation while units are prefetched and resharded, a user unit policy, the live-parameter
limit, buffer reuse, what a user reads between steps (full_state_dict copies, no stale
gathered weights, rank 0's buffers), and training on after a backward that raised. DDP +
torch.optim.AdamW on the same batches is the oracle throughout."""

import copy

import pytest
import torch
from torch import nn

from harness import run_pooled
from sharding import SHARD_ALL, assert_sharded

LR = 3e-3
THRESHOLD = 100  # LayerNorm weights stay whole (the persistent path), everything else is sharded


def _full_diff(model, ref):
    import zeroplus

    full = zeroplus.full_state_dict(model, rank0_only=False)
    return max((full[k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items())


def _sharded_numel(module):
    return sum(p.numel() for p in module.parameters() if p.numel() > THRESHOLD)


def _assert_above_threshold_sharded(model, opt):
    """Every parameter above THRESHOLD sharded on this rank (the others are kept whole)."""
    return assert_sharded(model, opt, [n for n, p in model.named_parameters() if p.numel() > THRESHOLD],
                          at_least=4)


def _checkpoint_policy_limit(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zeroplus
    import zero_models as zm

    model = zm.make_model(checkpoint=True, layers=4)
    ref = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    # Room for the root unit and two blocks: prefetch may run one block ahead, never the whole
    # model (which the default 50M-element prefetch would gather at once).
    block = _sharded_numel(model.blocks.layers[0])
    root = _sharded_numel(model) - 4 * block
    max_live = root + 2 * block + block // 2  # + room for the padding of each flat buffer
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=LR, param_persistence_threshold=THRESHOLD,
                                     unit_classes=[nn.TransformerEncoderLayer], max_live_parameters=max_live)
    _assert_above_threshold_sharded(model, opt)
    unit_names = [u.name for u in opt.units]
    for step in range(12):
        x, y = zm.batch(step, rank)
        for m, o in ((ref, ref_opt), (model, opt)):
            zm.loss_fn(m, x, y).backward()
            o.step()
            o.zero_grad()
    return (_full_diff(model, ref.module), unit_names, opt.gatherer.peak_live_elems, max_live,
            dict(opt.gatherer.stats), opt.gatherer.pool.reused, opt.reducer.pool.reused, opt.gatherer.live_elems)


def test_checkpointing_with_prefetch_a_unit_policy_and_the_live_limit_match_ddp():
    for diff, names, peak, max_live, stats, gather_reused, reduce_reused, live in run_pooled(
            _checkpoint_policy_limit, 2, timeout=420):
        assert diff < 1e-5
        # unit_classes: one unit per encoder layer, the root takes the rest (embedding, norm, head).
        assert names == [f"blocks.layers.{i}" for i in range(4)] + [""]
        assert stats["prefetched"] > 0 and 0 < peak <= max_live
        # Released unit buffers and reduce-scatter inputs serve the next ones (buffer_pool.py).
        assert gather_reused > 0 and reduce_reused > 0
        assert live == 0


def _default_prefetch_depth(rank, world):
    import zeroplus
    import zero_models as zm

    peaks = {}
    for label, knobs in (("default", {}), ("deepspeed_budget", {"prefetch_bucket_size": 50_000_000})):
        model = zm.make_model(layers=4)
        block = _sharded_numel(model.blocks.layers[0])
        root = _sharded_numel(model) - 4 * block
        model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=LR, param_persistence_threshold=THRESHOLD,
                                         unit_classes=[nn.TransformerEncoderLayer], **knobs)
        _assert_above_threshold_sharded(model, opt)
        for step in range(3):  # step 0 records the order, the next ones prefetch by it
            x, y = zm.batch(step, rank)
            zm.loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        peaks[label] = (opt.gatherer.peak_live_elems, opt.gatherer.stats["prefetched"])
    return peaks, root, block


def test_default_prefetch_runs_one_unit_ahead_and_an_element_budget_is_deepspeeds():
    for peaks, root, block in run_pooled(_default_prefetch_depth, 2, timeout=300):
        pad = block // 2  # room for the padding of each flat buffer
        # Default (FSDP2's depth): the root, the block in use and the next one, never the model.
        peak, prefetched = peaks["default"]
        assert prefetched > 0 and peak <= root + 2 * block + pad, (peak, root, block)
        # An explicit element budget is DeepSpeed's: 5e7 elements gather this whole model ahead.
        peak, prefetched = peaks["deepspeed_budget"]
        assert prefetched > 0 and peak >= root + 4 * block, (peak, root, block)


def _between_steps(rank, world, stage):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zeroplus
    import zero_models as zm

    model = zm.make_model()
    ref = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    knobs = {"param_persistence_threshold": THRESHOLD, "reshard_after_forward": False} if stage == 3 else {}
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=stage, lr=LR, **knobs)
    if stage == 3:
        _assert_above_threshold_sharded(model, opt)
    x, y = zm.batch(0, rank)
    for m, o in ((ref, ref_opt), (model, opt)):
        zm.loss_fn(m, x, y).backward()
        o.step()
        o.zero_grad()
    # What full_state_dict returns belongs to the caller: training on must not change it.
    saved = zeroplus.full_state_dict(model, rank0_only=False)
    frozen = {k: v.clone() for k, v in saved.items()}
    # A forward with grad enabled whose backward never comes (reshard_after_forward=False holds
    # its units), then the step of the previous backward: the gathered copies must not survive
    # the step with the old values.
    x, y = zm.batch(1, rank)
    for m in (ref, model):
        zm.loss_fn(m, x, y).backward()
    zm.loss_fn(model, x, y)
    ref_opt.step()
    opt.step()
    unchanged = max((saved[k] - frozen[k]).abs().max().item() for k in saved)
    # Direct use of a submodule after the step sees the new weights.
    probe = torch.randn(2, 16, 32)
    with torch.no_grad():
        direct = (model.blocks.layers[0](probe) - ref.module.blocks.layers[0](probe)).abs().max().item()
    after_step = _full_diff(model, ref.module)
    return unchanged, after_step, direct


@pytest.mark.parametrize("stage", [2, 3])
def test_full_state_dict_is_a_copy_and_no_stale_gathered_weights_survive_a_step(stage):
    for unchanged, after_step, direct in run_pooled(_between_steps, 2, stage, timeout=300):
        assert unchanged == 0.0
        assert after_step < 1e-5
        assert direct < 1e-5


def _buffers(rank, world):
    import zeroplus
    import zero_models as zm

    model = zm.make_model()
    model.register_buffer("calibration", torch.full((5,), float(rank + 1)))  # differs per rank
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=LR, config=SHARD_ALL)
    sharded = assert_sharded(model, opt)  # buffers beside sharded parameters, not a stage-2 model
    return (model.calibration.tolist(), zeroplus.full_state_dict(model, rank0_only=False)["calibration"].tolist(),
            len(sharded))


def test_buffers_take_rank0_values_at_initialize():
    for live, saved, sharded in run_pooled(_buffers, 2, timeout=300):
        assert live == saved == [1.0] * 5
        assert sharded > 10


def _after_failed_backward(rank, world, stage):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zeroplus
    import zero_models as zm

    model = zm.make_model(layers=3)
    ref = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    # Small buckets: the blocks after the failing point are reduce-scattered before it fails.
    zero_cfg = {"stage": stage, "reduce_bucket_size": 2000}
    if stage == 3:
        zero_cfg["stage3_param_persistence_threshold"] = THRESHOLD
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, lr=LR, config={"zero_optimization": zero_cfg})
    if stage == 3:
        _assert_above_threshold_sharded(model, opt)

    def fail(_grad):
        raise RuntimeError("injected failure in backward")

    def arm(_module, _args, out):
        out.register_hook(fail)  # returns None: the output stays as it is

    handle = model.blocks.layers[0].register_forward_hook(arm)
    x, y = zm.batch(0, rank)
    try:
        zm.loss_fn(model, x, y).backward()
        raised = False
    except RuntimeError as e:
        raised = "injected failure" in str(e)
    handle.remove()
    # The user goes on without zero_grad (the failed backward produced nothing to step with).
    for step in range(1, 6):
        x, y = zm.batch(step, rank)
        for m, o in ((ref, ref_opt), (model, opt)):
            zm.loss_fn(m, x, y).backward()
            o.step()
            o.zero_grad()
    live = opt.gatherer.live_elems if stage == 3 else 0
    return raised, _full_diff(model, ref.module), live


@pytest.mark.parametrize("stage", [2, 3])
def test_training_goes_on_correctly_after_a_backward_that_raised(stage):
    for raised, diff, live in run_pooled(_after_failed_backward, 2, stage, timeout=300):
        assert raised
        assert diff < 1e-5
        assert live == 0


def test_publish_gathers_in_place_only_where_the_device_backend_allows_it(monkeypatch):
    """comm.gather_input: this rank's slice itself on zeroplus and NCCL (their all-gathers take an
    input aliasing the output), a copy elsewhere; the backend is the one serving the tensor's
    device in a mixed group ("cpu:gloo,cuda:nccl")."""
    import torch.distributed as dist

    from zeroplus.zero import comm

    own = torch.arange(4.0)
    for config, in_place in (("cpu:zeroplus,cuda:zeroplus", True), ("cpu:gloo,cuda:gloo", False),
                             ("cpu:gloo,cuda:nccl", False), ("cpu:zeroplus,cuda:nccl", True), ("cuda:nccl", False)):
        monkeypatch.setattr(dist, "get_backend_config", lambda group, config=config: config)
        got = comm.gather_input(own, group=None)
        assert (got is own) == in_place, config
        assert torch.equal(got, own)
    assert comm.backend_for(torch.device("cuda", 0), None) == "nccl"  # the last config above

    def unknown(group):
        raise ValueError("Invalid process group specified")
    monkeypatch.setattr(dist, "get_backend_config", unknown)
    assert comm.gather_input(own, group=object()) is not own  # a group torch does not know: a copy
