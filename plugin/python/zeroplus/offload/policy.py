"""Offload policies: where optimizer state (and, at stage 3, parameters) live between steps.

Parsed once, from the keyword arguments of zeroplus.initialize (`offload_optimizer={...}`,
`offload_param={...}`) or from a DeepSpeed config (`zero_optimization.offload_optimizer` /
`.offload_param`, and the top-level `aio` block), with DeepSpeed's key names:

    device        "none" | "cpu" | "nvme"            (DeepSpeed's default: "none")
    nvme_path     directory for the swap files       (required for "nvme")
    buffer_count  pooled I/O buffers, each one bucket's record (offload_optimizer: 4; param: 5)
    pin_memory    accepted; NVMe buffers are always page-locked where RLIMIT_MEMLOCK allows
    pipeline_read / pipeline_write
                  read the next bucket while this one steps / write without waiting (default
                  true here: DeepSpeed's false only makes swapping slower)
    fast_init     accepted, no effect (records are written at the first step)
    ratio         fraction of the state offloaded; only 1.0 is built
    buffer_size   (offload_param) elements per pooled parameter buffer (DeepSpeed's 1e8): the
                  pool holds at most buffer_count x buffer_size elements of shards (never less
                  than buffer_count records), read ahead in the gatherer's prefetch order
    max_in_cpu    (offload_param) accepted, checked, no effect: every offloaded shard is on disk

The keys accepted, their defaults and DeepSpeed's other names for them come from the one table,
zeroplus.ds_keys (OFFLOAD_OPTIMIZER, OFFLOAD_PARAM, AIO). A bad value raises ValueError/TypeError
naming the key, so a typo never silently changes nothing; a key that only tunes DeepSpeed's
engine (super_offload, ...) is dropped with a UserWarning naming it. OffloadPolicy is frozen.
Nothing in this file touches the file system: nvme_store.py creates the directory when an engine
is built.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

from .. import ds_keys

DEVICES = ("none", "cpu", "nvme")
_TABLES = {"offload_optimizer": ds_keys.OFFLOAD_OPTIMIZER, "offload_param": ds_keys.OFFLOAD_PARAM}
DEFAULT_OPTIMIZER_BUFFERS = ds_keys.OFFLOAD_OPTIMIZER["buffer_count"].default  # DeepSpeed's
DEFAULT_PARAM_BUFFERS = ds_keys.OFFLOAD_PARAM["buffer_count"].default          # DeepSpeed's
DEFAULT_PARAM_BUFFER_SIZE = ds_keys.OFFLOAD_PARAM["buffer_size"].default       # elements, DeepSpeed's
DEFAULT_BLOCK_SIZE = ds_keys.AIO["block_size"].default                         # DeepSpeed's
DEFAULT_QUEUE_DEPTH = ds_keys.AIO["queue_depth"].default  # DeepNVMe's tuned optimum; DeepSpeed's config says 8


@dataclass(frozen=True)
class AioPolicy:
    """The I/O engine's knobs (DeepSpeed's top-level `aio` block; see docs/aio.md)."""
    block_size: int = DEFAULT_BLOCK_SIZE
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    threads: int = 1

    def __post_init__(self):
        for key, minimum in (("block_size", 4096), ("queue_depth", 1), ("threads", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"AioPolicy: {key} must be an int, got {value!r}")
            if value < minimum:
                raise ValueError(f"AioPolicy: {key} must be >= {minimum}, got {value!r}")

    def new_handle(self):
        """A zeroplus.aio.AioHandle with these knobs (each swapper keeps its own reader/writer)."""
        from ..aio import AioHandle  # the library loads on first use, not when a config is parsed

        return AioHandle(block_size=self.block_size, queue_depth=self.queue_depth, threads=self.threads)


@dataclass(frozen=True)
class OffloadPolicy:
    """Where one kind of state lives between steps. `what` is "offload_optimizer" or
    "offload_param" (used in error messages and to pick the defaults)."""
    what: str = "offload_optimizer"
    device: str = ds_keys.OFFLOAD_COMMON["device"].default
    nvme_path: str | None = None
    buffer_count: int = DEFAULT_OPTIMIZER_BUFFERS
    buffer_size: int = DEFAULT_PARAM_BUFFER_SIZE  # elements per parameter buffer (offload_param)
    pin_memory: bool = ds_keys.OFFLOAD_COMMON["pin_memory"].default
    pipeline_read: bool = ds_keys.OFFLOAD_OPTIMIZER["pipeline_read"].default
    pipeline_write: bool = ds_keys.OFFLOAD_OPTIMIZER["pipeline_write"].default
    aio: AioPolicy = AioPolicy()

    def __post_init__(self):
        if self.what not in ("offload_optimizer", "offload_param"):
            raise ValueError(f"OffloadPolicy: what must be 'offload_optimizer' or 'offload_param', got {self.what!r}")
        w = self.what
        if self.device not in DEVICES:
            raise ValueError(f"{w}: device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.device == "nvme":
            if self.nvme_path is None:
                raise ValueError(f"{w}: device 'nvme' needs nvme_path (a directory for the swap files)")
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, os.PathLike)):
                raise TypeError(f"{w}: nvme_path must be a str or os.PathLike, got {type(self.nvme_path).__name__}")
            path = os.fspath(self.nvme_path)
            if not path or "\0" in path:
                raise ValueError(f"{w}: nvme_path must be a non-empty path, got {path!r}")
            object.__setattr__(self, "nvme_path", path)
        count = self.buffer_count
        if isinstance(count, bool) or not isinstance(count, (int, float)) or not math.isfinite(count) \
                or count != int(count) or count < 1:
            raise ValueError(f"{w}: buffer_count must be an integer >= 1, got {count!r}")
        object.__setattr__(self, "buffer_count", int(count))
        size = self.buffer_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not math.isfinite(size) \
                or size != int(size) or size < 1:
            raise ValueError(f"{w}: buffer_size must be an integer >= 1 (elements), got {size!r}")
        object.__setattr__(self, "buffer_size", int(size))
        for key in ("pin_memory", "pipeline_read", "pipeline_write"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"{w}: {key} must be true or false, got {getattr(self, key)!r}")
        if not isinstance(self.aio, AioPolicy):
            raise TypeError(f"{w}: aio must be an AioPolicy, got {type(self.aio).__name__}")

    @property
    def enabled(self) -> bool:
        return self.device != "none"


def _number(what: str, key: str, value, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{what}: {key} must be a number >= {minimum:g}, got {value!r}")
    return value


def _known(what: str, path: tuple, block: dict) -> dict:
    """`block` with DeepSpeed's other names renamed (ds_keys aliases) and the keys that only tune
    DeepSpeed's engine dropped (one UserWarning names them); an unknown key raises ValueError
    naming it and the closest known one, a refused value (use_gds: true) ValueError naming it."""
    section = ds_keys.table(path)
    unknown = sorted(set(block) - set(section))
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown} (did you mean {ds_keys.closest(unknown[0], section)!r}?); "
                         f"known: {sorted(section)}")
    block = ds_keys.canonical(path, block, section, prefix=f"{what}: ")
    ignored = [k for k in block if section[k].role == "internal"]
    if ignored:
        warnings.warn(f"zeroplus: DeepSpeed {what} keys with no effect in zeroplus (they tune DeepSpeed's own engine), "
                      f"ignored: {', '.join(ignored)}", UserWarning, stacklevel=3)
    for key, value in block.items():
        spec = section[key]
        if spec.refuse is not None and type(value) is type(spec.refuse) and value == spec.refuse:
            raise ValueError(f"{what}: {key}={ds_keys.json_value(value)} is not supported: {spec.doc}")
    return {k: v for k, v in block.items() if k not in ignored}


def parse_aio(block) -> AioPolicy:
    """The DeepSpeed `aio` block (None: defaults)."""
    if block is None:
        return AioPolicy()
    if not isinstance(block, dict):
        raise TypeError(f"aio: must be a dict, got {type(block).__name__}")
    block = _known("aio", ("aio",), block)
    for key in (k for k in block if ds_keys.AIO[k].kind == ds_keys.BOOL):
        if not isinstance(block[key], bool):
            raise TypeError(f"aio: {key} must be true or false, got {block[key]!r}")
    values = {"block_size": block.get("block_size", DEFAULT_BLOCK_SIZE),
              "queue_depth": block.get("queue_depth", DEFAULT_QUEUE_DEPTH),
              "threads": block.get("intra_op_parallelism", ds_keys.AIO["intra_op_parallelism"].default)}
    for key, value in values.items():
        name = "intra_op_parallelism" if key == "threads" else key
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value != int(value):
            raise ValueError(f"aio: {name} must be an integer, got {value!r}")
    try:
        return AioPolicy(**{k: int(v) for k, v in values.items()})
    except (TypeError, ValueError) as e:
        raise type(e)(f"aio: {str(e).removeprefix('AioPolicy: ')}") from e


def parse_offload(what: str, block, aio: AioPolicy | None = None) -> OffloadPolicy:
    """OffloadPolicy from a kwargs/config dict with DeepSpeed's keys (None: no offload)."""
    if what not in ("offload_optimizer", "offload_param"):
        raise ValueError(f"parse_offload: what must be 'offload_optimizer' or 'offload_param', got {what!r}")
    aio = AioPolicy() if aio is None else aio
    if block is None:
        return OffloadPolicy(what=what, buffer_count=_default_buffers(what), aio=aio)
    if isinstance(block, OffloadPolicy):
        if block.what != what:
            raise ValueError(f"{what}: got an OffloadPolicy for {block.what!r}")
        return block
    if not isinstance(block, dict):
        raise TypeError(f"{what}: must be a dict (DeepSpeed's keys) or None, got {type(block).__name__}")
    block = _known(what, ("zero_optimization", what), block)
    device = block.get("device", _TABLES[what]["device"].default)
    if device is None:
        device = "none"
    if not isinstance(device, str):
        raise TypeError(f"{what}: device must be a string, got {device!r}")
    if what == "offload_optimizer":
        ratio = _number(what, "ratio", block.get("ratio", _TABLES[what]["ratio"].default), 0.0)
        if ratio != 1.0:
            raise ValueError(f"{what}: ratio={ratio!r}: partial offload is not built; only 1.0 (everything) is")
        if "fast_init" in block and not isinstance(block["fast_init"], bool):
            raise TypeError(f"{what}: fast_init must be true or false, got {block['fast_init']!r}")
        if "pipeline" in block and not isinstance(block["pipeline"], bool):
            raise TypeError(f"{what}: pipeline must be true or false, got {block['pipeline']!r}")
    else:
        _number(what, "max_in_cpu", block.get("max_in_cpu", _TABLES[what]["max_in_cpu"].default), 0)
    pipeline = block.get("pipeline")
    try:
        return OffloadPolicy(what=what, device=device.lower(), nvme_path=block.get("nvme_path"),
                             buffer_count=block.get("buffer_count", _default_buffers(what)),
                             buffer_size=block.get("buffer_size", DEFAULT_PARAM_BUFFER_SIZE),
                             pin_memory=block.get("pin_memory", OffloadPolicy.pin_memory),
                             pipeline_read=block.get("pipeline_read", OffloadPolicy.pipeline_read if pipeline is None
                                                     else pipeline),
                             pipeline_write=block.get("pipeline_write", OffloadPolicy.pipeline_write if pipeline is None
                                                      else pipeline), aio=aio)
    except TypeError as e:
        raise TypeError(str(e)) from None


def _default_buffers(what: str) -> int:
    return DEFAULT_OPTIMIZER_BUFFERS if what == "offload_optimizer" else DEFAULT_PARAM_BUFFERS
