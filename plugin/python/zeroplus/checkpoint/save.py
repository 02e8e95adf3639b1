"""zeroplus.save_checkpoint: every rank writes what it owns; rank 0 commits the manifest.

    handle = zeroplus.save_checkpoint("ckpt/step100", model, opt, extra={"step": 100})

PATH is ROOT/NAME: the checkpoint becomes the directory NAME inside ROOT (created 0700 if
missing, and so are its missing parents, whatever the umask), and ROOT/latest names it once it is
complete. A ROOT or PATH that is a symbolic link of this user or root is followed (the checkpoint
goes where it points); another user's link is refused (files.own_link_target). A PATH holding a complete zeroplus
checkpoint is replaced by writing the new one aside and swapping the two atomically, so PATH is
always one complete checkpoint (never one written over in place); a PATH that exists, is not
empty and is not a zeroplus checkpoint raises FileExistsError before anything is written.
Collective over the optimizer's process group (every rank calls it with the same PATH).

Synchronous (async_=False, default): returns a finished CheckpointHandle after the checkpoint is
complete and durable on every rank. async_=True: saves the state of the moment of the call, blocking
only for a snapshot of this rank's shard into CPU memory (handle.snapshot_bytes), then writes in a
background thread while training goes on. The bulk of the snapshot (the engine's masters and
optimizer state, which only the optimizer changes) is taken on that thread while training runs
its next forward and backward (through the page cache written from the live tensors, the cache's
copy being the snapshot; with direct="auto" copied first: snapshot.py); opt.step(), opt.load_state_dict() and model.load_state_dict() wait
for it first (snapshot.py; handle.blocked_s is the call plus those waits, handle.wait_snapshot()
waits for it explicitly; CheckpointOptions(overlap_snapshot=False) copies everything before
returning; with offload nvme, whose swapped buckets only the training thread can read, this rank's
shard file is written before returning instead, one swapped bucket in memory at a time, and only the
commit runs in the background). handle.wait() blocks until this rank's part is durable and the commit is done, and
raises any error (OSError from the disk, CheckpointError naming the rank that failed). On rank 0
wait() returns after `latest` names the new checkpoint; on other ranks as soon as the checkpoint is
complete (loadable by its PATH), and `latest` follows a moment later. wait() is not collective.
A new save first waits for the previous one (saves are serialised); its error, if any, stays
with its handle. The background thread runs no collectives (ranks coordinate through files in
the staging directory, commit.py), so training's collectives never interleave with it. A
synchronous save coordinates through two small collectives instead of polling those files.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import torch
import torch.distributed as dist

from .. import __version__
from .. import files
from . import commit, fsutil
from .adapters import adapter_for
from .format import BLOCK_BYTES, MAX_BLOCK_BYTES, check_dir_name, check_json, encode_value
from .save_job import SaveJob, capture, sync_commit, sync_outcome
from .snapshot import Snapshot, guard_for, release_buffer

_MAX_SCALAR_ELEMS = 4096


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """io: "aio" (zeroplus.aio io_uring engine) or "posix" (pwrite) for shard bytes;
    commit_timeout_s: how long rank 0 waits for the other ranks' shards, and they for its commit;
    block_bytes: checksum granularity (a reader reads whole blocks around what it needs);
    overlap_snapshot: async saves take the masters and optimizer state on the writer thread,
    overlapping the next forward and backward (written from the live tensors through the page
    cache, copied first with direct="auto"; False: everything copied before the call returns);
    direct: io="aio" writes through the page cache ("off", the default; then fdatasync) or
    O_DIRECT where the file system takes it ("auto"). Through the cache a load soon after the save
    (a restart, a resume on the same host) reads memory, not the disk, and the save itself was no
    slower (bench/checkpoint: 0.234-0.238 s against 0.250-0.258 s O_DIRECT for 0.6 GB, loads 0.24 s
    against 0.39-0.40 s); "auto" keeps a checkpoint out of the page cache."""
    io: str = "aio"
    commit_timeout_s: float = 1800.0
    block_bytes: int = BLOCK_BYTES
    overlap_snapshot: bool = True
    direct: str = "off"

    def __post_init__(self):
        if self.direct not in ("auto", "off"):
            raise ValueError(f"CheckpointOptions: direct must be 'auto' or 'off', got {self.direct!r}")
        if not isinstance(self.overlap_snapshot, bool):
            raise TypeError(f"CheckpointOptions: overlap_snapshot must be a bool, got {self.overlap_snapshot!r}")
        if isinstance(self.block_bytes, bool) or not isinstance(self.block_bytes, int) \
                or not 64 <= self.block_bytes <= MAX_BLOCK_BYTES:
            raise ValueError(f"CheckpointOptions: block_bytes must be an int in [64, {MAX_BLOCK_BYTES}] (readers refuse "
                             f"larger blocks), got {self.block_bytes!r}")
        if self.io not in ("aio", "posix"):
            raise ValueError(f"CheckpointOptions: io must be 'aio' or 'posix', got {self.io!r}")
        if isinstance(self.commit_timeout_s, bool) or not isinstance(self.commit_timeout_s, (int, float)) \
                or not self.commit_timeout_s > 0:
            raise ValueError(f"CheckpointOptions: commit_timeout_s must be a positive number, got "
                             f"{self.commit_timeout_s!r}")


class CheckpointHandle:
    """One save. wait() returns the checkpoint path or raises what went wrong (every call).
    snapshot_bytes: the CPU copy an async save holds (0 for a synchronous one); blocked_s: how
    long the training thread was blocked by this save: the call itself plus, for an async save,
    what opt.step() (or a load_state_dict) waited for the snapshot; explicit waits not counted."""

    def __init__(self, path: str, snapshot_bytes: int, snapshot: Snapshot | None = None):
        self.path = path
        self.snapshot_bytes = snapshot_bytes
        self.blocked_s = 0.0
        self._snapshot = snapshot
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._blocked_lock = threading.Lock()

    def _add_blocked(self, seconds: float) -> None:
        with self._blocked_lock:
            self.blocked_s += seconds

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until the snapshot is taken: from then on nothing done to the model or the
        optimizer reaches this checkpoint (before: see the module doc). Errors go to wait()."""
        if self._snapshot is not None and not self._snapshot.done.wait(timeout):
            raise TimeoutError(f"checkpoint: snapshot of {self.path} still running after {timeout} s")

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - stored, rethrown by wait()
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint: save of {self.path} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "done")
        return f"CheckpointHandle({self.path!r}, {state}, snapshot_bytes={self.snapshot_bytes})"


