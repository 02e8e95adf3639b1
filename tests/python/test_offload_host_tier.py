"""The CUDA optimizer-offload path's host tier (zeroplus.offload.host_tier), run on CPU.

On CUDA training offload_optimizer moves every bucket's fp32 master and optimizer state to host
memory and steps them there; gradients come down and parameters go up per bucket. The tier's
device-specific calls go through one place that is a plain copy on CPU, and a private hook
(force_on_cpu_for_tests) makes CPU training take the same path. So here, 2 ranks, one pooled
launch: the forced host tier must equal the in-memory engine BIT FOR BIT after 3 steps (with
clipping, an unused parameter, several buckets) at stages 1-3, fp32
and bf16, Adam/AdamW/SGD; its sharded state_dict must equal the in-memory one, and loading it
(plus the model's state) into fresh engines must continue identically; fp16 with an overflowing
step is skipped alike; zeroplus checkpoints cross-load (each side loads the other's and they
continue alike); "nvme" (the swapper under the host tier) is equal too. A case also checks
that the tier is really in use: its masters are host tensors of their own (not the parameters)
and the optimizer state lives on them, and that every step found every bucket's gradient already
on the host (copied during backward).

Gradient copies during backward (the tier observes the gradient reducer): the same bitwise
comparison with gradient accumulation (no_sync, and two reduced backwards), zero_grad between
backward and step, and a backward that raises midway, through a recording copier that runs each
copy as late as CUDA may; and an ordering test: each bucket's copy starts in backward (most of
them before backward reaches the first layer), after its reduction (it copies the reduced
shard), clipping's in-place multiply waits for it and the step waits for it. Unit tests pin the
per-bucket buffers' order and the casts.
"""

from __future__ import annotations

import functools
import shutil
import tempfile

import pytest
import torch
from torch import nn

from harness import run_cases_in_own_groups, run_pooled
from offload_compare import diffs as _diffs, state_diffs as _state_diffs

