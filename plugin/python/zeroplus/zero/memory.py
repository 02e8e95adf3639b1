"""Model-state memory: what this rank holds (memory_report) and what the ZeRO formulas predict
(estimate_memory).

Categories (bytes on this rank):
  parameters             the model's parameters (flat buffers included, padding included)
  gradients              gradient storage that persists between backward and step
  master_parameters      fp32 master copies separate from the parameters (mixed precision)
  optimizer_state        the optimizer's state tensors (only the owned shard at stages 1-3)
  communication_buffers  bucket buffers alive right now (transient: empty at rest)
  pooled_buffers         stages 2-3: released bucket inputs and gather buffers kept for reuse by
                         the next step (never more than the peak of the buffers in use at once)
  gathered_parameters    stage 3: full parameters gathered right now (0 between steps)
  peak_gathered_parameters  stage 3: the most gathered at once so far (prefetch included)
  peak_communication_buffers  stages 2-3: the most reduce-scatter inputs/outputs taken at once so far
  model_state            parameters + gradients + master_parameters + optimizer_state
  offload_buffers        with offload_optimizer on NVMe: the swapper's pooled record buffers
                         (optimizer state in memory while a bucket is read, stepped or written)
  offload_peak_buffers   the most such buffers held at once so far
  offload_disk           bytes the swap files take on disk
  offload_param_buffers  stage 3 with offload_param on NVMe: the parameter swapper's pooled shard
                         buffers (the only parameter shards in memory; gathered units are counted
                         in gathered_parameters)
  offload_param_peak_buffers  the most such buffers held at once so far
  offload_param_disk     bytes the parameter swap files take on disk
"""

from __future__ import annotations

import torch

from .dtensor_params import local
from .layout import is_rest_storage
from .policies import DEFAULT_REDUCE_BUCKET_ELEMS

