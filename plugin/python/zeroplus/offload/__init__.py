"""Offload: optimizer state and stage-3 parameters kept outside the engine's memory.

    policy.py      OffloadPolicy / AioPolicy: the knobs, parsed from kwargs or a DeepSpeed config
    nvme_store.py  one rank's private swap directory and its exclusively created files
    record.py      what the swappers keep of a record: its Layout (which tensors, where), the
                   C++ swap store each swapper opens (torch.classes.zeroplus.SwapStore,
                   optimizers/core/swap_store.hpp: records, pinned pool, write-behind) and the
                   error wording
    swapper.py     the NVMe optimizer swapper behind BucketOptimizer.fetch/store (a store of its own)
    host_tier.py   CUDA training (ZeRO-Offload): fp32 masters and state on the host, the step on
                   the CPU, gradients down and parameters up per bucket on a copy stream
    param_swapper.py  the NVMe parameter-shard swapper behind the stage-3 gatherer and publish
                   (a store of its own, caching records)
    host_params.py the same interface on CUDA training: shards in host memory ("cpu") or in the
                   NVMe swapper's records ("nvme"), copied up for their gather on a copy stream
    grad_spill.py  gradient shards of NVMe-offloaded parameters, in files between backward and step
                   (CPU training; CUDA training with offload_optimizer; a store of its own)

The ZeRO engines call prepare_optimizer_store() before changing anything (checks, the swap
directory), make_host_tier() once their masters exist (the host tier replaces them with host
copies on CUDA training) and attach_optimizer_store() once their bucket optimizers exist; stage 3 calls
prepare_param_store() likewise and make_param_store() once its buckets are planned.
See docs/offload.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import host_tier
from .host_tier import HostTier
from .nvme_store import SwapDirectory
from .policy import AioPolicy, OffloadPolicy, parse_aio, parse_offload
from .grad_spill import GradSpill
from .host_params import HostParamStore
from .param_swapper import ParamSwapper
from .swapper import OptimizerSwapper


@dataclass(frozen=True)
class OptimizerOffload:
    """What prepare_optimizer_store decided (None from it: the optimizer state stays in memory)."""
    policy: OffloadPolicy
    rank: int
    directory: SwapDirectory | None  # "nvme": this rank's swap directory (the NVMe swapper's)
    host_tier: bool                  # masters and state move to host memory (CUDA training; the test hook)


def prepare_optimizer_store(policy: OffloadPolicy, param_policy: OffloadPolicy, rank: int, device: torch.device,
                            who: str) -> OptimizerOffload | None:
    """Checks the offload settings against the training device and creates this rank's swap
    directory, before the engine changes anything; returns what make_host_tier and
    attach_optimizer_store need (None: optimizer state stays in memory).

    CPU training: device 'cpu' is a no-op, for the optimizer state and for the parameters: they
    are in host memory already; 'nvme' swaps the state (and a mixed-precision master) through
    the NVMe swapper. CUDA training: 'cpu' and 'nvme' move the fp32 masters and the state to the
    host tier (host_tier.py), with the NVMe swapper under it for 'nvme'. Parameter offload is
    prepare_param_store's."""
    _check_param_device(param_policy, device, who)
    if not policy.enabled:
        return None
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"{who}: offload_optimizer device {policy.device!r} with parameters on "
                                  f"{device.type} is not built (CPU and CUDA training are); nothing was changed")
    use_host_tier = _device_path(device)
    if policy.device == "cpu" and not use_host_tier:
        return None  # CPU training: optimizer state is in CPU memory already (docs/offload.md)
    directory = SwapDirectory(policy.nvme_path, rank, policy.what) if policy.device == "nvme" else None
    return OptimizerOffload(policy, rank, directory, use_host_tier)


def _device_path(device: torch.device) -> bool:
    """CUDA training, or CPU training under host_tier.force_on_cpu_for_tests (same code)."""
    return device.type == "cuda" or host_tier.forced_on_cpu()


def _check_param_device(policy: OffloadPolicy, device: torch.device, who: str) -> None:
    if not policy.enabled:
        return
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"{who}: offload_param device {policy.device!r} with parameters on {device.type} "
                                  f"is not built (CPU and CUDA training are); nothing was changed")


