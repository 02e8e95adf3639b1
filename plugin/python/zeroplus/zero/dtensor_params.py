"""Tensor-parallel (DTensor) parameters in the ZeRO engine: the engine works on local tensors.

A model parallelised with torch.distributed.tensor.parallel keeps DTensor parameters (Shard or
Replicate over the tensor-parallel mesh). Stages 1-2 treat each DTensor parameter as its local
tensor: the layout flattens local shapes, gradients are taken as their local tensors, the data-
parallel collectives run over `process_group` (which must hold exactly one rank of every
tensor-parallel group: the mesh's "dp" dimension). What stays DTensor for the user:

  * model.parameters() (the same Parameter objects; their local tensors become views into the
    engine's flat buffers, as plain parameters' .data do);
  * the consolidated optimizer state (state_dict after consolidate_state_dict): elementwise state
    of a DTensor parameter is a DTensor with the parameter's mesh and placements, as torch.optim's
    would be; load_state_dict takes that, or a plain tensor of the global shape;
  * clip_grad_norm_: the global norm covers both dimensions (squares of tensor-parallel-sharded
    pieces are summed over the tensor-parallel group as well, replicated ones counted once).

Contract of the helpers: `local` only reads (public DTensor.to_local under no_grad: a view of the
local tensor); `show_local` is the one writer of a DTensor parameter's local storage. torch has no
public setter for it (Parameter(DTensor).to_local() returns a fresh view, and `param.data = dt`
replaces the wrapper's metadata but not its `_local_tensor`), so it sets `_local_tensor.data`, as
plain parameters get `.data`; the wrapper's dtype follows through `param.data = DTensor(...)`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor


def is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a view sharing its storage), or `t` itself."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def is_tp_sharded(p: torch.Tensor) -> bool:
    """True when each tensor-parallel rank holds a different piece of `p`: any placement but
    Replicate (Partial is refused up front). Not `is_shard()`: torch's _StridedShard (GPT-2's fused
    c_attn, tensor_parallel/styles.py) is a shard for which is_shard() answers False."""
    return isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements)


def show_local(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make `param` (plain or DTensor) hold `view` as its (local) storage, possibly in another dtype."""
    if not isinstance(param, DTensor):
        param.data = view
        return
    if param.dtype != view.dtype:  # mixed precision: the wrapper's dtype follows its local tensor
        param.data = DTensor.from_local(view, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
    param._local_tensor.data = view


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """param.grad as a local tensor laid out like param's local tensor. A DTensor gradient with
    other placements than its parameter (a Partial one) is redistributed first, as FSDP2 does
    (a collective over the tensor-parallel group: every rank of it runs the same backward)."""
    grad = param.grad
    if grad is None or not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad.to_local()


def _group_ranks(group) -> set[int]:
    if group is None or group is dist.group.WORLD:
        return set(range(dist.get_world_size()))
    return set(dist.get_process_group_ranks(group))


def tensor_parallel_group(name: str, params, process_group):
    """The tensor-parallel group the DTensor parameters among `params` are sharded over (None when
    there is none), after checking that ZeRO can take them with `process_group` as its data-parallel
    group. ValueError naming the argument otherwise; nothing is changed."""
    groups, dp_ranks, me, checked = {}, None, dist.get_rank(), set()
    for p in params:
        if not isinstance(p, DTensor):
            continue
        for pl in p.placements:
            if pl.is_partial():
                raise ValueError(f"{name}: a DTensor parameter of shape {tuple(p.shape)} has a Partial placement; "
                                 f"parameters must be Shard or Replicate")
        if p.device_mesh.ndim != 1:
            raise ValueError(f"{name}: DTensor parameter of shape {tuple(p.shape)} lives on a {p.device_mesh.ndim}-D "
                             f"mesh {p.device_mesh.mesh_dim_names}; ZeRO takes tensor-parallel parameters on the "
                             f"mesh's 1-D tensor-parallel dimension (parallelize_module(model, mesh['tp'], plan)) and "
                             f"shards them over process_group (mesh['dp'].get_group())")
        if id(p.device_mesh) in checked:
            continue  # one check per mesh (a model's parameters share a handful)
        checked.add(id(p.device_mesh))
        group = p.device_mesh.get_group()
        groups[id(group)] = group
        if dp_ranks is None:
            dp_ranks = _group_ranks(process_group)
        tp_ranks = _group_ranks(group)
        if dp_ranks & tp_ranks != {me}:
            raise ValueError(f"{name}: process_group must be the data-parallel group of the tensor-parallel model "
                             f"(one rank of each tensor-parallel group, e.g. mesh['dp'].get_group()); it shares "
                             f"global ranks {sorted(dp_ranks & tp_ranks)} with the tensor-parallel group "
                             f"{sorted(tp_ranks)} of a parameter of shape {tuple(p.shape)}")
    if len(groups) > 1:
        raise ValueError(f"{name}: DTensor parameters are on {len(groups)} different tensor-parallel meshes; ZeRO "
                         f"takes one tensor-parallel mesh dimension")
    return next(iter(groups.values()), None)


def as_dtensor_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """An elementwise state tensor of `param`'s local shape as `param` is shaped: a DTensor with its
    mesh and placements for a DTensor parameter (what torch.optim keeps), else `value` itself."""
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def local_state(value, param: torch.Tensor, where: str) -> torch.Tensor:
    """The local piece of a loaded elementwise state tensor of DTensor parameter `param`: a DTensor
    with param's global shape (any placements: redistributed) or a plain tensor of the global shape
    (this rank's piece is cut locally, no communication)."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"load_state_dict: {where} has shape {tuple(value.shape)}, the parameter has "
                         f"{tuple(param.shape)}")
    if isinstance(value, DTensor):
        if tuple(value.placements) != tuple(param.placements) or value.device_mesh != param.device_mesh:
            value = value.redistribute(param.device_mesh, param.placements)
        return value.to_local()
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None).to_local()
