"""The typed save and load plans an adapter (adapters.py) hands to save, load and DCP.

Save: a list of `Piece` (plus `LazyPieces` items whose pieces exist only while resident).
Load: `Destination`s (in memory, copied into after every rank has read everything),
`OptimizerRange`s (the optimizer state this rank owns, by segment), `OffloadedBucket`s (a bucket
whose shard lives in a parameter swap file: its new shard is staged as a side record) and
`StreamedBucket`s (a bucket whose optimizer state, and master where it is a copy, lives in the
optimizer's swap records: read and staged one bucket at a time).

All are NamedTuples: positional unpacking keeps working, fields say what each number is.
Element ranges [lo, hi) are in the flat (reshape(-1)) coordinates of the named tensor's global
value; shard ranges [shard_lo, shard_hi) in the bucket's shard on this rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Piece(NamedTuple):
    """Elements [lo, hi) of value `key` ("param", "value" for a buffer, or an optimizer state key
    such as "exp_avg") of tensor `name`, held by `tensor` (1-D, hi - lo elements)."""
    name: str
    key: str
    lo: int
    hi: int
    tensor: torch.Tensor


class Destination(NamedTuple):
    """Where a load puts elements [lo, hi) of tensor `name` held in memory (`tensor`, 1-D)."""
    name: str
    lo: int
    hi: int
    tensor: torch.Tensor


class OptimizerRange(NamedTuple):
    """Elements [lo, hi) of parameter `name` whose optimizer state is segment `segment` of the
    engine's sharded state dict (its "state" key)."""
    segment: int
    name: str
    lo: int
    hi: int


class ShardRange(NamedTuple):
    """Elements [lo, hi) of parameter `name`, at [shard_lo, shard_hi) of its bucket's shard."""
    name: str
    lo: int
    hi: int
    shard_lo: int
    shard_hi: int


class OffloadedBucket(NamedTuple):
    """A bucket whose shard lives in a parameter swap file, and the ranges a load replaces."""
    bucket: Any               # layout.Bucket
    ranges: list[ShardRange]


class StreamedSegment(NamedTuple):
    """One segment of a streamed bucket: OptimizerRange's fields and the segment object."""
    segment: int
    name: str
    lo: int
    hi: int
    seg: Any                  # bucket_optimizer.Segment


class StreamedBucket(NamedTuple):
    """A bucket whose optimizer state (and master, where it is a copy) lives in swap records."""
    optimizer: Any            # bucket_optimizer.BucketOptimizer
    segments: list[StreamedSegment]
