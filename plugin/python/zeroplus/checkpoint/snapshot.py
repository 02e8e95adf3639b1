"""The snapshot of an async save: CPU copies of one rank's pieces, and the guard that keeps the
saved state unchanged until the copies are taken.

An async save must write the state of the moment of the call while training goes on. Copying
everything before the call returns blocks training for the whole copy (~65 ms for 300 MB here).
Most of the bytes (the engine's fp32 masters and elementwise optimizer state) change only when the
optimizer steps or loads, never in forward or backward, so those copies are taken on the writer
thread while the training loop runs its next forward and backward; what forward or the user may
change (buffers, frozen parameters, replicated tensors) is copied on the calling thread.

Through the page cache (CheckpointOptions.direct="off", the default) the deferred pieces are not
copied at all: the writer thread writes them from the live tensors, and the kernel's copy into the
page cache is the snapshot (a write returns once its bytes are there, long before the disk has
them). That saves the copy's CPU time and memory bandwidth (a third of the bytes an async save
moved through memory) and its buffer. With O_DIRECT ("auto") a write holds the tensor until the
disk has it, so they are copied on the writer thread, as before.

Until the deferred copies (or live writes) are done, a `SnapshotGuard` (one per optimizer and model, installed
once, through torch's public hooks) makes every entry point that changes those tensors wait
first: opt.step() (a step pre-hook, so zeroplus.GradScaler.step and closures too),
opt.load_state_dict() and model.load_state_dict() (pre-hooks); a second save and
load_checkpoint already wait for the whole save. The time the guards wait is added to the
handle's blocked_s. Tensors written in place by user code (param.data.mul_ under no_grad) are not
seen by any hook: CheckpointOptions(overlap_snapshot=False) copies everything before returning.

Memory: one buffer per process, kept between saves (copying into memory already faulted in runs at
memcpy speed; into fresh memory at the page-fault rate), the size of the largest snapshot so far,
each large piece page-aligned in it so the shard writer sends it O_DIRECT with no further copy.
Saves are serialised, so the previous save is done with the buffer before the next one takes it.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch

from .shard_io import aligned_empty

_PAGE = 4096
_LARGE = 1 << 20  # pieces from this size on start on a page (the writer's zero-copy O_DIRECT path)

_buffer: torch.Tensor | None = None


def release_buffer() -> int:
    """Drop the kept buffer (the caller made sure no save uses it); returns its size in bytes."""
    global _buffer
    freed = 0 if _buffer is None else _buffer.numel()
    _buffer = None
    return freed


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Snapshot:
    """The copies of one save. `pieces` are the save's (name, key, lo, hi, tensor) in file order;
    `deferred[i]` says piece i may be taken on the writer thread (it changes only in the
    optimizer's step or load). take_now() copies the others at once.

    The deferred pieces are either copied on the writer thread (take_deferred, then `done`), or,
    with `live=True`, not copied at all: the writer writes them straight from the live tensors
    (through the page cache, whose copy is then the snapshot) and calls live_written() once every
    byte of them is written and checksummed, which sets `done`. Either way `done` is set also
    when it fails (finish()). `bytes` is what was copied into memory."""

    def __init__(self, pieces: list, deferred: list[bool], live: bool = False):
        global _buffer
        self.deferred = deferred
        self.live = live
        copied = [not (live and later) for later in deferred]
        self.offsets, total = [], 0
        for (*_, t), copy in zip(pieces, copied):
            align = _PAGE if _nbytes(t) >= _LARGE else 64
            total = -(-total // align) * align
            self.offsets.append(total)
            total += _nbytes(t) if copy else 0
        self.bytes = sum(_nbytes(t) for (*_, t), copy in zip(pieces, copied) if copy)
        if _buffer is None or _buffer.numel() < total:
            _buffer = None  # the old one goes before the new one is allocated
            _buffer = aligned_empty(total)
        self._buffer = _buffer
        self._sources = list(pieces)
        self.pieces = list(pieces)
        self.done = threading.Event()

    def _copy(self, i: int) -> None:
        n, k, lo, hi, t = self._sources[i]
        at = self.offsets[i]
        copy = self._buffer[at:at + _nbytes(t)].view(t.dtype)
        copy.copy_(t.detach().reshape(-1))
        self.pieces[i] = (n, k, lo, hi, copy)

    def take_now(self) -> None:
        for i, later in enumerate(self.deferred):
            if not later:
                self._copy(i)
        if not any(self.deferred):
            self._finish()

    def take_deferred(self) -> None:
        """The writer thread, before it writes: copy the deferred pieces (then `done`), or, live,
        nothing (`done` follows live_written)."""
        if self.live:
            return
        try:
            for i, later in enumerate(self.deferred):
                if later:
                    self._copy(i)
        finally:
            self._finish()

    def last_live(self) -> int:
        """The index of the last piece written from a live tensor (-1: none)."""
        if not self.live or self.done.is_set():
            return -1
        return max((i for i, later in enumerate(self.deferred) if later), default=-1)

    def live_written(self) -> None:
        """Every live piece's bytes are written and checksummed: training may change them."""
        self._finish()

    def finish(self) -> None:
        """`done` (idempotent): the save failed or ended; nobody waits for the snapshot any more."""
        if not self.done.is_set():
            self._finish()

    def _finish(self) -> None:
        self._sources = None  # no reference to the live tensors once copied
        self.done.set()


class SnapshotGuard:
    """Hooks on one optimizer (and its model) that wait for the snapshot in progress, if any.
    Installed once per optimizer (guard_for); `watch` arms it for one snapshot."""

    def __init__(self, opt, model):
        self._pending: tuple[Snapshot, object] | None = None
        self._lock = threading.Lock()
        hook = self._hook
        # First among the pre-hooks, so no earlier hook changes the tensors before the wait: the
        # engine's own module load hooks (zero/full_state.py) write masters. torch offers
        # prepend= only for the optimizer's load hook; the others are moved to the front of
        # torch's hook dicts, as prepend= does.
        step = opt.register_step_pre_hook(lambda *_: hook())
        opt._optimizer_step_pre_hooks.move_to_end(step.id, last=False)
        opt.register_load_state_dict_pre_hook(lambda *_: hook(), prepend=True)
        if model is not None:
            load = model.register_load_state_dict_pre_hook(lambda *_: hook())
            model._load_state_dict_pre_hooks.move_to_end(load.id, last=False)

    def watch(self, snapshot: Snapshot, handle) -> None:
        with self._lock:
            self._pending = (snapshot, handle)

    def _hook(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        snapshot, handle = pending
        if not snapshot.done.is_set():
            t0 = time.perf_counter()
            snapshot.done.wait()
            handle._add_blocked(time.perf_counter() - t0)


_guards: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_guards_lock = threading.Lock()


def guard_for(opt, model) -> SnapshotGuard:
    """The optimizer's guard (installed on first use; it lives as long as the optimizer)."""
    with _guards_lock:
        guard = _guards.get(opt)
        if guard is None:
            guard = _guards[opt] = SnapshotGuard(opt, model)
        return guard
