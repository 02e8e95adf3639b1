"""Stage-3 parameter offload to host memory on CUDA training (zeroplus.offload.host_params), run on CPU.

On CUDA training offload_param "cpu" keeps every non-persistent bucket's parameter shard in host
memory; a unit's gather copies its shards up (copy stream, an event the all-gather waits for),
ahead in the recorded prefetch order, and nothing of a released unit stays on the device. Every
CUDA call goes through host_tier.DeviceCopier (plain copies on CPU) and the private hook
force_on_cpu_for_tests makes CPU training take this path, so here (2 ranks, one pooled launch):

  * parity: BIT FOR BIT with the in-memory stage-3 engine after 3 steps with clipping, fp32 and
    bf16, with the optimizer offloaded too (host tier, "cpu" and "nvme") and without (the step on
    the device, the master copied down into the host shard), pinned and pageable (the staging
    ring), on a model with a layer used twice in one forward and a frozen layer; a few cases
    again with the store's copies run as late as CUDA may (when their event is waited for; a copy
    up's buffer is NaN until then), so a missing wait shows as a difference; the sharded and
    consolidated optimizer state too; between steps every offloaded shard is empty on the device
    and its host shard holds the in-memory run's values;
  * round trips: model + optimizer state dicts, and zeroplus checkpoints cross-loaded between the
    in-memory and offloaded engines, continue identically;
  * ordering (a recording copier): each offloaded shard's copy up, and the compute stream's wait
    for it, come before the all-gather that reads it; each copy up comes right after the copy
    stream was told to follow the compute stream (its device buffer was just allocated there); on
    the second pass (prediction recorded) a unit's copy is issued before the previous unit's
    forward ends;
  * memory: at every module boundary the device-resident shard bytes stay within those of the
    units gathered or in flight plus buffer_count read-ahead shards (buffer_count 1 here), and
    the buckets of released units are empty;
  * gradient spill ("nvme" with offload_optimizer "cpu"/"nvme"; fp32, bf16, fp16, and one case
    with persistent buckets beside the offloaded ones): bit for bit with the in-memory engine
    through gradient accumulation, a backward that raises midway, clipping twice in a step and an
    fp16 overflow; between backward and step the gradient files are on disk, no spilled bucket has
    an accumulator and the host tier holds no gradient buffer for it.
Unit tests: the store's read-ahead limit, invalidation on write, replacements, bad input; the
device/offload decisions; estimate_memory's CUDA columns.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time

import pytest
import torch
from torch import nn

from harness import run_cases_in_own_groups, run_pooled
from offload_compare import diffs as _diffs, state_diffs as _state_diffs
from offload_fakes import MemorySwapper

STEPS = 3
CONFIG = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}  # every unit offloaded


class Net(nn.Module):
    """Five units: `b` runs twice per forward, `frozen` has requires_grad False (sharded, gathered,
    never stepped)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 40)
        self.b = nn.Linear(40, 40)
        self.frozen = nn.Linear(40, 24)
        self.c = nn.Linear(24, 6)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.b(h))  # the same parameters a second time
        return self.c(torch.tanh(self.frozen(h)))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)


def _build(group, precision, param=None, optimizer=None, config=CONFIG):
    import zeroplus
    from zeroplus.offload.host_tier import force_on_cpu_for_tests

    kw = {}
    if param is not None:
        kw["offload_param"] = param
    if optimizer is not None:
        kw["offload_optimizer"] = optimizer
    model = Net()
    with force_on_cpu_for_tests():
        return zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=1e-2, weight_decay=0.1,
                                   mixed_precision=precision, process_group=group, config=config, **kw)


