"""DeepSpeed's side of the DeepSpeed-checkpoint tests: a tiny model trained by DeepSpeed's own engine
on CPU (gloo), saved with engine.save_checkpoint, then continued (the reference a zeroplus resume
must match). Runs inside a pooled rank whose group is gloo (harness.run_pooled(backend="gloo")).

The data is one global batch of GLOBAL_ROWS rows per step, split evenly over the ranks of whichever
run uses it (DeepSpeed at 2 ranks, zeroplus at 1, 2 or 3): with a mean loss, every split gives the
same averaged gradient, so the runs are comparable step by step.
"""

from __future__ import annotations

import os

import torch
from torch import nn

GLOBAL_ROWS = 12  # divisible by 1, 2, 3 and 4 ranks
IN, HIDDEN, OUT = 5, 7, 3  # odd sizes: DeepSpeed pads its flat partitions and per-parameter alignment
GRADIENT_CLIPPING = 1.0  # DeepSpeed 0.19.8's default (runtime/constants.py), written out in the config


class DsNet(nn.Module):
    """frozen=True adds a frozen parameter (`gate`): DeepSpeed saves it apart from the optimizer's
    partitions (frozen_param_fragments; at stage 3 one fragment per rank). tied=True adds a layer
    sharing lin2's weight (`lin_back.weight`: DeepSpeed's shared_params)."""

    def __init__(self, frozen: bool = False, tied: bool = False):
        super().__init__()
        self.lin1 = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.lin2 = nn.Linear(HIDDEN, OUT)
        self.register_buffer("shift", torch.tensor([0.25, -0.5, 1.0]))
        self.gate = nn.Parameter(torch.rand(OUT) + 0.5, requires_grad=False) if frozen else None
        self.lin_back = None
        if tied:
            self.lin_back = nn.Linear(HIDDEN, OUT)
            self.lin_back.weight = self.lin2.weight

    def forward(self, x):
        h = torch.tanh(self.norm(self.lin1(x)))
        out = self.lin2(h) + self.shift
        if self.lin_back is not None:
            out = out + 0.5 * self.lin_back(h)
        return out * self.gate if self.gate is not None else out


def make(seed: int = 0, variant=False) -> DsNet:
    """variant: False (plain), True / "with_frozen" (a frozen parameter), "tied" (tied weights)."""
    torch.manual_seed(seed)
    return DsNet(frozen=variant in (True, "with_frozen"), tied=variant == "tied")


def param_groups(model: DsNet, grouped) -> list[dict]:
    """One group, or the usual two (weights decayed; biases and the norm not) of the trainable
    parameters; grouped="with_frozen": the frozen ones in group 0 too (as zeroplus.initialize holds them)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if grouped in (False, "tied"):
        return [{"params": [p for _n, p in trainable], "weight_decay": 0.1}]
    frozen = [p for p in model.parameters() if not p.requires_grad] if grouped == "with_frozen" else []
    return [{"params": [p for n, p in trainable if n.endswith("weight") and "norm" not in n] + frozen,
             "weight_decay": 0.1},
            {"params": [p for n, p in trainable if not (n.endswith("weight") and "norm" not in n)],
             "weight_decay": 0.0}]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    return torch.randn(GLOBAL_ROWS, IN, generator=g), torch.randn(GLOBAL_ROWS, OUT, generator=g)


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    rows = GLOBAL_ROWS // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def loss_of(model, x, y, dtype=torch.float32):
    return nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def ds_config(stage: int, precision: str | None, ds_optimizer, scheduler: bool, world: int = 2) -> dict:
    """ds_optimizer: False (a client torch AdamW), True (AdamW from the config, torch_adam) or "fused"
    (DeepSpeed's FusedAdam, JIT-compiled on first use)."""
    config = {"train_micro_batch_size_per_gpu": GLOBAL_ROWS // world, "gradient_accumulation_steps": 1,
              "gradient_clipping": GRADIENT_CLIPPING,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if ds_optimizer:  # DeepSpeed builds the optimizer from its config: torch's AdamW, or "fused" its own
        params = {"lr": 1e-2, "weight_decay": 0.1} | ({} if ds_optimizer == "fused" else {"torch_adam": True})
        config["optimizer"] = {"type": "AdamW", "params": params}
    if scheduler:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                               "warmup_num_steps": 10}}
    return config


