"""Multi-process test harness: every distributed pytest in zeroplus runs through run_distributed()
(fresh ranks per test) or run_pooled() (ranks that live for a whole test module, RankPool below).

run_distributed: each rank is a fresh spawned interpreter (no state shared with pytest) that
  1. optionally loads zeroplus (``import zeroplus``) or nothing at all (load_library tests),
  2. joins a process group over a FileStore in a private temporary directory,
  3. runs ``fn(rank, world_size, *args)`` and ships its return value back (torch.save bytes),
  4. destroys the group.
The parent enforces one wall-clock ``timeout`` for the whole run: a hang kills every rank and
fails the test with the tracebacks the ranks did report. A rank that raises fails the test with
its traceback; a rank that dies without a word (segfault, os._exit) fails it with its exit code;
a rank still running at the timeout fails it with its Python stacks (faulthandler).
``fn`` must be a module-level function (it is pickled by reference).

Which one: run_pooled for cases that only need a healthy group (most of them: a pooled case
starts in milliseconds instead of the seconds that spawning ranks, importing torch and forming a
group cost on two cores); run_distributed for cases that need a fresh process by nature: fault
injection and ranks that die, environment read when the library loads, load_library-only
processes, version guards, destroy races, their own group set-up (backend=None), memory
measurements of the whole process (peak RSS), multi-host and cgroup tests.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import io
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

_CONTEXTS: dict[str, Any] = {}
# The environment the forkserver was started with: its ranks get that one, not the caller's
# current environment (pytest's per-test variable aside).
_FORKSERVER_ENV: dict[str, str] = {}


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


_IMPORT_ENV = _environment()  # before any test changed it (monkeypatch.setenv)


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
            _FORKSERVER_ENV.update(_environment())
        _CONTEXTS[start_method] = ctx
    return _CONTEXTS[start_method]


class DistributedTestError(AssertionError):
    """One or more ranks failed, crashed or timed out; the message carries their tracebacks."""


def _arm_stack_dump(path: str) -> None:
    """SIGUSR1 makes this process write every thread's Python stack to `path` (the parent's
    timeout report); faulthandler writes from the signal handler, so it works while a rank is
    blocked in C++ (a collective waiting for a peer)."""
    import faulthandler

    # The file stays open for the life of the process: faulthandler keeps only its descriptor.
    faulthandler.register(signal.SIGUSR1, file=open(path, "w"), all_threads=True)


def _stacks_of(procs: dict[int, Any], paths: dict[int, str]) -> dict[int, str]:
    """Asks each living rank in `procs` for its stacks (SIGUSR1) and returns what they wrote."""
    sizes = {}
    for r, p in procs.items():
        if p.is_alive() and os.path.exists(paths[r]):
            sizes[r] = os.path.getsize(paths[r])
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0 if sizes else 0.0)  # the handlers write within milliseconds
    out = {}
    for r, start in sizes.items():
        with open(paths[r]) as f:
            f.seek(start)
            out[r] = f.read().strip()
    return out


# Read when the library loads or on first use, not per group: a rank forked from the preloaded
# forkserver would not see them in time. ZEROPLUS_DEBUG is read per group, but what it logs
# goes to the rank's stderr, which a forked rank shares with the forkserver instead of the
# test's capture (capfd).
_NEEDS_SPAWN = {"ZEROPLUS_LIBRARY", "ZEROPLUS_BUILD_DIR", "ZEROPLUS_CPU_ISA", "ZEROPLUS_DEBUG"}


def _read_at_group_creation(name: str) -> bool:
    """Whether zeroplus reads `name` when a group is created (configFromEnvironment,
    process_group/core/config.cpp), so that setting it in a forked rank before
    init_process_group is the same as setting it before the interpreter started."""
    return (name.startswith("ZEROPLUS_") and name not in _NEEDS_SPAWN) or name == "GLOO_SOCKET_IFNAME"


def _rank_threads(world_size: int) -> int:
    """Intra-op threads per rank: the ranks share the machine's cores, as under torchrun (which
    sets OMP_NUM_THREADS=1). Left at torch's default (one per core), 4 ranks x 2 threads on 2
    cores spend most of their time preempting each other's spinning threads: a 4-rank ZeRO parity
    case took 90 s instead of 5. Both sides of a parity case run in the same rank, so they always
    compare at the same thread count."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def _interactive_sigint() -> None:
    """A rank handles Ctrl-C as a training process started from a terminal does. A launcher that
    ignores SIGINT (the suite run as a background job, nohup) passes SIG_IGN on to every child;
    Python then installs no KeyboardInterrupt handler, the backend chains its interrupt handler
    only over Python's default one (process_group/adapter/interrupt_watch.hpp), and the SIGINT
    tests would test nothing. Must run before init_process_group."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _child(rank, world_size, fn, args, backend, store_path, pg_timeout_s, load, env, results):
    try:
        _interactive_sigint()
        os.environ.update(env)
        _arm_stack_dump(f"{store_path}.stacks{rank}")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(_rank_threads(world_size))
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
    start_method: str | None = None,
) -> list[Any]:
    """Runs fn(rank, world_size, *args) on `world_size` spawned ranks; returns their results.

    backend: None to skip init_process_group (fn sets up its own group).
    load: "zeroplus" (import the package), "library" (torch.ops.load_library only), or "none".
    expected_exits: {rank: exit code} for ranks that are meant to die (fault tests); their
        result is None, and any other outcome for them is a failure.
    start_method: "spawn" (a fresh interpreter per rank) or "forkserver" (ranks fork from a
        server that has imported torch and zeroplus: seconds faster per run on two cores; for
        load="zeroplus"). None: forkserver for load="zeroplus" while this process's environment
        is still the one the forkserver started with (so every variable, including those read at
        process start such as MALLOC_*, is what a spawned rank would see) and `env` holds only
        variables read when a group is created (_read_at_group_creation); spawn otherwise.
    """
    if start_method is None:
        same_env = _environment() == (_FORKSERVER_ENV if "forkserver" in _CONTEXTS else _IMPORT_ENV)
        read_late = all(_read_at_group_creation(k) for k in (env or {}))
        start_method = "forkserver" if load == "zeroplus" and read_late and same_env else "spawn"
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
            hung = {r: p for r, p in enumerate(procs) if p.is_alive() and r not in outcome and r not in expected_exits}
            stacks = _stacks_of(hung, {r: f"{store_path}.stacks{r}" for r in hung})
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
            failures.append(f"--- rank {r}: {why}" + (f"; its stacks:\n{stacks[r]}" if stacks.get(r) else ""))
        elif outcome[r][0] == "error":
            failures.append(f"--- rank {r} raised:\n{outcome[r][1]}")
    if failures:
        raise DistributedTestError(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(failures))
    return [
        None if r in expected_exits else torch.load(io.BytesIO(outcome[r][1]), weights_only=False)
        for r in range(world_size)
    ]


# --- Ranks that live for a whole test module ----------------------------------------------------

_LIBC = ctypes.CDLL(None)  # glibc: malloc_trim


class _RankState:
    """What a pooled rank restores around every case, so that a case sees what a fresh rank
    would: the default generator at torch's start-up seed, the environment, working directory,
    thread count, default dtype and grad mode it started with, and only the default group (the
    subgroups a case created are destroyed after it)."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.seed = torch.initial_seed()
        self.groups = set(dist.distributed_c10d._world.pg_map)

    def before_case(self):
        import torch

        torch.manual_seed(self.seed)

    def after_case(self):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("the case destroyed the default process group: run it with run_distributed")
        # Every rank finished the case before any starts the next one, and the group still works.
        dist.barrier()
        for pg in [g for g in dist.distributed_c10d._world.pg_map if g not in self.groups]:
            dist.destroy_process_group(pg)
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        # An idle rank should not sit on the case's freed heap (GBs after a 1M-element case).
        gc.collect()
        _LIBC.malloc_trim(0)


