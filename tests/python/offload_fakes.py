"""Stand-ins the offload tests share (a helper module, no tests of its own)."""

from __future__ import annotations


class MemorySwapper:
    """What HostParamStore's NVMe mode uses of a ParamSwapper (offload/param_swapper.py), with the
    records in host memory: a test of the store's own ordering needs no disk."""

    def put_initial(self, proxy, values):
        proxy.shard = values.clone()

    def finish_initial(self):
        pass

    def pin(self, proxy, update=False):
        return proxy.shard

    def unpin(self, proxy):
        pass

    def read_ahead(self, proxies, depth=None):
        pass

    def write(self, proxy, src, defer=False):
        proxy.shard.copy_(src)

    def end_step(self):
        pass
