"""Small models and data shared by the ZeRO stage tests and benchmarks (no downloads)."""

from __future__ import annotations

import torch
from torch import nn


class TiedGPT(nn.Module):
    """A tiny decoder with the token embedding tied to the LM head (GPT-2 style), so tied
    parameters are exercised by every stage test."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, context: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        # bias=False: attention's key bias has a mathematically zero gradient (softmax is shift
        # invariant); its rounding noise, normalised by Adam to +-lr steps, would make any two
        # correct implementations diverge on those elements.
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True,
                                           bias=False)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's init: a sane first loss (~log vocab)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        x = self.blocks(x, mask=self.causal_mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))


def make_model(seed: int = 0, **kw) -> TiedGPT:
    torch.manual_seed(seed)
    return TiedGPT(**kw)


def batch(step: int, rank: int, size: int = 4, context: int = 16, vocab: int = 64):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 5, (size, 1), generator=g)
    seq = (start + stride * torch.arange(context + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]


def loss_fn(model, tokens, targets):
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
