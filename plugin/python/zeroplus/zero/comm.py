"""The collectives the ZeRO engines issue, on any backend (zeroplus, gloo, nccl).

torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single and deprecates the
old names; 2.11 has only the old ones. Both take (output, input, op/group, async_op).

On gloo with 2 ranks the engines use one collective per owner instead (`owner_collectives`): a
bucket's reduce-scatter is 2 `reduce`s (slice r to its owner r) and the parameter all-gather is 2
in-place `broadcast`s (slice r from owner r). Measured on 2 CPU ranks, 3.3M fp32 elements,
interleaved: gloo's reduce_scatter_tensor took 1.4-1.8x and its all_gather_into_tensor 1.5x the
time of the per-owner calls, and the broadcast form needs no copy of the input because each
rank's slice of the output is its input. Only at 2 ranks: a sum of two values is the same in any
order, so the result is bitwise the one DDP's allreduce gives; with more ranks gloo's reduce adds
in another order than its allreduce, and Adam turns those last-bit differences of near-zero
gradients into visible parameter differences (measured: 4e-3 after 30 steps at 4 ranks). The
stage-3 parameter gather has no such limit (`owner_broadcast_gather`): broadcasts only copy.
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


def gather_input(own: torch.Tensor, group) -> torch.Tensor:
    """The input of an all-gather whose `own` is this rank's slice of the output: `own` itself
    where the backend that moves tensors of its device allows the alias (zeroplus: its
    communicators take `in` at out + rank * bytes, process_group/core/communicator.hpp, and host
    staging copies each side; NCCL's in-place all-gather), else a copy (gloo beyond 2 ranks, MPI,
    custom backends). The copy cost a shard-sized allocation and memcpy per bucket at every step's
    publish and every load. The backend is the device's ("cpu:gloo,cuda:nccl": NCCL for CUDA)."""
    return own if backend_for(own.device, group) in ("zeroplus", "nccl") else own.clone()


def backend_for(device: torch.device, group) -> str:
    """The name of the backend that serves `device`'s tensors in `group` ("" if none does, or the
    group is not one torch.distributed knows: gather_input then copies, which is always safe)."""
    try:
        config = dist.get_backend_config(group)
    except (RuntimeError, ValueError, KeyError):
        return ""
    for part in config.split(","):  # "cpu:gloo,cuda:nccl"
        kind, _, name = part.partition(":")
        if kind == device.type:
            return name
    return ""


def agreement_all_gather(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """A small synchronous all-gather of control integers (gather_agreement.py), apart from
    all_gather so that what moves parameters is one function (tests count and wrap it)."""
    _all_gather(output, input, group=group, async_op=False)


def owner_collectives(group) -> bool:
    """True where per-owner reduce/broadcast replace the tensor collectives (gloo, 2 ranks; see above)."""
    return dist.get_backend(group) == "gloo" and dist.get_world_size(group) == 2


def owner_broadcast_gather(group) -> bool:
    """True where the parameter all-gather is one broadcast per owner: gloo at any world size.
    A broadcast does no arithmetic, so unlike the reduce this is exact at every world size; at 4
    ranks (3.2M fp32, interleaved medians) gloo took 25.4 ms for all_gather_into_tensor and 15.4 ms
    for the 4 broadcasts."""
    return dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1


class Works:
    """Several async works waited on as one."""

    def __init__(self, works):
        self.works = list(works)

    def wait(self):
        for w in self.works:
            w.wait()
        return True


def reduce_to_owners(flat: torch.Tensor, shard_numel: int, group, world_size: int) -> Works:
    """SUM-reduce slice r of `flat` onto group rank r, for every r, in place. Afterwards this rank's
    own slice holds the sum; the rest of `flat` is scratch (gloo may leave partial sums there)."""
    return Works(dist.reduce(flat[r * shard_numel:(r + 1) * shard_numel], dst=group_src_rank(group, r),
                             op=dist.ReduceOp.SUM, group=group, async_op=True) for r in range(world_size))


def broadcast_from_owners(flat: torch.Tensor, shard_numel: int, group, world_size: int) -> Works:
    """All-gather in place: slice r of `flat` comes from group rank r, for every r."""
    return Works(dist.broadcast(flat[r * shard_numel:(r + 1) * shard_numel], src=group_src_rank(group, r),
                                group=group, async_op=True) for r in range(world_size))


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM):
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def group_src_rank(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (broadcast's src is a global rank)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)
