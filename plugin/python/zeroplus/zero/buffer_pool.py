"""Reuse of the large flat buffers stage 3 allocates and frees every step.

Each step gathers every unit twice (forward, backward) into a fresh full-size buffer and fills
a full-size reduce-scatter input per bucket. On the CPU such blocks are mmap'ed by glibc, so each
new one page-faults all its pages in again: measured on the 50M-parameter stage-3 bench (2 ranks,
gloo), raising glibc's mmap threshold so that they came from the heap instead cut the step by a
fifth. Keeping released buffers for the next buffer of the same size does the same without
touching the allocator's settings.

Memory bound: a pool never holds more than (peak bytes taken at once) - (bytes taken now), so
taken + pooled never exceeds the peak its owner reached without a pool. The bound is per pool:
the gatherer and the gradient reducer each have one, so at rest the two may together hold up to
the sum of their peaks (both are reached in every backward anyway). memory_report shows it as
pooled_buffers. A buffer is pooled
only when nothing else references it: a tensor or a view that still aliases it (a saved
activation, a user's reference, a collective still holding it) keeps it out of the pool, so a
reused buffer can never be seen through an old alias.
"""

from __future__ import annotations

import torch

try:
    _storage_use_count = torch._C._storage_Use_Count
except AttributeError:  # no way to tell whether a buffer is shared: never pool
    _storage_use_count = None


def _key(t: torch.Tensor):
    return (t.numel(), t.dtype, t.device)


class BufferPool:
    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self.taken_bytes = 0   # handed out by take() and not given back
        self.pooled_bytes = 0  # kept for reuse
        self.peak_bytes = 0    # most taken_bytes at once
        self.reused = 0        # take() calls served from the pool

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of `numel` elements; its contents are undefined."""
        device = torch.device(device)
        free = self._free.get((numel, dtype, device))
        if free:
            t = free.pop()
            self.pooled_bytes -= _nbytes(t)
            self.reused += 1
        else:
            t = torch.empty(numel, dtype=dtype, device=device)
        self.taken_bytes += _nbytes(t)
        self.peak_bytes = max(self.peak_bytes, self.taken_bytes)
        self._trim()
        return t

    def give(self, t: torch.Tensor) -> None:
        """Hand back a buffer from take(). The caller drops its own reference right after.
        (taken + pooled never exceeds the peak here: taken just shrank by this buffer.)"""
        self.taken_bytes -= _nbytes(t)
        if self._reusable(t):
            self._free.setdefault(_key(t), []).append(t)
            self.pooled_bytes += _nbytes(t)

    def forget(self, t: torch.Tensor) -> None:
        """A buffer from take() that will not come back (its pass failed and dropped it): stop
        counting it as taken, so the bound stays the real peak."""
        self.taken_bytes -= _nbytes(t)

    def clear(self) -> None:
        self._free.clear()
        self.pooled_bytes = 0

    def _trim(self) -> None:
        while self.taken_bytes + self.pooled_bytes > self.peak_bytes and self.pooled_bytes:
            key = max((k for k, v in self._free.items() if v), key=lambda k: _nbytes(self._free[k][-1]))
            self.pooled_bytes -= _nbytes(self._free[key].pop())

    @staticmethod
    def _reusable(t: torch.Tensor) -> bool:
        if _storage_use_count is None or t._base is not None:
            return False
        # This tensor object is the storage's only user: one reference from its TensorImpl
        # (and that impl held only by this Python object) plus the temporary storage object.
        return t._use_count() == 1 and _storage_use_count(t.untyped_storage()._cdata) == 2


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
