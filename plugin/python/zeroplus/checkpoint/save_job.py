"""One rank's part of a save once the staging directory exists (save.py starts it).

    job = SaveJob(root, name, staging, rank, world, meta, options, where)
    job.write_own(pieces, scalars, error)   # this rank's shard + index, or its failure marker
    async (writer thread):  job.finish_async()          # rank 0 commits; others wait for it
    sync (training thread): sync_commit(job, error, ...); sync_outcome(error, ...)   # two collectives

The async path runs no collectives (commit.py's files carry everything); the synchronous path
replaces the polling for index files and for rank 0's commit by collectives, so no rank sleeps
past the moment the others are done. Errors: write_own raises this rank's failure on rank > 0
(rank 0 goes on to commit, which gives up at once on its own error: it never waits for its own
marker, which a full disk may have refused); in the synchronous path every rank's error reaches
every rank (sync_outcome). In the async path a rank > 0 whose marker the disk refused removes the
staging directory instead (removing needs no space): rank 0 stops waiting as soon as it sees that
(commit._gather_indexes), and every other rank's wait ends with it.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from .. import files
from . import commit
from .format import CheckpointError
from .shard_io import write_shard


def _index(rank: int, record: dict, chunks: list, scalars: dict) -> dict:
    """What rank 0 merges into the manifest: the file record, the chunk table, state dtypes."""
    state: dict[str, dict] = {}
    for name, key, _lo, _hi, dtype, _f, _o in chunks:
        if key not in ("param", "value"):
            state.setdefault(name, {})[key] = dtype
    return {"rank": rank, "file": record, "chunks": chunks, "state": state, "scalars": scalars}


class SaveJob:
    """One rank's part of one save after the staging directory exists: its shard and index
    (write_own), then rank 0's commit (async: finish_async polls the staging directory; sync:
    sync_commit agrees through collectives first)."""

    def __init__(self, root, name, staging, rank, world, meta, options, where, asynchronous=False):
        self.root, self.name, self.staging, self.rank, self.world = root, name, staging, rank, world
        self.meta, self.options, self.where = meta, options, where
        self.asynchronous = asynchronous  # ranks coordinate through files only (no collectives)
        self.own_error: BaseException | None = None

    def _in_staging(self, fn):
        root_fd = files.open_directory(self.root)
        try:
            staging_fd = files.open_directory_at(root_fd, self.staging, owned=True)
            try:
                return fn(root_fd, staging_fd)
            finally:
                os.close(staging_fd)
        finally:
            os.close(root_fd)

    def write_own(self, pieces, scalars, error, live=None) -> None:
        """This rank's shard and index, or its failure marker. Raises the failure on rank > 0
        (rank 0 goes on to commit, which fails on its marker, and raises its own error then)."""
        if self.own_error is not None:
            return  # a failure marker is written already (the deferred snapshot failed)
        def write(root_fd, staging_fd):
            try:
                if error is not None:
                    raise error
                record, chunks = write_shard(staging_fd, os.path.join(self.root, self.staging), self.rank, pieces,
                                             self.options.io, self.options.block_bytes, self.options.direct,
                                             live=live)
                commit.write_index(staging_fd, self.rank, _index(self.rank, record, chunks, scalars))
            except BaseException as e:
                if os.fstat(staging_fd).st_nlink == 0:  # not this rank's fault: see below
                    e = CheckpointError(f"checkpoint: another rank failed to write its shard of {self.where} and "
                                        f"removed the staging directory (its failure marker did not fit on the "
                                        f"disk); see its error")
                self.own_error = e
                if not commit.write_failure(staging_fd, self.rank, e) and self.asynchronous and self.rank != 0:
                    # Rank 0 would poll for the marker until commit_timeout_s: the staging
                    # directory's removal needs no free space and ends every rank's wait now
                    # (retried: a rank still writing may add an entry between listing and rmdir).
                    for _ in range(10):
                        if files.remove_tree_at(root_fd, self.staging):
                            break
        try:
            self._in_staging(write)
        except BaseException as e:
            self.own_error = e  # the staging directory could not be opened: rank 0 times out on it
        if self.own_error is not None and self.rank != 0:
            raise self.own_error

    def commit(self) -> None:
        """Rank 0: merge the indexes into the manifest and publish (commit.py). When its own shard
        failed it gives up at once (its failure marker may never have reached the disk): the
        staging directory is removed, which ends the other ranks' waits, and its error raised."""
        if self.own_error is not None:
            self.abort("")  # raises self.own_error
        def run(root_fd, staging_fd):
            try:
                commit.commit(root_fd, self.staging, staging_fd, self.name, self.world, self.meta,
                              self.options.commit_timeout_s, self.where)
            except BaseException:
                if self.own_error is not None:
                    raise self.own_error from None
                raise
        self._in_staging(run)

    def abort(self, message: str) -> None:
        """Rank 0, sync save: another rank failed; remove the staging directory and raise."""
        try:
            root_fd = files.open_directory(self.root)
            try:
                files.remove_tree_at(root_fd, self.staging)
            finally:
                os.close(root_fd)
        except OSError:
            pass  # left unlocked: the next save into ROOT removes it; the failure is what matters
        if self.own_error is not None:
            raise self.own_error
        raise CheckpointError(message)

    def finish_async(self) -> None:
        if self.rank == 0:
            self.commit()
        else:
            commit.wait_committed(self.root, self.staging, self.name, self.options.commit_timeout_s)


def capture(fn) -> BaseException | None:
    """fn()'s exception, or None."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the caller decides what to raise
        return e
    return None


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def sync_commit(job: SaveJob, error: BaseException | None, group, lock_fd) -> BaseException | None:
    """Synchronous save, after every rank's write_own (`error`: this rank's failure): one
    collective tells rank 0 that every shard is written, or which rank failed, so it commits (or
    gives up) without polling for index files. Returns this rank's error afterwards: rank 0's
    commit failure, or `error`. Rank 0's lock on the staging directory is released here."""
    everyone = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(everyone, _describe(error), group=group)
    except BaseException:
        if lock_fd is not None:
            os.close(lock_fd)  # the staging directory stays behind, unlocked: the next save removes it
        raise
    if job.rank != 0:
        return error
    try:
        failed = [(r, e) for r, e in enumerate(everyone) if e is not None and r != 0]
        if job.own_error is None and not failed:
            return capture(job.commit)
        # no index files will come from the failed ranks: remove the staging directory now
        message = (f"checkpoint: rank {failed[0][0]} failed to write its shard of {job.where}: {failed[0][1]}"
                   if failed else "")
        return capture(lambda: job.abort(message))
    finally:
        os.close(lock_fd)


def sync_outcome(error: BaseException | None, group, path: str) -> BaseException | None:
    """Synchronous save, after rank 0's commit: every rank learns every rank's outcome. Returns
    what this rank raises: its own error, else a RuntimeError naming the first rank that failed,
    else None."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, _describe(error), group=group)
    if error is not None:
        return error
    failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
    if failed:
        return RuntimeError(f"checkpoint: rank {failed[0][0]} failed to save {path}: {failed[0][1]}")
    return None
