"""HF transformers: the stock Trainer with zeroplus.ZeroRedundancyOptimizer (stage 1, save and
resume) and ZeroPlusTrainer at stages 1-3 (and with HF's ds_config_zero2.json), 2 ranks over
backend="zeroplus", losses against the plain DDP Trainer run; HF's stage-3 seed config with NVMe
offload of optimizer and parameters, saved and resumed. One pooled launch. The stage-3
checkpoints (resume at 2 ranks and at 1, load_best_model_at_end) hold and load sharded
parameters (persistence threshold 0 saving, 100 loading; asserted)."""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest
import torch
import transformers  # noqa: F401  (a hard requirement: scripts/setup.sh installs it)

import integration_common as ic
import zero_models as zm
from harness import run_pooled
from sharding import assert_sharded

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "ds_configs"
STEPS = 4
# Mixed precision against the fp32 DDP run: the fp32 masters' distance from DDP's parameters as a
# fraction of how far DDP moved them (measured 0.014 with fp16 at stages 1-3, 0.036 with bf16; an
# engine that does not step is at 1.0)
FP16_REL = 0.045
BF16_REL = 0.11


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


def _params_full(model):
    import zeroplus

    return {k: v.clone() for k, v in zeroplus.full_state_dict(model, rank0_only=False).items()}


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
    # Mixed precision is checked on the parameters (fp32 masters) relative to how far DDP moved
    # them (the first step runs at lr 0: warmup_steps=1).
    out["start"], out["ddp_named"] = zm.params_of(ic.tiny_gpt2()), zm.params_of(ref.model)
    ref_log = ref.state.log_history

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

    # 2. ZeroPlusTrainer at stages 1-3 (no DDP wrap), saving checkpoints at steps 2 and 4
    # (zeroplus.save_checkpoint into checkpoint-N/zeroplus), then a resume from checkpoint-2 into
    # a model with other weights: steps 3-4 must be the uninterrupted run's. Stage 3 saves every
    # parameter sharded and loads into both kinds of bucket (ic.SHARD_ALL / SHARD_SOME).
    for stage in (1, 2, 3):
        t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/zp{stage}", save_strategy="steps", save_steps=2),
                            train_dataset=data, stage=stage, config=ic.SHARD_ALL if stage == 3 else None)
        t.train()
        out[f"zp{stage}_sharded"] = ic.sharded_counts(t.model, t.optimizer.optimizer)
        out[f"zp{stage}"] = _losses(t)
        out[f"zp{stage}_params"] = _params_full(t.model)
        out[f"zp{stage}_ddp_wrapped"] = isinstance(t.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        out[f"zp{stage}_files"] = sorted(os.listdir(f"{tmp}/zp{stage}/checkpoint-2"))
        t.save_model(f"{tmp}/zp{stage}/final")
        dist.barrier()
        out[f"zp{stage}_saved"] = None
        if rank == 0:
            from safetensors.torch import load_file
            saved = load_file(f"{tmp}/zp{stage}/final/model.safetensors")
            out[f"zp{stage}_saved"] = {k: v.shape for k, v in saved.items()}
        t = ZeroPlusTrainer(model=ic.tiny_gpt2(seed=5), args=_args(f"{tmp}/zp{stage}"), train_dataset=data, stage=stage,
                            config=ic.SHARD_SOME if stage == 3 else None)
        t.train(resume_from_checkpoint=f"{tmp}/zp{stage}/checkpoint-2")
        out[f"zp{stage}_resumed_sharded"] = ic.sharded_counts(t.model, t.optimizer.optimizer)
        out[f"zp{stage}_resumed"] = _losses(t)
        out[f"zp{stage}_resumed_params"] = _params_full(t.model)
    # load_best_model_at_end at stage 3: the best checkpoint's weights are in the model at the end.
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/best", save_strategy="steps", save_steps=1,
                                                         eval_strategy="steps", eval_steps=1,
                                                         load_best_model_at_end=True, metric_for_best_model="loss",
                                                         greater_is_better=False, learning_rate=0.05),
                        train_dataset=data, eval_dataset=ic.TokenDataset(n=4, seed=3), stage=3, config=ic.SHARD_SOME)
    t.train()
    out["best"] = (t.state.best_model_checkpoint, _params_full(t.model))
    out["best_sharded"] = ic.sharded_counts(t.model, t.optimizer.optimizer)
    out["best_saved"] = None
    if rank == 0:
        from safetensors.torch import load_file
        out["best_saved"] = load_file(f"{t.state.best_model_checkpoint}/model.safetensors")
        out["last_saved"] = load_file(f"{tmp}/best/checkpoint-{STEPS}/model.safetensors")
    # A checkpoint the stock Trainer wrote (no zeroplus/ in it) is refused by name, before training.
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/zp_wrong"), train_dataset=data, stage=2)
    try:
        t.train(resume_from_checkpoint=f"{tmp}/stock/checkpoint-2")
    except FileNotFoundError as e:
        out["wrong_checkpoint_error"] = str(e)

    # 3. HF's two seed configs as files, as they are (offload_optimizer/offload_param to cpu,
    # "auto" values from TrainingArguments). The zero3 file's "auto" persistence threshold (10 x
    # hidden size) shards the matrices and embeddings (asserted), keeps LayerNorms and biases whole.
    large = [n for n, p in ic.tiny_gpt2().named_parameters() if p.numel() > 10 * 32]
    for name in ("ds_config_zero2.json", "ds_config_zero3.json"):
        t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/{name}", max_grad_norm=1.0, warmup_steps=2),
                            train_dataset=data, config=str(FIXTURES / name))
        t.train()
        engine = t.optimizer.optimizer
        if engine.stage == 3:
            assert_sharded(t.model, engine, large, at_least=8)
        out[name] = (_losses(t), [h["learning_rate"] for h in t.state.log_history if "learning_rate" in h],
                     engine.stage, engine.options.offload_optimizer.device, engine.options.gradient_clipping)

    # 3b. The stage-3 seed config with optimizer and parameters on NVMe (ZeRO-Infinity; nvme_path a
    # directory both ranks share, each with its own private swap directory under it), saving at
    # step 2, then a resume from checkpoint-2 into other weights: the checkpoint streams the
    # swapped state bucket by bucket and the resumed run must continue the uninterrupted one.
    nvme_config = json.loads((FIXTURES / "ds_config_zero3.json").read_text())
    nvme_path = f"{tmp}/nvme"
    os.makedirs(nvme_path, exist_ok=True)
    for key in ("offload_optimizer", "offload_param"):
        nvme_config["zero_optimization"][key] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4}
    nvme_args = dict(max_grad_norm=1.0, warmup_steps=2)
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/nvme_run", save_strategy="steps", save_steps=2,
                                                         **nvme_args), train_dataset=data, config=nvme_config)
    t.train()
    engine = t.optimizer.optimizer
    out["nvme"] = (_losses(t), _params_full(t.model), engine.options.offload_optimizer.device,
                   engine.options.offload_param.device, sorted(os.listdir(nvme_path)))
    # The sharded matrices and embeddings are what the parameter store holds on disk.
    out["nvme_sharded"] = len(assert_sharded(t.model, engine, large, at_least=8))
    out["nvme_param_files"] = ic.parameter_store_bytes(engine)
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(seed=5), args=_args(f"{tmp}/nvme_run", **nvme_args), train_dataset=data,
                        config=nvme_config)
    t.train(resume_from_checkpoint=f"{tmp}/nvme_run/checkpoint-2")
    out["nvme_resumed"] = (_losses(t), _params_full(t.model))
    del t, engine
    import gc
    gc.collect()  # the engines go: their swap directories are removed
    dist.barrier()
    out["nvme_left"] = sorted(os.listdir(nvme_path))

    # 4. bf16 from TrainingArguments (CPU autocast by accelerate + zeroplus bf16 compute).
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/bf16", bf16=True), train_dataset=data, stage=2)
    t.train()
    out["bf16"] = _losses(t)
    out["bf16_precision"] = t.optimizer.optimizer.mixed_precision
    out["bf16_params"] = zm.full_masters(t.model, t.optimizer)

    # 4b. fp16 from TrainingArguments at stages 1-3: the engine's fp16 with dynamic loss scaling.
    # The logged grad_norm (the engine's unscaled global norm) matches DDP's only if the Trainer's
    # backward carried the loss scale (else it is 2**16 times smaller).
    # Stage 3 shards every parameter (asserted).
    for stage in (1, 2, 3):
        t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/fp16_{stage}", fp16=True), train_dataset=data,
                            stage=stage, config=ic.SHARD_ALL if stage == 3 else None)
        t.train()
        engine = t.optimizer.optimizer
        out[f"fp16_{stage}"] = (_losses(t), [h["grad_norm"] for h in t.state.log_history if "grad_norm" in h],
                                engine.mixed_precision, engine.loss_scale, engine.skipped_steps,
                                next(t.model.parameters()).dtype)
        out[f"fp16_{stage}_params"] = zm.full_masters(t.model, engine)
        if stage == 3:
            out["fp16_3_sharded"] = len(assert_sharded(t.model, engine))
    out["ddp_grad_norm"] = [h["grad_norm"] for h in ref_log if "grad_norm" in h]
    # An fp16 step the engine skips (overflow at a loss scale of 2**30) does not step the
    # Trainer's LR scheduler (DeepSpeed's engine does not either).
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/fp16_skip", fp16=True), train_dataset=data,
                        config={"fp16": {"enabled": "auto", "initial_scale_power": 30, "hysteresis": 1},
                                "zero_optimization": {"stage": 2}})
    t.train()
    out["fp16_skip"] = (t.optimizer.optimizer.skipped_steps, t.lr_scheduler.last_epoch, t.state.global_step)

    # 5. Gradient accumulation (the model's no_sync under accelerate), stage 2 against DDP.
    ref = Trainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/ref_acc", gradient_accumulation_steps=2), train_dataset=data)
    ref.train()
    out["ddp_accum"] = _losses(ref)
    t = ZeroPlusTrainer(model=ic.tiny_gpt2(), args=_args(f"{tmp}/acc", gradient_accumulation_steps=2),
                        train_dataset=data, stage=2)
    t.train()
    out["zp_accum"] = _losses(t)
    return out


