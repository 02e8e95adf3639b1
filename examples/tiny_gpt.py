"""A small decoder-only transformer and a synthetic next-token task; no downloads.

The task is learnable (each sequence is an arithmetic progression modulo the vocabulary), so
the loss visibly falls within a few dozen steps on a CPU.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        x = self.blocks(x, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))


def synthetic_batch(batch: int, context: int, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 8, (batch, 1), generator=generator)
    seq = (start + stride * torch.arange(context + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]
