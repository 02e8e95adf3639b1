"""Parallel styles for HF GPT-2's Conv1D, which torch's ColwiseParallel/RowwiseParallel refuse
(they take nn.Linear and nn.Embedding only).

Conv1D computes `x @ weight + bias` with weight of shape (in, out): the transpose of nn.Linear's.
So the column-parallel split (each rank computes a slice of the outputs) shards weight dim 1 and the
bias, and the row-parallel split (each rank holds a slice of the inputs, partial sums all-reduced)
shards weight dim 0 and replicates the bias: the dims torch's styles use for nn.Linear, transposed.

GPT-2's fused c_attn computes [q | k | v] in one Conv1D (3 * hidden outputs). A plain column split
would give rank 0 all of q and half of k; each rank needs its heads of q, k and v. The weight is
therefore placed as _StridedShard(1, split_factor=3): each rank holds its slice of every one of the
three blocks, [q_r | k_r | v_r], which is what its local attention needs, while the DTensor's global
value (full_tensor(), state dicts) stays the checkpoint's [q | k | v] order. (_StridedShard is
torch's own placement for FSDP2 over TP; its matmul and redistribution rules are torch's.)

Inputs and outputs follow torch's styles: column-parallel takes the replicated activation and
returns the local output slice (a plain tensor); row-parallel takes that local slice and returns
the all-reduced (replicated) output as a plain tensor.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard


def is_conv1d(module: nn.Module) -> bool:
    """HF's transformers.pytorch_utils.Conv1D (recognised by shape, so transformers need not be imported)."""
    return (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor)
            and getattr(module, "weight").dim() == 2 and hasattr(module, "nf") and hasattr(module, "nx"))


def _replace(module: nn.Module, name: str, mesh, placements) -> None:
    p = getattr(module, name, None)
    if p is None:
        return
    # src_data_rank=None: every rank already holds the same full value (built from the same seed or
    # checkpoint), so each cuts its own piece and nothing is communicated.
    dist_p = nn.Parameter(distribute_tensor(p.detach(), mesh, placements, src_data_rank=None),
                          requires_grad=p.requires_grad)
    module.register_parameter(name, dist_p)


def _check(module: nn.Module, style: str) -> None:
    if not is_conv1d(module):
        raise ValueError(f"{style}: takes HF Conv1D modules, got {type(module).__name__}")


def _to_replicate_input(mesh):
    def fn(_module, inputs, _mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return (x, *inputs[1:])
    return fn


class Conv1DColwise(ParallelStyle):
    """Column-parallel Conv1D: weight Shard(1), bias Shard(0); fused=k for a fused block of k
    equal projections (GPT-2's c_attn: k=3) whose rank-local output must be [p1_r | ... | pk_r]."""

    def __init__(self, fused: int = 1):
        super().__init__()
        if isinstance(fused, bool) or not isinstance(fused, int) or fused < 1:
            raise ValueError(f"Conv1DColwise: fused must be a positive int, got {fused!r}")
        self.fused = fused

    def _placements(self, dim: int):
        return [_StridedShard(dim, split_factor=self.fused)] if self.fused > 1 else [Shard(dim)]

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check(module, "Conv1DColwise")

        def partition(_name, mod, mesh):
            _replace(mod, "weight", mesh, self._placements(1))
            _replace(mod, "bias", mesh, self._placements(0))

        def output(_mod, out, _mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, _to_replicate_input(device_mesh), output)

    def __repr__(self) -> str:
        return f"Conv1DColwise(fused={self.fused})"


class Conv1DRowwise(ParallelStyle):
    """Row-parallel Conv1D: weight Shard(0), bias Replicate; input is the rank's slice of the
    last dimension; output all-reduced (Replicate), returned as a plain tensor."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check(module, "Conv1DRowwise")

        def partition(_name, mod, mesh):
            _replace(mod, "weight", mesh, [Shard(0)])
            _replace(mod, "bias", mesh, [Replicate()])

        def inputs(_mod, args, mesh):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False)
            return (x, *args[1:])

        def output(_mod, out, mesh):
            if isinstance(out, DTensor):
                if out.placements != (Replicate(),):
                    out = out.redistribute(mesh, [Replicate()])
                return out.to_local()
            return out

        return distribute_module(module, device_mesh, partition, inputs, output)

    def __repr__(self) -> str:
        return "Conv1DRowwise()"