@dataclass(frozen=True)
class HostParams:
    """prepare_param_store's decision for offload_param on CUDA training (HostParamStore; 'nvme':
    with the NVMe parameter swapper under it, in this rank's swap directory)."""
    policy: OffloadPolicy
    device: torch.device
    rank: int = 0
    directory: SwapDirectory | None = None
    spill_gradients: bool = False    # 'nvme' with the step on the host: gradients to files (host_params.py)


def make_host_tier(prepared: OptimizerOffload | None, device: torch.device,
                   masters: list[torch.Tensor]) -> HostTier | None:
    """The HostTier holding host copies of these masters (its .masters replace them), or None."""
    if prepared is None or not prepared.host_tier:
        return None
    return HostTier(device, masters, prepared.policy.pin_memory)


def prepare_param_store(policy: OffloadPolicy, stage: int, rank: int, device: torch.device, who: str,
                        optimizer: OptimizerOffload | None = None):
    """Checks offload_param against the stage and device and creates this rank's parameter swap
    directory; returns what make_param_store needs (None: parameters stay in memory; device
    'cpu' on CPU training is a no-op, like offload_optimizer's). optimizer: what
    prepare_optimizer_store decided; on CUDA training 'nvme' spills the offloaded buckets'
    gradients when the step runs on the host (the host tier), and keeps them on the device when
    it runs there (host_params.py)."""
    if not policy.enabled:
        return None
    if stage != 3:
        raise ValueError(f"{who}: offload_param applies to ZeRO stage 3 only (parameters are sharded there), "
                         f"got stage {stage}")
    _check_param_device(policy, device, who)
    if _device_path(device):  # host_params.py
        directory = SwapDirectory(policy.nvme_path, rank, policy.what) if policy.device == "nvme" else None
        on_host = optimizer is not None and optimizer.host_tier
        return HostParams(policy, device, rank, directory, spill_gradients=directory is not None and on_host)
    if policy.device == "cpu":
        return None  # CPU training: the shards are in CPU memory already (docs/offload.md)
    return (policy, rank, SwapDirectory(policy.nvme_path, rank, policy.what))


def make_param_store(prepared, buckets: list):
    """The parameter store for these (non-persistent stage-3) buckets: a ParamSwapper (nvme, CPU
    training), a HostParamStore (cpu, CUDA training), or None."""
    if prepared is None:
        return None
    if isinstance(prepared, HostParams):
        swapper_for = None
        if prepared.directory is not None:
            def swapper_for(stand_ins):
                return ParamSwapper(prepared.policy, prepared.rank, prepared.directory, stand_ins)
        return HostParamStore(prepared.policy, prepared.device, buckets, swapper_for=swapper_for,
                              spill_gradients=prepared.spill_gradients)
    policy, rank, directory = prepared
    return ParamSwapper(policy, rank, directory, buckets)


def make_grad_spill(param_store: ParamSwapper | HostParamStore, buckets: dict, device: torch.device):
    """The GradSpill for these reducer buckets ({index: (dtype, shard_numel)}), in the parameter
    swapper's directory (a HostParamStore's: the one under it); device: where the gradients are
    reduced (the spill's statistics are computed there)."""
    home = param_store.swapper if isinstance(param_store, HostParamStore) else param_store
    return GradSpill(home.policy, home.rank, home.directory, buckets, device)


def attach_optimizer_store(prepared, bucket_optimizers: list):
    """The store behind every bucket optimizer's fetch/store (attached to each), or None."""
    if prepared is None or prepared.directory is None:
        return None
    store = OptimizerSwapper(prepared.policy, prepared.rank, prepared.directory, bucket_optimizers)
    for bo in bucket_optimizers:
        bo.attach_store(store)
    return store


__all__ = ["AioPolicy", "GradSpill", "HostParamStore", "HostParams", "HostTier", "OffloadPolicy", "OptimizerOffload",
           "ParamSwapper", "attach_optimizer_store", "make_grad_spill", "make_host_tier", "make_param_store",
           "parse_aio", "parse_offload", "prepare_optimizer_store", "prepare_param_store"]
