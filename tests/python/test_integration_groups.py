"""Frameworks use the user's param groups (issue 38, item 3), 2 ranks, one pooled launch.

  * ZeroPlusTrainer without a config optimizer block builds the stock Trainer's groups (weight
    decay on get_decay_parameter_names, none on biases and norms): the same groups as
    Trainer.create_optimizer, and with weight_decay=0.1 the same losses and weights as the stock
    Trainer under DDP (before: one group, weight decay on every parameter).
  * ZeroPlusTrainer(optimizers=(opt, sched)) with the user's own grouped AdamW and LambdaLR at stage
    3: the stock Trainer's losses, weights and lrs (before: refused).
  * Lightning: configure_optimizers returning torch AdamW with two groups and a torch LambdaLR
    (before: refused) through Trainer(strategy="zeroplus_stage_2") (a registered name): the same
    losses, weights and per-group lrs as DDPStrategy.
  * accelerate: prepare(accelerator, model, opt) with the user's optimizer instance and its groups.
  * A ds_config's train_batch_size is checked against micro x accumulation x data-parallel size
    at zeroplus.initialize (before: never, the world size was unknown there).
  * The integrations' backend warning: once, and only when the default group is not zeroplus.
"""

from __future__ import annotations

import traceback
import warnings

import lightning  # noqa: F401  (a hard requirement: scripts/setup.sh installs it)
import pytest
import torch
import transformers  # noqa: F401

from harness import run_pooled

STEPS, LR, WD = 3, 1e-3, 0.1


def _trainer_args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, use_cpu=True, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=LR,
                weight_decay=WD, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                optim="adamw_torch", seed=0, data_seed=0, dataloader_num_workers=0, lr_scheduler_type="linear",
                warmup_steps=1)
    base.update(kw)
    return TrainingArguments(**base)


def _group_names(model, opt):
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [(sorted(name_of[id(p)] for p in g["params"]), g["weight_decay"]) for g in opt.param_groups]


