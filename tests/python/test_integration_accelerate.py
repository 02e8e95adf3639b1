"""accelerate: the stock accelerator.prepare with zeroplus.ZeroRedundancyOptimizer (stage 1,
save_state/load_state) and zeroplus.integrations.accelerate.prepare at stages 1-3, 2 ranks over
backend="zeroplus", losses against the plain DDP run. One pooled launch."""

from __future__ import annotations

import time

import accelerate  # noqa: F401  (a hard requirement: scripts/setup.sh installs it)
import pytest
import torch

from harness import run_pooled

STEPS, LR = 4, 1e-3


def _loop(accelerator, model, opt, loader, steps):
    losses = []
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _loader(accelerator, skip=0):
    import integration_common as ic

    data = ic.TokenDataset()
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(skip * 4, len(data))), batch_size=2)
    return accelerator.prepare(loader)


def _all_cases(rank, world_size, tmp):
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    import integration_common as ic
    import zeroplus
    from zeroplus.integrations import accelerate as zp_accelerate

    ic.torchrun_env(rank, world_size)
    out = {"backend": dist.get_backend()}
    # accelerate's fixed rule for multi-process CPU (gloo or mpi): the documented line
    # dist.init_process_group("zeroplus") before Accelerator is why this is not needed.
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="zeroplus")])
    except ValueError as e:
        out["kwarg_refused"] = str(e)
    AcceleratorState._reset_state(reset_partial_state=True)
    # One Accelerator per run: save_state/load_state cover the models and optimizers it prepared.
    accelerator = Accelerator(cpu=True)

    model = ic.tiny_gpt2()
    ref_model, ref_opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0))
    out["ddp"] = _loop(accelerator, ref_model, ref_opt, _loader(accelerator), STEPS)

    # Stock: accelerator.prepare (DDP) with zeroplus.ZeroRedundancyOptimizer; save after 2 steps.
    accelerator = Accelerator(cpu=True)
    model = ic.tiny_gpt2()
    opt = zeroplus.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR,
                                           weight_decay=0.0)
    model, opt = accelerator.prepare(model, opt)  # calls opt.state_dict() before any step
    hook = accelerator.register_save_state_pre_hook(zeroplus.integrations.accelerate.consolidate_on_save(opt))
    out["stock"] = _loop(accelerator, model, opt, _loader(accelerator), 2)
    accelerator.save_state(f"{tmp}/stock")
    out["stock"] += _loop(accelerator, model, opt, _loader(accelerator, skip=2), 2)
    hook.remove()
    accelerator = Accelerator(cpu=True)
    model = ic.tiny_gpt2(seed=5)
    opt = zeroplus.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR,
                                           weight_decay=0.0)
    model, opt = accelerator.prepare(model, opt)
    accelerator.load_state(f"{tmp}/stock")
    out["stock_resumed"] = _loop(accelerator, model, opt, _loader(accelerator, skip=2), 2)

    # zeroplus.integrations.accelerate.prepare at stages 1-3 (no DDP); stage 1 saves and resumes.
    for stage in (1, 2, 3):
        accelerator = Accelerator(cpu=True)
        model, opt = zp_accelerate.prepare(accelerator, ic.tiny_gpt2(), torch.optim.AdamW, stage=stage, lr=LR,
                                           weight_decay=0.0)
        out[f"zp{stage}_ddp"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        out[f"zp{stage}"] = _loop(accelerator, model, opt, _loader(accelerator), 2)
        try:
            accelerator.save_state(f"{tmp}/zp{stage}", safe_serialization=False)
        except NotImplementedError as e:
            out[f"zp{stage}_save_error"] = str(e)
        out[f"zp{stage}"] += _loop(accelerator, model, opt, _loader(accelerator, skip=2), 2)
    accelerator = Accelerator(cpu=True)
    model, opt = zp_accelerate.prepare(accelerator, ic.tiny_gpt2(seed=5), torch.optim.AdamW, stage=1, lr=LR,
                                       weight_decay=0.0)
    accelerator.load_state(f"{tmp}/zp1")
    out["zp1_resumed"] = _loop(accelerator, model, opt, _loader(accelerator, skip=2), 2)
    return out


def test_accelerate_stage1_stock_and_prepare_stages_1_to_3(tmp_path):
    t0 = time.monotonic()
    for rank, r in enumerate(run_pooled(_all_cases, 2, str(tmp_path), timeout=600)):
        assert r["backend"] == "zeroplus"
        assert "zeroplus is not available" in r["kwarg_refused"]
        assert len(r["ddp"]) == STEPS
        assert r["stock"] == pytest.approx(r["ddp"], rel=1e-5, abs=1e-6), rank
        assert r["stock_resumed"] == pytest.approx(r["ddp"][2:], rel=1e-5, abs=1e-6), rank
        for stage in (1, 2, 3):
            assert not r[f"zp{stage}_ddp"]
            assert r[f"zp{stage}"] == pytest.approx(r["ddp"], rel=1e-4, abs=1e-5), (rank, stage)
        assert "zp1_save_error" not in r
        for stage in (2, 3):
            assert f"stage {stage}" in r[f"zp{stage}_save_error"]
        assert r["zp1_resumed"] == pytest.approx(r["ddp"][2:], rel=1e-4, abs=1e-5), rank
    print(f"test_integration_accelerate wall time: {time.monotonic() - t0:.1f}s")
