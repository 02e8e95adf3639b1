"""Reads that complete one by one, checked off the training thread.

`AioHandle.wait()` waits for everything queued on the handle. A swapper that reads several
records ahead and then needs the first one would wait for all of them, and a read that fails
would fail the whole batch. So each read gets a lane (an AioHandle of its own): `read()` queues
it on an idle lane and returns a ticket; `wait(ticket)` blocks for that read only and raises
only its error. Lanes are reused (an idle one is an io_uring ring, created on first need);
there are never more lanes than reads in flight, and a swapper bounds those by its buffers.

A read may carry a `check` (record.check of what arrived): one background thread waits for the
reads in the order they were queued and runs their checks, so checksumming a record overlaps
the training thread's work instead of adding to it (AioHandle.wait and numpy's sums release
the GIL). `wait(ticket)` then returns only when the record arrived AND passed its check, and
raises its OSError or the check's exception. `check_s` is the checking time spent there.

Thread-safe for one producer thread at a time (a swapper's training thread, or its autograd
thread: never both at once) plus the background thread.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .policy import AioPolicy


class IoLanes:
    def __init__(self, aio: AioPolicy):
        self._aio = aio
        self._idle: list = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.lanes = 0        # created so far (the most reads that were in flight at once)
        self.check_s = 0.0    # seconds the background thread spent in checks

    def read(self, buf: torch.Tensor, path: str, check=None) -> Future:
        """Queues a read of buf's bytes from the start of `path`, then `check()` (no argument)
        in the background; returns its ticket. Raises OSError when the read is refused at the
        call."""
        lane = self._take()
        try:
            lane.async_pread(buf, path)
        except BaseException:
            self._give(lane)
            raise
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeroplus-swap-check")
        return self._pool.submit(self._finish, lane, check)

    @staticmethod
    def wait(ticket: Future) -> None:
        """Blocks until that read finished and passed its check; raises its error."""
        ticket.result()

    @staticmethod
    def wait_quietly(ticket: Future) -> None:
        """wait(), dropping the error (a read ahead nobody needs any more)."""
        ticket.exception()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _finish(self, lane, check) -> None:
        try:
            lane.wait()
        finally:
            self._give(lane)
        if check is not None:
            t0 = time.perf_counter()
            try:
                check()
            finally:
                self.check_s += time.perf_counter() - t0

    def _take(self):
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.lanes += 1
        return self._aio.new_handle()

    def _give(self, lane) -> None:
        with self._lock:
            self._idle.append(lane)
