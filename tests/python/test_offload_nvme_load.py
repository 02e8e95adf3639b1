"""Loading into an NVMe-offloaded optimizer (issue 40, item 2): loading is the repair of a lost
swap record, and a load is all or nothing.

  * A deleted `optimizer-bNNNNN.swp` is written anew by `opt.load_state_dict(...)` (fp32: the
    master is the parameters) and by `zeroplus.load_checkpoint` (fp16: master, state and loss
    scaler from the checkpoint); training on equals the uninterrupted in-memory run bit for bit.
  * A write that fails for one bucket in the middle of a load (injected at the swapper's I/O
    handle) raises an error that does not tell the user to continue, and leaves every bucket's
    state, its swap record, the parameters and the loss scaler exactly as they were: training on
    still equals the run that never tried the load.
One rank in this process (the one_rank_group fixture), the tiny GPT with small buckets: ~5 s.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

STEPS = 3
BUCKET = 4  # the record lost or failing: one in the middle (buckets before and after it exist)
SMALL_BUCKETS = {"zero_optimization": {"reduce_bucket_size": 3000}}


def _build(precision, nvme=None, buffer_count=2):
    import zeroplus
    import zero_models as zm

    kw = {}
    if nvme is not None:
        os.makedirs(nvme, exist_ok=True)
        kw["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": buffer_count}
    return zeroplus.initialize(zm.make_model(), torch.optim.AdamW, stage=2, lr=3e-3, mixed_precision=precision,
                               config=SMALL_BUCKETS, **kw)


def _train(model, opt, steps, start):
    import zero_models as zm

    for step in range(start, start + steps):
        x, y = zm.batch(step, 0)
        opt.backward(zm.loss_fn(model, x, y))
        opt.step()
        opt.zero_grad()


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _snapshot(model, opt) -> dict:
    return {"params": [p.detach().clone() for p in model.parameters()], "state": opt.state_dict(),
            "scaler": opt.scaler.state_dict(), "skipped": opt.skipped_steps}


def _record(opt, bucket: int) -> str:
    return os.path.join(opt.offload.directory.path, f"optimizer-b{bucket:05d}.swp")


class _FailingWrites:
    """The swapper's I/O handle, refusing every write to one bucket's files (ENOSPC)."""

    def __init__(self, inner, bucket: int):
        self.inner, self.needle = inner, f"b{bucket:05d}"

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _check(self, path):
        if self.needle in os.path.basename(path):
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)

    def async_pwrite(self, buf, path, *args, **kwargs):
        self._check(path)
        return self.inner.async_pwrite(buf, path, *args, **kwargs)

    def sync_pwrite(self, buf, path, *args, **kwargs):
        self._check(path)
        return self.inner.sync_pwrite(buf, path, *args, **kwargs)


def _load(how, model, opt, source):
    import zeroplus

    if how == "state_dict":
        opt.load_state_dict(source)
    else:
        zeroplus.load_checkpoint(source, model, opt)


def _source(how, model, opt, path):
    import zeroplus

    if how == "state_dict":
        return opt.state_dict()
    zeroplus.save_checkpoint(path, model, opt)
    return path


@pytest.mark.parametrize("how, precision", [("state_dict", None), ("checkpoint", "fp16")])
def test_a_load_recreates_a_lost_swap_record(one_rank_group, tmp_path, how, precision):
    ref, ref_opt = _build(precision)
    model, opt = _build(precision, str(tmp_path / "nvme"))
    assert len(opt.bucket_optimizers) > BUCKET + 1
    _train(ref, ref_opt, STEPS, 0)
    _train(model, opt, STEPS, 0)
    source = _source(how, model, opt, str(tmp_path / "ckpt"))
    os.unlink(_record(opt, BUCKET))
    _load(how, model, opt, source)  # the documented repair
    assert os.path.exists(_record(opt, BUCKET))
    _train(ref, ref_opt, STEPS, STEPS)
    _train(model, opt, STEPS, STEPS)
    assert _same(_snapshot(model, opt), _snapshot(ref, ref_opt)), "the repaired run differs from the uninterrupted one"
    assert not [n for n in os.listdir(opt.offload.directory.path) if n.endswith(".new")]
    opt.offload.close()


@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
def test_a_load_that_fails_half_way_changes_nothing(one_rank_group, tmp_path, how):
    """fp16, so that the loss scaler has state a load would change."""
    ref, ref_opt = _build("fp16")
    model, opt = _build("fp16", str(tmp_path / "nvme"))
    _train(ref, ref_opt, STEPS, 0)
    _train(model, opt, STEPS, 0)
    source = _source(how, model, opt, str(tmp_path / "ckpt"))
    _train(ref, ref_opt, 2, STEPS)  # the state the load would replace differs from the source's
    _train(model, opt, 2, STEPS)
    before = _snapshot(model, opt)
    if how == "state_dict":
        assert not _same(before["state"], source) and before["scaler"] != source["zeroplus"]["loss_scaler"]
    real = opt.offload._writer  # noqa: SLF001 - the fault is injected at the swapper's I/O handle
    opt.offload._writer = _FailingWrites(real, BUCKET)  # noqa: SLF001
    with pytest.raises(OSError) as info:
        _load(how, model, opt, source)
    opt.offload._writer = real  # noqa: SLF001
    assert _same(_snapshot(model, opt), before), "a failed load changed the model, the optimizer or the scaler"
    text = str(info.value)
    assert f"bucket {BUCKET}" in text and "continue" not in text, text
    assert not [n for n in os.listdir(opt.offload.directory.path) if n.endswith(".new")]
    _train(ref, ref_opt, 2, STEPS + 2)  # the records on disk are the ones from before the load
    _train(model, opt, 2, STEPS + 2)
    assert _same(_snapshot(model, opt), _snapshot(ref, ref_opt))
    opt.offload.close()


def test_a_commit_that_cannot_rename_is_refused_until_a_load_succeeds(one_rank_group, tmp_path):
    """The one window left: a rename failing half-way through the commit. Nothing of the
    optimizer changed, the records already replaced are refused (never read as the old state),
    the error says to load again, and loading again repairs everything."""
    ref, ref_opt = _build(None)
    model, opt = _build(None, str(tmp_path / "nvme"), buffer_count=64)  # records stay cached in the pool
    _train(ref, ref_opt, STEPS, 0)
    _train(model, opt, STEPS, 0)
    saved = opt.state_dict()
    directory, last = opt.offload.directory, len(opt.bucket_optimizers) - 1
    real = directory.replace

    def failing(src, dst):
        if f"b{last:05d}" in dst:  # the last rename: every other record is replaced by then
            raise OSError(errno.EIO, "Input/output error (injected)", dst)
        return real(src, dst)

    directory.replace = failing
    with pytest.raises(OSError, match=f"bucket {last}.*load again") as info:
        opt.load_state_dict(saved)
    del directory.replace
    assert "continue" not in str(info.value)
    assert not [n for n in os.listdir(directory.path) if n.endswith(".new")]
    refused = []
    for b, bo in enumerate(opt.bucket_optimizers):  # cached copies of the old records included
        try:
            opt.offload.segment_states(bo)
        except OSError as e:
            assert "generation" in str(e), e
            refused.append(b)
    assert refused == list(range(last)), refused
    opt.load_state_dict(saved)
    _train(ref, ref_opt, STEPS, STEPS)
    _train(model, opt, STEPS, STEPS)
    assert _same(_snapshot(model, opt), _snapshot(ref, ref_opt))
    opt.offload.close()
