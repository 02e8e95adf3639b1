"""PEFT LoRA at ZeRO stage 3: get_peft_model(tiny GPT-2, LoraConfig(target_modules=[...])) under
zeroplus.initialize(stage=3) directly and under ZeroPlusTrainer(stage=3), 2 ranks, against the same
LoRA run under DDP: the frozen base is sharded and gathered like any parameter, only the adapters
have gradients and optimizer state (memory_report), and the saved adapter is what PEFT's
save_pretrained writes (PeftModel.from_pretrained loads it back). One pooled launch."""

from __future__ import annotations

import time

import peft  # noqa: F401  (a hard requirement: scripts/setup.sh installs it)
import pytest
import torch

from harness import run_pooled

STEPS, LR = 4, 1e-2
# Every parameter of the tiny model is below DeepSpeed's default persistence threshold (1e5
# elements: kept whole on every rank); 0 shards them all, the frozen base included.
CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
LORA_EXAMPLE = {"bf16": {"enabled": "auto"},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                      "offload_param": {"device": "cpu", "pin_memory": True},
                                      "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": 0,
                                      "stage3_gather_16bit_weights_on_model_save": True},
                "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto"}


def _lora(seed=0):
    from peft import LoraConfig, get_peft_model

    import integration_common as ic

    return get_peft_model(ic.tiny_gpt2(seed), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                         target_modules=["c_attn", "c_proj"]))


def _batches(rank):
    import integration_common as ic

    data = ic.TokenDataset()
    return [data.ids[4 * i + 2 * rank: 4 * i + 2 * rank + 2] for i in range(STEPS)]  # rank's half of a batch of 4


def _adapters(state):
    return {k: v.clone() for k, v in state.items() if "lora_" in k}


def _all_cases(rank, world_size, tmp):
    import torch.distributed as dist
    from peft import PeftModel
    from transformers import Trainer, TrainingArguments

    import integration_common as ic
    import zeroplus
    from zeroplus.integrations.transformers import ZeroPlusTrainer

    ic.torchrun_env(rank, world_size)
    out = {}

    # DDP reference: the same LoRA model, torch's AdamW over the trainable (adapter) parameters.
    model = _lora()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    out["ddp"] = []
    for ids in _batches(rank):
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["ddp"].append(loss.item())
    out["ddp_adapters"] = _adapters(model.state_dict())
    out["n_trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out["n_total"] = sum(p.numel() for p in model.parameters())

    # zeroplus stage 3, directly (the lines of docs/integrations.md, "PEFT LoRA").
    model = _lora()
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=LR, weight_decay=0.0, config=CONFIG)
    out["zp"] = []
    for ids in _batches(rank):
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        if not out["zp"]:
            # Only the adapters have gradients and optimizer state; the frozen base is sharded.
            out["report"] = zeroplus.memory_report(model, opt)
        opt.step()
        opt.zero_grad()
        out["zp"].append(loss.item())
    out["report_after"] = zeroplus.memory_report(model, opt)
    model.save_pretrained(f"{tmp}/adapter", state_dict=zeroplus.full_state_dict(model),
                          is_main_process=dist.get_rank() == 0)
    dist.barrier()
    loaded = PeftModel.from_pretrained(ic.tiny_gpt2(), f"{tmp}/adapter")
    out["loaded_adapters"] = _adapters(loaded.state_dict())

    # Through the HF integration: ZeroPlusTrainer(stage=3) against the DDP Trainer, save_model
    # writing the adapter (PEFT's files).
    args = dict(use_cpu=True, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=LR, logging_steps=1,
                save_strategy="no", report_to="none", disable_tqdm=True, optim="adamw_torch", weight_decay=0.0,
                seed=0, data_seed=0, dataloader_num_workers=0, lr_scheduler_type="constant")
    data = ic.TokenDataset()
    ref = Trainer(model=_lora(), args=TrainingArguments(output_dir=f"{tmp}/hf_ddp", **args), train_dataset=data)
    ref.train()
    out["hf_ddp"] = [h["loss"] for h in ref.state.log_history if "loss" in h]
    out["hf_ddp_adapters"] = _adapters(ref.model.state_dict())
    t = ZeroPlusTrainer(model=_lora(), args=TrainingArguments(output_dir=f"{tmp}/hf_zp", **args), train_dataset=data,
                        config=CONFIG)
    t.train()
    out["hf_zp"] = [h["loss"] for h in t.state.log_history if "loss" in h]
    t.save_model(f"{tmp}/hf_zp/final")
    dist.barrier()
    import os
    out["hf_files"] = sorted(os.listdir(f"{tmp}/hf_zp/final"))
    loaded = PeftModel.from_pretrained(ic.tiny_gpt2(), f"{tmp}/hf_zp/final")
    out["hf_loaded_adapters"] = _adapters(loaded.state_dict())
    # A config like DeepSpeed's LoRA example: bf16, optimizer and parameters offloaded to cpu,
    # stage-3 prefetch ("auto" from the model's hidden size), through ZeroPlusTrainer.
    t = ZeroPlusTrainer(model=_lora(), args=TrainingArguments(output_dir=f"{tmp}/hf_example", bf16=True, **args),
                        train_dataset=data, config=LORA_EXAMPLE)
    t.train()
    engine = t.optimizer.optimizer
    out["hf_example"] = ([h["loss"] for h in t.state.log_history if "loss" in h], engine.mixed_precision,
                         engine.options.offload_optimizer.device)
    return out


