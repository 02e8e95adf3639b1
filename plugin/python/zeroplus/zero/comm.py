"""The collectives the ZeRO engines issue, on any backend (zeroplus, gloo, nccl).

torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single and deprecates the
old names; 2.11 has only the old ones. Both take (output, input, op/group, async_op).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = True):
    """SUM-reduce `input` (world_size * output.numel() elements) and keep this rank's slice."""
    return _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = True):
    """Concatenate every rank's `input` into `output` in group-rank order."""
    return _all_gather(output, input, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM):
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def group_src_rank(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (broadcast's src is a global rank)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)