STEPS = 3
CONFIG = {1: {"zero_optimization": {"reduce_bucket_size": 400}},
          2: {"zero_optimization": {"reduce_bucket_size": 400}},
          3: {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}  # a bucket per unit


class Net(nn.Module):
    """Four linear layers (four stage-3 units, several stage-1/2 buckets of 400 elements); `never`
    gets no gradient, so it must not be stepped."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 40)
        self.b = nn.Linear(40, 40)
        self.c = nn.Linear(40, 6)
        self.never = nn.Linear(6, 6)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Chain(nn.Module):
    """Five linear layers, every parameter used: the buckets of the later layers are complete
    (and launched, in bucket order) while backward goes on through the earlier ones. (Net's unused
    `never` sits in bucket 0, which then completes only at the end of backward, holding back every
    later bucket: launches are in bucket order, as DDP's.) The overlap cases use this one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 24)
        self.c = nn.Linear(24, 24)
        self.d = nn.Linear(24, 24)
        self.e = nn.Linear(24, 6)

    def rest(self, h):
        """Everything after layer a."""
        for layer in (self.b, self.c, self.d, self.e):
            h = layer(torch.tanh(h))
        return h

    def forward(self, x):
        return self.rest(self.a(x))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)


def _build(group, stage, precision, optimizer, offload=None, net=Net):
    import zeroplus

    kw = {"momentum": 0.9} if optimizer is torch.optim.SGD else {"weight_decay": 0.1}
    if offload is not None:
        kw["offload_optimizer"] = offload
    return zeroplus.initialize(net(), optimizer, stage=stage, lr=1e-2, mixed_precision=precision,
                               process_group=group, config=CONFIG[stage], **kw)


def _train(model, opt, rank, steps, start=0, overflow_at=None, found=None):
    """`found`, a list: the host tier's found_on_host after each step (buckets whose gradient
    came down during backward)."""
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        loss = nn.functional.mse_loss(model(x).float(), y)
        if step == overflow_at:
            loss = loss * float("inf")  # every gradient inf/NaN: fp16's step must be skipped
        opt.backward(loss)
        opt.clip_grad_norm_(0.5)
        opt.step()
        if found is not None:
            found.append(opt.host_tier.found_on_host)
        opt.zero_grad()


def _params(model, stage):
    import zeroplus

    if stage == 3:
        return zeroplus.full_state_dict(model, rank0_only=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _case(rank, group, stage, precision, optimizer, device):
    from zeroplus.offload.host_tier import force_on_cpu_for_tests

    root = tempfile.mkdtemp(prefix="zp-host-tier-") if device == "nvme" else None
    offload = {"device": device, "pin_memory": True}
    if root is not None:
        offload.update(nvme_path=root, buffer_count=2)
    overflow_at = 1 if precision == "fp16" else None
    try:
        ref, ref_opt = _build(group, stage, precision, optimizer)
        with force_on_cpu_for_tests():
            model, opt = _build(group, stage, precision, optimizer, offload)
        tier = opt.host_tier
        used = {
            "tier": tier is not None,
            "buckets": len(opt.buckets),
            # host masters of their own: never the parameters' memory, even in fp32 on CPU
            "aliases": sum(m.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                           for m in opt.masters for b in opt.buckets for t in (b.flat, b.shard) if t is not None),
        }
        _train(ref, ref_opt, rank, STEPS, overflow_at=overflow_at)
        found = []
        _train(model, opt, rank, STEPS, overflow_at=overflow_at, found=found)
        used["found_on_host"] = found
        state_devices = {str(t.device) for bo in opt.bucket_optimizers for t in bo.state_tensors()}
        used["staging"] = __import__("zeroplus").memory_report(model, opt).get("offload_host_staging")
        out = {**used, "state_devices": sorted(state_devices), "skipped": (ref_opt.skipped_steps, opt.skipped_steps),
               "params": _diffs(_params(model, stage), _params(ref, stage))}
        saved, saved_model = ref_opt.state_dict(), _params(ref, stage)
        out["sharded_state"] = _state_diffs(opt.state_dict(), saved)
        ref_opt.consolidate_state_dict(0)
        opt.consolidate_state_dict(0)
        out["consolidated_state"] = _state_diffs(opt.state_dict(), ref_opt.state_dict()) if rank == 0 else []
        # Round trip: fresh engines (one step taken, so state exists to be replaced) load the
        # in-memory run's model and sharded optimizer state and continue alike.
        ref2, ref_opt2 = _build(group, stage, precision, optimizer)
        with force_on_cpu_for_tests():
            model2, opt2 = _build(group, stage, precision, optimizer, offload)
        for m, o in ((ref2, ref_opt2), (model2, opt2)):
            _train(m, o, rank, 1, start=10)
            m.load_state_dict(saved_model)
            o.load_state_dict(saved)
        _train(ref2, ref_opt2, rank, 2, start=STEPS)
        _train(model2, opt2, rank, 2, start=STEPS)
        out["after_load_params"] = _diffs(_params(model2, stage), _params(ref2, stage))
        out["after_load_state"] = _state_diffs(opt2.state_dict(), ref_opt2.state_dict())
        # zeroplus checkpoints, cross-loaded: the in-memory engine loads the host tier's checkpoint
        # and the host tier the in-memory one's; both then continue alike.
        import torch.distributed as dist
        import zeroplus

        ckpt_root = [tempfile.mkdtemp(prefix="zp-host-tier-ckpt-") if rank == 0 else None]
        dist.broadcast_object_list(ckpt_root, src=dist.get_global_rank(group, 0), group=group)
        try:
            zeroplus.save_checkpoint(f"{ckpt_root[0]}/tier", model, opt)
            zeroplus.save_checkpoint(f"{ckpt_root[0]}/ref", ref, ref_opt)
            ref3, ref_opt3 = _build(group, stage, precision, optimizer)
            with force_on_cpu_for_tests():
                model3, opt3 = _build(group, stage, precision, optimizer, offload)
            for m, o, which in ((ref3, ref_opt3, "tier"), (model3, opt3, "ref")):
                _train(m, o, rank, 1, start=10)
                zeroplus.load_checkpoint(f"{ckpt_root[0]}/{which}", m, o)
            _train(ref3, ref_opt3, rank, 2, start=STEPS)
            _train(model3, opt3, rank, 2, start=STEPS)
            out["checkpoint_params"] = _diffs(_params(model3, stage), _params(ref3, stage))
            out["checkpoint_state"] = _state_diffs(opt3.state_dict(), ref_opt3.state_dict())
            dist.barrier(group=group)
        finally:
            if rank == 0:
                shutil.rmtree(ckpt_root[0], ignore_errors=True)
        never = {k: v for k, v in _params(model, stage).items() if k.startswith("never.")}
        initial = {k: v.to(never[k].dtype) for k, v in Net().state_dict().items() if k.startswith("never.")}
        out["never_moved"] = _diffs(never, initial)
        return out
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


# -- gradient copies during backward: accumulation, zero_grad, a raising backward, the ordering ------

class _Raise(Exception):
    pass


def _micro_steps(model, opt, rank, step, mode, fail, after_raise=lambda: None):
    """One optimizer step's backward passes in `mode`; `fail` makes the first pass raise late in
    backward (after the later layers' buckets were reduced: a hook on layer a's output)."""
    def loss_of(k):
        x, y = _batch(10 * step + k, rank)
        h = model.a(x.to(model.a.weight.dtype))  # (the root's forward, which casts inputs, is bypassed)
        if fail and k == 0:
            def boom(_grad):
                raise _Raise()
            h.register_hook(boom)
        out = model.rest(h)
        return nn.functional.mse_loss(out.float(), y)

    def raising_backward(k=0, why="the hook did not raise"):
        try:
            opt.backward(loss_of(k))
        except _Raise:
            after_raise()
        else:
            raise AssertionError(why)

    if mode == "no_sync":  # DDP's accumulation: the first micro-batch is not reduced
        with model.no_sync():
            opt.backward(loss_of(0))
        opt.backward(loss_of(1))
    elif mode == "two_backwards":  # every micro-batch reduced, summed in the accumulators
        opt.backward(loss_of(0))
        opt.backward(loss_of(1))
    elif mode == "zero_grad_between":  # the first backward's gradients are dropped
        opt.backward(loss_of(0))
        opt.zero_grad()
        opt.backward(loss_of(1))
    elif mode == "edit_shards":  # the user halves the gradient shards in place before the step
        opt.backward(loss_of(0))
        for shard in opt.gradient_shards():
            shard.mul_(0.5)
    elif mode == "raising":  # the first backward raises midway; its pass is abandoned
        raising_backward()
        opt.backward(loss_of(1))
    elif mode == "raising_after_one":  # a backward, then one that raises: the first one's gradients stay
        opt.backward(loss_of(1))
        raising_backward()
    elif mode == "settle_fails":  # a second backward fails while adding into the released gradients
        # (taking a gradient back allocates on the device: out of memory there) after one bucket
        # was added: every bucket keeps the first backward's gradient, as a failed pass leaves them
        opt.backward(loss_of(0))
        tier = getattr(opt, "host_tier", None)
        if tier is not None:  # the in-memory engine's pass cannot fail there: it is left out
            fetch, calls = tier.fetch, []

            def failing_fetch(b):
                calls.append(b)
                if len(calls) == 2:
                    raise _Raise()
                return fetch(b)

            tier.fetch = failing_fetch
            try:
                raising_backward(1, "the second backward did not fail")
            finally:
                del tier.fetch
    elif mode == "norms":  # norms whose terms were not kept (3), kept (inf), and stale after a scaling
        opt.backward(loss_of(0))
        opt.clip_grad_norm_(0.02, norm_type=3.0)
        opt.clip_grad_norm_(0.01, norm_type=float("inf"))
    elif mode == "grad_scaler":  # zeroplus.GradScaler: unscale_ scales, its inf check reads back
        import zeroplus

        scaler = zeroplus.GradScaler(init_scale=1024.0)
        opt.backward(scaler.scale(loss_of(0)))
        scaler.unscale_(opt)
    elif mode == "step_twice":  # a step, then a second one on the same (already clipped) gradients
        opt.backward(loss_of(0))
        opt.clip_grad_norm_(0.5)
        opt.step()
    else:
        raise ValueError(mode)


class RecordingCopier:
    """A DeviceCopier that records what CUDA would be asked (each call with the training phase it
    came in, set by the test) and runs each copy as late as CUDA may: when its event (or a later
    one: one stream) is waited for, by the host or by the compute stream. So a read of a host
    buffer before its wait sees stale bytes, and a device write to a shard before the compute
    stream waits for the copy reading it changes what the copy reads: both break the bitwise
    comparisons. `copied[event]` is what a copy read, when it ran."""

    phase = "build"

    def __init__(self, device):
        from zeroplus.offload.host_tier import DeviceCopier

        self._inner = DeviceCopier(device)
        self.log = []      # (phase, what, event)
        self.copied = {}   # event -> the values copied
        self.pending = []  # (event, dst, src) issued, not run yet
        self.n = 0

    def host_empty(self, numel, dtype, pin):
        return self._inner.host_empty(numel, dtype, pin)

    def follow_compute(self):
        self.log.append((RecordingCopier.phase, "follow", None))

    def copy(self, dst, src, device_side):
        self.n += 1
        event = f"e{self.n}"
        self.pending.append((event, dst, src))
        self.log.append((RecordingCopier.phase, "copy", event))
        return event

    def _run_through(self, event):
        while any(e == event for e, _, _ in self.pending):
            e, dst, src = self.pending.pop(0)
            dst.copy_(src)
            self.copied[e] = src.clone()

    def host_wait(self, event):
        if event is not None:
            self.log.append((RecordingCopier.phase, "host_wait", event))
            self._run_through(event)

    def compute_waits(self, event):
        if event is not None:
            self.log.append((RecordingCopier.phase, "compute_waits", event))
            self._run_through(event)


def _overlap_case(rank, group, stage, precision, mode):
    from zeroplus.offload.host_tier import force_on_cpu_for_tests

    offload = {"device": "cpu", "pin_memory": True}
    ref, ref_opt = _build(group, stage, precision, torch.optim.AdamW, net=Chain)
    copiers = []

    def factory(device):
        copiers.append(RecordingCopier(device))  # copies run as late as CUDA may
        return copiers[-1]

    with force_on_cpu_for_tests(copier_factory=factory):
        model, opt = _build(group, stage, precision, torch.optim.AdamW, offload, net=Chain)
    found, raised_with, device_grads = [], [], []
    for step in range(STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            mark = (lambda: raised_with.append(len(copiers[0].pending))) if o is opt else (lambda: None)
            _micro_steps(m, o, rank, step, mode, fail=mode.startswith("raising"), after_raise=mark)
            if o is opt:  # where the gradients live between backward and step
                device_grads.append(__import__("zeroplus").memory_report(model, opt)["gradients"])
            o.clip_grad_norm_(0.5)
            o.step()
            o.zero_grad()
        found.append(opt.host_tier.found_on_host)
    report = __import__("zeroplus").memory_report(model, opt)
    shard_bytes = sum(t.numel() * t.element_size() for t in ref_opt.reducer.shards)
    return {"buckets": len(opt.buckets), "found_on_host": found,
            "params": _diffs(_params(model, stage), _params(ref, stage)),
            "state": _state_diffs(opt.state_dict(), ref_opt.state_dict()),
            "grad_bytes": (report.get("offload_host_grads"), shard_bytes),
            "raised_with": raised_with,  # gradient copies not run yet when a backward raised
            "device_grads": device_grads}


def _ordering_case(rank, group, stage, precision):
    """Per step: every gradient copy is issued during backward, after its bucket's reduction
    (what it copied is the reduced, averaged shard: the in-memory engine's shard after the same
    backward), after the copy stream was told to follow the compute stream; clipping's in-place
    multiply waits for it on the device; the step waits for it on the host and copies nothing."""
    from zeroplus.offload.host_tier import force_on_cpu_for_tests

    copiers = []

    def factory(device):
        copiers.append(RecordingCopier(device))
        return copiers[-1]

    ref, ref_opt = _build(group, stage, precision, torch.optim.AdamW, net=Chain)
    with force_on_cpu_for_tests(copier_factory=factory):
        model, opt = _build(group, stage, precision, torch.optim.AdamW, {"device": "cpu"}, net=Chain)
    rec = copiers[0]
    out = []

    def loss_of(m, x, y, mark=False):
        h = m.a(x.to(m.a.weight.dtype))
        if mark:  # backward reaches layer a (its gradient still to come): the late part of backward
            h.register_hook(lambda g: setattr(RecordingCopier, "phase", "backward_end"))
        return nn.functional.mse_loss(m.rest(h).float(), y)

    for step in range(STEPS):
        x, y = _batch(step, rank)
        ref_opt.backward(loss_of(ref, x, y))
        reduced = [t.clone() for t in ref_opt.reducer.shards]
        ref_opt.clip_grad_norm_(0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        rec.log.clear()
        RecordingCopier.phase = "backward"
        opt.backward(loss_of(model, x, y, mark=True))
        RecordingCopier.phase = "clip"
        opt.clip_grad_norm_(0.5)
        RecordingCopier.phase = "step"
        opt.step()
        RecordingCopier.phase = "zero_grad"
        opt.zero_grad()
        RecordingCopier.phase = "other"
        log = list(rec.log)
        down = [e for ph, what, e in log if what == "copy" and ph in ("backward", "backward_end")]
        follows_first = all(log[k - 1][1] == "follow" for k, (ph, what, e) in enumerate(log)
                            if what == "copy" and ph in ("backward", "backward_end"))
        # An upload writes the parameter shard, which work queued on the compute stream (the
        # previous step's all-gather, user code after backward) may still read or write: the copy
        # stream follows the compute stream right before it (DeviceCopier's contract).
        uploads_follow = all(log[k - 1][1] == "follow" for k, (ph, what, e) in enumerate(log)
                             if what == "copy" and ph == "step")
        step_waits = [e for ph, what, e in log if what == "host_wait" and ph == "step"]
        clip_waits = [e for ph, what, e in log if what == "compute_waits" and ph == "clip"]
        out.append({
            "buckets": len(opt.buckets),
            "down_in_backward": len(down),
            "down_before_layer_a": sum(1 for ph, what, e in log if what == "copy" and ph == "backward"),
            "values": [k for k, e in enumerate(down)
                       if k >= len(reduced) or not torch.equal(rec.copied[e], reduced[k])],
            "follows_first": follows_first,
            "uploads_follow": uploads_follow,
            "step_waits_all": all(step_waits.count(e) == 1 for e in down),  # (and uploads' events)
            "clip_waits_all": sorted(set(clip_waits)) == sorted(down),
            "uploads_in_step": sum(1 for ph, what, e in log if what == "copy" and ph == "step"),
            "found_on_host": opt.host_tier.found_on_host,
        })
    out.append({"params": _diffs(_params(model, stage), _params(ref, stage))})
    return out


OVERLAP_CASES = ([(stage, precision, mode) for stage in (1, 2, 3) for precision in (None, "bf16")
                  for mode in ("no_sync", "two_backwards")]
                 + [(2, None, "zero_grad_between"), (3, "bf16", "zero_grad_between"),
                    (1, None, "edit_shards"), (3, None, "edit_shards"),
                    (1, None, "raising"), (2, "bf16", "raising"), (3, None, "raising"),
                    (1, None, "raising_after_one"), (3, "bf16", "raising_after_one"),
                    (1, None, "settle_fails"), (2, "bf16", "settle_fails"),
                    (1, None, "norms"), (2, "fp16", "norms"), (3, "bf16", "norms"),
                    (2, None, "step_twice"), (3, None, "step_twice"),
                    (2, None, "grad_scaler"), (3, "bf16", "grad_scaler")])
ORDERING_CASES = [(1, None), (2, None), (3, None), (2, "bf16")]


CASES = ([(stage, precision, opt, "cpu") for stage in (1, 2, 3) for precision in (None, "bf16")
          for opt in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)]
         + [(2, "fp16", torch.optim.AdamW, "cpu"), (3, "fp16", torch.optim.Adam, "cpu"),
            (2, "bf16", torch.optim.AdamW, "nvme"), (3, None, torch.optim.AdamW, "nvme"),
            (1, None, torch.optim.Adam, "nvme")])


def _case_id(case) -> str:
    stage, precision, opt, device = case
    return f"stage{stage}-{precision or 'fp32'}-{opt.__name__}-{device}"


def _overlap_id(case) -> str:
    stage, precision, mode = case
    return f"stage{stage}-{precision or 'fp32'}-{mode}"


def _ordering_id(case) -> str:
    stage, precision = case
    return f"ordering-stage{stage}-{precision or 'fp32'}"


def _all_cases(rank, world):
    cases = {_case_id(c): functools.partial(_case_in, case=c) for c in CASES}
    cases.update({_overlap_id(c): functools.partial(_overlap_case, stage=c[0], precision=c[1], mode=c[2])
                  for c in OVERLAP_CASES})
    cases.update({_ordering_id(c): functools.partial(_ordering_case, stage=c[0], precision=c[1])
                  for c in ORDERING_CASES})
    return run_cases_in_own_groups(rank, world, cases)


def _case_in(rank, group, case):
    return _case(rank, group, *case)


@pytest.fixture(scope="module")
def results():
    return run_pooled(_all_cases, 2, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_host_tier_equals_in_memory_bit_for_bit(results, case):
    key = _case_id(case)
    for r, per_rank in enumerate(results):
        status, res = per_rank[key]
        assert status == "ok", f"rank {r}:\n{res}"
        assert res["tier"], f"rank {r}: the engine did not take the host tier"
        assert res["buckets"] > 3, f"rank {r}: {res['buckets']} buckets do not exercise several buffers"
        assert res["aliases"] == 0, f"rank {r}: {res['aliases']} host masters alias the parameters"
        assert res["state_devices"] == ["cpu"], f"rank {r}: optimizer state on {res['state_devices']}"
        assert res["staging"], f"rank {r}: memory_report has no offload_host_staging bytes: {res['staging']!r}"
        for what in ("params", "sharded_state", "consolidated_state", "after_load_params", "after_load_state",
                     "checkpoint_params", "checkpoint_state"):
            assert res[what] == [], f"rank {r}: {what} differ from the in-memory engine: {res[what][:5]}"
        assert res["never_moved"] == [], f"rank {r}: the unused parameter was stepped: {res['never_moved']}"
        ref_skipped, skipped = res["skipped"]
        assert skipped == ref_skipped == (1 if case[1] == "fp16" else 0), f"rank {r}: skipped {res['skipped']}"
        # Every bucket's gradient came down during backward (the step waited, copied nothing).
        assert res["found_on_host"] == [res["buckets"]] * STEPS, f"rank {r}: {res['found_on_host']}"


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=_overlap_id)
def test_copies_in_backward_keep_accumulation_zero_grad_and_raising_backwards_exact(results, case):
    """Gradient accumulation (no_sync, or two reduced backwards: a copy made in the first is
    forgotten when the second adds to the shard), zero_grad between backward and step, a backward
    that raises midway (its copies discarded), a second backward that fails while adding to the
    gradients kept on the host (none of them changes), gradient shards edited in place through
    opt.gradient_shards(): bit for bit the in-memory engine, and every step found every bucket's
    gradient already on the host (none after gradient_shards(): those are copied by the step)."""
    key = _overlap_id(case)
    for r, per_rank in enumerate(results):
        status, res = per_rank[key]
        assert status == "ok", f"rank {r}:\n{res}"
        assert res["params"] == [], f"rank {r}: parameters differ from the in-memory engine: {res['params'][:5]}"
        assert res["state"] == [], f"rank {r}: optimizer state differs: {res['state'][:5]}"
        # gradient_shards() hands out the device shards to write: their copies are dropped, the step copies
        expected = 0 if case[2] == "edit_shards" else res["buckets"]
        assert res["found_on_host"] == [expected] * STEPS, f"rank {r}: {res['found_on_host']}"
        if case[2].startswith("raising"):  # the raising backward had started copies (then discarded)
            assert len(res["raised_with"]) == STEPS and min(res["raised_with"]) > 0, f"rank {r}: {res['raised_with']}"
        host, shards = res["grad_bytes"]
        assert host == shards, f"rank {r}: offload_host_grads {host} bytes, the gradient shards {shards}"
        # Between backward and step the gradients live on the host only (ZeRO-Offload), except
        # those gradient_shards() handed out to be written in place.
        if case[2] == "edit_shards":
            assert all(g > 0 for g in res["device_grads"]), f"rank {r}: {res['device_grads']}"
        else:
            assert res["device_grads"] == [0] * STEPS, f"rank {r}: gradient bytes on the device {res['device_grads']}"


@pytest.mark.parametrize("case", ORDERING_CASES, ids=_ordering_id)
def test_each_gradient_copy_starts_in_backward_after_its_reduction_and_the_step_waits(results, case):
    key = _ordering_id(case)
    for r, per_rank in enumerate(results):
        status, res = per_rank[key]
        assert status == "ok", f"rank {r}:\n{res}"
        *steps, final = res
        for k, st in enumerate(steps):
            where = f"rank {r} step {k}: {st}"
            assert st["down_in_backward"] == st["buckets"] > 3, where
            assert st["down_before_layer_a"] > 0, where  # copies overlap the rest of backward
            assert st["values"] == [], where  # a copy before its reduction would hold other values
            assert st["follows_first"], where
            assert st["uploads_follow"], where
            assert st["clip_waits_all"], where  # clipping's multiply waits for each copy's read
            assert st["step_waits_all"], where  # the step waits for each before reading it
            assert st["found_on_host"] == st["buckets"], where
            assert st["uploads_in_step"] == st["buckets"], where  # the step itself only uploads
        assert final["params"] == [], f"rank {r}: {final['params'][:5]}"
        print(f"\n{key} rank {r}: buckets {steps[0]['buckets']}, copies started before backward reached layer a "
              f"{[st['down_before_layer_a'] for st in steps]}")


# -- the tier alone (no ranks) --------------------------------------------------------------

def test_gradients_come_in_step_order_into_their_buffers():
    from zeroplus.offload.host_tier import DEPTH, HostTier

    masters = [torch.full((n,), float(i)) for i, n in enumerate((5, 3, 8, 1, 6, 4))]
    tier = HostTier(torch.device("cpu"), masters, pin_memory=True)
    assert all(h is not m and torch.equal(h, m) for h, m in zip(tier.masters, masters))
    grads = [torch.arange(m.numel(), dtype=torch.bfloat16) + 10 * i for i, m in enumerate(masters)]
    asked = []

    def source(i):
        asked.append(i)
        return grads[i]

    order = [5, 4, 3, 2, 1, 0]
    tier.begin_step(order, source)
    assert asked == order[:DEPTH]  # copies start ahead of the first bucket's step
    for k, i in enumerate(order):
        got = tier.gradient(i)
        assert got.dtype == torch.bfloat16 and torch.equal(got, grads[i]), f"bucket {i}"
        assert asked == order[:min(len(order), k + DEPTH + 1)]
    tier.end_step()
    # A bucket skipped by the step (never asked for) does not disturb the others.
    asked.clear()
    tier.begin_step(order, source)
    for i in order:
        if i != 3:
            assert torch.equal(tier.gradient(i), grads[i]), f"bucket {i} after a skipped one"
    tier.end_step()
    # One buffer per bucket, its shard's bytes, reused: a third step allocates nothing.
    assert tier.grad_bytes == tier.staging_bytes == sum(m.numel() for m in masters) * 2
    tier.begin_step(order, source)
    for i in order:
        tier.gradient(i)
    tier.end_step()
    assert tier.grad_bytes == sum(m.numel() for m in masters) * 2


def test_copies_and_waits_come_in_the_order_the_device_needs():
    """On CPU a copy is synchronous, so the bit-for-bit cases cannot see a missing wait; a copier
    that records its calls pins the CUDA ordering: the copy stream follows the compute stream
    before every copy, after the shard it copies was asked for (the reducer may make it just then,
    on the compute stream: a zero-filled accumulator), bucket i+1's download is queued before the CPU waits for bucket i's,
    every upload follows the compute stream (it writes the parameter shard) and is followed by the
    compute stream waiting for it, an upload buffer is reused only
    after its last copy is done, and end_step waits for downloads the step never asked for."""
    from zeroplus.offload.host_tier import DeviceCopier, HostTier

    class Recorder(DeviceCopier):
        def __init__(self):
            super().__init__(torch.device("cpu"))
            self.log, self.events = [], 0

        def follow_compute(self):
            self.log.append("follow")

        def copy(self, dst, src, device_side):
            dst.copy_(src)
            self.events += 1
            self.log.append(f"copy e{self.events}")
            return f"e{self.events}"

        def host_wait(self, event):
            if event is not None:
                self.log.append(f"host_wait {event}")

        def compute_waits(self, event):
            self.log.append(f"compute_waits {event}")

    rec = Recorder()
    masters = [torch.full((4,), float(i)) for i in range(4)]
    tier = HostTier(torch.device("cpu"), masters, pin_memory=False, copier=rec)
    grads = [torch.full((4,), 10.0 + i) for i in range(4)]
    dst = torch.empty(4, dtype=torch.bfloat16)

    def source(b):
        rec.log.append(f"source {b}")
        return grads[b]

    tier.begin_step([0, 1, 2, 3], source)
    # buckets 0 and 1 start down at once, each after its shard was made
    assert rec.log == ["source 0", "follow", "copy e1", "source 1", "follow", "copy e2"]
    rec.log.clear()
    assert torch.equal(tier.gradient(0), grads[0])
    # bucket 2 queued before the CPU waits for bucket 0
    assert rec.log == ["source 2", "follow", "copy e3", "host_wait e1"]
    rec.log.clear()
    tier.upload(0, dst)
    tier.upload(1, dst)
    tier.upload(2, dst)  # the first upload buffer again: its copy (e4) must be done first
    # each upload follows the compute stream first (it writes the parameter shard, which queued
    # work may still use)
    assert rec.log == ["follow", "copy e4", "compute_waits e4", "follow", "copy e5", "compute_waits e5",
                       "host_wait e4", "follow", "copy e6", "compute_waits e6"]
    assert torch.equal(dst, masters[2].to(torch.bfloat16))
    rec.log.clear()
    tier.end_step()  # buckets 1 and 2 were downloaded but never asked for
    assert sorted(rec.log) == ["host_wait e2", "host_wait e3"]


def test_a_device_coefficient_comes_to_the_host_once_per_step():
    """Clipping's coefficient is a device tensor: bringing it to the host makes the CPU wait for
    the compute stream (and so for the previous bucket's upload). It is brought once per step and
    dtype, not once per bucket, and a new step brings the new one."""
    from zeroplus.offload.host_tier import HostTier

    moved = []

    class Coef(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.to:
                moved.append(1)
            return super().__torch_function__(func, types, args, kwargs or {})

    tier = HostTier(torch.device("cpu"), [torch.zeros(4) for _ in range(4)], pin_memory=False)
    for step, value in enumerate((0.5, 0.25)):
        moved.clear()
        coef = torch.tensor(value).as_subclass(Coef)
        grads = [torch.full((4,), 1.0 + b) for b in range(4)]
        for b in range(4):
            tier.ready(b, grads[b])
            tier.scaling(b, coef)
        tier.begin_step([0, 1, 2, 3], grads.__getitem__)
        for b in range(4):
            assert torch.equal(tier.gradient(b).as_subclass(torch.Tensor), torch.full((4,), (1.0 + b) * value))
        tier.end_step()
        tier.clear()
        assert len(moved) == 1, f"step {step}: the coefficient was moved {len(moved)} times"


def test_upload_casts_like_the_device_and_checks_sizes():
    from zeroplus.offload.host_tier import HostTier

    master = torch.tensor([1.0 + 2 ** -9, 1.0 + 3 * 2 ** -9, -3.3e38, 1e-40, float("nan")])
    tier = HostTier(torch.device("cpu"), [master], pin_memory=False)
    dst = torch.empty(5, dtype=torch.bfloat16)
    tier.upload(0, dst)
    assert torch.equal(dst[:4], master[:4].to(torch.bfloat16)) and dst[4].isnan()
    tier.masters[0].fill_(2.0)
    tier.upload(0, dst)
    tier.upload(0, dst)  # both upload slots reused
    assert torch.equal(dst, torch.full((5,), 2.0, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bucket 0's master has 5 elements, its parameter shard 4"):
        tier.upload(0, torch.empty(4))


def test_prepare_picks_the_host_tier_for_cuda_and_the_test_hook(tmp_path):
    from zeroplus.offload import make_host_tier, prepare_optimizer_store
    from zeroplus.offload.host_tier import force_on_cpu_for_tests
    from zeroplus.offload.policy import parse_offload

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    none_p = parse_offload("offload_param", None)
    cpu_o = parse_offload("offload_optimizer", {"device": "cpu", "pin_memory": True})
    nvme_o = parse_offload("offload_optimizer", {"device": "nvme", "nvme_path": str(tmp_path)})
    prepared = prepare_optimizer_store(cpu_o, none_p, 0, cuda, "E")
    assert prepared.host_tier and prepared.directory is None and prepared.policy.pin_memory
    prepared = prepare_optimizer_store(nvme_o, none_p, 0, cuda, "E")
    assert prepared.host_tier and prepared.directory is not None and len(list(tmp_path.iterdir())) == 1
    prepared.directory.close()
    assert prepare_optimizer_store(cpu_o, none_p, 0, cpu, "E") is None  # CPU training: a no-op
    assert make_host_tier(None, cpu, [torch.zeros(1)]) is None
    with force_on_cpu_for_tests():
        prepared = prepare_optimizer_store(cpu_o, none_p, 0, cpu, "E")
        assert prepared.host_tier and prepared.directory is None
        # offload_param ('cpu' or 'nvme') combines with it (host_params.py, test_offload_param_host.py)
        for block in ({"device": "cpu"}, {"device": "nvme", "nvme_path": str(tmp_path)}):
            assert prepare_optimizer_store(cpu_o, parse_offload("offload_param", block), 0, cpu, "E").host_tier
    assert prepare_optimizer_store(cpu_o, none_p, 0, cpu, "E") is None  # the hook ends with its block


def test_estimate_memory_gpu_and_host_columns():
    import zeroplus

    psi, n, bucket = 1e9, 8, 1 << 22
    shard = -(-bucket // n)
    base = zeroplus.estimate_memory(psi, n, 2, "bf16", device="cuda")
    assert base["gpu"] == base["model_state"] and base["host"] == 0
    off = zeroplus.estimate_memory(psi, n, 2, "bf16", offload_optimizer="cpu", device="cuda")
    staging = 2 * psi / n + 2 * shard * 2  # every bucket's gradient shard and 2 upload buffers, bf16
    assert off["gpu"] == base["parameters"] + shard * 2  # the gradients live on the host: one bucket's in flight
    assert off["host"] == 4 * psi / n + base["optimizer_state"] + staging
    fp32 = zeroplus.estimate_memory(psi, n, 2, None, offload_optimizer="cpu", device="cuda")
    assert fp32["master_parameters"] == 0
    assert fp32["host"] == 4 * psi / n + fp32["optimizer_state"] + 4 * psi / n + 2 * shard * 4
    nvme = zeroplus.estimate_memory(psi, n, 3, None, offload_optimizer="nvme", buffer_count=4, device="cuda")
    buckets = -(-psi // bucket)
    assert nvme["nvme"] == 4 * psi / n + nvme["optimizer_state"] + 4096 * buckets  # the master too, in fp32
    assert nvme["offload_buffers"] == 4 * (4096 + shard * 12)  # whole pages already
    assert nvme["host"] == nvme["offload_buffers"] + 4 * psi / n + 2 * shard * 4
    assert nvme["resident"] == nvme["gpu"] + nvme["host"]
    cpu = zeroplus.estimate_memory(psi, n, 2, "bf16", offload_optimizer="nvme")
    assert cpu["gpu"] == 0 and cpu["host"] == cpu["resident"]
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        zeroplus.estimate_memory(psi, n, 2, device="tpu")
    with pytest.raises(ValueError, match="needs a ZeRO stage"):
        zeroplus.estimate_memory(psi, n, 0, offload_optimizer="cpu", device="cuda")
