"""Reads that complete one by one: a lane (an AioHandle of its own) per record in flight.

`AioHandle.wait()` waits for everything queued on the handle. A swapper that reads several
records ahead and then needs the first one would wait for all of them, and a read that fails
would fail the whole batch. So each read ahead gets a lane: `read()` queues it on an idle lane,
`wait(lane)` blocks for that read only and raises only its error. Lanes are reused (an idle one
is an io_uring ring and its thread, created on first need); there are never more lanes than
reads in flight, and a swapper bounds those by its buffer budget.

Not thread-safe: one swapper's training thread (or its autograd thread, never both at once).
"""

from __future__ import annotations

import torch

from .policy import AioPolicy


class IoLanes:
    def __init__(self, aio: AioPolicy):
        self._aio = aio
        self._idle: list = []
        self._busy = 0
        self.lanes = 0  # created so far (the most reads that were in flight at once)

    def read(self, buf: torch.Tensor, path: str):
        """Queues a read of buf's bytes from the start of `path`; returns its lane. Raises
        OSError when the read is refused at the call (no lane is kept then)."""
        lane = self._take()
        try:
            lane.async_pread(buf, path)
        except BaseException:
            self._give(lane)
            raise
        return lane

    def wait(self, lane) -> None:
        """Blocks until the read on `lane` finished; raises its OSError. The lane is idle after."""
        try:
            lane.wait()
        finally:
            self._give(lane)

    def wait_quietly(self, lane) -> None:
        """wait(), dropping the error (a read ahead nobody needs any more)."""
        try:
            self.wait(lane)
        except OSError:
            pass

    @property
    def in_flight(self) -> int:
        return self._busy

    def _take(self):
        self._busy += 1
        if self._idle:
            return self._idle.pop()
        self.lanes += 1
        return self._aio.new_handle()

    def _give(self, lane) -> None:
        self._busy -= 1
        self._idle.append(lane)
