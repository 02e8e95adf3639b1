"""Multi-process test harness: every distributed pytest in zeroplus runs through run_distributed().

Each rank is a fresh spawned interpreter (no state shared with pytest) that
  1. optionally loads zeroplus (``import zeroplus``) or nothing at all (load_library tests),
  2. joins a process group over a FileStore in a private temporary directory,
  3. runs ``fn(rank, world_size, *args)`` and ships its return value back (torch.save bytes),
  4. destroys the group.
The parent enforces one wall-clock ``timeout`` for the whole run: a hang kills every rank and
fails the test with the tracebacks the ranks did report. A rank that raises fails the test with
its traceback; a rank that dies without a word (segfault, os._exit) fails it with its exit code.
``fn`` must be a module-level function (it is pickled by reference).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

_CONTEXTS: dict[str, Any] = {}


def _context(start_method: str):
    if start_method not in _CONTEXTS:
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"run_distributed: start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Ranks fork from one server process that imported torch and zeroplus once, so a run
            # starts in a fraction of a second instead of seconds per rank (the fault matrix runs
            # dozens). The server runs no torch code, so no threads or state are forked with it.
            ctx.set_forkserver_preload(["torch", "torch.distributed", "zeroplus"])
        _CONTEXTS[start_method] = ctx
    return _CONTEXTS[start_method]


class DistributedTestError(AssertionError):
    """One or more ranks failed, crashed or timed out; the message carries their tracebacks."""


def _child(rank, world_size, fn, args, backend, store_path, pg_timeout_s, load, env, results):
    try:
        os.environ.update(env)
        import torch
        import torch.distributed as dist

        if load == "zeroplus":
            import zeroplus  # noqa: F401  (registers the backend)
        elif load.startswith("library:"):
            torch.ops.load_library(load[len("library:"):])  # nothing else: no zeroplus import
        if backend is not None:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
        value = fn(rank, world_size, *args)
        if backend is not None and dist.is_initialized():
            dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report everything, including SystemExit and KeyboardInterrupt
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = "zeroplus",
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    load: str = "zeroplus",
    env: dict[str, str] | None = None,
    expected_exits: dict[int, int] | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """Runs fn(rank, world_size, *args) on `world_size` spawned ranks; returns their results.

    backend: None to skip init_process_group (fn sets up its own group).
    load: "zeroplus" (import the package), "library" (torch.ops.load_library only), or "none".
    expected_exits: {rank: exit code} for ranks that are meant to die (fault tests); their
        result is None, and any other outcome for them is a failure.
    start_method: "spawn" (a fresh interpreter per rank) or "forkserver" (ranks fork from a
        server that has imported torch and zeroplus: much faster to start; for load="zeroplus").
    """
    expected_exits = dict(expected_exits or {})
    if not callable(fn):
        raise TypeError(f"run_distributed: fn must be callable, got {type(fn).__name__}")
    if not 1 <= world_size <= 8:
        raise ValueError(f"run_distributed: world_size must be in [1, 8], got {world_size}")
    import torch

    if load == "library":
        from zeroplus._library import library_path  # in the parent only; the child never imports it

        load = "library:" + library_path()
    ctx = _context(start_method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="zeroplus-test-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, fn, args, backend, store_path, pg_timeout, load, dict(env or {}), results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            def waiting_for():
                return [r for r in range(world_size) if r not in outcome and r not in expected_exits]

            while waiting_for():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 0.5))
                    outcome[rank] = (status, payload)
                    continue
                except queue.Empty:
                    pass
                # A rank that died without reporting will never report: stop waiting for it.
                silent = [r for r in waiting_for() if procs[r].exitcode is not None]
                if silent:
                    time.sleep(0.5)  # let a report still in the pipe arrive
                    while True:
                        try:
                            rank, status, payload = results.get_nowait()
                            outcome[rank] = (status, payload)
                        except queue.Empty:
                            break
                    if any(r not in outcome for r in silent):
                        break
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    failures = []
    for r, p in enumerate(procs):
        if r in expected_exits:
            if r in outcome or p.exitcode != expected_exits[r]:
                failures.append(f"--- rank {r}: expected to exit with {expected_exits[r]}, got exit code {p.exitcode}"
                                + (f" and a {outcome[r][0]} report" if r in outcome else ""))
        elif r not in outcome:
            why = f"exit code {p.exitcode}" if p.exitcode not in (None, -9) else f"no result within {timeout:.0f} s"
            failures.append(f"--- rank {r}: {why}")
        elif outcome[r][0] == "error":
            failures.append(f"--- rank {r} raised:\n{outcome[r][1]}")
    if failures:
        raise DistributedTestError(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(failures))
    return [
        None if r in expected_exits else torch.load(io.BytesIO(outcome[r][1]), weights_only=False)
        for r in range(world_size)
    ]
