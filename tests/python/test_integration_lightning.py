"""Lightning: ZeroPlusStrategy(stage=1|2|3) against DDPStrategy(process_group_backend="zeroplus"),
2 ranks, a tiny GPT-2 LightningModule; checkpoints at stages 1-3 (zeroplus.save_checkpoint inside
Lightning's checkpoint directory) resumed at 2 ranks and at 1 (stage 3 with sharded parameters,
asserted). Every stage-3 run shards every parameter (asserted on each rank); parity is checked on
the parameters (the engines' fp32 masters) relative to how far DDP moved them, and the NVMe run's
parameter store holds the shards on disk. One pooled launch per world size."""

from __future__ import annotations

import os
import time

import lightning  # noqa: F401  (a hard requirement: scripts/setup.sh installs it)
import pytest
import torch

import integration_common as ic
import zero_models as zm
from harness import run_pooled
from sharding import assert_sharded

LR = 1e-3
# Mixed precision against fp32 DDP: the fp32 masters' distance from DDP's parameters, as a fraction
# of how far DDP moved them in 4 steps (measured 0.020 with fp16 at stages 1-3, 0.052 with bf16;
# an engine that does not step is at 1.0)
FP16_REL = 0.06
BF16_REL = 0.15


def _module_class():
    import lightning as L

    import integration_common as ic

    class TinyLM(L.LightningModule):
        def __init__(self, seed=0, record_norms=False):
            super().__init__()
            self.net = ic.tiny_gpt2(seed)
            self.losses = []
            self.record_norms, self.grad_norms = record_norms, []

        def on_before_optimizer_step(self, optimizer):
            # The global gradient norm before the step, unscaled (fp16: only right if the backward
            # carried the engine's loss scale, which the engine then divides out).
            if self.record_norms:
                inner = getattr(optimizer, "optimizer", optimizer)
                if hasattr(inner, "clip_grad_norm_"):
                    norm = inner.clip_grad_norm_(float("inf"))
                else:
                    norm = torch.nn.utils.clip_grad_norm_(self.parameters(), float("inf"))
                self.grad_norms.append(float(norm))

        def training_step(self, batch, batch_idx):
            loss = self.net(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            return self.net(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    return TinyLM


def _fit(strategy, tmp, *, seed=0, epochs=2, ckpt=None, save=None, clip=None, accumulate=1, precision="32-true",
         devices=2, batch_size=2, callbacks=None, record_norms=False, built=None):
    """built: a dict that gets the module and trainer before fit (to inspect a fit that raises)."""
    import lightning as L

    import integration_common as ic

    model = _module_class()(seed, record_norms)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ic.TokenDataset(), range(8)), batch_size=batch_size)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs, logger=False,
                        enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False,
                        default_root_dir=tmp, gradient_clip_val=clip, accumulate_grad_batches=accumulate,
                        precision=precision)
    if built is not None:
        built.update(model=model, trainer=trainer)
    trainer.fit(model, loader, ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(save)
    return model, trainer


def _all_cases(rank, world_size, tmp):
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy

    import integration_common as ic
    from zeroplus.integrations.lightning import ZeroPlusStrategy

    ic.torchrun_env(rank, world_size)
    out = {"backend": dist.get_backend()}
    # Every stage-3 run shards every parameter (tiny_gpt2's are below the default persistence
    # threshold) and asserts it on this rank; parity is checked on the parameters (fp32 masters),
    # relative to how far DDP moved them.
    out["start"] = {f"net.{k}": v for k, v in zm.params_of(ic.tiny_gpt2(0)).items()}
    ref, _ = _fit(DDPStrategy(process_group_backend="zeroplus"), tmp, record_norms=True)
    out["ddp"], out["ddp_norms"], out["ddp_params"] = ref.losses, ref.grad_norms, zm.params_of(ref)
    ref_clip, _ = _fit(DDPStrategy(process_group_backend="zeroplus"), tmp, clip=0.5)
    out["ddp_clip"] = ref_clip.losses
    for stage in (1, 2, 3):
        shard = ic.SHARD_ALL if stage == 3 else None
        m, trainer = _fit(ZeroPlusStrategy(stage=stage, config=shard), tmp)
        out[f"zp{stage}"] = m.losses
        out[f"zp{stage}_type"] = type(trainer.strategy.model).__name__
        out[f"zp{stage}_params"] = zm.full_masters(m, trainer.strategy.optimizers[0])
        if stage == 3:
            out["zp3_run_sharded"] = len(assert_sharded(m, trainer.strategy.optimizers[0]))
        m, trainer = _fit(ZeroPlusStrategy(stage=stage, config=shard), tmp, clip=0.5)
        out[f"zp{stage}_clip"] = m.losses
        if stage == 3:
            assert_sharded(m, trainer.strategy.optimizers[0])
    ref_acc, _ = _fit(DDPStrategy(process_group_backend="zeroplus"), tmp, accumulate=2)
    out["ddp_accum"] = [p.detach().clone() for p in ref_acc.parameters()]
    m, _ = _fit(ZeroPlusStrategy(stage=2), tmp, accumulate=2)
    out["zp_accum"] = [p.detach().clone() for p in m.parameters()]
    m, trainer = _fit(ZeroPlusStrategy(stage=3, config=ic.SHARD_ALL), tmp, precision="bf16-mixed")
    out["bf16"], out["bf16_precision"] = m.losses, trainer.strategy.optimizers[0].mixed_precision
    out["bf16_params"] = zm.full_masters(m, trainer.strategy.optimizers[0])
    assert_sharded(m, trainer.strategy.optimizers[0])
    # fp16 ("16-true": on CPU Lightning turns "16-mixed" into "bf16-mixed") at stages 1-3: the
    # engine's fp16 with dynamic loss scaling through the strategy's backward.
    for stage in (1, 2, 3):
        m, trainer = _fit(ZeroPlusStrategy(stage=stage, config=ic.SHARD_ALL if stage == 3 else None), tmp,
                          precision="16-true", record_norms=True)
        engine = trainer.strategy.optimizers[0]
        out[f"fp16_{stage}"] = (m.losses, m.grad_norms, engine.mixed_precision, engine.loss_scale,
                                engine.skipped_steps)
        out[f"fp16_{stage}_params"] = zm.full_masters(m, engine)
        if stage == 3:
            assert_sharded(m, engine)
    # A DeepSpeed-style config with a scheduler block, stepped by opt.step(); saved after epoch 1
    # and resumed (the scheduler's state travels in lightning_state.pt).
    cfg = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}},
           **ic.SHARD_ALL}
    m, trainer = _fit(ZeroPlusStrategy(stage=3, config=cfg), tmp)
    out["cfg"], out["cfg_lr"] = m.losses, trainer.strategy.optimizers[0].lr_scheduler.get_last_lr()
    assert_sharded(m, trainer.strategy.optimizers[0])
    _fit(ZeroPlusStrategy(stage=3, config=cfg), tmp, epochs=1, save=f"{tmp}/cfg.ckpt")
    m, trainer = _fit(ZeroPlusStrategy(stage=3, config=cfg), tmp, seed=5, ckpt=f"{tmp}/cfg.ckpt")
    out["cfg_resumed"] = m.losses
    assert_sharded(m, trainer.strategy.optimizers[0])
    out["cfg_resumed_lr"] = trainer.strategy.optimizers[0].lr_scheduler.get_last_lr()
    # Stages 1-3: checkpoint after epoch 1 (2 steps; a directory: zeroplus/ + lightning_state.pt),
    # resume into epoch 2 from other weights. Stage 2 saves through ModelCheckpoint.
    from lightning.pytorch.callbacks import ModelCheckpoint
    for stage in (1, 2, 3):
        if stage == 2:
            _fit(ZeroPlusStrategy(stage=2), tmp, epochs=1,
                 callbacks=[ModelCheckpoint(dirpath=f"{tmp}/mc", filename="zp2", save_top_k=1)])
            path = f"{tmp}/mc/zp2.ckpt"
        else:  # stage 3 saves every parameter sharded and loads into both kinds of bucket
            path = f"{tmp}/zp{stage}.ckpt"
            m, trainer = _fit(ZeroPlusStrategy(stage=stage, config=ic.SHARD_ALL if stage == 3 else None), tmp,
                              epochs=1, save=path)
            out[f"zp{stage}_sharded"] = ic.sharded_counts(m, trainer.strategy.optimizers[0])
            # validate after fit, same trainer and module: its step gathers the sharded parameters too
            val = torch.utils.data.DataLoader(ic.TokenDataset(4), batch_size=2)
            out[f"zp{stage}_validate"] = trainer.validate(m, val, verbose=False)
        out[f"zp{stage}_files"] = sorted(os.listdir(path))
        m, trainer = _fit(ZeroPlusStrategy(stage=stage, config=ic.SHARD_SOME if stage == 3 else None), tmp, seed=5,
                          ckpt=path)
        out[f"zp{stage}_resumed"] = m.losses
        out[f"zp{stage}_resumed_sharded"] = ic.sharded_counts(m, trainer.strategy.optimizers[0])
        out[f"zp{stage}_resumed_step"] = trainer.global_step
    # Stage 3 with optimizer and parameters on NVMe through the strategy's config: bit for bit
    # the in-memory stage-3 run (CPU training), saved after epoch 1 (the swapped state streamed into
    # the checkpoint) and resumed exactly; the swap directories are gone once the engines are.
    nvme_path = f"{tmp}/nvme"
    os.makedirs(nvme_path, exist_ok=True)
    nvme = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4}
    # Every parameter sharded, so the parameter store holds every one (kept whole, none would be).
    nvme_cfg = {"zero_optimization": {"offload_optimizer": dict(nvme), "offload_param": dict(nvme),
                                      "stage3_param_persistence_threshold": 0}}
    m, trainer = _fit(ZeroPlusStrategy(stage=3, config=nvme_cfg), tmp)
    engine = trainer.strategy.optimizers[0]
    out["nvme"] = (m.losses, engine.options.offload_optimizer.device, engine.options.offload_param.device,
                   any(n.startswith("zeroplus-swap-") for n in os.listdir(nvme_path)))
    out["nvme_sharded"] = len(assert_sharded(m, engine))
    out["nvme_param_files"] = ic.parameter_store_bytes(engine)
    _fit(ZeroPlusStrategy(stage=3, config=nvme_cfg), tmp, epochs=1, save=f"{tmp}/nvme.ckpt")
    m, trainer = _fit(ZeroPlusStrategy(stage=3, config=nvme_cfg), tmp, seed=5, ckpt=f"{tmp}/nvme.ckpt")
    out["nvme_resumed"] = m.losses
    out["nvme_resumed_param_files"] = ic.parameter_store_bytes(trainer.strategy.optimizers[0])
    del m, trainer, engine
    import gc
    gc.collect()
    dist.barrier()
    out["nvme_left"] = sorted(os.listdir(nvme_path))
    # The error paths, sharded too: the checkpoint is refused by the engine built in setup, which
    # holds every parameter sharded (asserted after the refusal).
    built = {}
    try:
        _fit(ZeroPlusStrategy(stage=3, config=ic.SHARD_ALL), tmp, seed=5, ckpt=f"{tmp}/mc", built=built)
    except FileNotFoundError as e:  # not a zeroplus checkpoint
        out["wrong_ckpt_error"] = str(e)
    out["wrong_ckpt_sharded"] = len(assert_sharded(built["model"], built["trainer"].strategy.optimizers[0]))
    m, trainer = _fit(ZeroPlusStrategy(stage=3, config=ic.SHARD_ALL), tmp, epochs=1)
    assert_sharded(m, trainer.strategy.optimizers[0])
    try:  # outside fit there is no optimizer to load into
        trainer.validate(_module_class()(5), torch.utils.data.DataLoader(ic.TokenDataset(4), batch_size=2),
                         ckpt_path=f"{tmp}/zp3.ckpt")
    except RuntimeError as e:
        out["validate_ckpt_error"] = str(e)
    out["validate_sharded"] = len(assert_sharded(m, trainer.strategy.optimizers[0]))  # the fit's engine, untouched
    return out