_previous: CheckpointHandle | None = None
_lock = threading.Lock()


def wait_for_pending_save() -> None:
    """Block until this process's async save in flight (if any) has finished (its error stays
    with its handle). load_checkpoint calls it: a load right after save_checkpoint(async_=True)
    of the same path sees the finished checkpoint."""
    with _lock:
        previous = _previous
    if previous is not None:
        previous._done.wait()


def release_snapshot_memory() -> int:
    """Free the memory kept for async snapshots (after waiting for a save in flight); returns
    the bytes released. The next async save allocates it again."""
    global _previous
    with _lock:
        previous, _previous = _previous, None
    if previous is not None:
        previous._done.wait()
    return release_buffer()


def _split(path) -> tuple[str, str]:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save_checkpoint: path must be a str or os.PathLike, got {type(path).__name__}")
    # PATH as the user's own link is followed (the checkpoint goes where it points; a link of
    # another user raises PermissionError): NAME is then the target's last component.
    path = files.own_link_target(os.path.abspath(os.fspath(path)).rstrip("/"))
    root, name = os.path.split(os.path.abspath(path).rstrip("/"))
    try:
        check_dir_name(name, "save_checkpoint: path")
    except OSError as e:
        raise ValueError(str(e)) from None
    return root, name


def make_directories(path: str) -> None:
    """`path` and each of its missing parents, created 0700 (os.makedirs gives the parents 0777
    less the umask: world-writable under umask 000). An existing link to a directory counts as
    the directory (the user's own layout)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not os.path.isdir(d):
                raise


def _prepare(root: str, name: str) -> tuple[str, int]:
    """Rank 0: refuse an existing checkpoint, create the private staging directory and lock it
    (returns its name and the locked descriptor, held until the save ends), and remove the
    staging directories of saves that were killed (fsutil.remove_stale_temp_dirs)."""
    make_directories(root)
    root_fd = files.open_directory(root)
    try:
        try:
            existing = files.open_directory_at(root_fd, name)
        except FileNotFoundError:
            existing = None
        except OSError as e:  # a file or a link
            raise FileExistsError(17, "checkpoint: path exists and is not a directory", os.path.join(root, name)) from e
        if existing is not None:
            try:
                if os.listdir(existing) and not commit.is_checkpoint(root_fd, name):
                    raise FileExistsError(17, "checkpoint: path exists, is not empty and is not a zeroplus checkpoint; "
                                              "refusing to replace it", os.path.join(root, name))
            finally:
                os.close(existing)
        staging, lock_fd = fsutil.new_locked_directory(root_fd, name)
        try:
            fsutil.remove_stale_temp_dirs(root_fd, keep=staging)
        except OSError:
            pass  # housekeeping only: a leftover we cannot remove is never read
        return staging, lock_fd
    finally:
        os.close(root_fd)


def _agree_on_staging(rank: int, group, root: str, name: str, make_meta) -> tuple[str, dict | None, int | None]:
    """Rank 0 describes the model (make_meta) and creates the staging directory; every rank
    learns its name, or raises rank 0's error (no rank is left waiting in a collective)."""
    from ..zero.comm import group_src_rank

    msg = [None]
    meta, lock_fd = None, None
    if rank == 0:
        try:
            meta = make_meta()
            staging, lock_fd = _prepare(root, name)
            msg[0] = ("ok", staging)
        except OSError as e:
            msg[0] = ("oserror", (e.errno, e.strerror or str(e), e.filename))
            error = e
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, raised below
            msg[0] = ("error", f"{type(e).__name__}: {e}")
            error = e
    try:
        dist.broadcast_object_list(msg, src=group_src_rank(group, 0), group=group)
    except BaseException:
        if lock_fd is not None:  # the staging directory stays behind, unlocked: the next save removes it
            os.close(lock_fd)
        raise
    kind, value = msg[0]
    if kind == "ok":
        return value, meta, lock_fd
    if rank == 0:
        raise error
    if kind == "oserror":
        raise OSError(*value)
    raise RuntimeError(f"checkpoint: rank 0 could not start the save: {value}")


