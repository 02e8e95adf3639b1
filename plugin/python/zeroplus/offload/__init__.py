"""Offload: optimizer state (and, later, stage-3 parameters) kept outside the engine's memory.

    policy.py      OffloadPolicy / AioPolicy: the knobs, parsed from kwargs or a DeepSpeed config
    nvme_store.py  one rank's private swap directory and its exclusively created files
    record.py      one bucket's swap record: header (generation, checksums) + payload
    swapper.py     the pipelined NVMe swapper behind BucketOptimizer.fetch/store

The ZeRO engines call prepare_optimizer_store() before changing anything (checks, the swap
directory) and attach_optimizer_store() once their bucket optimizers exist.
See docs/offload.md.
"""

from __future__ import annotations

import torch

from .nvme_store import SwapDirectory
from .policy import AioPolicy, OffloadPolicy, parse_aio, parse_offload
from .swapper import OptimizerSwapper


def prepare_optimizer_store(policy: OffloadPolicy, param_policy: OffloadPolicy, rank: int, device: torch.device,
                            who: str):
    """Checks the offload settings against the training device and creates this rank's swap
    directory, before the engine changes anything; returns what attach_optimizer_store needs
    (None: optimizer state stays in memory).

    device 'cpu' on CPU training is a no-op, for the optimizer state and for the parameters:
    they are in host memory already. Offload of CUDA training and parameter offload to NVMe are
    refused (not built)."""
    if param_policy.device == "nvme" or (param_policy.device == "cpu" and device.type != "cpu"):
        raise NotImplementedError(f"{who}: offload_param device {param_policy.device!r} with parameters on "
                                  f"{device.type} is not built yet (parameter offload); nothing was changed")
    if not policy.enabled:
        return None
    if device.type != "cpu":
        raise NotImplementedError(f"{who}: offload_optimizer device {policy.device!r} with parameters on "
                                  f"{device.type} is not built yet (the CUDA offload path); nothing was changed")
    if policy.device == "cpu":
        return None  # CPU training: optimizer state is in CPU memory already (docs/offload.md)
    return (policy, rank, SwapDirectory(policy.nvme_path, rank, policy.what))


def attach_optimizer_store(prepared, bucket_optimizers: list):
    """The store behind every bucket optimizer's fetch/store (attached to each), or None."""
    if prepared is None:
        return None
    policy, rank, directory = prepared
    store = OptimizerSwapper(policy, rank, directory, bucket_optimizers)
    for bo in bucket_optimizers:
        bo.attach_store(store)
    return store


__all__ = ["AioPolicy", "OffloadPolicy", "attach_optimizer_store", "parse_aio", "parse_offload",
           "prepare_optimizer_store"]