def _transformers_cases(tmp, out):
    from transformers import Trainer

    import integration_common as ic
    import zeroplus
    from zeroplus.integrations.transformers import ZeroPlusTrainer

    data = ic.TokenDataset(16)
    stock_model = ic.tiny_gpt2(0)
    stock = Trainer(model=stock_model, args=_trainer_args(f"{tmp}/stock"), train_dataset=data)
    stock_groups = _group_names(stock_model, stock.create_optimizer())
    out["stock_groups"] = stock_groups
    for stage in (1, 3):
        model = ic.tiny_gpt2(0)
        t = ZeroPlusTrainer(model=model, args=_trainer_args(f"{tmp}/zp{stage}"), train_dataset=data, stage=stage)
        t.create_optimizer()
        out[f"zp{stage}_groups"] = _group_names(model, zeroplus.integrations.unwrap_optimizer(t.optimizer))
    # Train: the stock Trainer (DDP) against ZeroPlusTrainer stage 2, weight_decay=0.1.
    stock_model = ic.tiny_gpt2(0)
    stock = Trainer(model=stock_model, args=_trainer_args(f"{tmp}/stock_train"), train_dataset=data)
    stock.train()
    model = ic.tiny_gpt2(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zp = ZeroPlusTrainer(model=model, args=_trainer_args(f"{tmp}/zp_train"), train_dataset=data, stage=2)
        zp.train()
    out["backend_warnings"] = [str(w.message) for w in caught if "not 'zeroplus'" in str(w.message)]
    losses = lambda tr: [h["loss"] for h in tr.state.log_history if "loss" in h]  # noqa: E731
    out["stock_losses"], out["zp_losses"] = losses(stock), losses(zp)
    out["weight_diff"] = max((a.detach() - b.detach()).abs().max().item()
                             for a, b in zip(stock_model.parameters(), model.parameters()))


def _transformers_own_optimizer_cases(tmp, out):
    """The user's own optimizer and scheduler: optimizers=(opt, sched), stock Trainer (DDP) against
    ZeroPlusTrainer stage 3 (before: refused)."""
    from transformers import Trainer

    import integration_common as ic
    import zeroplus
    from zeroplus.integrations.transformers import ZeroPlusTrainer

    data = ic.TokenDataset(16)
    losses = lambda tr: [h["loss"] for h in tr.state.log_history if "loss" in h]  # noqa: E731

    def user_optimizers(m):
        named = list(m.named_parameters())
        opt = torch.optim.AdamW([{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": WD},
                                 {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": LR / 2}],
                                lr=LR, betas=(0.9, 0.95))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))

    stock_model = ic.tiny_gpt2(0)
    stock = Trainer(model=stock_model, args=_trainer_args(f"{tmp}/stock_own"), train_dataset=data,
                    optimizers=user_optimizers(stock_model))
    stock.train()
    model = ic.tiny_gpt2(0)
    zp = ZeroPlusTrainer(model=model, args=_trainer_args(f"{tmp}/zp_own"), train_dataset=data, stage=3,
                         optimizers=user_optimizers(model))
    zp.train()
    full = zeroplus.full_state_dict(model, rank0_only=False)
    out["own_losses"] = (losses(stock), losses(zp))
    out["own_lrs"] = ([g["lr"] for g in stock.optimizer.param_groups],
                      [g["lr"] for g in zeroplus.integrations.unwrap_optimizer(zp.optimizer).param_groups])
    out["own_weight_diff"] = max((v.detach().float() - full[k].float()).abs().max().item()
                                 for k, v in stock_model.state_dict().items() if k in full)


def _lightning_module(seed):
    import lightning as L

    import integration_common as ic

    class GroupsLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = ic.tiny_gpt2(seed)
            self.losses, self.lrs = [], []

        def training_step(self, batch, batch_idx):
            loss = self.net(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            self.losses.append(loss.item())
            return loss

        def on_train_batch_end(self, *args):
            self.lrs.append([g["lr"] for g in self.trainer.optimizers[0].param_groups])

        def configure_optimizers(self):
            decay = [p for n, p in self.named_parameters() if p.ndim >= 2 and "wte" not in n]
            no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
            embed = [p for n, p in self.named_parameters() if p.ndim >= 2 and "wte" in n]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                                     {"params": no_decay, "weight_decay": 0.0},
                                     {"params": embed, "lr": LR / 2, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return GroupsLM()


def _lightning_cases(tmp, out):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    import integration_common as ic
    import zeroplus.integrations.lightning  # noqa: F401  (registers the strategy names)

    def fit(strategy, epochs=2, save=None, ckpt=None, seed=0):
        model = _lightning_module(seed)
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ic.TokenDataset(), range(8)), batch_size=2)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp)
        trainer.fit(model, loader, ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        full = trainer.strategy.optimizers[0]
        weights = ({k: v.float() for k, v in zeroplus.full_state_dict(model, rank0_only=False).items()}
                   if getattr(full, "stage", None) == 3 else
                   {k: v.detach().float().clone() for k, v in model.state_dict().items()})
        return model.losses, model.lrs, weights, type(trainer.strategy).__name__, getattr(full, "stage", None)

    import zeroplus
    out["ddp"] = fit(DDPStrategy(process_group_backend="zeroplus"))
    for stage in (2, 3):
        out[f"zeroplus_stage_{stage}"] = fit(f"zeroplus_stage_{stage}")
    # Stage 3 saved after epoch 1 and resumed from other weights: the groups' lrs and the
    # scheduler continue where they were (the scheduler's state travels in Lightning's file).
    fit("zeroplus_stage_3", epochs=1, save=f"{tmp}/groups.ckpt")
    out["resumed"] = fit("zeroplus_stage_3", ckpt=f"{tmp}/groups.ckpt", seed=5)


def _accelerate_cases(out):
    """prepare(accelerator, model, opt_instance, stage=2): the instance's groups are the engine's."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import integration_common as ic
    import zeroplus
    from zeroplus.integrations import accelerate as zp_accelerate

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = ic.tiny_gpt2(0)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": WD},
                             {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": LR / 2}], lr=LR)
    expected = _group_names(model, opt)
    model, wrapped = zp_accelerate.prepare(accelerator, model, opt, stage=2)
    engine = zeroplus.integrations.unwrap_optimizer(wrapped)
    out["accelerate_groups"] = (_group_names(model, engine), expected, [g["lr"] for g in engine.param_groups])


def _batch_size_cases(out):
    import zeroplus

    for name, cfg in {"wrong_product": {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                                        "gradient_accumulation_steps": 1},
                      "wrong_derived": {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4},
                      "right": {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 2}}.items():
        try:
            zeroplus.initialize(torch.nn.Linear(4, 4), torch.optim.SGD, stage=1, lr=0.1, config=cfg)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)


def _all_cases(rank, world_size, tmp):
    import integration_common as ic

    ic.torchrun_env(rank, world_size)
    out = {}
    # Each section's error is recorded (its tests fail with it), so one section's failure does not
    # hide the others' results (every rank raises the same way here: nothing is left half-run).
    for section, run in (("batch", lambda: _batch_size_cases(out)),
                         ("transformers", lambda: _transformers_cases(tmp, out)),
                         ("transformers_own", lambda: _transformers_own_optimizer_cases(tmp, out)),
                         ("lightning", lambda: _lightning_cases(tmp, out)),
                         ("accelerate", lambda: _accelerate_cases(out))):
        try:
            run()
        except Exception:  # noqa: BLE001 - reported by the section's tests
            out[f"{section}_error"] = traceback.format_exc()
    return out


def _section(results, section):
    for out in results:
        assert f"{section}_error" not in out, out[f"{section}_error"]
    return results


def _gloo_warning(rank, world_size):
    from zeroplus.integrations import warn_if_not_zeroplus

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_not_zeroplus("a")
        warn_if_not_zeroplus("b")
    return [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_pooled(_all_cases, 2, str(tmp_path_factory.mktemp("groups")), timeout=600)


def test_trainer_builds_the_stock_no_decay_groups(results):
    for out in _section(results, "transformers"):
        stock = out["stock_groups"]
        assert len(stock) == 2 and stock[1][1] == 0.0 and any("ln_" in n for n in stock[1][0])
        assert out["zp1_groups"] == stock
        assert out["zp3_groups"] == stock


def test_trainer_with_weight_decay_trains_like_the_stock_trainer(results):
    for out in _section(results, "transformers"):
        assert out["zp_losses"] == pytest.approx(out["stock_losses"], rel=1e-5)
        assert out["weight_diff"] <= 1e-5
        assert out["backend_warnings"] == []  # the default group is on zeroplus here


@pytest.mark.parametrize("stage", (2, 3))
def test_lightning_groups_and_torch_scheduler(results, stage):
    for out in _section(results, "lightning"):
        losses, lrs, weights, _, _ = out["ddp"]
        z_losses, z_lrs, z_weights, kind, z_stage = out[f"zeroplus_stage_{stage}"]
        assert (kind, z_stage) == ("ZeroPlusStrategy", stage)
        assert z_lrs == lrs and lrs[-1] == [LR, LR, LR / 2] and lrs[0] != lrs[-1]
        assert z_losses == pytest.approx(losses, rel=1e-5)
        worst = max((z_weights[k] - v).abs().max().item() for k, v in weights.items())
        assert worst <= 1e-5


def test_train_batch_size_checked_against_world_size(results):
    for out in _section(results, "batch"):
        assert out["right"] is None
        for key, numbers in (("wrong_product", ("10", "4", "1", "2")), ("wrong_derived", ("12", "4", "2"))):
            assert out[key] is not None and "train_batch_size" in out[key], out[key]
            for n in numbers:
                assert n in out[key], (key, out[key])


def test_backend_warning_once_off_zeroplus():
    messages = run_pooled(_gloo_warning, 2, backend="gloo", timeout=120)
    for got in messages:
        assert len(got) == 1 and "'gloo'" in got[0] and "init_process_group(backend='zeroplus')" in got[0]


def test_accelerate_prepare_takes_the_optimizer_instance(results):
    for out in _section(results, "accelerate"):
        got, expected, lrs = out["accelerate_groups"]
        assert got == expected and lrs == [LR, LR / 2]


def test_lightning_groups_and_scheduler_resume(results):
    for out in _section(results, "lightning"):
        losses, lrs, weights, _, _ = out["zeroplus_stage_3"]
        r_losses, r_lrs, r_weights, _, _ = out["resumed"]
        steps = len(r_losses)
        assert 0 < steps < len(losses)
        assert r_lrs == lrs[-steps:]
        assert r_losses == pytest.approx(losses[-steps:], rel=1e-5)
        assert max((r_weights[k] - v).abs().max().item() for k, v in weights.items()) <= 1e-5


def test_trainer_takes_the_users_optimizer_and_scheduler(results):
    for out in _section(results, "transformers_own"):
        stock, mine = out["own_losses"]
        assert len(mine) == len(stock) > 0 and mine == pytest.approx(stock, rel=1e-5)
        assert out["own_lrs"][0] == out["own_lrs"][1] and out["own_lrs"][0] == [LR, LR / 2]
        assert out["own_weight_diff"] <= 1e-5
