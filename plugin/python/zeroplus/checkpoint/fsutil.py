"""Durability primitives of the checkpoint writer: temporary names, atomic rename, fsync, reads.

Contract (docs/checkpoints.md, "Guarantees"):
  * creating and opening is zeroplus.files' (the one owner of those rules, docs/security.md):
    files O_CREAT|O_EXCL|O_NOFOLLOW and directories 0700, exclusively, relative to a directory
    descriptor opened O_DIRECTORY|O_NOFOLLOW and checked with fstat; nothing here opens a name
    except through it (os.stat/unlink/rename/link on names never follow a link);
  * temporary names are ".<final>.tmp-" + 64 random bits (temp_prefix / temp_name), so they
    cannot be predicted, and remove_stale_temp_dirs recognises them;
  * a file becomes visible under its final name only after its bytes are on disk: write to the
    temporary name, fdatasync, rename, fsync the directory (rename alone is not durable until
    the directory entry is).

Distribution-free: the writer and reader call these with explicit descriptors.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import stat
import time

from .. import files

_TEMP = re.compile(r"^\..+\.tmp-[0-9a-f]{16}$")


def temp_prefix(final: str) -> str:
    """The prefix of `final`'s temporary names (files.create_temporary_at adds 16 hex digits)."""
    return f".{final}.tmp-"


def temp_name(final: str) -> str:
    """A temporary name for `final` chosen before it is created (a staging directory)."""
    return files.temporary_name(temp_prefix(final))


lock = files.lock  # flock(LOCK_EX) on a staging directory: held by the save that owns it


STALE_TEMP_FILE_S = 600  # a temporary file (of `latest`) untouched this long belongs to a killed save
_LATEST_TEMP = re.compile(r"^\.latest\.tmp-[0-9a-f]{16}$")
_NEW = re.compile(r"^\..+\.new-[0-9a-f]{16}$")


def new_locked_directory(dir_fd: int, final: str) -> tuple[str, int]:
    """A new private directory for `final`'s staging, locked (flock) before it appears under a
    name remove_stale_temp_dirs recognises: created as ".<final>.new-<random>" (which it leaves
    alone until STALE_TEMP_FILE_S old), locked, then renamed to temp_name(final) without replacing
    anything. Another job sweeping the same directory can therefore never find it unlocked.
    Returns (name, locked descriptor)."""
    pending = files.temporary_name(f".{final}.new-")
    fd = files.make_private_directory_at(dir_fd, pending)
    try:
        lock(fd)
        name = temp_name(final)
        rename_noreplace(dir_fd, pending, name)
    except BaseException:
        os.close(fd)
        files.remove_tree_at(dir_fd, pending)
        raise
    return name, fd


def remove_stale_temp_dirs(dir_fd: int, keep: str) -> list[str]:
    """Remove what zeroplus left in dir_fd when a save was killed: staging directories (names it
    generates, owned by this user, not locked by a save in flight: the save's rank 0 holds a
    flock on its staging directory from before it has that name until it commits or cleans up;
    a ".new-" directory of new_locked_directory's only once STALE_TEMP_FILE_S old) and temporary
    files of `latest` (written in milliseconds) not modified for STALE_TEMP_FILE_S. Other files
    with temporary names (a running consolidate's output, a user's) are left alone. Returns them."""
    removed = []
    now = time.time()
    for entry in os.listdir(dir_fd):
        if entry == keep or not (_TEMP.match(entry) or _NEW.match(entry)):
            continue
        try:
            st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        old = now - st.st_mtime > STALE_TEMP_FILE_S
        if stat.S_ISREG(st.st_mode):
            if _LATEST_TEMP.match(entry) and st.st_uid == os.geteuid() and old:
                remove_quietly(dir_fd, entry)
                removed.append(entry)
            continue
        if _NEW.match(entry) and not old:
            continue  # being locked by the save that created it
        try:
            fd = files.open_directory_at(dir_fd, entry, owned=True)  # a directory of ours, or skipped
        except OSError:
            continue
        try:
            stale = lock(fd, wait=False)
        finally:
            os.close(fd)  # the lock goes with it; a save starting now creates its own directory
        if stale:
            files.remove_tree_at(dir_fd, entry)
            removed.append(entry)
    if removed:
        os.fsync(dir_fd)
    return removed


