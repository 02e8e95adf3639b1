"""accelerate: the stock accelerator.prepare with zeroplus.ZeroRedundancyOptimizer (stage 1,
save_state/load_state) and zeroplus.integrations.accelerate.prepare at stages 1-3 with save_state/
load_state (zeroplus checkpoints, resumed at 2 ranks and at 1; stage 3 with sharded parameters,
asserted; stage 3 with optimizer and parameters on NVMe, the parameter store's shards on disk
asserted), 2 ranks over backend="zeroplus", losses and parameters (relative to how far DDP moved
them) against the plain DDP run; every stage-3 run shards every parameter, asserted on each rank.
One pooled launch per world size."""

from __future__ import annotations

import os
import time

import accelerate  # noqa: F401  (a hard requirement: scripts/setup.sh installs it)
import pytest
import torch

import integration_common as ic
import zero_models as zm
from harness import run_pooled
from sharding import assert_sharded

STEPS, LR = 4, 1e-3
# fp16 (stage 2) against fp32 DDP: the fp32 masters' distance from DDP's parameters as a fraction
# of how far DDP moved them in STEPS steps (measured 0.023; an engine that does not step is at 1.0)
FP16_REL = 0.07


def _loop(accelerator, model, opt, loader, steps, backward=None):
    losses = []
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        (backward or accelerator.backward)(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _loader(accelerator, skip=0, batch_size=2):
    import integration_common as ic

    data = ic.TokenDataset()
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(skip * 4, len(data))),
                                         batch_size=batch_size)
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
    # Parity is checked on the parameters (fp32 masters) relative to how far DDP moved them.
    out["start"], out["ddp_params"] = zm.params_of(ic.tiny_gpt2()), zm.params_of(ref_model.module)

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

    # zeroplus.integrations.accelerate.prepare at stages 1-3 (no DDP): save_state after 2 steps
    # (zeroplus.save_checkpoint into PATH/zeroplus), then load_state into other weights.
    # Stage 3 saves every parameter sharded and loads into both kinds of bucket (ic.SHARD_ALL/SOME).
    for stage in (1, 2, 3):
        accelerator = Accelerator(cpu=True)
        model, opt = zp_accelerate.prepare(accelerator, ic.tiny_gpt2(), torch.optim.AdamW, stage=stage, lr=LR,
                                           weight_decay=0.0, config=ic.SHARD_ALL if stage == 3 else None)
        out[f"zp{stage}_sharded"] = ic.sharded_counts(model, opt.optimizer)
        out[f"zp{stage}_ddp"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        out[f"zp{stage}"] = _loop(accelerator, model, opt, _loader(accelerator), 2)
        accelerator.save_state(f"{tmp}/zp{stage}")
        accelerator.wait_for_everyone()  # the main process writes accelerate's files; no barrier after them
        out[f"zp{stage}_files"] = sorted(os.listdir(f"{tmp}/zp{stage}"))
        out[f"zp{stage}_optimizer_file"] = torch.load(f"{tmp}/zp{stage}/optimizer.bin", weights_only=True)
        out[f"zp{stage}"] += _loop(accelerator, model, opt, _loader(accelerator, skip=2), 2)
        out[f"zp{stage}_params"] = zm.full_masters(model, opt)
        if stage == 3:  # sharded while training, not only in its checkpoint
            out["zp3_run_sharded"] = len(assert_sharded(model, opt))
        accelerator = Accelerator(cpu=True)
        model, opt = zp_accelerate.prepare(accelerator, ic.tiny_gpt2(seed=5), torch.optim.AdamW, stage=stage, lr=LR,
                                           weight_decay=0.0, config=ic.SHARD_SOME if stage == 3 else None)
        out[f"zp{stage}_resumed_sharded"] = ic.sharded_counts(model, opt.optimizer)
        accelerator.load_state(f"{tmp}/zp{stage}")
        out[f"zp{stage}_resumed"] = _loop(accelerator, model, opt, _loader(accelerator, skip=2), 2)
    # A config scheduler (opt.lr_scheduler, stepped by opt.step()) travels in the checkpoint.
    cfg = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}},
           **ic.SHARD_ALL}
    accelerator = Accelerator(cpu=True)
    model, opt = zp_accelerate.prepare(accelerator, ic.tiny_gpt2(), torch.optim.AdamW, stage=3, lr=LR, config=cfg)
    out["cfg"] = _loop(accelerator, model, opt, _loader(accelerator), 2)
    accelerator.save_state(f"{tmp}/cfg")
    out["cfg"] += _loop(accelerator, model, opt, _loader(accelerator, skip=2), 2)
    assert_sharded(model, opt)
    accelerator = Accelerator(cpu=True)
    model, opt = zp_accelerate.prepare(accelerator, ic.tiny_gpt2(seed=5), torch.optim.AdamW, stage=3, lr=LR,
                                       config=cfg)
    accelerator.load_state(f"{tmp}/cfg")
    out["cfg_resumed"] = _loop(accelerator, model, opt, _loader(accelerator, skip=2), 2)
    out["cfg_resumed_lr"] = opt.optimizer.lr_scheduler.get_last_lr()
    assert_sharded(model, opt)
    # The stock run's state (no zeroplus/ in it) is refused by name; nothing changes.
    try:
        accelerator.load_state(f"{tmp}/stock")
    except FileNotFoundError as e:
        out["wrong_state_error"] = str(e)
    # Stage 3 with optimizer and parameters on NVMe, given as prepare's keyword arguments (as to
    # zeroplus.initialize): bit for bit the in-memory stage-3 run (CPU training), save_state after
    # 2 steps and load_state into other weights continue it exactly; the swap directories go with
    # the engines. Every parameter sharded (as in the in-memory run), so the parameter store holds
    # them all on disk (kept whole, none would be).
    nvme_path = f"{tmp}/nvme"
    os.makedirs(nvme_path, exist_ok=True)
    nvme = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4}
    accelerator = Accelerator(cpu=True)
    model, opt = zp_accelerate.prepare(accelerator, ic.tiny_gpt2(), torch.optim.AdamW, stage=3, lr=LR,
                                       weight_decay=0.0, offload_optimizer=dict(nvme), offload_param=dict(nvme),
                                       config=ic.SHARD_ALL)
    out["nvme"] = _loop(accelerator, model, opt, _loader(accelerator), 2)
    out["nvme_sharded"] = len(assert_sharded(model, opt))
    out["nvme_param_files"] = ic.parameter_store_bytes(opt)
    accelerator.save_state(f"{tmp}/nvme_state")
    out["nvme_swapping"] = any(n.startswith("zeroplus-swap-") for n in os.listdir(nvme_path))
    out["nvme"] += _loop(accelerator, model, opt, _loader(accelerator, skip=2), 2)
    accelerator = Accelerator(cpu=True)
    model, opt = zp_accelerate.prepare(accelerator, ic.tiny_gpt2(seed=5), torch.optim.AdamW, stage=3, lr=LR,
                                       weight_decay=0.0, offload_optimizer=dict(nvme), offload_param=dict(nvme),
                                       config=ic.SHARD_ALL)
    accelerator.load_state(f"{tmp}/nvme_state")
    out["nvme_resumed"] = _loop(accelerator, model, opt, _loader(accelerator, skip=2), 2)
    out["nvme_resumed_param_files"] = ic.parameter_store_bytes(opt)
    accelerator.free_memory()  # accelerate's way to drop what it holds (its models, optimizers, hooks)
    del model, opt
    import gc
    gc.collect()
    dist.barrier()
    out["nvme_left"] = sorted(os.listdir(nvme_path))
    # fp16: zeroplus's loss scaler through opt.backward, with Accelerator(mixed_precision="no");
    # Accelerator(mixed_precision="fp16") is refused by name.
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    model, opt = zp_accelerate.prepare(accelerator, ic.tiny_gpt2(), torch.optim.AdamW, stage=2, lr=LR,
                                       weight_decay=0.0, mixed_precision="fp16")
    out["fp16"] = _loop(accelerator, model, opt, _loader(accelerator), STEPS, backward=opt.backward)
    out["fp16_engine"] = (opt.optimizer.mixed_precision, opt.optimizer.loss_scale, opt.optimizer.skipped_steps)
    out["fp16_params"] = zm.full_masters(model, opt)
    try:  # accelerate's optimizer file of a zeroplus save, loaded without load_state's hook
        opt.load_state_dict(torch.load(f"{tmp}/zp2/optimizer.bin", weights_only=True))
    except ValueError as e:
        out["reference_error"] = str(e)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        zp_accelerate.prepare(Accelerator(cpu=True, mixed_precision="fp16"), ic.tiny_gpt2(), torch.optim.AdamW,
                              stage=2, lr=LR)
    except ValueError as e:
        out["fp16_refused"] = str(e)
    return out


