"""Communication accounting of a zeroplus group: calls and bytes per collective type.

    import zeroplus
    zeroplus.reset_comm_stats()                 # the default group; or reset_comm_stats(group)
    ...train a step...
    stats = zeroplus.comm_stats()               # a CommStats snapshot of this rank's counters
    stats["all_gather_into_tensor"].bytes, stats.total.calls, stats.as_dict()

The backend counts every op the group accepts, on the rank that issued it, whatever its device
(always on: two relaxed atomic adds per op). ``bytes`` is the op's message size S, the size
nccl-tests prints and DeepSpeed's comms logger logs; ``bus_bytes`` is S times the op's nccl-tests
busbw factor at the group's size, the bytes each rank moves with a bandwidth-optimal algorithm.
The definitions per op are in docs/comm_stats.md (and process_group/core/comm_stats.hpp):

    all_reduce, reduce, broadcast       S = the tensor           bus: 2(n-1)/n, 1, 1
    all_gather*, gather                 S = the whole result     bus: (n-1)/n
    reduce_scatter*, scatter            S = the whole input      bus: (n-1)/n
    all_to_all*                         S = this rank's input    bus: (n-1)/n
    *_coalesced                         S = sum over tensors     (as the plain op)
    send / recv                         S = the tensor           bus: 1
    barrier                             S = 0

A snapshot or reset taken while another thread issues ops may split one op (its call without its
bytes); take them between steps. Snapshots subtract (``after - before``) for a window's traffic,
and such differences add up.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Mapping

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class OpStats:
    """Calls and bytes of one collective type (or of all of them, CommStats.total)."""

    calls: int = 0
    bytes: int = 0  # sum of the message sizes S
    bus_bytes: float = 0.0  # sum of S x busbw factor(op, group size)

    def __add__(self, other: OpStats) -> OpStats:
        return OpStats(self.calls + other.calls, self.bytes + other.bytes, self.bus_bytes + other.bus_bytes)

    def __sub__(self, other: OpStats) -> OpStats:
        return OpStats(self.calls - other.calls, self.bytes - other.bytes, self.bus_bytes - other.bus_bytes)


@dataclasses.dataclass(frozen=True)
class CommStats:
    """One rank's counters of one group: ``ops`` holds every collective type, zeros included."""

    group_size: int
    ops: Mapping[str, OpStats]

    @property
    def total(self) -> OpStats:
        out = OpStats()
        for s in self.ops.values():
            out = out + s
        return out

    def __getitem__(self, op: str) -> OpStats:
        if op not in self.ops:
            raise KeyError(f"CommStats: unknown collective {op!r}; known: {', '.join(self.ops)}")
        return self.ops[op]

    def _combine(self, other, what: str, fn) -> CommStats:
        if not isinstance(other, CommStats):
            return NotImplemented
        if other.group_size != self.group_size or set(other.ops) != set(self.ops):
            raise ValueError(f"CommStats: can only {what} snapshots of groups of one size")
        return CommStats(self.group_size, types.MappingProxyType({k: fn(v, other.ops[k]) for k, v in self.ops.items()}))

    def __sub__(self, other: CommStats) -> CommStats:
        """The traffic between snapshot `other` and this one."""
        return self._combine(other, "subtract", lambda a, b: a - b)

    def __add__(self, other: CommStats) -> CommStats:
        """The sum of two windows' traffic (e.g. per-step differences)."""
        return self._combine(other, "add", lambda a, b: a + b)

    def as_dict(self) -> dict:
        """{op: {"calls", "bytes", "bus_bytes"}} for the ops with calls, plus "total" (JSON-ready)."""
        out = {k: dataclasses.asdict(v) for k, v in self.ops.items() if v.calls}
        out["total"] = dataclasses.asdict(self.total)
        return out


def _group(name: str, group) -> dist.ProcessGroup:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"zeroplus.{name}: group must be a ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError(f"zeroplus.{name}: torch.distributed is not initialized")
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = dist.get_backend(pg)
    if backend != "zeroplus":
        raise ValueError(f"zeroplus.{name}: group must use the zeroplus backend, got {backend!r}")
    return pg


def comm_stats(group: dist.ProcessGroup | None = None) -> CommStats:
    """This rank's calls and bytes per collective type on `group` (default: the default group)
    since the group was created or last reset."""
    pg = _group("comm_stats", group)
    names, calls, nbytes, factors = torch.ops.zeroplus.comm_stats(pg.boxed())
    ops = {str(n): OpStats(int(c), int(b), float(b) * float(f)) for n, c, b, f in zip(names, calls, nbytes, factors)}
    return CommStats(group_size=pg.size(), ops=types.MappingProxyType(ops))


def reset_comm_stats(group: dist.ProcessGroup | None = None) -> None:
    """Zeroes this rank's counters of `group` (default: the default group)."""
    torch.ops.zeroplus.reset_comm_stats(_group("reset_comm_stats", group).boxed())
