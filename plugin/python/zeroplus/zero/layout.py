"""Flat sharded buffers for ZeRO stages 2 and 3: which parameter lives where.

The bucket cuts come from the C++ planner (op zeroplus::plan_flat_buckets, torch-free code in
optimizers/core/flat_bucket_planner.hpp). This module only turns that plan into tensors:

  * one flat parameter buffer per bucket, in the compute dtype; every managed parameter's .data
    becomes a view into it, so the post-step all-gather writes the model's parameters directly;
  * rank r owns elements [r * shard_numel, (r + 1) * shard_numel) of every bucket;
  * stage 3 between uses: a parameter holds no values. Its .data is a "resting view": its full
    shape, dtype and device as a stride-0 expansion of one element (resting_view), so the lines a
    DDP script runs between steps (sum(p.numel() ...), p.shape, p.dim(), p.dtype, p.device) give
    what they give under DDP, memory is one element per (dtype, device), and values read are NaN
    (never plausible numbers). Its values live in the bucket's `shard`, which the engine reads;
    nothing in the engine reads a resting parameter's .data.

Parameters are ordered for the planner in reverse registration order, group by group from the
last group: gradients become ready roughly in that order during backward (DDP's heuristic), and a
bucket is reduced as soon as all its gradients are in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dtensor_params import is_tp_sharded, local, show_local

# Shard starts are multiples of this many elements: 64 bytes of fp32, the SIMD kernels' width.
ALIGN_ELEMS = 16

# (dtype, device) -> the one element every resting view of that dtype and device expands.
_REST_BASES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _rest_value(dtype: torch.dtype):
    """What a resting parameter reads as: NaN where the dtype has it, else an unlikely value."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min


def _rest_base(dtype: torch.dtype, device) -> torch.Tensor:
    key = (dtype, torch.device(device))
    base = _REST_BASES.get(key)
    if base is None:
        base = torch.full((1,), _rest_value(dtype), dtype=dtype, device=device)
        _REST_BASES[key] = base
        _REST_BASES.setdefault((dtype, base.device), base)  # "cuda" and "cuda:0" name one base
        _REST_STORAGES.add(base.untyped_storage().data_ptr())
    return base


_REST_STORAGES: set[int] = set()  # data_ptr of every base's storage


def is_rest_storage(data_ptr: int) -> bool:
    """Whether a storage's data_ptr is a resting view's (the saved-tensor hook's check)."""
    return data_ptr in _REST_STORAGES


