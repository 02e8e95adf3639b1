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


# Parameter parity (distance relative to how far the reference moved) lives in zero_models.py:
# params_of, full_masters, parity, assert_parity.


def sharded_counts(model, engine) -> tuple[int, int]:
    """(parameters in the stage-3 engine's non-persistent buckets, parameters of model): see
    SHARD_ALL. The kind of bucket a checkpoint loads into, also at world size 1; whether a rank
    really holds only a shard is sharding.assert_sharded's question."""
    from checkpoint_models import sharded_names

    return len(sharded_names(model, engine)), len(list(model.parameters()))


def parameter_store_bytes(opt) -> tuple[int, int, int]:
    """(param-b*.swp files in the stage-3 parameter store's swap directory, their bytes, this
    rank's shard bytes of the buckets the store offloads): what "parameters on NVMe" puts on disk.
    (0, 0, 0) without a parameter store: a config that names offload_param "nvme" while every
    parameter is kept whole (persistent) offloads nothing."""
    import os

    from sharding import engine_of

    engine = engine_of(opt)
    store = getattr(engine.placement, "param_store", None)
    if store is None:
        return 0, 0, 0
    shards = sum(b.shard_numel * b.dtype.itemsize for b in list(engine.buckets) + engine.placement.frozen_buckets
                 if store.offloads(b))
    path = store.directory.path
    files = [f for f in os.listdir(path) if f.startswith("param-b") and f.endswith(".swp")]
    return len(files), sum(os.stat(os.path.join(path, f)).st_size for f in files), shards
