"""Shared pieces of the framework integration tests (test_integration_*.py): a tiny GPT-2 from a
config (no hub download), its data, and the environment a torchrun launch would give a rank.

The frameworks are a hard requirement of these tests: scripts/setup.sh installs them, and a
missing one fails the import (never a skip), so CI cannot pass without them."""

from __future__ import annotations

import os

import torch

SEQ, VOCAB = 16, 64


def torchrun_env(rank: int, world_size: int) -> None:
    """What torchrun exports, for frameworks that read it (accelerate, Lightning). The group
    itself is already up (the harness made it with backend="zeroplus")."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29555",
                      OMP_NUM_THREADS="1")


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class TokenDataset(torch.utils.data.Dataset):
    """Deterministic random token sequences; labels = inputs (causal LM loss)."""

    def __init__(self, n: int = 32, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# Stage 3's persistence threshold for the stage-3 checkpoint cases. Every parameter of tiny_gpt2
# is below the default (1e5 elements), which keeps them all whole on every rank: a "stage-3
# checkpoint" would then hold no sharded parameter. SHARD_ALL (saving) shards every one;
# SHARD_SOME (loading) keeps those of at most 100 elements (LayerNorms, most biases) whole, so
# a load fills both kinds of bucket.
SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
SHARD_SOME = {"zero_optimization": {"stage3_param_persistence_threshold": 100}}


def sharded_counts(model, engine) -> tuple[int, int]:
    """(parameters the stage-3 engine holds sharded, parameters of model): see SHARD_ALL."""
    from checkpoint_models import sharded_names

    return len(sharded_names(model, engine)), len(list(model.parameters()))
