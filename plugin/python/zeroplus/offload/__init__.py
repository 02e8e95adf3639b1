"""Offload: optimizer state and stage-3 parameters kept outside the engine's memory.

    policy.py      OffloadPolicy / AioPolicy: the knobs, parsed from kwargs or a DeepSpeed config
    nvme_store.py  one rank's private swap directory and its exclusively created files
    record.py      one bucket's swap record: header (generation, checksums) + payload
    swapper.py     the pipelined NVMe swapper behind BucketOptimizer.fetch/store
    param_swapper.py  the NVMe parameter-shard swapper behind the stage-3 gatherer and publish
    grad_spill.py  gradient shards of those parameters, in files between backward and step
    io_lanes.py    reads that complete one by one (a lane each), checked off the training thread

The ZeRO engines call prepare_optimizer_store() before changing anything (checks, the swap
directory) and attach_optimizer_store() once their bucket optimizers exist; stage 3 calls
prepare_param_store() likewise and make_param_store() once its buckets are planned.
See docs/offload.md.
"""

from __future__ import annotations

import torch

from .nvme_store import SwapDirectory
from .policy import AioPolicy, OffloadPolicy, parse_aio, parse_offload
from .grad_spill import GradSpill
from .param_swapper import ParamSwapper
from .swapper import OptimizerSwapper


def prepare_optimizer_store(policy: OffloadPolicy, param_policy: OffloadPolicy, rank: int, device: torch.device,
                            who: str):
    """Checks the offload settings against the training device and creates this rank's swap
    directory, before the engine changes anything; returns what attach_optimizer_store needs
    (None: optimizer state stays in memory).

    device 'cpu' on CPU training is a no-op, for the optimizer state and for the parameters:
    they are in host memory already. Offload of CUDA training is refused (not built); parameter
    offload to NVMe is prepare_param_store's."""
    if param_policy.enabled and device.type != "cpu":
        raise NotImplementedError(f"{who}: offload_param device {param_policy.device!r} with parameters on "
                                  f"{device.type} is not built yet (the CUDA offload path); nothing was changed")
    if not policy.enabled:
        return None
    if device.type != "cpu":
        raise NotImplementedError(f"{who}: offload_optimizer device {policy.device!r} with parameters on "
                                  f"{device.type} is not built yet (the CUDA offload path); nothing was changed")
    if policy.device == "cpu":
        return None  # CPU training: optimizer state is in CPU memory already (docs/offload.md)
    return (policy, rank, SwapDirectory(policy.nvme_path, rank, policy.what))


def prepare_param_store(policy: OffloadPolicy, stage: int, rank: int, device: torch.device, who: str):
    """Checks offload_param against the stage and device and creates this rank's parameter swap
    directory; returns what make_param_store needs (None: parameters stay in memory; device
    'cpu' on CPU training is a no-op, like offload_optimizer's)."""
    if not policy.enabled:
        return None
    if stage != 3:
        raise ValueError(f"{who}: offload_param applies to ZeRO stage 3 only (parameters are sharded there), "
                         f"got stage {stage}")
    if device.type != "cpu":
        raise NotImplementedError(f"{who}: offload_param device {policy.device!r} with parameters on "
                                  f"{device.type} is not built yet (the CUDA offload path); nothing was changed")
    if policy.device == "cpu":
        return None  # CPU training: the shards are in CPU memory already (docs/offload.md)
    return (policy, rank, SwapDirectory(policy.nvme_path, rank, policy.what))


def make_param_store(prepared, buckets: list):
    """The ParamSwapper for these (non-persistent stage-3) buckets, or None."""
    if prepared is None:
        return None
    policy, rank, directory = prepared
    return ParamSwapper(policy, rank, directory, buckets)


def make_grad_spill(param_store: ParamSwapper, buckets: dict):
    """The GradSpill for these reducer buckets ({index: (dtype, shard_numel)}), in the parameter
    store's directory."""
    return GradSpill(param_store.policy, param_store.rank, param_store.directory, buckets)


def attach_optimizer_store(prepared, bucket_optimizers: list):
    """The store behind every bucket optimizer's fetch/store (attached to each), or None."""
    if prepared is None:
        return None
    policy, rank, directory = prepared
    store = OptimizerSwapper(policy, rank, directory, bucket_optimizers)
    for bo in bucket_optimizers:
        bo.attach_store(store)
    return store


__all__ = ["AioPolicy", "GradSpill", "OffloadPolicy", "ParamSwapper", "make_grad_spill", "attach_optimizer_store", "make_param_store", "parse_aio",
           "parse_offload", "prepare_optimizer_store", "prepare_param_store"]
