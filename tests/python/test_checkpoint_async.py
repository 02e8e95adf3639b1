"""save_checkpoint(..., async_=True): snapshot, then a background write that training overlaps.

One 2-rank launch (one process group per case):
  * overlap: 10 training steps run while the save is in flight (its deferred snapshot and its
    writes both slowed down); the checkpoint holds the state of the moment of the call (a fresh
    model loading it and training the same 10 steps ends equal, exactly, to the model that kept
    training), that model equals one trained the same 13 steps without any save, and
    snapshot_bytes (the bytes copied into memory) is a small part of this rank's shard: the masters
    and the optimizer state are written from the live tensors; stage 3 with sharded parameters
    (persistence threshold 0 saving, 8 loading; asserted);
  * guarded: opt.step(), opt.load_state_dict() and model.load_state_dict() issued right after an
    async save, while its deferred snapshot is still being taken (slowed down), wait for it: the
    checkpoint holds the state of the call (params and the sharded optimizer state, exactly), and
    handle.blocked_s counts the wait (also with direct="auto", where the deferred pieces are copied
    rather than written live); with overlap_snapshot=False nothing is left to wait for;
  * error: a file size limit on one rank makes both ranks' wait() raise (the limited rank its
    OSError, the other the commit failure naming the rank); the previous checkpoint still loads;
  * serialised: two saves in a row: the second starts after the first finished; a load of the
    second right away (no wait()) waits for it and gets its parameters and optimizer state; the
    first holds the parameters from before; latest names the second;
  * full disk (issue 40 item 4): one rank's shard write fails and the disk refuses its failure
    marker too; with commit_timeout_s=30, every rank's wait() raises within seconds (rank 0 used
    to poll for its own marker, or for rank 1's, for all 30 s), nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

from checkpoint_models import (PERSIST_SOME, VOCAB, CkptNet, batch, build, fsize_limited, full_params, loss_of,
                               sharded_names, train)
from checkpoint_helpers import cases_of, ok_values, pooled_results
from harness import run_cases_in_own_groups


@contextlib.contextmanager
def _slow_disk(seconds: float):
    """Shard writes take `seconds` longer (a slow disk), so training surely runs during them: the
    delay comes after the live pieces' bytes reached the page cache (an async save's writer calls
    back then, snapshot.py), or before anything when there is no such callback."""
    from zeroplus.checkpoint import save_job as save

    real = save.write_shard

    def slow(*args, live=None, **kwargs):
        if live is None:
            time.sleep(seconds)
            return real(*args, **kwargs)
        last, written = live

        def then_slow():
            written()
            time.sleep(seconds)
        return real(*args, live=(last, then_slow), **kwargs)
    save.write_shard = slow
    try:
        yield
    finally:
        save.write_shard = real


@contextlib.contextmanager
def _slow_snapshot(seconds: float):
    """The deferred part of an async snapshot starts `seconds` late (a slow copy), so whatever the
    training thread does right after the call happens while it is still pending."""
    from zeroplus.checkpoint.snapshot import Snapshot

    real = Snapshot.take_deferred

    def slow(self):
        time.sleep(seconds)
        return real(self)
    Snapshot.take_deferred = slow
    try:
        yield
    finally:
        Snapshot.take_deferred = real


def _differ(a: dict, b: dict) -> list:
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


def case_overlap(root, rank, group):
    import zeroplus

    # stage 3 with every parameter sharded (threshold 0): the snapshot copies shards that the
    # steps during the write update in place; the loading side keeps the 8-element ones whole
    model, call, opt = build("engine", 3, None, group, seed=0, persist=0)
    train(call, opt, 3, rank)
    with _slow_snapshot(0.2), _slow_disk(0.5):
        handle = zeroplus.save_checkpoint(os.path.join(root, "overlap"), model, opt, extra={"step": 3}, async_=True)
        train(call, opt, 10, rank, first_step=3)
        overlapped = not handle.done()
        path = handle.wait()
    shard = os.path.getsize(os.path.join(path, f"rank{rank:05d}.bin"))
    model_b, call_b, opt_b = build("engine", 3, None, group, seed=1, lr=1e-3, persist=PERSIST_SOME)
    extra = zeroplus.load_checkpoint(path, model_b, opt_b)
    train(call_b, opt_b, 10, rank, first_step=3)
    model_c, call_c, opt_c = build("engine", 3, None, group, seed=0, persist=0)
    train(call_c, opt_c, 13, rank)
    a, b, c = full_params("engine", model), full_params("engine", model_b), full_params("engine", model_c)
    return (extra, handle.snapshot_bytes, shard, _differ(a, b), overlapped, _differ(a, c),
            (sharded_names(model, opt), sharded_names(model_b, opt_b)))


def _state(model, opt) -> dict:
    """Every parameter (gathered) and this rank's sharded optimizer state tensors, cloned."""
    out = {f"param.{k}": v.clone() for k, v in full_params("engine", model).items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


class _RootParamNet(CkptNet):
    """A trainable parameter on the root module itself: the engine's own load_state_dict
    pre-hook on the root writes its master, so the guard's hook must run before that one."""

    def __init__(self):
        super().__init__()
        self.root_bias = torch.nn.Parameter(torch.randn(VOCAB))

    def forward(self, x):
        return super().forward(x) + self.root_bias


def _root_param_net(seed: int) -> _RootParamNet:
    torch.manual_seed(seed)
    return _RootParamNet()


def case_guarded(root, rank, group):
    """Each mutation right after the call must wait for the snapshot (see the module doc)."""
    import zeroplus

    root = os.path.join(root, "guarded")
    model, call, opt = build("engine", 2, None, group, seed=0, model=_root_param_net(0))
    train(call, opt, 2, rank)
    earlier_opt_state = opt.state_dict()  # loaded below: an optimizer state unlike the saved one
    earlier_opt_state = {**earlier_opt_state, "state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                            for k, v in st.items()}
                                                        for i, st in earlier_opt_state["state"].items()}}
    train(call, opt, 1, rank, first_step=2)
    zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}

    def mutate_step():
        opt.step()
        opt.zero_grad()

    # default options: the deferred pieces are written from the live tensors (the page cache's
    # copy is the snapshot); direct="auto" (O_DIRECT): copied on the writer thread instead
    copied = zeroplus.checkpoint.CheckpointOptions(direct="auto")
    mutations = {"step": (mutate_step, None), "opt_load": (lambda: opt.load_state_dict(earlier_opt_state), None),
                 "model_load": (lambda: model.load_state_dict(zeros), None), "step_copied": (mutate_step, copied)}
    out = {}
    for what, (mutate, options) in mutations.items():
        if what.startswith("step"):  # gradients ready before the save: the step is the very next call
            opt.backward(loss_of(call, batch(3, rank)))
        expected = _state(model, opt)
        with _slow_snapshot(0.3):
            handle = zeroplus.save_checkpoint(os.path.join(root, what), model, opt, async_=True, options=options)
            mutate()
            handle.wait()
        model_b, _c, opt_b = build("engine", 2, None, group, seed=1, model=_root_param_net(1))
        zeroplus.load_checkpoint(os.path.join(root, what), model_b, opt_b)
        changed = _differ(expected, _state(model, opt))  # the mutation did happen
        out[what] = (_differ(expected, _state(model_b, opt_b)), handle.blocked_s, bool(changed))
    # overlap_snapshot=False: everything copied before the call returns, so the step waits for nothing
    opt.backward(loss_of(call, batch(4, rank)))
    expected = _state(model, opt)
    with _slow_snapshot(0.3):
        handle = zeroplus.save_checkpoint(os.path.join(root, "eager"), model, opt, async_=True,
                                          options=zeroplus.checkpoint.CheckpointOptions(overlap_snapshot=False))
        call_s = handle.blocked_s
        mutate_step()
        handle.wait()
    model_b, _c, opt_b = build("engine", 2, None, group, seed=1, model=_root_param_net(1))
    zeroplus.load_checkpoint(os.path.join(root, "eager"), model_b, opt_b)
    out["eager"] = (_differ(expected, _state(model_b, opt_b)), handle.blocked_s - call_s, True)
    return out