def _encode_scalars(scalars: dict) -> dict:
    """Per-parameter optimizer scalars as manifest JSON (a copy: the snapshot of an async save)."""
    enc = {}
    for name, keys in scalars.items():
        for k, v in keys.items():
            if isinstance(v, torch.Tensor) and v.numel() > _MAX_SCALAR_ELEMS:
                raise TypeError(f"checkpoint: optimizer state {k!r} of {name!r} has shape {tuple(v.shape)}, neither "
                                f"elementwise nor small; zeroplus checkpoints cannot reshard it")
            enc.setdefault(name, {})[k] = encode_value(v)
    return enc


def save_checkpoint(path, model, opt, extra=None, async_: bool = False, *,
                    options: CheckpointOptions | None = None) -> CheckpointHandle:
    """Save model and optimizer state to the directory `path` (see the module doc)."""
    global _previous
    t_call = time.perf_counter()
    options = CheckpointOptions() if options is None else options
    if not isinstance(options, CheckpointOptions):
        raise TypeError(f"save_checkpoint: options must be a CheckpointOptions, got {type(options).__name__}")
    if not isinstance(async_, bool):
        raise TypeError(f"save_checkpoint: async_ must be a bool, got {async_!r}")
    check_json(extra, "extra")
    root, name = _split(path)
    adapter = adapter_for(model, opt)
    group = opt.process_group
    rank, world = adapter.rank, adapter.world_size
    with _lock:
        previous, _previous = _previous, None
    if previous is not None:
        previous._done.wait()  # serialised; its error belongs to its own handle
    def make_meta():
        return {**adapter.meta(), "source": {**adapter.source(), "zeroplus_version": __version__,
                                            "torch_version": torch.__version__},
                "optimizer": adapter.optimizer_meta(), "extra": extra, "block_bytes": options.block_bytes}

    staging, meta, lock_fd = _agree_on_staging(rank, group, root, name, make_meta)
    if meta is not None:
        meta["save_id"] = staging  # how the other ranks tell this save's manifest from a replaced one
    where = os.path.join(root, name)
    # From here on a failure must reach rank 0 as a failure marker (commit.py), never as a rank
    # that silently stops: rank 0 would wait for its shard until commit_timeout_s.
    pieces, scalars, snapshot, snapshot_error, lazy = [], {}, None, None, False
    try:
        pieces, scalars = adapter.pieces()
        scalars = _encode_scalars(scalars)
        # Buckets whose values live in swap files (offload nvme: adapters.LazyPieces) are read
        # through the swappers, which only the training thread may use, and a copy of them could
        # be larger than memory: an async save writes this rank's shard before returning.
        lazy = async_ and any(not isinstance(p, tuple) for p in pieces)
        if async_ and not lazy:  # training may change every live tensor after we return: snapshot.py
            deferred = [options.overlap_snapshot and adapter.changes_only_in_optimizer(n, k) for n, k, *_ in pieces]
            # Through the page cache the deferred pieces are written from the live tensors (the
            # kernel's copy is the snapshot); O_DIRECT would hold them until the disk has them.
            snapshot = Snapshot(pieces, deferred, live=not (options.io == "aio" and options.direct == "auto"))
            snapshot.take_now()
    except Exception as e:  # noqa: BLE001 - raised by SaveJob.write_own
        snapshot_error = e
        if snapshot is not None:
            snapshot.done.set()
            snapshot = None
    handle = CheckpointHandle(where, snapshot.bytes if snapshot is not None else 0, snapshot)
    job = SaveJob(root, name, staging, rank, world, meta, options, where, asynchronous=async_)

    if not async_:
        try:
            error = capture(lambda: job.write_own(pieces, scalars, snapshot_error))
            error = sync_commit(job, error, group, lock_fd)
            error = sync_outcome(error, group, where)
        finally:
            handle._add_blocked(time.perf_counter() - t_call)
        handle._error = error
        handle._done.set()
        if error is not None:
            raise error
        return handle

    # Offloaded buckets: this rank's shard now, in the training thread (see `lazy` above).
    own_error = capture(lambda: job.write_own(pieces, scalars, snapshot_error)) if lazy else None

    def work():
        try:
            if lazy:
                if own_error is not None:
                    raise own_error  # rank > 0 (rank 0's is raised by its commit)
                job.finish_async()
                return
            live = None
            if snapshot is not None and not snapshot.done.is_set():
                try:
                    snapshot.take_deferred()
                except Exception as e:  # noqa: BLE001 - reported through the failure marker
                    job.write_own([], {}, e)
                last = snapshot.last_live()
                live = (last, snapshot.live_written) if last >= 0 else None
            try:
                job.write_own(snapshot.pieces if snapshot is not None else pieces, scalars, snapshot_error, live)
            finally:
                if snapshot is not None:
                    snapshot.finish()  # an error before the live pieces were written: nobody waits
            job.finish_async()
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the staging directory's lock (rank 0)

    if snapshot is not None and not snapshot.done.is_set():
        guard_for(opt, adapter.model).watch(snapshot, handle)
    handle._thread = threading.Thread(target=handle._run, args=(work,), name="zeroplus-checkpoint", daemon=True)
    with _lock:
        _previous = handle
    handle._thread.start()
    handle._add_blocked(time.perf_counter() - t_call)
    return handle