def _train(model, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        opt.backward(nn.functional.mse_loss(model(x).float(), y))
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


def _full(model):
    import zeroplus

    return zeroplus.full_state_dict(model, rank0_only=False)


def _residency(opt, ref_opt) -> dict:
    """Between steps: where the offloaded shards are, against the in-memory engine's shards."""
    from zeroplus.zero.layout import is_resting

    store = opt.placement.param_store
    buckets = list(opt.buckets) + list(opt.placement.frozen_buckets)
    ref_buckets = list(ref_opt.buckets) + list(ref_opt.placement.frozen_buckets)
    store.drain()
    offloaded = [(b, r) for b, r in zip(buckets, ref_buckets) if store.offloads(b)]
    return {
        "store": type(store).__name__,
        "offloaded": len(offloaded),
        "all_buckets": len(buckets),
        "device_shard_elems": sum(b.shard.numel() for b, _ in offloaded),
        "device_bytes": store.device_bytes,
        "host_equal": all(torch.equal(store.host_shard(b), r.shard) for b, r in offloaded),
        # Elements the module's parameters hold between uses (resting views hold none).
        "module_param_elems": sum(0 if is_resting(p.data) else p.numel() for p in opt.module.parameters()),
        "grad_spill": opt.reducer.spill is not None,
    }


def _parity(rank, group, precision, optimizer, pin, device="cpu", late=False):
    import torch.distributed as dist
    import zeroplus

    root = tempfile.mkdtemp(prefix="zp-param-host-") if "nvme" in (optimizer, device) else None
    param = {"device": device, "pin_memory": pin}
    if device == "nvme":  # a pool of 2 records: most shards are on disk at any moment
        param.update(nvme_path=root, buffer_count=2, buffer_size=1)
    opt_offload = None
    if optimizer == "cpu":
        opt_offload = {"device": "cpu", "pin_memory": True}
    elif optimizer == "nvme":
        opt_offload = {"device": "nvme", "nvme_path": root, "buffer_count": 2}
    try:
        ref, ref_opt = _build(group, precision)
        model, opt = _build_with(_LateCopier if late else None, group, precision, param, opt_offload)
        out = {"host_tier": opt.host_tier is not None}
        _train(ref, ref_opt, rank, STEPS)
        _train(model, opt, rank, STEPS)
        out["residency"] = _residency(opt, ref_opt)
        swapper = opt.placement.param_store.swapper
        out["on_disk"] = (0 if swapper is None else swapper.disk_bytes(),
                          0 if swapper is None else swapper.bytes_written)
        out["params"] = _diffs(_full(model), _full(ref))
        saved, saved_model = ref_opt.state_dict(), _full(ref)
        out["sharded_state"] = _state_diffs(opt.state_dict(), saved)
        ref_opt.consolidate_state_dict(0)
        opt.consolidate_state_dict(0)
        out["consolidated_state"] = _state_diffs(opt.state_dict(), ref_opt.state_dict()) if rank == 0 else []
        # Round trip: fresh engines (one step taken, so there is state to replace) load the in-memory
        # run's model and sharded optimizer state, then continue alike.
        ref2, ref_opt2 = _build(group, precision)
        model2, opt2 = _build_with(_LateCopier if late else None, group, precision, param, opt_offload)
        for m, o in ((ref2, ref_opt2), (model2, opt2)):
            _train(m, o, rank, 1, start=10)
            m.load_state_dict(saved_model)
            o.load_state_dict(saved)
        out["loaded_params"] = _diffs(_full(model2), _full(ref2))
        _train(ref2, ref_opt2, rank, 2, start=STEPS)
        _train(model2, opt2, rank, 2, start=STEPS)
        out["after_load_params"] = _diffs(_full(model2), _full(ref2))
        out["after_load_state"] = _state_diffs(opt2.state_dict(), ref_opt2.state_dict())
        # zeroplus checkpoints, cross-loaded: each side loads the other's and both continue alike.
        ckpt = [tempfile.mkdtemp(prefix="zp-param-host-ckpt-") if rank == 0 else None]
        dist.broadcast_object_list(ckpt, src=dist.get_global_rank(group, 0), group=group)
        try:
            zeroplus.save_checkpoint(f"{ckpt[0]}/host", model, opt)
            zeroplus.save_checkpoint(f"{ckpt[0]}/ref", ref, ref_opt)
            ref3, ref_opt3 = _build(group, precision)
            model3, opt3 = _build_with(_LateCopier if late else None, group, precision, param, opt_offload)
            for m, o, which in ((ref3, ref_opt3, "host"), (model3, opt3, "ref")):
                _train(m, o, rank, 1, start=10)
                zeroplus.load_checkpoint(f"{ckpt[0]}/{which}", m, o)
            _train(ref3, ref_opt3, rank, 2, start=STEPS)
            _train(model3, opt3, rank, 2, start=STEPS)
            out["checkpoint_params"] = _diffs(_full(model3), _full(ref3))
            out["checkpoint_state"] = _state_diffs(opt3.state_dict(), ref_opt3.state_dict())
            out["checkpoint_residency"] = _residency(opt3, ref_opt3)
            dist.barrier(group=group)
        finally:
            if rank == 0:
                shutil.rmtree(ckpt[0], ignore_errors=True)
        frozen = {k: v for k, v in _full(model).items() if k.startswith("frozen.")}
        initial = {k: v.to(frozen[k].dtype) for k, v in Net().state_dict().items() if k.startswith("frozen.")}
        out["frozen_moved"] = _diffs(frozen, initial)
        return out
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


def _build_with(copier, *args, **kwargs):
    """_build, with the parameter store's DeviceCopier made from `copier` (None: the real one)."""
    import zeroplus.offload.host_params as host_params

    real = host_params.DeviceCopier
    host_params.DeviceCopier = copier or real
    try:
        return _build(*args, **kwargs)
    finally:
        host_params.DeviceCopier = real


class _LateCopier:
    """A CPU DeviceCopier that runs each copy as late as CUDA may: when its event (or a later one:
    one stream) is waited for, by the host or by the compute stream. A copy up's destination is
    NaN until then (so an all-gather reading it before the compute stream waited fails the
    comparison), a copy down's host shard keeps the old values, and a device tensor written
    before the wait changes what the copy reads."""

    def __init__(self, device):
        from zeroplus.offload.host_tier import DeviceCopier

        self._inner = DeviceCopier(device)
        self.device, self.cuda = self._inner.device, False
        self.pending = []  # (event, dst, src) issued, not run yet

    def host_empty(self, numel, dtype, pin):
        return self._inner.host_empty(numel, dtype, pin)

    def follow_compute(self):
        pass

    def copy(self, dst, src, device_side):
        event = object()
        if device_side is dst and dst.is_floating_point():
            dst.fill_(float("nan"))
        self.pending.append((event, dst, src))
        return event

    def _run_through(self, event):
        while any(e is event for e, _, _ in self.pending):
            _, dst, src = self.pending.pop(0)
            dst.copy_(src)

    def host_wait(self, event):
        if event is not None:
            self._run_through(event)

    def compute_waits(self, event):
        if event is not None:
            self._run_through(event)


class _RecordingCopier:
    """Wraps a CPU DeviceCopier: logs every copy (its destination's address) and every wait of the
    compute stream, and hands out tokens as events (so the waits are visible)."""

    log: list = []

    def __init__(self, device):
        from zeroplus.offload.host_tier import DeviceCopier

        self._inner = DeviceCopier(device)
        self.device, self.cuda = self._inner.device, False

    def host_empty(self, numel, dtype, pin):
        return self._inner.host_empty(numel, dtype, pin)

    def follow_compute(self):
        self.log.append(("follow",))

    def copy(self, dst, src, device_side):
        dst.copy_(src)
        token = object()
        self.log.append(("copy", dst.data_ptr(), dst.numel(), id(token), device_side is dst))
        return token

    @staticmethod
    def host_wait(event):
        pass

    def compute_waits(self, event):
        if event is not None:
            self.log.append(("compute_waits", id(event)))


def _ordering(rank, group):
    import zeroplus.offload.host_params as host_params
    from zeroplus.zero import comm

    log = _RecordingCopier.log = []
    real_gather, real_copier = comm.all_gather, host_params.DeviceCopier

    def gather(output, input, group, async_op=True):
        log.append(("gather", input.data_ptr(), input.numel()))
        return real_gather(output, input, group, async_op)

    host_params.DeviceCopier = _RecordingCopier
    comm.all_gather = gather
    try:
        model, opt = _build(group, "bf16", {"device": "cpu", "pin_memory": True, "buffer_count": 1},
                            {"device": "cpu"})
        names = ["a", "b", "frozen", "c"]
        for n in names:
            getattr(model, n).register_forward_hook(lambda *_a, n=n: log.append(("end", n)))
            getattr(model, n).register_forward_pre_hook(lambda *_a, n=n: log.append(("start", n)))
        passes = []
        for step in range(3):
            start = len(log)
            _train(model, opt, rank, 1, start=step)
            passes.append(log[start:])
    finally:
        host_params.DeviceCopier, comm.all_gather = real_copier, real_gather
        _RecordingCopier.log = []
    out = {"gathers": 0, "gather_without_copy": [], "gather_before_wait": [], "late_prefetch": [],
           "up_without_follow": []}
    for entries in passes:
        last_copy, waited = {}, set()
        for k, e in enumerate(entries):
            if e[0] == "copy":
                last_copy[(e[1], e[2])] = (k, e[3])
                if e[4] and (k == 0 or entries[k - 1] != ("follow",)):
                    out["up_without_follow"].append(k)
            elif e[0] == "compute_waits":
                waited.add(e[1])
            elif e[0] == "gather":
                out["gathers"] += 1
                found = last_copy.get((e[1], e[2]))
                if found is None:
                    out["gather_without_copy"].append(k)
                elif found[1] not in waited:
                    out["gather_before_wait"].append(k)
    # Second and third passes: in forward, unit j's copy up is issued before unit j-1's forward ends.
    for entries in passes[1:]:
        forward = entries[:next(k for k, e in enumerate(entries) if e == ("end", "c")) + 1]
        copies_before_end = {}
        copied = 0
        for e in forward:
            if e[0] == "copy":
                copied += 1
            elif e[0] == "end":
                copies_before_end.setdefault(e[1], copied)
        # the copies issued by the time `a` ends cover a and b; by b's first end, frozen too; ...
        for prev, nxt in zip(names, names[1:]):
            if copies_before_end[prev] < names.index(nxt) + 1:
                out["late_prefetch"].append((prev, nxt, copies_before_end[prev]))
    out["passes"] = len(passes)
    return out


def _memory(rank, group):
    """Device-resident shard bytes at every module boundary, against the gathered units'."""
    from zeroplus.zero.stage3.param_gatherer import RELEASED

    model, opt = _build(group, None, {"device": "cpu", "pin_memory": True, "buffer_count": 1}, {"device": "cpu"})
    store, gatherer = opt.placement.param_store, opt.placement.gatherer
    largest = max(b.shard_numel * b.dtype.itemsize for st in gatherer.states for b in st.buckets)
    out = {"checks": 0, "over": [], "stale": [], "peak": 0}

    def check(where):
        live = sum(b.shard_numel * b.dtype.itemsize for st in gatherer.states if st.state != RELEASED
                   for b in st.buckets)
        bound = live + store.read_ahead_limit * largest
        out["checks"] += 1
        out["peak"] = max(out["peak"], store.device_bytes)
        if store.device_bytes > bound:
            out["over"].append((where, store.device_bytes, live))
        stale = [b.unit for st in gatherer.states if st.state == RELEASED for b in st.buckets
                 if b.shard.numel() and not store.pinned(b)]
        if stale:
            out["stale"].append((where, stale))

    for n in ("a", "b", "frozen", "c"):
        getattr(model, n).register_forward_pre_hook(lambda *_a, n=n: check(f"pre {n}"))
        getattr(model, n).register_forward_hook(lambda *_a, n=n: check(f"post {n}"))
        if n != "a":  # (a's input needs no gradient: torch warns about a backward hook there)
            getattr(model, n).register_full_backward_pre_hook(lambda *_a, n=n: check(f"backward {n}"))
    for step in range(3):
        _train(model, opt, rank, 1, start=step)
        check(f"after step {step}")
    out["after"] = store.device_bytes
    out["shard_elems_after"] = sum(b.shard.numel() for st in gatherer.states for b in st.buckets)
    return out


def _grad_files(spill) -> int:
    import os

    return sum(1 for n in os.listdir(spill.directory.path) if n.startswith("grad-b"))


def _spill(rank, group, precision, optimizer, persistent=False):
    """offload_param "nvme" with offload_optimizer: the offloaded buckets' gradients go to files as
    backward reduces them, as on CPU training. Trained beside the in-memory engine on the same
    batches: gradient accumulation (two backwards) on odd steps, a backward that raises midway
    after the first of them (the previous gradients must survive), clipping (twice on step 2:
    the second call reads the scaled gradients back, its terms are stale), zero_grad; fp16: one
    step overflows and is skipped. persistent: the biases are persistent buckets (kept whole, not
    offloaded): their gradients go through the host tier's buffers beside the spilled ones."""
    root = tempfile.mkdtemp(prefix="zp-param-host-spill-")
    param = {"device": "nvme", "nvme_path": root, "buffer_count": 2, "buffer_size": 1}
    opt_offload = ({"device": "cpu", "pin_memory": True} if optimizer == "cpu"
                   else {"device": "nvme", "nvme_path": root, "buffer_count": 2})
    try:
        config = {"zero_optimization": {"stage3_param_persistence_threshold": 40 if persistent else 0}}
        ref, ref_opt = _build(group, precision, config=config)
        model, opt = _build(group, precision, param, opt_offload, config=config)
        spill = opt.reducer.spill
        out = {"spill": spill is not None, "checks": [], "raised": []}
        # the host tier's gradient buffers may hold the non-spilled (persistent) buckets' shards only
        kept = sum(b.shard_numel * opt.reducer.accum_dtypes[i].itemsize for i, b in enumerate(opt.buckets)
                   if spill is None or not spill.spills(i))
        if spill is None:
            return out
        spilled = [i for i in range(len(opt.buckets)) if spill.spills(i)]
        out["spilled"], out["buckets"] = len(spilled), len(opt.buckets)

        def fail_midway(_grad):  # on the input layer's output: the later units' buckets are reduced by then
            raise RuntimeError("planted backward failure")

        def plant(_module, _inputs, output):
            output.register_hook(fail_midway)

        for step in range(4):
            for m, o in ((ref, ref_opt), (model, opt)):
                x, y = _batch(step, rank)
                scale = float("inf") if (precision == "fp16" and step == 1) else 1.0
                o.backward(nn.functional.mse_loss(m(x).float(), y) * scale)
                if step % 2:
                    x, y = _batch(50 + step, rank)
                    planted = m.a.register_forward_hook(plant)
                    loss = nn.functional.mse_loss(m(x).float(), y)
                    planted.remove()
                    try:
                        o.backward(loss)
                    except RuntimeError as e:
                        if "planted" not in str(e):
                            raise
                        if o is opt:
                            out["raised"].append(step)
                    x, y = _batch(100 + step, rank)
                    o.backward(nn.functional.mse_loss(m(x).float(), y))
                if step == 3 and o is opt:
                    # A pass whose gradient files cannot be written (commit raises) changes no
                    # gradient, the persistent buckets' either (the in-memory engine runs no such pass).
                    x, y = _batch(70 + step, rank)

                    def failing_commit():
                        raise OSError(5, "planted gradient write failure")

                    spill.commit = failing_commit
                    try:
                        o.backward(nn.functional.mse_loss(m(x).float(), y))
                    except OSError as e:
                        if "planted" not in str(e):
                            raise
                        out["commit_failed"] = True
                    finally:
                        del spill.commit
                o.clip_grad_norm_(0.5)
                if step == 2:
                    o.clip_grad_norm_(0.25)
            # between backward and step: the gradients are in files, none of them in memory
            out["checks"].append({
                "files": _grad_files(spill),
                "on_disk": spill.bytes_written > 0,
                "resident": sum(opt.reducer.accum[i] is not None for i in spilled),
                "host_grad_bytes": opt.host_tier.grad_bytes - kept,
            })
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad()
        out["host_grad_bytes_after"] = opt.host_tier.grad_bytes - kept
        out["kept_on_host"] = kept
        out["found_on_host"] = opt.host_tier.found_on_host
        out["skipped"] = (opt.skipped_steps, ref_opt.skipped_steps)
        out["params"] = _diffs(_full(model), _full(ref))
        out["state"] = _state_diffs(opt.state_dict(), ref_opt.state_dict())
        out["spill_peak"] = spill.peak_buffer_bytes
        out["grad_record"] = max(spill._buckets[i].layout.record_bytes for i in spilled)  # noqa: SLF001
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _spill_fault(rank, group):
    """A spilled gradient damaged between backward and step (each rank its own record of the same
    bucket): step raises EBADMSG naming the file and the bucket after the step's collectives, that
    bucket is not stepped (its parameters unchanged) and training goes on."""
    root = tempfile.mkdtemp(prefix="zp-param-host-spill-fault-")
    try:
        model, opt = _build(group, None, {"device": "nvme", "nvme_path": root, "buffer_count": 2, "buffer_size": 1},
                            {"device": "cpu"})
        _train(model, opt, rank, 1)
        x, y = _batch(1, rank)
        opt.backward(nn.functional.mse_loss(model(x).float(), y))
        spill = opt.reducer.spill
        b = 0  # every bucket is spilled (no persistent ones)
        h = spill._buckets[b]  # noqa: SLF001
        gpath = spill.directory.display_path(h.name(h.generation))
        with open(gpath, "r+b") as f:
            f.seek(4096 + 8)
            byte = f.read(1)
            f.seek(4096 + 8)
            f.write(bytes([byte[0] ^ 0x01]))
        before = _full(model)
        out = {"gpath": gpath, "bucket": b}
        try:
            opt.step()
            out["error"] = None
        except OSError as e:
            out["error"] = (e.errno, str(e), e.filename)
        after = _full(model)
        names = {id(p): n for n, p in model.named_parameters()}
        in_bucket = {names[id(e.param)] for e in opt.buckets[b].entries}
        out["bucket_params_changed"] = sorted(n for n in in_bucket if not torch.equal(before[n], after[n]))
        out["others_changed"] = sorted(n for n in before if n not in in_bucket and not torch.equal(before[n], after[n]))
        opt.zero_grad()
        _train(model, opt, rank, 1, start=2)
        out["went_on"] = all(torch.isfinite(v).all() for v in _full(model).values())
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


SPILL = [(p, o, False) for p in (None, "bf16") for o in ("cpu", "nvme")] + [("fp16", "cpu", False),
                                                                           ("bf16", "nvme", True)]


def _spill_id(case) -> str:
    return f"spill-{case[0] or 'fp32'}-opt_{case[1]}{'-persistent_biases' if case[2] else ''}"


PARITY = [(p, o, pin, "cpu") for p in (None, "bf16") for o, pin in (("cpu", True), (None, False))] \
    + [("bf16", "nvme", True, "cpu"), (None, "cpu", False, "cpu"), ("fp16", "cpu", True, "cpu"),
       ("bf16", "cpu", True, "nvme"), (None, "nvme", True, "nvme"), ("bf16", None, False, "nvme")]
# The store's copies run as late as CUDA may (_LateCopier): every wait the store needs is there.
PARITY += [(None, None, True, "cpu", True), ("bf16", "cpu", True, "cpu", True), ("bf16", None, False, "cpu", True),
           (None, None, True, "nvme", True)]


def _parity_id(case) -> str:
    precision, optimizer, pin, device, *late = case
    return (f"{precision or 'fp32'}-param_{device}-opt_{optimizer or 'device'}-"
            f"{'pinned' if pin else 'pageable'}{'-late_copies' if late else ''}")


def _all_cases(rank, world):
    cases = {_parity_id(c): functools.partial(_parity_in, case=c) for c in PARITY}
    cases.update({_spill_id(c): functools.partial(_spill_in, case=c) for c in SPILL})
    cases["spill_fault"] = _spill_fault
    cases["ordering"] = _ordering
    cases["memory"] = _memory
    return run_cases_in_own_groups(rank, world, cases)


def _parity_in(rank, group, case):
    return _parity(rank, group, *case)


def _spill_in(rank, group, case):
    return _spill(rank, group, *case)


@functools.lru_cache(maxsize=1)
def _results():
    t0 = time.perf_counter()
    res = run_pooled(_all_cases, 2, timeout=600)
    print(f"\n2-rank pooled launch: {time.perf_counter() - t0:.1f} s")
    return res


def _ok(key):
    out = []
    for rank, res in enumerate(_results()):
        status, value = res[key]
        assert status == "ok", f"rank {rank}:\n{value}"
        out.append(value)
    return out


@pytest.mark.parametrize("case", PARITY, ids=_parity_id)
def test_bit_for_bit_with_the_in_memory_engine(case):
    precision, optimizer, _pin, device, *_late = case
    for out in _ok(_parity_id(case)):
        res = out["residency"]
        # gradients go to files with "nvme" and the step on the host only (host_params.py)
        assert res["store"] == "HostParamStore" and res["grad_spill"] == (device == "nvme" and optimizer is not None)
        assert res["offloaded"] == res["all_buckets"] == 4  # one bucket per unit (weight and bias)
        assert res["device_shard_elems"] == 0 and res["device_bytes"] == 0 and res["module_param_elems"] == 0
        assert res["host_equal"], "a host shard differs from the in-memory engine's shard"
        assert out["host_tier"] == (optimizer is not None)
        for key in ("params", "sharded_state", "consolidated_state", "loaded_params", "after_load_params",
                    "after_load_state", "checkpoint_params", "checkpoint_state", "frozen_moved"):
            assert out[key] == [], f"{key}: {out[key]}"
        assert out["checkpoint_residency"]["host_equal"] and out["checkpoint_residency"]["device_bytes"] == 0
        disk, written = out["on_disk"]
        if device == "nvme":  # the shards really are in the swap files
            assert disk >= 4 * 4096 and written > 0, out["on_disk"]
        else:
            assert disk == written == 0


@pytest.mark.parametrize("case", SPILL, ids=_spill_id)
def test_nvme_param_offload_spills_gradients_with_the_step_on_the_host(case):
    precision, _optimizer, persistent = case
    for rank, out in enumerate(_ok(_spill_id(case))):
        assert out["spill"], "offload_param nvme + offload_optimizer on the device path kept its gradients in memory"
        # a, b, c (frozen has no gradient); with persistent biases 3 more buckets, not offloaded
        assert out["spilled"] == 3 and out["buckets"] == (6 if persistent else 3), out
        assert (out["kept_on_host"] > 0) == persistent
        assert out["raised"] == [1, 3], out["raised"]
        assert out.get("commit_failed"), "the planted gradient write failure did not raise from backward"
        for step, c in enumerate(out["checks"]):
            # a record file per bucket, two from the second pass on (generations alternate); no
            # gradient shard in memory: not on the device, not in the host tier
            assert c["files"] == (1 if step == 0 else 2) * 3 and c["on_disk"], (rank, step, c)
            assert c["resident"] == 0 and c["host_grad_bytes"] == 0, (rank, step, c)
        assert out["host_grad_bytes_after"] == 0
        assert out["found_on_host"] == (3 if persistent else 0)  # copied in backward: the persistent ones
        assert out["skipped"] == ((1, 1) if precision == "fp16" else (0, 0)), out["skipped"]
        assert out["params"] == [] and out["state"] == [], (out["params"], out["state"])
        assert 0 < out["spill_peak"] <= 2 * (-(-out["grad_record"] // 4096) * 4096), out


def test_damaged_spilled_gradient_is_refused_naming_file_and_bucket():
    import errno

    for rank, out in enumerate(_ok("spill_fault")):
        assert out["error"] is not None, f"rank {rank}: a damaged gradient record was read back as valid"
        code, msg, filename = out["error"]
        assert code == errno.EBADMSG and filename == out["gpath"], (rank, out["error"])
        assert f"gradient bucket {out['bucket']}" in msg and "payload checksum" in msg and f"rank {rank}" in msg, msg
        assert out["bucket_params_changed"] == [], f"rank {rank}: the refused bucket was stepped"
        assert out["others_changed"], f"rank {rank}: the other buckets were not stepped"
        assert out["went_on"]


def test_copy_up_comes_before_its_all_gather_and_ahead_of_compute():
    for out in _ok("ordering"):
        assert out["passes"] == 3 and out["gathers"] == 3 * 9  # forward a, b, b, frozen, c; backward c, frozen, b, a
        assert out["gather_without_copy"] == [], "an all-gather read a shard that was not copied up"
        assert out["gather_before_wait"] == [], "an all-gather was issued before the compute stream waited for its copy"
        assert out["late_prefetch"] == [], "a unit's copy up was not issued before the previous unit's forward ended"
        assert out["up_without_follow"] == [], "a copy up was issued without the copy stream following the compute stream"


def test_device_holds_only_the_gathered_units_shards():
    for out in _ok("memory"):
        assert out["checks"] > 3 * 12
        assert out["over"] == [], f"device-resident shards beyond the gathered units': {out['over'][:3]}"
        assert out["stale"] == [], f"released units' shards left on the device: {out['stale'][:3]}"
        assert out["peak"] > 0 and out["after"] == 0 and out["shard_elems_after"] == 0


# -- unit tests ------------------------------------------------------------------------------------

class _Bucket:
    def __init__(self, n, dtype=torch.float32):
        self.shard = torch.arange(n, dtype=dtype)
        self.shard_numel = n
        self.dtype = dtype


def _store(buckets, count=1, pin=False):
    from zeroplus.offload.host_params import HostParamStore
    from zeroplus.offload.policy import parse_offload

    store = HostParamStore(parse_offload("offload_param", {"device": "cpu", "pin_memory": pin, "buffer_count": count}),
                           torch.device("cpu"), buckets)
    for b in buckets:
        store.put_initial(b, b.shard)
    store.finish_initial()
    return store


def test_store_read_ahead_write_and_replacements():
    b0, b1, b2 = _Bucket(4), _Bucket(3), _Bucket(2, torch.bfloat16)
    store = _store([b0, b1, b2], count=1)
    assert all(b.shard.numel() == 0 for b in (b0, b1, b2)) and store.host_bytes == 4 * 4 + 3 * 4 + 2 * 2
    store.read_ahead([b0, b1, b2])
    assert store.device_bytes == 16 and store.reads_ahead == 1  # buffer_count 1: one shard ahead
    shard = store.pin(b0)
    assert shard is b0.shard and torch.equal(shard, torch.arange(4.0)) and store.reads_on_demand == 0
    store.read_ahead([b1, b2])  # b0 is pinned, not ahead: one more may go
    assert store.device_bytes == 16 + 12
    store.unpin(b0)
    assert b0.shard.numel() == 0 and store.device_bytes == 12
    with pytest.raises(RuntimeError, match="bucket 0 is not pinned"):
        store.unpin(b0)
    # a write replaces the host values and drops the read-ahead copy of the old ones
    store.write(b1, torch.full((3,), 7.0))
    assert store.device_bytes == 0 and torch.equal(store.pin(b1), torch.full((3,), 7.0))
    b1.shard[0] = -1.0  # changed in place on the device (a model load), then written down
    store.write(b1, None)
    store.unpin(b1)
    assert torch.equal(store.host_shard(b1), torch.tensor([-1.0, 7.0, 7.0]))
    with pytest.raises(RuntimeError, match="bucket 1 has no pinned shard to write"):
        store.write(b1, None)
    # fp32 master cast into a bf16 shard on the host (round to nearest even)
    store.write(b2, torch.tensor([1.0 + 2 ** -9, 3.0]))
    assert store.host_shard(b2).dtype == torch.bfloat16 and store.host_shard(b2).tolist() == [1.0, 3.0]
    with pytest.raises(RuntimeError, match="bucket 2's shard has 2 elements, the new values 3"):
        store.write(b2, torch.zeros(3))
    store.stage_replacement(b0, torch.full((4,), 5.0))
    store.discard_replacements()
    assert torch.equal(store.host_shard(b0), torch.arange(4.0))
    store.stage_replacement(b0, torch.full((4,), 5.0))
    store.read_ahead([b0])
    store.commit_replacements()
    assert torch.equal(store.host_shard(b0), torch.full((4,), 5.0)) and store.device_bytes == 0
    with pytest.raises(RuntimeError, match="bucket 0's shard has 4 elements, the replacement 2"):
        store.stage_replacement(b0, torch.zeros(2))
    store.read_ahead([b2])
    store.end_step()
    assert store.device_bytes == 0 and store.disk_bytes() == 0


class _StreamLog:
    """A CPU DeviceCopier that logs, in order, the copy stream following the compute stream and
    each copy, as "up" (the device-side tensor is the destination) or "down"."""

    def __init__(self):
        from zeroplus.offload.host_tier import DeviceCopier

        self._inner = DeviceCopier(torch.device("cpu"))
        self.device, self.cuda, self.log = self._inner.device, False, []

    def host_empty(self, numel, dtype, pin):
        return self._inner.host_empty(numel, dtype, pin)

    def follow_compute(self):
        self.log.append("follow")

    def copy(self, dst, src, device_side):
        dst.copy_(src)
        self.log.append("up" if device_side is dst else "down")
        return object()

    def host_wait(self, event):
        pass

    def compute_waits(self, event):
        if event is not None:
            self.log.append("compute_waits")


@pytest.mark.parametrize("mode", ("pinned", "pageable", "nvme"))
def test_every_copy_up_follows_the_compute_stream(mode, tmp_path):
    """A copy up writes a device buffer just allocated from the compute stream's pool, whose
    memory the kernels queued there may still use (a freed activation, a shard an all-gather the
    compute stream waits for still reads): on CUDA the copy stream must wait for the compute
    stream first. (On CPU copies are synchronous, so only the order of the calls can show it.)"""
    from zeroplus.offload.host_params import HostParamStore
    from zeroplus.offload.policy import parse_offload

    rec = _StreamLog()
    buckets = [_Bucket(4), _Bucket(3), _Bucket(2, torch.bfloat16)]
    knobs = {"device": "cpu", "pin_memory": mode == "pinned", "buffer_count": 2}
    swapper_for = None
    if mode == "nvme":
        knobs = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2}
        swapper_for = lambda _proxies: MemorySwapper()  # noqa: E731
    store = HostParamStore(parse_offload("offload_param", knobs), torch.device("cpu"), buckets, copier=rec,
                           swapper_for=swapper_for)
    for b in buckets:
        store.put_initial(b, b.shard)
    store.finish_initial()
    for _ in range(2):  # read ahead, pinned, unpinned; written down; gathered again on demand
        store.read_ahead(buckets)
        for b in buckets:
            shard = store.pin(b)
            assert torch.equal(shard.float(), torch.arange(float(b.shard_numel)))
            store.unpin(b)
        store.pin(buckets[0])
        store.write(buckets[0], None)
        store.unpin(buckets[0])
        store.end_step()
    ups = [k for k, what in enumerate(rec.log) if what == "up"]
    assert len(ups) >= 2 * len(buckets)
    assert all(k > 0 and rec.log[k - 1] == "follow" for k in ups), rec.log


def test_store_pageable_goes_through_the_staging_ring():
    buckets = [_Bucket(5), _Bucket(6), _Bucket(7)]
    store = _store(buckets, count=2, pin=False)
    for _ in range(2):
        store.read_ahead(buckets)
        for b in buckets:
            assert torch.equal(store.pin(b), torch.arange(float(b.shard_numel)))
            store.unpin(b)
    assert store.device_bytes == 0 and store.bytes_up == 2 * (5 + 6 + 7) * 4


def test_decisions_by_device_and_hook(tmp_path):
    from zeroplus.offload import HostParams, OptimizerOffload, make_grad_spill, make_param_store, prepare_param_store
    from zeroplus.offload.host_tier import force_on_cpu_for_tests
    from zeroplus.offload.policy import parse_offload

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    cpu_p = parse_offload("offload_param", {"device": "cpu", "pin_memory": True})
    nvme_p = parse_offload("offload_param", {"device": "nvme", "nvme_path": str(tmp_path)})
    prepared = prepare_param_store(cpu_p, 3, 0, cuda, "E")
    assert isinstance(prepared, HostParams) and prepared.device == cuda
    assert prepare_param_store(cpu_p, 3, 0, cpu, "E") is None  # CPU training: a no-op
    prepare_param_store(nvme_p, 3, 0, cpu, "E")[2].close()  # CPU training: the NVMe swapper alone
    with force_on_cpu_for_tests():
        store = make_param_store(prepare_param_store(cpu_p, 3, 0, cpu, "E"), [])
        assert type(store).__name__ == "HostParamStore" and not store.spills_gradients and store.keeps_master_apart
        assert store.swapper is None
        nvme_store = make_param_store(prepare_param_store(nvme_p, 3, 0, cpu, "E"), [])
        assert type(nvme_store.swapper).__name__ == "ParamSwapper" and nvme_store.read_ahead_limit == 0
        assert not nvme_store.spills_gradients  # the step on the device reads its gradients there
        nvme_store.close()
        # the step on the host (offload_optimizer: the host tier): gradients to files, "nvme" only
        on_host = OptimizerOffload(parse_offload("offload_optimizer", {"device": "cpu"}), 0, None, True)
        spilling = make_param_store(prepare_param_store(nvme_p, 3, 0, cpu, "E", on_host), [])
        assert spilling.spills_gradients
        spill = make_grad_spill(spilling, {}, cpu)
        assert spill.directory is spilling.swapper.directory and spill.device == cpu
        spilling.close()
        assert not make_param_store(prepare_param_store(cpu_p, 3, 0, cpu, "E", on_host), []).spills_gradients
    prepared = prepare_param_store(nvme_p, 3, 0, cuda, "E", on_host)
    assert prepared.spill_gradients
    prepared.directory.close()
    prepared = prepare_param_store(nvme_p, 3, 0, cuda, "E")
    assert isinstance(prepared, HostParams) and prepared.directory is not None
    prepared.directory.close()
    for p in list(tmp_path.iterdir()):  # the CPU-training swapper's directory above
        shutil.rmtree(p)
    with pytest.raises(NotImplementedError, match="offload_param device 'cpu' with parameters on meta is not built"):
        prepare_param_store(cpu_p, 3, 0, torch.device("meta"), "E")
    with pytest.raises(ValueError, match="offload_param applies to ZeRO stage 3 only"):
        prepare_param_store(cpu_p, 2, 0, cuda, "E")
    assert list(tmp_path.iterdir()) == []  # refusals create nothing
    from zeroplus.offload.host_params import HostParamStore
    with pytest.raises(ValueError, match="needs an offload_param OffloadPolicy with device 'cpu'"):
        HostParamStore(nvme_p, cuda, [])
    with pytest.raises(ValueError, match="needs an offload_param OffloadPolicy with device 'cpu'"):
        HostParamStore(cpu_p, cuda, [], swapper_for=lambda _b: None)
    with pytest.raises(ValueError, match="spill_gradients needs NVMe mode"):
        HostParamStore(cpu_p, cuda, [], spill_gradients=True)
    with pytest.raises(TypeError, match="spill_gradients must be a bool, got str"):
        HostParamStore(cpu_p, cuda, [], spill_gradients="yes")


def test_estimate_memory_cuda_param_columns():
    import zeroplus

    psi, n = 1e9, 8
    base = zeroplus.estimate_memory(psi, n, 3, "bf16", offload_optimizer="cpu", device="cuda")
    both = zeroplus.estimate_memory(psi, n, 3, "bf16", offload_optimizer="cpu", offload_param="cpu", device="cuda")
    assert both["gpu"] == base["gpu"] - 2 * psi / n and both["host"] == base["host"] + 2 * psi / n
    assert both["resident"] == both["gpu"] + both["host"] and both["nvme"] == 0
    alone = zeroplus.estimate_memory(psi, n, 3, "bf16", offload_param="cpu", device="cuda")
    assert alone["host"] == 2 * psi / n and alone["gpu"] == alone["model_state"] - 2 * psi / n
    fp32 = zeroplus.estimate_memory(psi, n, 3, None, offload_param="cpu", device="cuda")
    assert fp32["host"] == 4 * psi / n and fp32["gpu"] == fp32["model_state"]  # a master of its own on the GPU
    on_cpu = zeroplus.estimate_memory(psi, n, 3, "bf16", offload_param="cpu")
    assert on_cpu["resident"] == on_cpu["model_state"]  # CPU training: a no-op
    bucket = 1 << 22
    records = -(-psi // bucket)
    nv = zeroplus.estimate_memory(psi, n, 3, "bf16", offload_optimizer="cpu", offload_param="nvme", device="cuda",
                                  param_buffer_count=2, param_buffer_size=1)
    pool = 2 * (4096 + -(-bucket // n) * 2)  # two records of the largest shard (whole pages already)
    assert nv["offload_param_buffers"] == pool
    # with the step on the host the gradient shards are spilled: two files per bucket, out of the
    # host tier's per-bucket gradient buffers (the GPU holds one bucket's on its way, as with "cpu")
    grads = 2 * psi / n
    assert nv["nvme"] == 2 * psi / n + 4096 * records + 2 * grads + 2 * 4096 * records
    assert nv["gpu"] == both["gpu"] and nv["host"] == base["host"] + pool - grads
    nv_opt = zeroplus.estimate_memory(psi, n, 3, "bf16", offload_optimizer="nvme", offload_param="nvme",
                                      device="cuda")
    opt_only = zeroplus.estimate_memory(psi, n, 3, "bf16", offload_optimizer="nvme", device="cuda")
    assert nv_opt["nvme"] == opt_only["nvme"] + 2 * psi / n + 4096 * records + 2 * grads + 2 * 4096 * records
    assert nv_opt["gpu"] == opt_only["gpu"] - 2 * psi / n
    # the step on the GPU reads its gradients there: only the parameter records go to the files
    nv_gpu = zeroplus.estimate_memory(psi, n, 3, "bf16", offload_param="nvme", device="cuda", param_buffer_count=2,
                                      param_buffer_size=1)
    assert nv_gpu["nvme"] == 2 * psi / n + 4096 * records
    assert nv_gpu["gpu"] == alone["gpu"] and nv_gpu["host"] == pool
