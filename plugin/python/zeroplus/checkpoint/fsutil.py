"""File-system primitives of the checkpoint writer: exclusive creation, durability, atomic rename.

Contract (docs/checkpoints.md, "Guarantees"):
  * every file and directory zeroplus creates is created exclusively (O_CREAT|O_EXCL, mkdir) and
    never through a symlink: files are opened with O_NOFOLLOW relative to a directory descriptor
    that was itself opened O_DIRECTORY|O_NOFOLLOW and checked with fstat (a directory, owned by
    this user); directories are created 0700;
  * temporary names carry 64 random bits (secrets.token_hex), so they cannot be predicted;
  * a file becomes visible under its final name only after its bytes are on disk: write to the
    temporary name, fdatasync, rename, fsync the directory (rename alone is not durable until
    the directory entry is).

Torch-free and distribution-free: the writer and reader call these with explicit paths.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import stat
import time

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(path: str, *, dir_fd: int | None = None, own: bool = True) -> int:
    """A descriptor of directory `path` (relative to dir_fd when given), refusing a symlink.
    own: also refuse a directory owned by another user (one zeroplus is about to write into)."""
    try:
        fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotADirectoryError(errno.ENOTDIR, "checkpoint: refusing a symlink where a directory was expected",
                                     path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or (own and st.st_uid != os.geteuid()):
        os.close(fd)
        raise PermissionError(errno.EPERM, f"checkpoint: directory is owned by uid {st.st_uid}, not this user "
                                           f"({os.geteuid()})", path)
    return fd


def make_private_dir(parent_fd: int, name: str) -> int:
    """mkdir `name` (0700) inside parent_fd, exclusively, and return its verified descriptor."""
    os.mkdir(name, 0o700, dir_fd=parent_fd)
    return open_dir(name, dir_fd=parent_fd)


_TEMP = re.compile(r"^\..+\.tmp-[0-9a-f]{16}$")


def temp_name(final: str) -> str:
    return f".{final}.tmp-{secrets.token_hex(8)}"


def lock(fd: int, wait: bool = True) -> bool:
    """flock(LOCK_EX) on fd (a staging directory: held by the save that owns it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False


STALE_TEMP_FILE_S = 600  # a temporary file (of `latest`) untouched this long belongs to a killed save


def remove_stale_temp_dirs(dir_fd: int, keep: str) -> list[str]:
    """Remove what zeroplus left in dir_fd when a save was killed: temporary directories (names
    it generates, owned by this user, not locked by a save in flight: the save's rank 0 holds a
    flock on its staging directory until it commits or cleans up) and temporary regular files of
    ours (`latest`'s, written in milliseconds) not modified for STALE_TEMP_FILE_S. Returns them."""
    removed = []
    now = time.time()
    for entry in os.listdir(dir_fd):
        if entry == keep or not _TEMP.match(entry):
            continue
        try:
            st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            if st.st_uid == os.geteuid() and now - st.st_mtime > STALE_TEMP_FILE_S:
                remove_quietly(dir_fd, entry)
                removed.append(entry)
            continue
        try:
            fd = open_dir(entry, dir_fd=dir_fd)  # a directory of ours, or skipped
        except OSError:
            continue
        try:
            stale = lock(fd, wait=False)
        finally:
            os.close(fd)  # the lock goes with it; a save starting now creates its own directory
        if stale:
            remove_tree(dir_fd, entry)
            removed.append(entry)
    if removed:
        os.fsync(dir_fd)
    return removed


def create_exclusive(dir_fd: int, name: str) -> int:
    """A new regular file `name` in dir_fd (0600), never an existing file or a symlink."""
    fd = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # cannot happen with O_EXCL; checked anyway, it is cheap
        os.close(fd)
        raise PermissionError(errno.EPERM, "checkpoint: created file is not a regular file", name)
    return fd


def open_read(dir_fd: int, name: str) -> int:
    """Open an existing regular file in dir_fd for reading, refusing symlinks and non-files."""
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(errno.EISDIR, "checkpoint: not a regular file", name)
    return fd


def write_all(fd: int, data, offset: int) -> None:
    """pwrite until every byte is written (a short write is not an error by itself)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"checkpoint: pwrite wrote {n} bytes at offset {offset + done}")
        done += n


def publish(dir_fd: int, tmp: str, final: str, *, replace: bool = False) -> None:
    """Rename tmp -> final inside dir_fd and make the rename durable (fsync of the directory).
    Without replace, an existing `final` is never replaced (renameat2 RENAME_NOREPLACE semantics
    via link + unlink: link() fails with EEXIST)."""
    if replace:
        os.rename(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    else:
        os.link(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        os.unlink(tmp, dir_fd=dir_fd)
    os.fsync(dir_fd)


def write_small_file(dir_fd: int, final: str, data: bytes, *, replace: bool = False) -> None:
    """The whole crash-consistent sequence for a small file: temp -> fdatasync -> rename -> fsync dir."""
    tmp = temp_name(final)
    fd = create_exclusive(dir_fd, tmp)
    try:
        try:
            write_all(fd, data, 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        publish(dir_fd, tmp, final, replace=replace)
    except BaseException:
        remove_quietly(dir_fd, tmp)
        raise


def remove_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def remove_tree(dir_fd: int, name: str) -> None:
    """Remove a directory zeroplus created (its regular files, then itself), never following links."""
    try:
        fd = open_dir(name, dir_fd=dir_fd)
    except OSError:
        return
    try:
        for entry in os.listdir(fd):
            try:
                os.unlink(entry, dir_fd=fd)
            except IsADirectoryError:
                remove_tree(fd, entry)
            except OSError:
                pass
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
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
