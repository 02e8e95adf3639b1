"""Which ranks of a zeroplus group share a host.

    import zeroplus
    topo = zeroplus.topology()          # the default group; or zeroplus.topology(group)
    topo.host_count, topo.local_ranks, topo.leaders

A host is one kernel with one ``/dev/shm`` (docs/backend.md, "Multi-host"): the backend
exchanges a host identity through the store when the group is created, so two containers with
the same host name but separate ``/dev/shm`` are two hosts. All ranks are group ranks.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Topology:
    host_count: int
    host_of: tuple[int, ...]  # host index of every group rank; host 0 holds rank 0
    host_names: tuple[str, ...]  # host name by host index (for logs; identity is not the name)
    rank: int  # this process's group rank
    # What carries the collectives: "tcp", "shm+tcp", or across hosts with hierarchical
    # collectives e.g. "shm+tcp within hosts, gloo between 2 hosts" (docs/multihost.md).
    transport: str = ""

    @property
    def host(self) -> int:
        """This rank's host index."""
        return self.host_of[self.rank]

    def ranks_on(self, host: int) -> tuple[int, ...]:
        if not isinstance(host, int) or isinstance(host, bool):
            raise TypeError(f"Topology.ranks_on: host must be an int, got {type(host).__name__}")
        if not 0 <= host < self.host_count:
            raise ValueError(f"Topology.ranks_on: host must be in [0, {self.host_count}), got {host}")
        return tuple(r for r, h in enumerate(self.host_of) if h == host)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """Group ranks on this rank's host, ascending."""
        return self.ranks_on(self.host)

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def leaders(self) -> tuple[int, ...]:
        """The lowest group rank of every host, by host index."""
        return tuple(self.ranks_on(h)[0] for h in range(self.host_count))

    @property
    def is_leader(self) -> bool:
        return self.rank in self.leaders


def topology(group: dist.ProcessGroup | None = None) -> Topology:
    """The host topology of `group` (default: the default group), which must use zeroplus."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"zeroplus.topology: group must be a ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("zeroplus.topology: torch.distributed is not initialized")
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = dist.get_backend(pg)
    if backend != "zeroplus":
        raise ValueError(f"zeroplus.topology: group must use the zeroplus backend, got {backend!r}")
    host_of, names, transport = torch.ops.zeroplus.topology(pg.boxed())
    return Topology(
        host_count=len(names), host_of=tuple(int(h) for h in host_of), host_names=tuple(names),
        rank=dist.get_rank(pg), transport=str(transport),
    )