def _pool_rank(rank, world_size, backend, store_path, pg_timeout_s, env, tasks, results):
    """A pooled rank: joins the group once, then runs cases from `tasks` until told to stop."""
    try:
        _interactive_sigint()
        os.environ.update(env)
        _arm_stack_dump(f"{store_path}.stacks{rank}")
        import torch
        import torch.distributed as dist

        import zeroplus  # noqa: F401  (registers the backend)

        torch.set_num_threads(_rank_threads(world_size))
        dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))
        state = _RankState()
        dist.barrier()
        results.put((rank, 0, "ok", b""))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the case
        results.put((rank, 0, "error", traceback.format_exc()))
        return
    while True:
        try:
            task = tasks.recv()
        except EOFError:  # the parent is gone
            return
        if task is None:
            break
        case, payload = task
        try:
            fn, args = pickle.loads(payload)
            state.before_case()
            value = fn(rank, world_size, *args)
            buffer = io.BytesIO()
            torch.save(value, buffer)
            state.after_case()
            results.put((rank, case, "ok", buffer.getvalue()))
        except BaseException:  # noqa: BLE001 - the parent tears the pool down after a failed case
            results.put((rank, case, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """`world_size` ranks forked from the preloaded forkserver (torch and zeroplus imported once)
    that form one process group and then run case after case: run(fn, *args) runs
    fn(rank, world_size, *args) on every rank and returns the per-rank results, with
    run_distributed's error reporting (DistributedTestError carrying each failing rank's
    traceback, the exit code of a rank that died, the stacks of ranks still running at the
    timeout). After a case the ranks meet in a barrier and restore their state (_RankState).

    A failed case kills the ranks: the group may be out of step (a peer still waits in a
    collective) or broken, so the next case starts fresh ranks. `env` is applied in each rank
    before the group is created but after torch and zeroplus are imported, so a variable read
    at library load time needs run_distributed. Not thread-safe; one case at a time.
    """

    # A rank that reported an error gives its peers this long to report theirs before the
    # pool is torn down: they may be blocked in a collective with the failed rank.
    FAILURE_GRACE_S = 3.0

    def __init__(self, world_size: int, *, backend: str = "zeroplus", env: dict[str, str] | None = None,
                 pg_timeout: float = 60.0, start_timeout: float = 120.0):
        if not 1 <= world_size <= 8:
            raise ValueError(f"RankPool: world_size must be in [1, 8], got {world_size}")
        if not isinstance(backend, str):
            raise TypeError(f"RankPool: backend must be a backend name, got {backend!r} (backend=None needs "
                            "run_distributed)")
        self.world_size = world_size
        self.backend = backend
        self.env = dict(env or {})
        self.pg_timeout = pg_timeout
        self.start_timeout = start_timeout
        self.starts = 0  # how many times ranks were started (a failed case restarts them)
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results = None
        self._tmp = None
        self._case = 0

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
        """Runs fn(rank, world_size, *args) on every rank; returns the results in rank order.
        `timeout` bounds this case alone (starting the ranks has its own start_timeout)."""
        if not callable(fn):
            raise TypeError(f"RankPool.run: fn must be callable, got {type(fn).__name__}")
        payload = pickle.dumps((fn, args))  # a function that is not module-level fails here, in pytest
        if not self._procs:
            self._start()
        self._case += 1
        for conn in self._tasks:
            conn.send((self._case, payload))
        values = self._collect(self._case, timeout, f"{fn.__name__} on {self.world_size} pooled ranks")
        import torch

        return [torch.load(io.BytesIO(v), weights_only=False) for v in values]

    def close(self) -> None:
        """Stops the ranks (they destroy their group) and removes the store; idempotent."""
        for conn in self._tasks:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _start(self) -> None:
        ctx = _context("forkserver")
        self._tmp = tempfile.TemporaryDirectory(prefix="zeroplus-pool-")
        store_path = os.path.join(self._tmp.name, "store")
        self._stack_paths = {r: f"{store_path}.stacks{r}" for r in range(self.world_size)}
        self._results = ctx.Queue()
        pipes = [ctx.Pipe(duplex=False) for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_pool_rank, daemon=True,
                        args=(r, self.world_size, self.backend, store_path, self.pg_timeout, self.env, pipes[r][0],
                              self._results))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        for receive, _ in pipes:
            receive.close()  # the ranks hold it now; the parent only sends
        self._tasks = [send for _, send in pipes]
        self.starts += 1
        self._collect(0, self.start_timeout, f"starting {self.world_size} pooled ranks ({self.backend})")

    def _collect(self, case: int, timeout: float, what: str) -> list[bytes]:
        """Waits for every rank's report of `case`; on any failure kills the ranks and raises."""
        outcome: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        failed = False
        while len(outcome) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, got_case, status, payload = self._results.get(timeout=min(remaining, 0.5))
                if got_case == case:
                    outcome[rank] = (status, payload)
                    if status == "error" and not failed:
                        failed = True
                        deadline = min(deadline, time.monotonic() + self.FAILURE_GRACE_S)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if r not in outcome and p.exitcode is not None]
            if dead:
                time.sleep(0.5)  # let a report still in the pipe arrive
                while True:
                    try:
                        rank, got_case, status, payload = self._results.get_nowait()
                    except queue.Empty:
                        break
                    if got_case == case:
                        outcome[rank] = (status, payload)
                if any(r not in outcome for r in dead):
                    break
        if len(outcome) == self.world_size and all(s == "ok" for s, _ in outcome.values()):
            return [outcome[r][1] for r in range(self.world_size)]
        silent = {r: p for r, p in enumerate(self._procs) if r not in outcome}
        stacks = _stacks_of({r: p for r, p in silent.items() if p.is_alive()}, self._stack_paths)
        failures = []
        for r, p in enumerate(self._procs):
            if r in outcome:
                if outcome[r][0] == "error":
                    failures.append(f"--- rank {r} raised:\n{outcome[r][1]}")
            elif p.exitcode is not None:
                failures.append(f"--- rank {r}: exit code {p.exitcode}")
            else:
                why = "still running when a peer failed" if failed else f"no result within {timeout:.0f} s"
                failures.append(f"--- rank {r}: {why}" + (f"; its stacks:\n{stacks[r]}" if stacks.get(r) else ""))
        self._kill()
        raise DistributedTestError(f"{what} failed (the ranks were stopped; the next case starts new ones):\n"
                                   + "\n".join(failures))

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join()
        for conn in self._tasks:
            conn.close()
        if self._results is not None:
            self._results.close()
            self._results.join_thread()
        if self._tmp is not None:
            self._tmp.cleanup()
        self._procs, self._tasks, self._results, self._tmp = [], [], None, None


_POOLS: dict[tuple, RankPool] = {}


def run_on_one_gpu(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float) -> list[Any]:
    """run_distributed for the GPU tests: every rank in a spawned process on the machine's one GPU;
    with two ranks or more CUDA tensors go through zeroplus's host-staged transport (NCCL refuses
    two ranks on one device)."""
    env = {"ZEROPLUS_CUDA_TRANSPORT": "host"} if world_size > 1 else {}
    return run_distributed(fn, world_size, *args, timeout=timeout, pg_timeout=300.0, env=env, start_method="spawn")


_ONE_GPU_RUNS: dict[tuple, list] = {}


def run_on_one_gpu_once(fn: Callable[..., Any], world_size: int, *, timeout: float) -> list[Any]:
    """run_on_one_gpu(fn, world_size), once per (fn, world_size) in this process: the GPU test
    modules run every case in one launch per world size and their parametrized tests read it."""
    key = (fn.__module__, fn.__qualname__, world_size)
    if key not in _ONE_GPU_RUNS:
        _ONE_GPU_RUNS[key] = run_on_one_gpu(fn, world_size, timeout=timeout)
    return _ONE_GPU_RUNS[key]


def run_pooled(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "zeroplus",
               timeout: float = 120.0, pg_timeout: float = 60.0, env: dict[str, str] | None = None) -> list[Any]:
    """run_distributed's signature for cases that only need a healthy group: runs fn on the
    module's RankPool for (world_size, backend, pg_timeout, env), started on first use.
    `timeout` bounds the case alone. conftest.py closes the pools after each test module."""
    key = (world_size, backend, pg_timeout, tuple(sorted((env or {}).items())))
    if key not in _POOLS:
        _POOLS[key] = RankPool(world_size, backend=backend, env=env, pg_timeout=pg_timeout)
    return _POOLS[key].run(fn, *args, timeout=timeout)


def close_pools() -> None:
    """Stops every pool run_pooled started."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_cases_in_own_groups(rank: int, world_size: int, cases: dict) -> dict:
    """Inside a rank: runs each `cases[key](rank, group)` in a process group of its own (created
    and destroyed around it), so a case that fails on one rank only (collectives out of step)
    breaks its own group, not the cases after it. Returns {key: ("ok", value) | ("error",
    traceback)}; every rank must pass the same cases in the same order."""
    import torch.distributed as dist

    out = {}
    for key, fn in cases.items():
        group = dist.new_group(list(range(world_size)))
        try:
            out[key] = ("ok", fn(rank, group))
        except Exception:  # noqa: BLE001 - reported per case
            out[key] = ("error", traceback.format_exc())
        finally:
            dist.destroy_process_group(group)
    return out

