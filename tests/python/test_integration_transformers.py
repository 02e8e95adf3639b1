"""HF transformers: the stock Trainer with zeroplus.ZeroRedundancyOptimizer (stage 1, save and
resume) and ZeroPlusTrainer at stages 1-3 (and with HF's ds_config_zero2.json), 2 ranks over
backend="zeroplus", losses against the plain DDP Trainer run. One pooled launch."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
import torch
import transformers  # noqa: F401  (a hard requirement: scripts/setup.sh installs it)

from harness import run_pooled

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "ds_configs"
STEPS = 4


def _args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, use_cpu=True, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, optim="adamw_torch",
                seed=0, data_seed=0, dataloader_num_workers=0, lr_scheduler_type="linear", warmup_steps=1)
    base.update(kw)
    return TrainingArguments(**base)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _all_cases(rank, world_size, tmp):
    import torch.distributed as dist
    from transformers import Trainer

    import integration_common as ic
    import zeroplus
    from zeroplus.integrations.transformers import ConsolidateOnSave, ZeroPlusTrainer

    ic.torchrun_env(rank, world_size)
    data = ic.TokenDataset()
    out = {"backend": dist.get_backend()}

    # Plain DDP reference (the Trainer's own AdamW).
    ref = Trainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/ref"), train_dataset=data)
    ref.train()
    out["ddp"] = _losses(ref)
    out["ddp_params"] = _params(ref.model)

    # 1. Stock Trainer + zeroplus.ZeroRedundancyOptimizer (DDP-wrapped by accelerate), with a
    # checkpoint at step 2, then a resume from it.
    model = ic.tiny_gpt2()
    opt = zeroplus.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3,
                                           weight_decay=0.0)
    out["prepare_state_dict"] = opt.state_dict()["state"]  # before any step: no communication
    stock = Trainer(model=model, args=_args(f"{tmp}/stock", save_strategy="steps", save_steps=2),
                    train_dataset=data, optimizers=(opt, None), callbacks=[ConsolidateOnSave()])
    stock.train()
    out["stock"] = _losses(stock)
    model = ic.tiny_gpt2(seed=5)  # other weights: the resume must load them
    opt = zeroplus.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3,
                                           weight_decay=0.0)
    resumed = Trainer(model=model, args=_args(f"{tmp}/stock", save_strategy="no"), train_dataset=data,
                      optimizers=(opt, None), callbacks=[ConsolidateOnSave()])
    resumed.train(resume_from_checkpoint=f"{tmp}/stock/checkpoint-2")
    out["stock_resumed"] = _losses(resumed)
    out["stock_resumed_params"] = _params(resumed.model)

    # 2. ZeroPlusTrainer at stages 1-3 (no DDP wrap), then stage 1 save + resume.
    for stage in (1, 2, 3):
        t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/zp{stage}"), train_dataset=data, stage=stage)
        t.train()
        out[f"zp{stage}"] = _losses(t)
        out[f"zp{stage}_ddp_wrapped"] = isinstance(t.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        t.save_model(f"{tmp}/zp{stage}/final")
        dist.barrier()
        out[f"zp{stage}_saved"] = None
        if rank == 0:
            from safetensors.torch import load_file
            out[f"zp{stage}_saved"] = {k: v.shape for k, v in load_file(f"{tmp}/zp{stage}/final/model.safetensors").items()}
        if stage == 3:
            try:
                t._save_checkpoint(t.model, None)
            except NotImplementedError as e:
                out["zp3_checkpoint_error"] = str(e)
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/zp1ck", save_strategy="steps", save_steps=2),
                        train_dataset=data, stage=1)
    t.train()
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(seed=5), args=_args(f"{tmp}/zp1ck"), train_dataset=data, stage=1)
    t.train(resume_from_checkpoint=f"{tmp}/zp1ck/checkpoint-2")
    out["zp1_resumed"] = _losses(t)

    # 3. HF's seed config (offload block dropped until offload lands), "auto" from TrainingArguments.
    cfg = json.loads((FIXTURES / "ds_config_zero2.json").read_text())
    del cfg["zero_optimization"]["offload_optimizer"]
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/cfg", max_grad_norm=1.0, warmup_steps=2),
                        train_dataset=data, config=cfg)
    t.train()
    out["cfg"] = _losses(t)
    out["cfg_lrs"] = [h["learning_rate"] for h in t.state.log_history if "learning_rate" in h]
    out["cfg_stage"] = t.zeroplus_stage

    # 4. bf16 from TrainingArguments (CPU autocast by accelerate + zeroplus bf16 compute).
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/bf16", bf16=True), train_dataset=data, stage=2)
    t.train()
    out["bf16"] = _losses(t)
    out["bf16_precision"] = t.optimizer.optimizer.mixed_precision

    # 5. Gradient accumulation (the model's no_sync under accelerate), stage 2 against DDP.
    ref = Trainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/ref_acc", gradient_accumulation_steps=2), train_dataset=data)
    ref.train()
    out["ddp_accum"] = _losses(ref)
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/acc", gradient_accumulation_steps=2),
                        train_dataset=data, stage=2)
    t.train()
    out["zp_accum"] = _losses(t)
    return out


def test_trainer_stage1_stock_and_zeroplus_trainer_stages_1_to_3(tmp_path):
    t0 = time.monotonic()
    results = run_pooled(_all_cases, 2, str(tmp_path), timeout=600)
    r = results[0]
    assert r["backend"] == "zeroplus"
    assert len(r["ddp"]) == STEPS
    assert r["prepare_state_dict"] == {}
    assert r["stock"] == pytest.approx(r["ddp"], rel=1e-5, abs=1e-6)
    # The resumed run continues from step 2 (its log starts with the checkpoint's two entries):
    # steps 3-4 as in the uninterrupted run, same weights.
    assert len(r["stock_resumed"]) == STEPS
    assert r["stock_resumed"][2:] == pytest.approx(r["ddp"][2:], rel=1e-5, abs=1e-6)
    for k, v in r["stock_resumed_params"].items():
        assert torch.allclose(v, r["ddp_params"][k], rtol=1e-4, atol=1e-6), k
    for stage in (1, 2, 3):
        assert r[f"zp{stage}"] == pytest.approx(r["ddp"], rel=1e-4, abs=1e-5), stage
        assert not r[f"zp{stage}_ddp_wrapped"]
        assert r[f"zp{stage}_saved"]["transformer.wte.weight"] == torch.Size([64, 32])  # full, also at stage 3
    assert "stage 3" in r["zp3_checkpoint_error"] and "save_checkpoint" in r["zp3_checkpoint_error"]
    assert len(r["zp1_resumed"]) == STEPS and r["zp1_resumed"][2:] == pytest.approx(r["ddp"][2:], rel=1e-4, abs=1e-5)
    # The config's WarmupLR ("auto": 0 -> learning_rate over warmup_steps=2), DeepSpeed's curve:
    # step n runs at iteration n-1 (log warmup: 0, 0, then lr).
    assert r["cfg_stage"] == 2 and len(r["cfg"]) == STEPS
    assert r["cfg_lrs"] == pytest.approx([0.0, 0.0, 1e-3, 1e-3])
    assert len(r["ddp_accum"]) == STEPS and r["ddp_accum"] != r["ddp"]
    assert r["zp_accum"] == pytest.approx(r["ddp_accum"], rel=1e-4, abs=1e-5)
    assert r["bf16_precision"] == "bf16"
    assert r["bf16"] == pytest.approx(r["ddp"], abs=0.05)  # bf16 rounding, same trajectory
    print(f"test_integration_transformers wall time: {time.monotonic() - t0:.1f}s")