_BYTES = {None: 4, "fp32": 4, "bf16": 2, "fp16": 2}
_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "sgd_nomomentum": 0, "adagrad": 4}


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        s = local(t).untyped_storage()  # a tensor-parallel parameter: its local piece
        if is_rest_storage(s.data_ptr()):
            continue  # a resting stage-3 parameter: its shard is counted by the engine
        key = (s.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _state_tensors(state) -> list[torch.Tensor]:
    return [v for st in state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def memory_report(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """This rank's model-state bytes. `optimizer` is what zeroplus.initialize returned (or a
    zeroplus/torch ZeroRedundancyOptimizer, or any torch optimizer for comparison)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"memory_report: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"memory_report: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = list(model.parameters())
    views = getattr(optimizer, "grad_views", None)  # the engine's p.grad views: counted by the engine
    grads = [p.grad for p in params if views is None or not views.owns(p)]
    report = {"parameters": _storage_bytes(params), "gradients": _storage_bytes(grads),
              "master_parameters": 0, "optimizer_state": 0, "communication_buffers": 0, "pooled_buffers": 0}
    if hasattr(optimizer, "memory_bytes"):  # a zeroplus ZeRO engine (stages 1-3)
        ours = optimizer.memory_bytes()
        report["gradients"] += ours["gradients"]
        report["master_parameters"] = ours["master_parameters"]
        report["optimizer_state"] = ours["optimizer_state"]
        report["communication_buffers"] = ours["communication_buffers"]
        report["pooled_buffers"] = ours["pooled_buffers"]
        report["parameters"] += ours.get("parameter_shards", 0)  # stage 3: what resting parameters hold
        for key in ("gathered_parameters", "peak_gathered_parameters", "peak_communication_buffers",
                    "offload_buffers", "offload_peak_buffers", "offload_disk", "offload_param_buffers",
                    "offload_param_peak_buffers", "offload_param_disk",
                    "offload_host_staging", "offload_host_grads"):  # stage 3; offload
            if key in ours:
                report[key] = ours[key]
    else:
        local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer there
        report["optimizer_state"] = _tensor_bytes(_state_tensors(local.state))
    report["model_state"] = sum(report[k] for k in ("parameters", "gradients", "master_parameters", "optimizer_state"))
    return report


def optimizer_bytes(opt) -> dict[str, int]:
    param_ptrs = {t.untyped_storage().data_ptr() for b in opt.buckets for t in (b.flat, b.shard) if t is not None}
    masters = [m for m in opt.masters if m.untyped_storage().data_ptr() not in param_ptrs]
    out = {"gradients": _tensor_bytes(opt.reducer.accum), "master_parameters": _tensor_bytes(masters),
           "optimizer_state": _tensor_bytes([t for bo in opt.bucket_optimizers for t in bo.state_tensors()]),
           "communication_buffers": opt.reducer.communication_bytes(),
           "pooled_buffers": opt.reducer.pool.pooled_bytes,
           "peak_communication_buffers": opt.reducer.pool.peak_bytes}
    tier = getattr(opt, "host_tier", None)
    if tier is not None:  # CUDA offload: masters and state above are in host memory, and so are these
        out["offload_host_staging"] = tier.staging_bytes  # the gradient buffers and the upload buffers
        out["offload_host_grads"] = tier.grad_bytes       # of which the per-bucket gradient buffers
    store = getattr(opt, "offload", None)
    if store is not None:
        out.update(offload_buffers=store.buffer_bytes, offload_peak_buffers=store.peak_buffer_bytes,
                   offload_disk=store.disk_bytes())
    return out


def estimate_memory(num_params, world_size: int, stage: int, mixed_precision: str | None = None,
                    optimizer: str = "adam", offload_optimizer: str = "none", buffer_count: int = 4,
                    bucket_elems: int = DEFAULT_REDUCE_BUCKET_ELEMS, offload_param: str = "none",
                    param_buffer_count: int = 5, param_buffer_size: int = 100_000_000,
                    device: str = "cpu") -> dict[str, float]:
    """Model-state bytes per rank by the ZeRO paper's accounting: parameters and gradients in the
    compute dtype (2 bytes with mixed precision, else 4), an fp32 master copy only with mixed
    precision (4), optimizer state (Adam: 8). Stage 1 shards master + state, stage 2 also
    gradients, stage 3 also parameters. Mixed-precision Adam gives 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N.

    offload_optimizer="nvme" (stages 1-3) adds the columns of docs/offload.md: `nvme` (bytes of
    the swap files: master, with mixed precision, and optimizer state, plus a 4 KiB header per
    bucket), `offload_buffers` (the swapper's pool in memory: buffer_count records of a bucket of
    bucket_elems elements: reduce_bucket_size, or the largest parameter when one is larger; at
    stage 3 the largest gather unit's elements) and `resident`
    (model state left in memory + offload_buffers). "cpu" on CPU training changes nothing
    (`nvme` 0, `resident` = model_state).

    offload_param="nvme" (stage 3 only) moves the parameter shards (compute dtype) and their
    gradient shards to the swap files too: `nvme` adds the parameters and twice the gradients (two
    gradient files per bucket, docs/offload.md) (+ 4 KiB per record), `offload_param_buffers` is
    the parameter swapper's pool (param_buffer_count buffers of param_buffer_size elements, each
    at least one record of the largest gather unit's shard, bucket_elems elements; at most every
    record: the pool caches them) and `resident` drops parameters and gradients and adds that pool.

    device="cuda" (training on a GPU) adds what is where: `gpu` (GPU memory) and `host` (host
    memory). Without offload everything is on the GPU. offload_optimizer "cpu" or "nvme" (the host
    tier, docs/offload.md "ZeRO-Offload") leaves parameters and gradients on the GPU and puts on the
    host an fp32 master shard in every precision (in fp32 too: the host keeps its own copy) with
    the optimizer state ("cpu") or the swapper's buffers ("nvme", whose files then hold that master
    and the state), plus a host copy of this rank's gradient shards (one pinned buffer per bucket,
    which backward's copies land in: g * psi / n) and 2 upload buffers (a bucket's parameter
    shard each); `resident` is gpu + host. device="cpu": `gpu` 0, `host` = `resident`.
    offload_param on CUDA training (stage 3, docs/offload.md "Parameter offload on CUDA training")
    moves the parameter shards off `gpu`: "cpu" to `host`; "nvme" to `nvme` (+ 4 KiB per record)
    with the swapper's pool (`offload_param_buffers`) in `host`. "nvme" with offload_optimizer
    also spills the gradient shards, as on CPU training: off `gpu` and out of the host tier's
    per-bucket gradient buffers, into `nvme` (two files per bucket); without offload_optimizer
    they stay on the GPU (the step runs there). Without offload_optimizer an fp32 run then keeps a
    separate fp32 master shard on the GPU (the shard is no longer the master), so `gpu` only drops
    in mixed precision. The gathered
    units (the unit computing and the prefetch) are working memory, not model state, and are not
    counted. offload_param="cpu" on CPU training changes nothing."""
    if isinstance(num_params, bool) or not isinstance(num_params, (int, float)) or num_params < 0:
        raise ValueError(f"estimate_memory: num_params must be a non-negative number, got {num_params!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"estimate_memory: world_size must be an int >= 1, got {world_size!r}")
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"estimate_memory: stage must be 0, 1, 2 or 3, got {stage!r}")
    if mixed_precision not in _BYTES:
        raise ValueError(f"estimate_memory: mixed_precision must be None, 'bf16' or 'fp16', got {mixed_precision!r}")
    if optimizer not in _STATE_BYTES:
        raise ValueError(f"estimate_memory: optimizer must be one of {sorted(_STATE_BYTES)}, got {optimizer!r}")
    if offload_optimizer not in ("none", "cpu", "nvme"):
        raise ValueError(f"estimate_memory: offload_optimizer must be 'none', 'cpu' or 'nvme', got {offload_optimizer!r}")
    if offload_param not in ("none", "cpu", "nvme"):
        raise ValueError(f"estimate_memory: offload_param must be 'none', 'cpu' or 'nvme', got {offload_param!r}")
    if offload_param != "none" and stage != 3:
        raise ValueError(f"estimate_memory: offload_param applies to stage 3 only, got stage={stage!r}")
    if offload_optimizer == "nvme" and stage == 0:
        raise ValueError("estimate_memory: offload_optimizer='nvme' needs a ZeRO stage (1-3), got stage=0")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"estimate_memory: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and offload_optimizer != "none" and stage == 0:
        raise ValueError(f"estimate_memory: offload_optimizer={offload_optimizer!r} on CUDA needs a ZeRO stage (1-3), "
                         f"got stage=0")
    for key, value in (("buffer_count", buffer_count), ("bucket_elems", bucket_elems),
                       ("param_buffer_count", param_buffer_count), ("param_buffer_size", param_buffer_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"estimate_memory: {key} must be an int >= 1, got {value!r}")
    n, psi = world_size, float(num_params)
    p = g = _BYTES[mixed_precision]
    m = 4 if mixed_precision in ("bf16", "fp16") else 0
    k = _STATE_BYTES[optimizer]
    shard = {"parameters": stage >= 3, "gradients": stage >= 2, "master_parameters": stage >= 1,
             "optimizer_state": stage >= 1}
    per = {"parameters": p, "gradients": g, "master_parameters": m, "optimizer_state": k}
    out = {key: psi * per[key] / (n if shard[key] else 1) for key in per}
    out["model_state"] = sum(out.values())
    if offload_optimizer == "nvme":
        moved = out["master_parameters"] + out["optimizer_state"]
        buckets = -(-psi // bucket_elems) if psi else 0
        shard = -(-bucket_elems // n)
        out["nvme"] = moved + 4096 * buckets
        record = -(-(4096 + shard * (m + k)) // 4096) * 4096  # buffers are whole pages
        out["offload_buffers"] = float(min(buffer_count, max(buckets, 1)) * record)
        out["resident"] = out["model_state"] - moved + out["offload_buffers"]
    else:
        out["nvme"], out["offload_buffers"], out["resident"] = 0.0, 0.0, out["model_state"]
    out["offload_param_buffers"] = 0.0
    if offload_param == "nvme":
        buckets = -(-psi // bucket_elems) if psi else 0
        record = -(-(4096 + -(-bucket_elems // n) * p) // 4096) * 4096
        buffer = max(record, -(-param_buffer_size * p // 4096) * 4096)
        every_record = max(out["parameters"] + 4096 * buckets, record)
        out["offload_param_buffers"] = float(min(param_buffer_count * buffer, every_record))
        out["nvme"] += out["parameters"] + 2 * out["gradients"] + 3 * 4096 * buckets
        out["resident"] += out["offload_param_buffers"] - out["parameters"] - out["gradients"]
    param_nvme = 0.0
    grads_spilled = device == "cuda" and offload_param == "nvme" and offload_optimizer != "none"
    if device == "cuda" and offload_param == "nvme":
        # the parameter records go to the files; the gradient files too when the step is on the host
        buckets = -(-psi // bucket_elems) if psi else 0
        out["nvme"] -= out["parameters"] + 2 * out["gradients"] + 3 * 4096 * buckets
        param_nvme = out["parameters"] + 4096 * buckets
        if grads_spilled:
            param_nvme += 2 * out["gradients"] + 2 * 4096 * buckets
    params_off = out["parameters"] if (device == "cuda" and offload_param != "none") else 0.0
    params_host = out["parameters"] if offload_param == "cpu" else out["offload_param_buffers"]
    if device == "cpu":
        out["gpu"], out["host"] = 0.0, out["resident"]
    elif offload_optimizer == "none":
        apart = 4 * psi / n if (params_off and m == 0) else 0.0  # fp32: a master of its own
        out["gpu"] = out["model_state"] - params_off + apart
        out["host"] = params_host if params_off else 0.0
        out["nvme"] += param_nvme
        out["resident"] = out["gpu"] + out["host"]
    else:
        host_master = 4 * psi / n  # the host tier's own fp32 master shard, in every precision
        shard = -(-min(bucket_elems, max(psi, 1)) // n)
        # every bucket's gradient shard (none when they are spilled), 2 upload buffers
        staging = (0.0 if grads_spilled else g * psi / n) + 2 * shard * p
        # Gradients live on the host (host_tier.py) or in files (spilled): on the GPU only a
        # bucket's (its shard; at stage 1 the whole bucket) from its reduction until its copy
        # down has read it.
        live_grad = g * (shard if stage >= 2 else min(bucket_elems, max(psi, 1)))
        out["gpu"] = out["parameters"] + live_grad
        if offload_optimizer == "cpu":
            out["host"] = host_master + out["optimizer_state"] + staging
        else:  # the swapper's records hold the master and the state
            buckets = -(-psi // bucket_elems) if psi else 0
            record = -(-(4096 + -(-bucket_elems // n) * (4 + k)) // 4096) * 4096
            out["offload_buffers"] = float(min(buffer_count, max(buckets, 1)) * record)
            out["nvme"] = host_master + out["optimizer_state"] + 4096 * buckets
            out["host"] = out["offload_buffers"] + staging
        if params_off:  # the parameter shards live in host memory or (nvme) the swapper's files
            out["gpu"] -= params_off
            out["host"] += params_host
            out["nvme"] += param_nvme
        out["resident"] = out["gpu"] + out["host"]
    return out