def write_all(fd: int, data, offset: int) -> None:
    """pwrite until every byte is written (a short write is not an error by itself)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"checkpoint: pwrite wrote {n} bytes at offset {offset + done}")
        done += n


def publish(dir_fd: int, tmp: str, final: str, *, replace: bool = False, sync_dir: bool = True) -> None:
    """Rename tmp -> final inside dir_fd and make the rename durable (fsync of the directory;
    sync_dir=False leaves that to the caller, who fsyncs the directory once for many renames).
    Without replace, an existing `final` is never replaced (renameat2 RENAME_NOREPLACE semantics
    via link + unlink: link() fails with EEXIST)."""
    if replace:
        os.rename(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    else:
        os.link(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        os.unlink(tmp, dir_fd=dir_fd)
    if sync_dir:
        os.fsync(dir_fd)


def write_small_file(dir_fd: int, final: str, data: bytes, *, replace: bool = False, durable: bool = True,
                     sync_dir: bool = True) -> None:
    """The whole crash-consistent sequence for a small file: temp -> fdatasync -> rename -> fsync
    dir. durable=False skips the fdatasync (a file only other processes read, never after a
    crash); sync_dir=False leaves the directory's fsync to the caller (publish)."""
    tmp = write_temporary(dir_fd, final, data, durable=durable)
    try:
        publish(dir_fd, tmp, final, replace=replace, sync_dir=sync_dir and durable)
    except BaseException:
        remove_quietly(dir_fd, tmp)
        raise


def write_temporary(dir_fd: int, final: str, data: bytes, *, durable: bool = True) -> str:
    """`data` in a new temporary file for `final` (fdatasync'ed unless durable=False); returns
    its name, for publish(). Nothing is left behind on an error."""
    fd, tmp = files.create_temporary_at(dir_fd, temp_prefix(final))
    try:
        try:
            write_all(fd, data, 0)
            if durable:
                os.fdatasync(fd)
        finally:
            os.close(fd)
    except BaseException:
        remove_quietly(dir_fd, tmp)
        raise
    return tmp


def remove_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def read_exact(fd: int, length: int, offset: int, name: str) -> bytearray:
    """length bytes at offset; a short file is a truncated checkpoint (an OSError naming it)."""
    buf = bytearray(length)
    read_into(fd, memoryview(buf), offset, name)
    return buf


def read_into(fd: int, view: memoryview, offset: int, name: str) -> None:
    """Fill `view` from offset, retrying short reads; end of file first: truncated (OSError)."""
    done, length = 0, len(view)
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"checkpoint: file is truncated: wanted {length} bytes at offset {offset}, "
                                     f"it ends at {offset + done}", name)
        done += n


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def exchange(dir_fd: int, a: str, b: str) -> None:
    """Atomically swap the entries a and b of dir_fd (renameat2 RENAME_EXCHANGE): at every
    instant each name is one of the two complete directories. OSError if the kernel, the C
    library or the file system cannot."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "checkpoint: renameat2 is not available in this C library")
    if fn(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"checkpoint: renameat2(RENAME_EXCHANGE) failed: {os.strerror(err)}", b)


def rename_noreplace(dir_fd: int, a: str, b: str) -> None:
    """Rename entry a of dir_fd to b, failing (FileExistsError) when b exists: renameat2
    RENAME_NOREPLACE, or, where the kernel or file system lacks it, a check then rename()."""
    fn = getattr(_libc, "renameat2", None)
    if fn is not None:
        if fn(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, f"checkpoint: renameat2(RENAME_NOREPLACE) failed: {os.strerror(err)}", b)
    if _exists_at(dir_fd, b):
        raise FileExistsError(errno.EEXIST, "checkpoint: refusing to replace an existing name", b)
    os.rename(a, b, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


@contextlib.contextmanager
def new_output_directory(parent: str, name: str):
    """The new private directory parent/name (exclusive mkdir, 0700, verified), as a descriptor
    for the body to write into. `parent` is opened under the link rule (files.open_directory:
    the user's or root's link is followed, another user's refused). On an exception the directory
    and all in it are removed; on success the parent is fsynced, so the new entry is durable."""
    parent_fd = files.open_directory(parent)
    try:
        dir_fd = files.make_private_directory_at(parent_fd, name)
        try:
            yield dir_fd
        except BaseException:
            os.close(dir_fd)
            dir_fd = None
            files.remove_tree_at(parent_fd, name)
            raise
        finally:
            if dir_fd is not None:
                os.close(dir_fd)
        os.fsync(parent_fd)
    finally:
        os.close(parent_fd)
