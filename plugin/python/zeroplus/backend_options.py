"""Per-group options of the "zeroplus" c10d backend.

    import zeroplus
    dist.init_process_group("zeroplus", pg_options=zeroplus.BackendOptions(bucket_bytes=8 << 20, shm="on"))

Each field left as ``None`` falls back to its ``ZEROPLUS_*`` environment variable, then to the
built-in default (docs/backend.md, "Knobs"). Validation happens in C++ when the group is
created (the same parser as the environment variables), so a bad value raises ``ValueError``
from ``init_process_group``/``new_group``. Every rank must pass the same options.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    bucket_bytes: int | None = None  # ZEROPLUS_BUCKET_BYTES: flat bucket size of fused/coalesced allreduces
    fuse: bool | None = None  # ZEROPLUS_FUSE: fuse queued async allreduces
    shm: str | None = None  # ZEROPLUS_SHM: "auto", "on" or "off"
    shm_chunk_bytes: int | None = None  # ZEROPLUS_SHM_CHUNK_BYTES: shared-memory pipeline stage
    spin_us: int | None = None  # ZEROPLUS_SPIN_US: spin before sleeping in a shared-memory wait
    inline_sync: bool | None = None  # ZEROPLUS_INLINE_SYNC: run sync ops on the caller's thread
    cuda_transport: str | None = None  # ZEROPLUS_CUDA_TRANSPORT: "auto", "nccl" or "host"
    socket_ifname: str | None = None  # ZEROPLUS_SOCKET_IFNAME (else GLOO_SOCKET_IFNAME): interface the listeners bind
    interhost: str | None = None  # ZEROPLUS_INTERHOST: "auto", "gloo" or "tcp" (docs/multihost.md)
    debug: bool | None = None  # ZEROPLUS_DEBUG: log topology and transport once at group creation

    def _zeroplus_options(self) -> list[str]:
        """The "field=value" list the backend hook forwards to torch.ops.zeroplus.attach."""
        out = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, bool):
                value = int(value)
            out.append(f"{field.name}={value}")
        return out