def case_error(root, rank, group):
    import zeroplus

    root = os.path.join(root, "error")
    model, call, opt = build("engine", 2, None, group, seed=0)
    zeroplus.save_checkpoint(os.path.join(root, "first"), model, opt)

    def save_and_wait():
        handle = zeroplus.save_checkpoint(os.path.join(root, "second"), model, opt, async_=True)
        try:
            handle.wait()
        except Exception as e:  # noqa: BLE001 - the error is the result
            return f"{type(e).__name__}: {e}"
        return None
    err = fsize_limited(save_and_wait, 1000) if rank == 1 else save_and_wait()
    model_b, _c, opt_b = build("engine", 2, None, group, seed=1)
    zeroplus.load_checkpoint(root, model_b, opt_b)
    with open(os.path.join(root, "latest")) as f:
        return err, f.read().strip(), sorted(os.listdir(root))


def case_serialised(root, rank, group):
    import zeroplus

    root = os.path.join(root, "serial")
    model, call, opt = build("engine", 1, None, group, seed=0)
    before = full_params("engine", model)
    h1 = zeroplus.save_checkpoint(os.path.join(root, "one"), model, opt, async_=True)
    train(call, opt, 1, rank)
    h2 = zeroplus.save_checkpoint(os.path.join(root, "two"), model, opt, async_=True)
    first_done_when_second_started = h1.done()
    # No wait(): a load of the same path waits for this process's save in flight (rank 0 ends
    # its commit before it; the other ranks wait in the load's collective for rank 0).
    model_b, call_b, opt_b = build("engine", 1, None, group, seed=1)
    zeroplus.load_checkpoint(os.path.join(root, "two"), model_b, opt_b)
    h2.wait()
    h1.wait()
    # What was loaded is the second save: the parameters as they were, and the optimizer state
    # (one more step on each gives the same parameters again).
    saved, loaded = full_params("engine", model), full_params("engine", model_b)
    moved = [k for k in before if not torch.equal(before[k], saved[k])]
    differ = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    train(call, opt, 1, rank, first_step=1)
    train(call_b, opt_b, 1, rank, first_step=1)
    after, after_b = full_params("engine", model), full_params("engine", model_b)
    differ_after_step = [k for k in after if not torch.equal(after[k], after_b[k])]
    # The first save holds the parameters from before the training step.
    model_c, _c, opt_c = build("engine", 1, None, group, seed=2)
    zeroplus.load_checkpoint(os.path.join(root, "one"), model_c, opt_c)
    first = full_params("engine", model_c)
    differ_first = [k for k in before if not torch.equal(before[k], first[k])]
    compared = (moved, differ, differ_after_step, differ_first)
    if rank != 0:
        return first_done_when_second_started, None, compared  # latest is rank 0's to update, after wait() on rank > 0
    with open(os.path.join(root, "latest")) as f:
        return first_done_when_second_started, f.read().strip(), compared