def _resume_at_one_rank(rank, world_size, tmp):
    """World size 1: resume the 2-rank checkpoints (stage 3 -> stage 3, stage 2 -> stage 3) with
    the same global batch (4 = 1 rank x 4)."""
    import integration_common as ic
    from zeroplus.integrations.transformers import ZeroPlusTrainer

    ic.torchrun_env(rank, world_size)
    out = {}
    for saved in (3, 2):
        t = ZeroPlusTrainer(model=ic.tiny_gpt2(seed=5), args=_args(f"{tmp}/zp{saved}", per_device_train_batch_size=4),
                            train_dataset=ic.TokenDataset(), stage=3, config=ic.SHARD_SOME)
        t.train(resume_from_checkpoint=f"{tmp}/zp{saved}/checkpoint-2")
        out[saved] = (_losses(t), _params_full(t.model), ic.sharded_counts(t.model, t.optimizer.optimizer))
    return out


def test_trainer_stage1_stock_and_zeroplus_trainer_stages_1_to_3(tmp_path):
    t0 = time.monotonic()
    results = run_pooled(_all_cases, 2, str(tmp_path), timeout=600)
    one_rank = run_pooled(_resume_at_one_rank, 1, str(tmp_path), timeout=300)[0]
    r = results[0]
    # Saved at 2 ranks, resumed at 1 (same global batch), stage 3 -> 3 and 2 -> 3: steps 3-4
    # and the final weights are the uninterrupted 2-rank run's.
    for saved in (3, 2):
        losses, params, (sharded, total) = one_rank[saved]
        assert 0 < sharded < total, (saved, sharded, total)  # stage 3 at world size 1: both kinds of bucket
        assert len(losses) == STEPS and losses[2:] == pytest.approx(r[f"zp{saved}"][2:], rel=1e-5, abs=1e-6), saved
        for k, v in params.items():
            assert torch.allclose(v, r[f"zp{saved}_params"][k], rtol=1e-5, atol=1e-6), (saved, k)
    assert r["backend"] == "zeroplus"
    assert len(r["ddp"]) == STEPS
    for rr in results:  # the stage-3 checkpoints hold sharded parameters and load into both kinds
        assert rr["zp3_sharded"][0] == rr["zp3_sharded"][1] > 0, rr["zp3_sharded"]
        for key in ("zp3_resumed_sharded", "best_sharded"):
            assert 0 < rr[key][0] < rr[key][1], (key, rr[key])
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
        # The Trainer's files and zeroplus's checkpoint, side by side; no optimizer.pt.
        files = r[f"zp{stage}_files"]
        assert {"zeroplus", "latest", "scheduler.pt", "trainer_state.json", "rng_state_0.pth",
                "model.safetensors"} <= set(files) and "optimizer.pt" not in files, files
        # Resumed from checkpoint-2 (other initial weights): steps 3-4 and the final weights are
        # the uninterrupted run's (fp32, same world size and stage: to rounding).
        resumed = r[f"zp{stage}_resumed"]
        assert len(resumed) == STEPS and resumed[2:] == pytest.approx(r[f"zp{stage}"][2:], rel=1e-6, abs=1e-7), stage
        for k, v in r[f"zp{stage}_resumed_params"].items():
            assert torch.allclose(v, r[f"zp{stage}_params"][k], rtol=1e-6, atol=1e-7), (stage, k)
    best, params = r["best"]
    assert not best.endswith(f"checkpoint-{STEPS}"), best  # lr 0.05: the eval loss got worse after its best
    for k, v in r["best_saved"].items():
        assert torch.equal(params[k], v), k
    assert any(not torch.equal(params[k], v) for k, v in r["last_saved"].items())
    assert "resume_from_checkpoint" in r["wrong_checkpoint_error"] and "zeroplus" in r["wrong_checkpoint_error"]
    # HF's seed files: the config's WarmupLR ("auto": 0 -> learning_rate over warmup_steps=2),
    # DeepSpeed's curve: step n runs at iteration n-1 (log warmup: 0, 0, then lr); CPU optimizer
    # offload from the file; both files train the same trajectory (fp32: "auto" fp16/bf16 off).
    for name, stage in (("ds_config_zero2.json", 2), ("ds_config_zero3.json", 3)):
        losses, lrs, got_stage, offload, clip = r[name]
        assert (got_stage, offload, clip) == (stage, "cpu", 1.0), name
        assert lrs == pytest.approx([0.0, 0.0, 1e-3, 1e-3]) and len(losses) == STEPS, name
        assert losses == pytest.approx(r["ds_config_zero2.json"][0], rel=1e-4, abs=1e-5), name
    # NVMe offload of the optimizer and the parameters through the Trainer (CPU training: bit for
    # bit the seed config's run, whose "cpu" offload is a no-op on CPU), a resume from its
    # checkpoint continuing it exactly, the swap directories there while training and gone after.
    for rr in results:
        losses, params, opt_device, param_device, during = rr["nvme"]
        assert (opt_device, param_device) == ("nvme", "nvme")
        assert losses == rr["ds_config_zero3.json"][0], (losses, rr["ds_config_zero3.json"][0])
        assert any(name.startswith("zeroplus-swap-") for name in during), during
        resumed, resumed_params = rr["nvme_resumed"]
        assert len(resumed) == STEPS and resumed[2:] == losses[2:], (resumed, losses)
        for k, v in resumed_params.items():
            assert torch.equal(v, params[k]), k
        assert rr["nvme_left"] == [], rr["nvme_left"]
        files, on_disk, shards = rr["nvme_param_files"]  # one record per sharded bucket
        assert rr["nvme_sharded"] >= 8 and files > 0 and shards > 0 and on_disk >= shards, rr["nvme_param_files"]
    assert len(r["ddp_accum"]) == STEPS and r["ddp_accum"] != r["ddp"]
    assert r["zp_accum"] == pytest.approx(r["ddp_accum"], rel=1e-4, abs=1e-5)
    for stage in (1, 2, 3):
        losses, norms, precision, scale, skipped, dtype = r[f"fp16_{stage}"]
        assert precision == "fp16" and dtype == torch.float16 and scale == 2.0 ** 16 and skipped == 0, stage
        assert len(losses) == STEPS, stage
        assert norms == pytest.approx(r["ddp_grad_norm"], rel=0.02), stage
        for rr in results:
            zm.assert_parity(rr[f"fp16_{stage}_params"], rr["ddp_named"], rr["start"], FP16_REL, f"fp16 stage {stage}")
    assert all(rr["fp16_3_sharded"] == len(rr["ddp_named"]) for rr in results)
    skipped, scheduler_steps, steps = r["fp16_skip"]
    assert steps == STEPS and skipped > 0 and scheduler_steps == STEPS - skipped, r["fp16_skip"]
    assert r["bf16_precision"] == "bf16"
    assert len(r["bf16"]) == STEPS
    for rr in results:
        zm.assert_parity(rr["bf16_params"], rr["ddp_named"], rr["start"], BF16_REL, "bf16")
    print(f"test_integration_transformers wall time: {time.monotonic() - t0:.1f}s")
