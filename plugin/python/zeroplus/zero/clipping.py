"""Global gradient norm over sharded gradients: one allreduce of the local partial sums.

Every element of the model's gradient lives in exactly one rank's shard (padding is zero), so the
2-norm is sqrt(allreduce_sum(sum of squares of my shards)), the inf-norm allreduce_max(max |g|),
and a p-norm allreduce_sum(sum |g|^p) ** (1/p): the value torch.nn.utils.clip_grad_norm_ returns
on the unsharded model (up to summation order).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def global_norm(shards: list[torch.Tensor], norm_type: float, group, device) -> torch.Tensor:
    if math.isinf(norm_type):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for s in shards:
            if s.numel():
                local = torch.maximum(local, s.detach().abs().max().to(torch.float32))
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    local = torch.zeros((), dtype=torch.float32, device=device)
    for s in shards:
        if s.numel():
            local += torch.linalg.vector_norm(s.detach(), norm_type, dtype=torch.float32) ** norm_type
    dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return local ** (1.0 / norm_type)


def check_norm_args(max_norm, norm_type) -> float:
    if isinstance(max_norm, torch.Tensor):
        if max_norm.numel() != 1:
            raise ValueError(f"clip_grad_norm_: max_norm must be a number, got a tensor of shape {tuple(max_norm.shape)}")
        max_norm = max_norm.item()
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"clip_grad_norm_: max_norm must be a number, got {type(max_norm).__name__}")
    if not (max_norm > 0):
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a positive number or inf, got {norm_type!r}")
    return float(max_norm)