def case_async_replace(root, rank, group):
    """An async save over an existing checkpoint, then a load of that path right away on every
    rank: every rank loads the new state (no rank may take the replaced checkpoint's manifest
    for the end of the save)."""
    import zeroplus

    root = os.path.join(root, "replace")
    path = os.path.join(root, "ck")
    model, call, opt = build("engine", 2, None, group, seed=0)
    zeroplus.save_checkpoint(path, model, opt, extra={"step": 0})
    train(call, opt, 2, rank)
    zeroplus.save_checkpoint(path, model, opt, extra={"step": 2}, async_=True)
    model_b, _c, opt_b = build("engine", 2, None, group, seed=1)
    extra = zeroplus.load_checkpoint(path, model_b, opt_b)
    a, b = full_params("engine", model), full_params("engine", model_b)
    return extra, [k for k in a if not torch.equal(a[k], b[k])], sorted(os.listdir(root))


@contextlib.contextmanager
def _full_disk():
    """This rank's shard write fails with ENOSPC, and so does its failure marker (commit.py): a
    full disk, as it reaches the save, on this rank only."""
    import errno

    from zeroplus.checkpoint import fsutil
    from zeroplus.checkpoint import save_job

    real_shard, real_small = save_job.write_shard, fsutil.write_small_file

    def shard(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def small(dir_fd, final, *args, **kwargs):
        if final.endswith(".failed"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_small(dir_fd, final, *args, **kwargs)
    save_job.write_shard, fsutil.write_small_file = shard, small
    try:
        yield
    finally:
        save_job.write_shard, fsutil.write_small_file = real_shard, real_small


def _full_disk_on(root, rank, group, failing_rank):
    import zeroplus
    from zeroplus.checkpoint import CheckpointOptions

    root = os.path.join(root, f"full{failing_rank}")
    model, call, opt = build("engine", 2, None, group, seed=0)
    zeroplus.save_checkpoint(os.path.join(root, "first"), model, opt)
    t0 = time.monotonic()
    with _full_disk() if rank == failing_rank else contextlib.nullcontext():
        handle = zeroplus.save_checkpoint(os.path.join(root, "second"), model, opt, async_=True,
                                          options=CheckpointOptions(commit_timeout_s=30))
        try:
            handle.wait()
            err = None
        except Exception as e:  # noqa: BLE001 - the error is the result
            err = f"{type(e).__name__}: {e}"
    waited = time.monotonic() - t0
    import torch.distributed as dist

    dist.barrier(group=group)  # rank 0 has removed the staging directory on both ranks' listing
    with open(os.path.join(root, "latest")) as f:
        return err, waited, f.read().strip(), sorted(os.listdir(root))


def case_full_disk_rank0(root, rank, group):
    return _full_disk_on(root, rank, group, 0)


def case_full_disk_rank1(root, rank, group):
    return _full_disk_on(root, rank, group, 1)


def _all(rank, world, root):
    cases = cases_of(globals(), root)
    return run_cases_in_own_groups(rank, world, cases)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return pooled_results(_all, str(tmp_path_factory.mktemp("async")), "async checkpoint cases")


def test_async_save_overlaps_training(results):
    for extra, snapshot, shard, differ, overlapped, differ_no_save, sharded in ok_values(results, "overlap"):
        assert overlapped, "the save finished before training went on: the case tests nothing"
        assert sharded == (["emb.weight", "frozen", "lin1.bias", "lin1.weight", "lin2.bias", "lin2.weight"],
                           ["emb.weight", "lin1.bias", "lin1.weight", "lin2.weight"]), sharded
        assert extra == {"step": 3}
        # the masters and optimizer state (nearly all of the shard) are written from the live
        # tensors, not copied: the copy is the few frozen and buffer bytes
        assert shard > 0 and snapshot < shard // 10, (snapshot, shard)
        assert differ == [], f"training after loading the async checkpoint differs in {differ}"
        assert differ_no_save == [], f"training with a save in flight differs from training without in {differ_no_save}"


def test_mutations_right_after_an_async_save_wait_for_its_snapshot(results):
    for rank, out in enumerate(ok_values(results, "guarded")):
        for what in ("step", "opt_load", "model_load", "step_copied"):
            leaked, blocked, changed = out[what]
            assert changed, f"rank {rank}: {what} changed nothing: the case tests nothing"
            assert leaked == [], f"rank {rank}: {what} right after the save reached the checkpoint in {leaked}"
            assert blocked >= 0.25, f"rank {rank}: {what} did not wait for the snapshot (blocked_s {blocked})"
        leaked, waited, _ = out["eager"]
        assert leaked == []
        assert waited < 0.25, f"rank {rank}: overlap_snapshot=False left the step waiting {waited} s"


def test_async_save_error_raises_at_wait(results):
    (err0, latest0, names0), (err1, latest1, names1) = ok_values(results, "error")
    assert err1 is not None and "File too large" in err1
    assert err0 is not None and "rank 1 failed" in err0
    assert latest0 == latest1 == "first"
    assert names0 == names1 == ["first", "latest"]


def test_async_saves_are_serialised(results):
    for rank, (first_done, latest, (moved, differ, differ_after_step, differ_first)) in enumerate(
            ok_values(results, "serialised")):
        assert first_done
        assert latest == ("two" if rank == 0 else None)
        assert moved, "training between the two saves changed nothing: the comparisons test nothing"
        assert differ == [], f"rank {rank}: the second checkpoint loaded other parameters in {differ}"
        assert differ_after_step == [], f"rank {rank}: a step after loading differs in {differ_after_step}"
        assert differ_first == [], f"rank {rank}: the first checkpoint loaded other parameters in {differ_first}"


def test_async_replace_then_load_sees_the_new_checkpoint(results):
    for extra, differ, names in ok_values(results, "async_replace"):
        assert extra == {"step": 2}
        assert differ == []
        assert names == ["ck", "latest"]


@pytest.mark.parametrize("failing", [0, 1])
def test_full_disk_on_one_rank_fails_every_wait_at_once(results, failing):
    for rank, (err, waited, latest, names) in enumerate(ok_values(results, f"full_disk_rank{failing}")):
        assert err is not None, f"rank {rank}: the save succeeded on a full disk"
        if rank == failing:
            assert "No space left on device (injected)" in err, err
        assert waited < 10, f"rank {rank}: wait() took {waited:.1f} s to report the full disk (commit_timeout_s 30)"
        assert latest == "first" and names == ["first", "latest"], (latest, names)