def _env(rank: int, world: int) -> None:
    # DeepSpeed's engine reads what a launcher exports; the group itself is already up (gloo).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", DS_ACCELERATOR="cpu")


def train_save_continue(rank: int, world: int, root: str, name: str, stage: int, precision: str | None,
                        ds_optimizer, grouped, steps: int, more: int) -> dict:
    """DeepSpeed trains `steps` steps, saves ROOT/NAME (tag global_step{steps}), trains `more`
    steps and saves again (tag global_step{steps+more}, the continuation's reference). Returns
    the lr and the scheduler state at the first save (rank 0's view). grouped: True, two param
    groups and a frozen parameter (DsNet(frozen=True)); "tied": tied weights (DsNet(tied=True))."""
    _env(rank, world)
    import importlib

    import deepspeed

    # DeepSpeed's CPU backend JIT-compiles a shared-memory allreduce op (C++, once per machine) that
    # only its inference all-reduce uses; training collectives go through the gloo group. (By its
    # module path: the attribute deepspeed.comm.torch is the torch package.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    model = make(0, grouped)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    config = ds_config(stage, precision, ds_optimizer, True, world)
    groups = param_groups(model, grouped)
    kwargs = {} if ds_optimizer else {"optimizer": torch.optim.AdamW(groups, lr=1e-2)}
    engine, _opt, _, sched = deepspeed.initialize(model=model, model_parameters=groups, config=config, **kwargs)
    out = {}
    for step in range(steps + more):
        x, y = local_batch(step, rank, world)
        loss = loss_of(engine, x, y, dtype)
        engine.backward(loss)
        engine.step()
        if step + 1 == steps:
            engine.save_checkpoint(os.path.join(root, name))
            out["lr"] = engine.get_lr()[0]
            out["scheduler"] = sched.state_dict() if sched is not None else None
    engine.save_checkpoint(os.path.join(root, name), tag=f"global_step{steps + more}", save_latest=False)
    engine.destroy()
    return out


def load_continue(rank: int, world: int, src: str, dst: str, stage: int, precision: str | None, grouped, steps: int,
                  more: int, tag: str | None = None) -> dict:
    """DeepSpeed's side of convert --to deepspeed: a fresh engine (another seed: every value must come
    from the load) loads SRC (its `latest`, or `tag`) with engine.load_checkpoint, saves at once into
    DST (tag "reloaded": what DeepSpeed itself makes of the files), trains steps..steps+more on the
    same global batches and saves again (tag global_step{steps+more}). Returns what the load gave
    (rank 0's view)."""
    _env(rank, world)
    import importlib

    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    model = make(5, grouped)
    groups = param_groups(model, grouped)
    engine, _opt, _, sched = deepspeed.initialize(model=model, model_parameters=groups,
                                                  config=ds_config(stage, precision, False, True, world),
                                                  optimizer=torch.optim.AdamW(groups, lr=1e-3))
    path, client = engine.load_checkpoint(src, tag=tag)
    out = {"path": path, "client_state": {k: v for k, v in client.items() if k == "run"},
           "global_steps": engine.global_steps, "lr": engine.get_lr()[0], "scheduler": sched.state_dict()}
    engine.save_checkpoint(dst, tag="reloaded", save_latest=False)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for step in range(steps, steps + more):
        x, y = local_batch(step, rank, world)
        engine.backward(loss_of(engine, x, y, dtype))
        engine.step()
    engine.save_checkpoint(dst, tag=f"global_step{steps + more}", save_latest=False)
    engine.destroy()
    return out