def _resume_at_one_rank(rank, world_size, tmp):
    """World size 1, global batch 4 (as 2 ranks x 2): the 2-rank stage-3 checkpoint resumed at
    stage 3 and the stage-1 one at stage 2."""
    import integration_common as ic
    from zeroplus.integrations.lightning import ZeroPlusStrategy

    ic.torchrun_env(rank, world_size)
    out = {}
    for saved, stage in ((3, 3), (1, 2)):
        m, trainer = _fit(ZeroPlusStrategy(stage=stage, config=ic.SHARD_SOME if stage == 3 else None), tmp, seed=5,
                          ckpt=f"{tmp}/zp{saved}.ckpt", devices=1, batch_size=4)
        out[saved] = m.losses
        out[f"{saved}_sharded"] = ic.sharded_counts(m, trainer.strategy.optimizers[0])
    return out


def test_lightning_zeroplus_strategy_stages_1_to_3(tmp_path):
    t0 = time.monotonic()
    results = run_pooled(_all_cases, 2, str(tmp_path), timeout=600)
    one_rank = run_pooled(_resume_at_one_rank, 1, str(tmp_path), timeout=300)[0]
    # 1 rank x batch 4 sees the samples of 2 ranks x batch 2: its loss is the mean of theirs.
    ddp_mean = [(a + b) / 2 for a, b in zip(results[0]["ddp"], results[1]["ddp"])]
    for saved in (3, 1):
        assert one_rank[saved] == pytest.approx(ddp_mean[2:], rel=1e-5, abs=1e-6), saved
    sharded, total = one_rank["3_sharded"]
    assert 0 < sharded < total, one_rank["3_sharded"]  # stage 3 at world size 1: both kinds of bucket
    assert one_rank["1_sharded"][0] == 0
    for rank, r in enumerate(results):
        assert r["backend"] == "zeroplus"
        assert len(r["ddp"]) == 4
        sharded, total = r["zp3_sharded"]
        assert sharded == total > 0, r["zp3_sharded"]  # the stage-3 checkpoint holds sharded parameters
        assert r["zp3_validate"] == [{}]  # ran (the module logs nothing)
        sharded, total = r["zp3_resumed_sharded"]
        assert 0 < sharded < total, r["zp3_resumed_sharded"]  # and loads into sharded and whole ones
        assert r["ddp_clip"] != r["ddp"]  # the clip is active in this run
        assert r["zp3_run_sharded"] == len(r["ddp_params"])
        for stage in (1, 2, 3):
            assert r[f"zp{stage}_type"] == "TinyLM"  # not wrapped in DDP
            assert r[f"zp{stage}"] == pytest.approx(r["ddp"], rel=1e-4, abs=1e-5), (rank, stage)
            zm.assert_parity(r[f"zp{stage}_params"], r["ddp_params"], r["start"], 1e-3, f"rank {rank} stage {stage}")
            assert r[f"zp{stage}_clip"] == pytest.approx(r["ddp_clip"], rel=1e-4, abs=1e-5), (rank, stage)
        for a, b in zip(r["zp_accum"], r["ddp_accum"]):  # accumulate_grad_batches=2: same weights
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        for stage in (1, 2, 3):
            assert r[f"zp{stage}_files"] == ["latest", "lightning_state.pt", "zeroplus"], r[f"zp{stage}_files"]
            # Epoch 2 after the resume: the uninterrupted run's steps 3-4 (fp32, to rounding).
            assert r[f"zp{stage}_resumed"] == pytest.approx(r[f"zp{stage}"][2:], rel=1e-6, abs=1e-7), (rank, stage)
            assert r[f"zp{stage}_resumed_step"] == 4
        assert r["cfg_resumed"] == pytest.approx(r["cfg"][2:], rel=1e-6, abs=1e-7) and r["cfg_resumed_lr"] == [LR]
        losses, opt_device, param_device, swapping = r["nvme"]
        assert (opt_device, param_device, swapping) == ("nvme", "nvme", True), r["nvme"]
        assert r["nvme_sharded"] == len(r["ddp_params"])
        for key in ("nvme_param_files", "nvme_resumed_param_files"):  # one record per sharded bucket
            files, on_disk, shards = r[key]
            assert files > 0 and shards > 0 and on_disk >= shards, (rank, key, r[key])
        assert losses == r["zp3"], (rank, losses, r["zp3"])  # bit for bit the in-memory run
        assert r["nvme_resumed"] == losses[2:], (rank, r["nvme_resumed"], losses)
        assert r["nvme_left"] == [], r["nvme_left"]
        assert "fit() only" in r["validate_ckpt_error"]
        assert "ckpt_path" in r["wrong_ckpt_error"] and "zeroplus" in r["wrong_ckpt_error"]
        assert r["wrong_ckpt_sharded"] == r["validate_sharded"] == len(r["ddp_params"])
        for stage in (1, 2, 3):
            losses, norms, precision, scale, skipped = r[f"fp16_{stage}"]
            assert precision == "fp16" and scale == 2.0 ** 16 and skipped == 0, (rank, stage)
            assert len(losses) == len(r["ddp"]), (rank, stage)
            assert norms == pytest.approx(r["ddp_norms"], rel=0.02), (rank, stage)
            zm.assert_parity(r[f"fp16_{stage}_params"], r["ddp_params"], r["start"], FP16_REL,
                             f"rank {rank} fp16 stage {stage}")
        assert r["bf16_precision"] == "bf16" and len(r["bf16"]) == len(r["ddp"])
        zm.assert_parity(r["bf16_params"], r["ddp_params"], r["start"], BF16_REL, f"rank {rank} bf16")
        # 4 steps of DeepSpeed's linear WarmupLR over 3 steps: iteration 3 -> the full lr.
        assert r["cfg_lr"] == pytest.approx([LR])
    print(f"test_integration_lightning wall time: {time.monotonic() - t0:.1f}s")