def _resume_at_one_rank(rank, world_size, tmp):
    """World size 1, batch 4 (the 2 ranks' global batch): the stage-3 state at stage 3, the
    stage-1 state at stage 2."""
    from accelerate import Accelerator

    import integration_common as ic
    from zeroplus.integrations import accelerate as zp_accelerate

    ic.torchrun_env(rank, world_size)
    out = {}
    for saved, stage in ((3, 3), (1, 2)):
        accelerator = Accelerator(cpu=True)
        model, opt = zp_accelerate.prepare(accelerator, ic.tiny_gpt2(seed=5), torch.optim.AdamW, stage=stage, lr=LR,
                                           weight_decay=0.0, config=ic.SHARD_SOME if stage == 3 else None)
        accelerator.load_state(f"{tmp}/zp{saved}")
        out[saved] = _loop(accelerator, model, opt, _loader(accelerator, skip=2, batch_size=4), 2)
        out[f"{saved}_sharded"] = ic.sharded_counts(model, opt.optimizer)
    return out


def test_accelerate_stage1_stock_and_prepare_stages_1_to_3(tmp_path):
    t0 = time.monotonic()
    results = run_pooled(_all_cases, 2, str(tmp_path), timeout=600)
    one_rank = run_pooled(_resume_at_one_rank, 1, str(tmp_path), timeout=300)[0]
    # 1 rank x batch 4 sees the 2 ranks' samples: its loss is the mean of theirs.
    ddp_mean = [(a + b) / 2 for a, b in zip(results[0]["ddp"], results[1]["ddp"])]
    for saved in (3, 1):
        assert one_rank[saved] == pytest.approx(ddp_mean[2:], rel=1e-5, abs=1e-6), saved
    sharded, total = one_rank["3_sharded"]
    assert 0 < sharded < total, one_rank["3_sharded"]  # stage 3 at world size 1: both kinds of bucket
    assert one_rank["1_sharded"][0] == 0
    for rank, r in enumerate(results):
        assert r["backend"] == "zeroplus"
        sharded, total = r["zp3_sharded"]
        assert sharded == total > 0, r["zp3_sharded"]  # the stage-3 checkpoint holds sharded parameters
        sharded, total = r["zp3_resumed_sharded"]
        assert 0 < sharded < total, r["zp3_resumed_sharded"]  # and loads into sharded and whole ones
        assert "zeroplus is not available" in r["kwarg_refused"]
        assert len(r["ddp"]) == STEPS
        assert r["stock"] == pytest.approx(r["ddp"], rel=1e-5, abs=1e-6), rank
        assert r["stock_resumed"] == pytest.approx(r["ddp"][2:], rel=1e-5, abs=1e-6), rank
        assert r["zp3_run_sharded"] == len(r["ddp_params"])
        for stage in (1, 2, 3):
            assert not r[f"zp{stage}_ddp"]
            assert r[f"zp{stage}"] == pytest.approx(r["ddp"], rel=1e-4, abs=1e-5), (rank, stage)
            zm.assert_parity(r[f"zp{stage}_params"], r["ddp_params"], r["start"], 1e-3, f"rank {rank} stage {stage}")
        for stage in (1, 2, 3):
            # accelerate's own files beside zeroplus/; no model weights file (zeroplus holds
            # them), the optimizer file only a reference.
            files = r[f"zp{stage}_files"]
            assert "zeroplus" in files and "random_states_0.pkl" in files, files
            assert not any(f.startswith(("model", "pytorch_model")) for f in files), files
            assert r[f"zp{stage}_optimizer_file"] == {"zeroplus_checkpoint": "zeroplus"}
            assert r[f"zp{stage}_resumed"] == pytest.approx(r[f"zp{stage}"][2:], rel=1e-6, abs=1e-7), (rank, stage)
        assert r["cfg_resumed"] == pytest.approx(r["cfg"][2:], rel=1e-6, abs=1e-7) and r["cfg_resumed_lr"] == [LR]
        assert r["nvme_swapping"] and r["nvme"] == r["zp3"], (rank, r["nvme"], r["zp3"])  # bit for bit
        assert r["nvme_resumed"] == r["nvme"][2:], (rank, r["nvme_resumed"], r["nvme"])
        assert r["nvme_left"] == [], r["nvme_left"]
        assert r["nvme_sharded"] == len(r["ddp_params"])
        for key in ("nvme_param_files", "nvme_resumed_param_files"):  # one record per sharded bucket
            files, on_disk, shards = r[key]
            assert files > 0 and shards > 0 and on_disk >= shards, (rank, key, r[key])
        assert r["fp16_engine"] == ("fp16", 2.0 ** 16, 0) and len(r["fp16"]) == STEPS, rank
        zm.assert_parity(r["fp16_params"], r["ddp_params"], r["start"], FP16_REL, f"rank {rank} fp16")
        assert "accelerator.load_state" in r["reference_error"]
        assert "mixed_precision='fp16'" in r["fp16_refused"] and "opt.backward" in r["fp16_refused"]
        assert "load_state" in r["wrong_state_error"] and "zeroplus" in r["wrong_state_error"]
    print(f"test_integration_accelerate wall time: {time.monotonic() - t0:.1f}s")