def resting_view(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A stage-3 parameter's .data between uses: `shape` with stride 0 over one shared element.
    torch refuses most in-place writes into it (one memory location for many elements); the
    writes it allows (fill_, zero_, any write to a one-element shape) are caught by
    Bucket.stray_at_rest through the parameter's version counter or the element's value."""
    return _rest_base(dtype, device).expand(shape)


def is_resting(t: torch.Tensor, shape=None) -> bool:
    """Whether `t` is a resting view (of `shape`, when given)."""
    base = _REST_BASES.get((t.dtype, t.device))
    if base is None or t.layout != torch.strided:
        return False
    if t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return False
    return shape is None or tuple(t.shape) == tuple(shape)


def rest_base_intact(dtype: torch.dtype, device) -> bool:
    """False when the shared element of (dtype, device) was written (p.data.fill_(...) between
    steps: torch allows fill_ into an expanded tensor). Read on CPU only: on CUDA the read would
    stall the host at every gather (docs/zero.md says what is not caught there)."""
    base = _REST_BASES.get((dtype, torch.device(device)))
    if base is None or base.device.type != "cpu":
        return True
    value = _rest_value(dtype)
    return bool(torch.isnan(base).all()) if value != value else bool((base == value).all())


def repair_rest_base(dtype: torch.dtype, device) -> None:
    """Give the shared element of (dtype, device) back its value after a write was reported, so
    other parameters read NaN again (the written parameter's own version stays moved)."""
    base = _REST_BASES.get((dtype, torch.device(device)))
    if base is not None:
        base.fill_(_rest_value(dtype))


@dataclass(frozen=True)
class Stray:
    """A resting parameter the user changed (Bucket.stray_at_rest): `param` is None when only the
    shared element shows a write (which parameter's cannot be told)."""
    param: torch.nn.Parameter | None
    how: str  # "replaced": .data is no longer its resting view; "written": written in place


@dataclass
class Entry:
    param: torch.nn.Parameter
    offset: int  # inside the bucket
    numel: int
    shape: torch.Size = torch.Size()  # the parameter's full shape; its local shape for a
    # tensor-parallel (DTensor) parameter: the engine only ever sees local tensors


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one rank's shard of its bucket (empty: numel 0)."""
    shard_lo: int  # [shard_lo, shard_hi) in shard coordinates (0..shard_numel)
    shard_hi: int
    param_lo: int  # the same elements in the flattened parameter
    param_hi: int

    @property
    def numel(self) -> int:
        return self.shard_hi - self.shard_lo


@dataclass
class Bucket:
    index: int
    group: int              # param group index
    dtype: torch.dtype      # compute dtype of its parameters and gradients
    device: torch.device
    numel: int              # padded
    shard_numel: int
    used: int
    entries: list[Entry] = field(default_factory=list)
    flat: torch.Tensor | None = None  # the parameters' storage (numel elements); stage 3: only while gathered
    shard: torch.Tensor | None = None  # stage 3: this rank's persistent slice (shard_numel elements)
    unit: int = -1                     # stage 3: the gather unit that owns the bucket
    persistent: bool = False           # stage 3: kept whole on every rank (small parameters)
    trainable: bool = True             # stage 3: False for buckets of frozen parameters
    tp_sharded: bool = False           # its parameters are tensor-parallel shards (dtensor_params.py)
    rest_versions: list[int] = field(default_factory=list, repr=False)  # stage 3: see show_resting

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def piece(self, entry: Entry, rank: int) -> Piece:
        """The part of `entry`'s parameter inside `rank`'s shard: the one place the shard
        intersection is computed."""
        lo, hi = self.shard_range(rank)
        a, z = max(entry.offset, lo), min(entry.offset + entry.numel, hi)
        if a >= z:
            return Piece(0, 0, 0, 0)
        return Piece(a - lo, z - lo, a - entry.offset, z - entry.offset)

    # What the module sees. These are the only writers of a managed parameter's .data: the rest
    # of the engine moves bytes inside `flat` and `shard` and never swaps a parameter's storage.

    def show_full(self) -> None:
        """Every parameter of the bucket becomes its full-shape view into `flat` (stages 1-2
        always; stage 3 while the bucket is gathered)."""
        for e in self.entries:
            show_local(e.param, self.flat[e.offset:e.offset + e.numel].view(e.shape))

    def show_resting(self) -> None:
        """Stage 3 between uses: every parameter becomes its resting view (the module doc; its
        values are in `shard`). Records each parameter's version counter: an in-place write
        into the view that torch allows (fill_, zero_, torch.nn.init.zeros_) bumps it."""
        for e in self.entries:
            e.param.data = resting_view(e.shape, self.dtype, self.device)
        self.rest_versions = [e.param._version for e in self.entries]

    def stray_at_rest(self, check_base: bool = True) -> Stray | None:
        """Stage 3, a released bucket: the first parameter the user changed since show_resting
        (model.to(...), param.data = ..., an in-place write), or None. The next gather would put
        the engine's values back and drop the change silently. check_base: also read the shared
        element of the bucket's (dtype, device) (rest_base_intact)."""
        if not self.rest_versions:
            return None
        for e, version in zip(self.entries, self.rest_versions):
            if not is_resting(local(e.param), e.shape):
                return Stray(e.param, "replaced")
            if e.param._version != version:
                return Stray(e.param, "written")
        if check_base and not rest_base_intact(self.dtype, self.device):
            return Stray(None, "written")
        return None

    def rested_again(self) -> None:
        """After zeroplus's own no-op write into resting parameters (load_state_dict: torch's
        param.copy_(param), full_state.py), their version counters are the new normal."""
        if self.rest_versions:
            self.rest_versions = [e.param._version for e in self.entries]

    def stray_param(self):
        """The first parameter whose .data no longer lives in this bucket's buffers (the model was
        moved or its parameters replaced after the engine was built: model.to(...), .data = ...),
        or None. Such a parameter would silently stop training: the engine writes the buffers."""
        homes = {t.untyped_storage().data_ptr() for t in (self.flat, self.shard) if t is not None}
        for e in self.entries:
            t = local(e.param)
            if t.untyped_storage().data_ptr() not in homes and not is_resting(t, e.shape):
                return e.param
        return None

    def owned_pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(entry index, shard_lo, shard_hi) of every parameter with a part inside `rank`'s shard,
        in bucket order; alignment gaps and padding belong to no parameter and are left out."""
        pieces = []
        for i, e in enumerate(self.entries):
            pc = self.piece(e, rank)
            if pc.numel:
                pieces.append((i, pc.shard_lo, pc.shard_hi))
        return pieces


def plan_buckets(groups: list[list[torch.nn.Parameter]], world_size: int, cap_elems: int,
                 dtype_of) -> list[Bucket]:
    """Stage-2 buckets for the trainable parameters of `groups` (lists of parameters, frozen ones
    excluded by the caller). dtype_of(p) is the compute dtype p will have. Tensor-parallel shards and
    replicated parameters never share a bucket (the global norm counts them differently)."""
    items = [(g, p, (g, dtype_of(p), p.device, is_tp_sharded(p)))
             for g in reversed(range(len(groups))) for p in reversed(groups[g])]
    return [b for b, _key in plan_segments(items, world_size, cap_elems, dtype_of)]


def plan_segments(items, world_size: int, cap_elems: int, dtype_of) -> list[tuple[Bucket, object]]:
    """Buckets for `items`, a list of (param group index, parameter, key) in the order gradients
    are expected to become ready. Consecutive items with equal keys may share a bucket (the key
    must include the group, dtype and device); returns (bucket, key) pairs in bucket order."""
    segments, keys = [], {}
    for _g, _p, key in items:
        segments.append(keys.setdefault(key, len(keys)))
    numels = [local(p).numel() for _, p, _ in items]
    raw = torch.ops.zeroplus.plan_flat_buckets(numels, segments, world_size, cap_elems, ALIGN_ELEMS)
    out, pos = [], 1
    for index in range(raw[0]):
        _segment, numel, shard, used, count = raw[pos:pos + 5]
        pos += 5
        entries = []
        first_item = None
        for _ in range(count):
            i, offset, n = raw[pos:pos + 3]
            pos += 3
            first_item = items[i] if first_item is None else first_item
            entries.append(Entry(items[i][1], offset, n, local(items[i][1]).shape))
        group, first, key = first_item
        out.append((Bucket(index=index, group=group, dtype=dtype_of(first), device=first.device, numel=numel,
                           shard_numel=shard, used=used, entries=entries, tp_sharded=is_tp_sharded(first)), key))
    return out
