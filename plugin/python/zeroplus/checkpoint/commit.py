"""The cross-rank commit protocol of a save (no collectives: it also runs on background threads).

    rank 0 (collective, before): mkdir ROOT/.NAME.tmp-<random> (0700)        -> "staging"
    every rank: staging/rankNNNNN.bin (write_shard, fdatasync'ed, renamed), then staging/rankNNNNN.json
                (its index: file record, chunk table, optimizer scalars; not synced: only rank 0 reads it);
                on failure: staging/rankNNNNN.failed with the error text instead; where the disk
                refuses even that (full), an async save's rank > 0 removes the staging directory
                (which needs no space) and rank 0 sees it gone at once
    rank 0:     gives up at once when its own shard failed (it never waits for its own marker); else
                waits until every rank left an index or a failure marker (commit_timeout_s), then
                removes the indexes, merges them into manifest.json (checksummed: format.py;
                fdatasync'ed, renamed), writes latest's new content under a temporary name
                (fdatasync'ed; a `latest` that is a directory is refused here), fsyncs
                the staging directory (every shard's and the manifest's entry durable at once), renames
                staging -> ROOT/NAME, or, when NAME is a complete zeroplus checkpoint, swaps the
                two atomically (renameat2 RENAME_EXCHANGE) and removes the old one afterwards
                (any other non-empty NAME is refused), fsyncs ROOT, renames latest's temporary
                file over ROOT/latest and fsyncs ROOT.
                Any failure up to the swap: the staging directory is removed; ROOT/NAME and latest
                are untouched. After it only that rename or fsync can fail: the error then says
                that NAME holds the new checkpoint and latest was not updated.
    rank > 0:   its save is over when the staging directory is gone; it succeeded when
                ROOT/NAME/manifest.json carries this save's id (the staging directory's name).

A crash at any point leaves either the previous state (no NAME or the old NAME, old latest) or
a complete checkpoint NAME (manifest durable before the rename that makes NAME visible), possibly with
latest still naming the previous one; leftover .NAME.tmp-* directories are never read.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time

from .. import files
from . import fsutil
from .format import FORMAT, LATEST, MANIFEST, VERSION, CheckpointError, manifest_for_save

_POLL_MAX_S = 0.05


def index_name(rank: int) -> str:
    return f"rank{rank:05d}.json"


def failed_name(rank: int) -> str:
    return f"rank{rank:05d}.failed"


def write_index(staging_fd: int, rank: int, index: dict) -> None:
    """Rank 0 reads it, merges it into the manifest and removes it: it never has to survive a
    crash (a save that crashes is abandoned), so no fdatasync; renamed into place so rank 0 never
    reads it half-written."""
    fsutil.write_small_file(staging_fd, index_name(rank), json.dumps(index, separators=(",", ":")).encode(),
                            durable=False)


def write_failure(staging_fd: int, rank: int, error: BaseException) -> bool:
    """Best effort: tell rank 0 not to wait for this rank. False when the disk refused this too
    (full): the caller then signals by removing the staging directory (SaveJob.write_own)."""
    try:
        fsutil.write_small_file(staging_fd, failed_name(rank), f"{type(error).__name__}: {error}".encode()[:4000])
    except OSError:
        return False
    return True


def _sleep(attempt: int) -> None:
    time.sleep(min(_POLL_MAX_S, 0.001 * (2 ** min(attempt, 6))))


def _gather_indexes(staging_fd: int, world_size: int, timeout_s: float, where: str) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    indexes: dict[int, dict] = {}
    failures: dict[int, str] = {}
    attempt = 0
    while len(indexes) + len(failures) < world_size:
        if os.fstat(staging_fd).st_nlink == 0:
            raise CheckpointError(f"checkpoint: the staging directory of {where} was removed during the save: a rank "
                                  f"failed and could not write its failure marker (a full disk?); see its error")
        names = set(os.listdir(staging_fd))
        for r in range(world_size):
            if r in indexes or r in failures:
                continue
            if failed_name(r) in names:
                fd = files.open_regular_at(staging_fd, failed_name(r))
                try:
                    failures[r] = fsutil.read_exact(fd, os.fstat(fd).st_size, 0, failed_name(r)).decode(errors="replace")
                finally:
                    os.close(fd)
            elif index_name(r) in names:
                fd = files.open_regular_at(staging_fd, index_name(r))
                try:
                    indexes[r] = json.loads(fsutil.read_exact(fd, os.fstat(fd).st_size, 0, index_name(r)))
                finally:
                    os.close(fd)
        if len(indexes) + len(failures) < world_size:
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in indexes and r not in failures]
                raise TimeoutError(f"checkpoint: ranks {missing} did not finish writing {where} within "
                                   f"{timeout_s:.0f} s (commit_timeout_s)")
            _sleep(attempt)
            attempt += 1
    if failures:
        r = min(failures)
        raise CheckpointError(f"checkpoint: rank {r} failed to write its shard of {where}: {failures[r]}")
    return [indexes[r] for r in range(world_size)]


def build_manifest(meta: dict, indexes: list[dict]) -> dict:
    tensors = {name: dict(t) for name, t in meta["tensors"].items()}
    for t in tensors.values():
        if t["kind"] == "param":
            t["state"], t["scalars"] = {}, {}
    files, chunks = [], []
    for fi, ix in enumerate(indexes):
        files.append(ix["file"])
        for c in ix["chunks"]:
            chunks.append(c[:5] + [fi, c[6]])
        for name, keys in ix["state"].items():
            tensors[name]["state"].update(keys)
        for name, keys in ix["scalars"].items():
            for k, v in keys.items():
                tensors[name]["scalars"].setdefault(k, v)
    return {"format": FORMAT, "version": VERSION, "source": meta["source"], "block_bytes": meta["block_bytes"],
            "files": files, "tensors": tensors, "aliases": meta["aliases"], "chunks": chunks,
            "param_groups": meta["param_groups"], "optimizer": meta["optimizer"], "extra": meta["extra"],
            "save_id": meta["save_id"]}


def is_checkpoint(root_fd: int, name: str) -> bool:
    """NAME is a directory holding a manifest that parses as a zeroplus checkpoint (of any version,
    of any size: a manifest of 35k tensors is over 16 MiB), read without following a link."""
    try:
        fd = files.open_directory_at(root_fd, name)
    except OSError:
        return False
    try:
        return _read_manifest_json(fd).get("format") == FORMAT
    except (OSError, ValueError, AttributeError, RecursionError):
        return False
    finally:
        os.close(fd)


def _read_manifest_json(dir_fd: int):
    """The parsed JSON of dir_fd/manifest.json (a regular file, never a link or FIFO), unchecked."""
    mf = files.open_regular_at(dir_fd, MANIFEST)
    try:
        return json.loads(fsutil.read_exact(mf, os.fstat(mf).st_size, 0, MANIFEST))
    finally:
        os.close(mf)


def commit(root_fd: int, staging: str, staging_fd: int, name: str, world_size: int, meta: dict,
           timeout_s: float, where: str) -> None:
    """Rank 0: everything after its own shard (see the module doc). Removes staging on failure."""
    latest_tmp = None
    try:
        indexes = _gather_indexes(staging_fd, world_size, timeout_s, where)
        for r in range(world_size):
            fsutil.remove_quietly(staging_fd, index_name(r))
        fsutil.write_small_file(staging_fd, MANIFEST, manifest_for_save(build_manifest(meta, indexes)), sync_dir=False)
        # One fsync of the staging directory makes every entry in it durable: each rank's shard
        # (renamed into place after its fdatasync, which its index announced), the manifest, and
        # the removal of the indexes; only then does the rename below make NAME visible.
        os.fsync(staging_fd)
        # latest's new bytes are on disk before NAME changes, so that after NAME changes only a
        # rename and an fsync are left to fail; a directory in latest's place (which no rename
        # can replace) is refused now, while nothing has changed.
        _check_latest_replaceable(root_fd, where)
        latest_tmp = fsutil.write_temporary(root_fd, LATEST, (name + "\n").encode())
        replaced = False
        try:
            os.rename(staging, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)  # NAME absent or an empty dir
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not is_checkpoint(root_fd, name):
                raise FileExistsError(e.errno, "checkpoint: destination exists and is not a zeroplus checkpoint; "
                                               "refusing to replace it", where) from None
            # A complete checkpoint is there: swap the new one in atomically (NAME is always one
            # complete checkpoint or the other); the old one now sits under the staging name.
            fsutil.exchange(root_fd, staging, name)
            replaced = True
    except BaseException:
        files.remove_tree_at(root_fd, staging)
        if latest_tmp is not None:
            fsutil.remove_quietly(root_fd, latest_tmp)
        raise
    try:
        os.fsync(root_fd)  # NAME's new entry durable before latest names it
        fsutil.publish(root_fd, latest_tmp, LATEST, replace=True)
    except OSError as e:
        fsutil.remove_quietly(root_fd, latest_tmp)
        raise CheckpointError(f"checkpoint: {where} was saved and is complete (loadable by its path"
                              f"{'; it replaced the checkpoint that was there' if replaced else ''}), but "
                              f"{LATEST} in its directory could not be updated to name it ({e}); {LATEST} names what "
                              f"it named before") from e
    finally:
        if replaced:
            files.remove_tree_at(root_fd, staging)


def _check_latest_replaceable(root_fd: int, where: str) -> None:
    try:
        st = os.stat(LATEST, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise FileExistsError(errno.EEXIST, f"checkpoint: {LATEST} next to {where} is a directory; refusing to save "
                                            f"(it cannot name the new checkpoint)", os.path.join(os.path.dirname(where),
                                                                                               LATEST))


def _save_id(where: str):
    """The save_id in WHERE/manifest.json, or None (no manifest, or one that does not parse).
    Read through zeroplus.files: never through a link, never blocking on a FIFO."""
    try:
        root_fd = files.open_directory(os.path.dirname(where))
        try:
            fd = files.open_directory_at(root_fd, os.path.basename(where))
        finally:
            os.close(root_fd)
        try:
            return _read_manifest_json(fd).get("save_id")
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


def wait_committed(root: str, staging: str, name: str, timeout_s: float) -> None:
    """Rank > 0: until rank 0 is done with this save: it removes (or renames) the staging
    directory in every outcome, after which ROOT/NAME holds this save's manifest (its save_id
    is the staging directory's name) on success, and anything else (nothing, or the checkpoint
    that was to be replaced) on failure."""
    where = os.path.join(root, name)
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while os.path.lexists(os.path.join(root, staging)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint: rank 0 did not commit {where} within {timeout_s:.0f} s")
        _sleep(attempt)
        attempt += 1
    if _save_id(where) != staging:
        raise CheckpointError(f"checkpoint: rank 0 did not commit {where} (see rank 0's error)")