def test_peft_lora_stage3_direct_and_trainer_match_ddp(tmp_path):
    t0 = time.monotonic()
    for rank, r in enumerate(run_pooled(_all_cases, 2, str(tmp_path), timeout=600)):
        assert r["zp"] == pytest.approx(r["ddp"], rel=1e-4, abs=1e-5), rank
        assert r["n_trainable"] < r["n_total"] // 10
        # memory_report (this rank): AdamW's two fp32 moments for this rank's half of the adapters
        # only (padding aside), gradients likewise; the frozen embedding is a shard.
        rep, after = r["report"], r["report_after"]  # after the first backward; after the last step
        assert 4 * (r["n_trainable"] // 2 - 256) <= rep["gradients"] <= 4 * (r["n_trainable"] // 2 + 256), rep
        assert 8 * (r["n_trainable"] // 2 - 256) <= after["optimizer_state"] <= 8 * (r["n_trainable"] // 2 + 256), after
        assert 4 * r["n_total"] * 0.45 < rep["parameters"] < 4 * r["n_total"] * 0.55, rep  # half: base sharded
        # The adapter PEFT's save_pretrained wrote, loaded back: the DDP run's adapter weights.
        assert set(r["loaded_adapters"]) == set(r["ddp_adapters"])
        for k, v in r["loaded_adapters"].items():
            assert torch.allclose(v, r["ddp_adapters"][k], rtol=1e-4, atol=1e-6), k
        # ZeroPlusTrainer(stage=3) against the DDP Trainer; save_model writes PEFT's adapter files.
        assert len(r["hf_ddp"]) == STEPS and r["hf_zp"] == pytest.approx(r["hf_ddp"], rel=1e-4, abs=1e-5), rank
        assert "adapter_config.json" in r["hf_files"] and "adapter_model.safetensors" in r["hf_files"], r["hf_files"]
        assert "model.safetensors" not in r["hf_files"]
        for k, v in r["hf_loaded_adapters"].items():
            assert torch.allclose(v, r["hf_ddp_adapters"][k], rtol=1e-4, atol=1e-6), k
        losses, precision, offload = r["hf_example"]
        assert (precision, offload) == ("bf16", "cpu") and losses == pytest.approx(r["hf_ddp"], abs=0.05), rank
    print(f"test_integration_peft wall time: {time.monotonic() - t0:.1f}s")
