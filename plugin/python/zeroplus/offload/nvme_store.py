"""One rank's private swap directory under nvme_path, and the swap files inside it.

    <nvme_path>/zeroplus-swap-<host>-<pid>-<random>-rank<r>/     mode 0700, owned by us
        optimizer-b00003.swp                                      mode 0600, one per bucket

Security and lifetime contract:
  * nvme_path itself must be a directory, opened by files.open_directory: a symlink to one is
    followed only when it belongs to this user or root (`/local_nvme -> /mnt/nvme0`), another
    user's raises PermissionError naming nvme_path (docs/security.md: one rule for every path a
    user names). Everything below it is created by us through zeroplus.files (the one owner of
    these rules), exclusively and never through a symlink: the rank directory with
    make_private_directory_at (mkdir of a random name, which fails on any existing name, then
    opened O_DIRECTORY|O_NOFOLLOW and verified with fstat: a directory, owned by our uid, mode
    0700); files with create_exclusive_at (openat O_CREAT|O_EXCL|O_NOFOLLOW, 0600).
  * AioHandle opens files by path. The path handed to it goes through /proc/self/fd/<dir_fd>
    (where /proc is mounted), so it names the directory we verified even if a component of
    nvme_path is replaced afterwards; nobody else can add or replace an entry inside a 0700
    directory we own.
  * Liveness is a lock, not a pid: the rank holds flock(LOCK_EX) on its directory (files.lock
    on dir_fd) from creation until close, and the kernel drops it when the process dies in any
    way. A pid says nothing across PID namespaces: two containers sharing a host name and one
    nvme_path see each other's pids as dead (issue 40), a lock is the same object for both.
  * close() (also run by a finalizer at garbage collection and interpreter exit) unlinks the
    files relative to dir_fd and removes the directory, then drops the lock. A crashed run
    leaves its directory: the next SwapDirectory created under the same nvme_path by the same
    user with the same host name removes every `zeroplus-swap-<host>-...` directory whose lock
    it can take (only real directories owned by us; files.remove_tree_at unlinks their contents
    without following links), holding that lock until the directory is gone. mkdir and flock
    are two calls, so such a sweep can remove a directory created a moment before its owner
    locked it: the owner, when the directory it just made is gone before it could open it, or
    once it holds the lock (the sweep held it until its removal was complete) is no longer in
    place, makes another.
Errors are OSError subclasses naming the path; nothing outside the rank directory is touched.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import weakref

from .. import files

PREFIX = "zeroplus-swap-"
# The pid in the name is for people reading `ls`; liveness is the directory's lock (module doc).
_OURS = re.compile(r"^zeroplus-swap-(?P<host>[A-Za-z0-9_.-]+)-(?P<pid>\d+)-[0-9a-f]{16}-rank\d+$")
_CREATE_ATTEMPTS = 8


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def _in_place(parent_fd: int, name: str, dir_fd: int) -> bool:
    """Whether `name` in parent_fd is still the directory dir_fd (not removed by a sweep)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return os.path.samestat(st, os.fstat(dir_fd))


def _cleanup(parent_fd: int, dir_fd: int, name: str, names: set) -> None:
    """Finalizer: must not reference the SwapDirectory (it would keep it alive)."""
    for f in list(names):
        try:
            os.unlink(f, dir_fd=dir_fd)
        except OSError:
            pass
    names.clear()
    files.remove_tree_at(parent_fd, name)
    for fd in (dir_fd, parent_fd):
        try:
            os.close(fd)
        except OSError:
            pass


class SwapDirectory:
    """This rank's swap directory (see the module doc). Not thread-safe: one owner."""

    def __init__(self, nvme_path: str, rank: int, what: str = "offload_optimizer"):
        self.nvme_path = os.path.abspath(os.fspath(nvme_path))
        self.what = what
        try:
            parent_fd = files.open_directory(self.nvme_path)  # the one rule for links (module doc)
        except FileNotFoundError as e:
            raise FileNotFoundError(e.errno, f"{what}: nvme_path {self.nvme_path!r} does not exist", self.nvme_path) \
                from None
        except NotADirectoryError as e:
            raise NotADirectoryError(e.errno, f"{what}: nvme_path {self.nvme_path!r} is not a directory",
                                     self.nvme_path) from None
        except PermissionError as e:
            raise PermissionError(e.errno, f"{what}: nvme_path {self.nvme_path!r}: {e.strerror}", self.nvme_path) \
                from None
        try:
            self.reclaimed = self._reclaim_stale(parent_fd)
            dir_fd, name = self._make_locked(parent_fd, int(rank))
        except BaseException:
            os.close(parent_fd)
            raise
        path = os.path.join(self.nvme_path, name)
        self.name = name
        self.path = path
        self._parent_fd = parent_fd
        self._dir_fd = dir_fd
        self._files: set[str] = set()
        proc = f"/proc/self/fd/{dir_fd}"
        self._io_root = proc if os.path.isdir(proc) and os.path.samestat(os.stat(proc), os.fstat(dir_fd)) else path
        self._finalizer = weakref.finalize(self, _cleanup, parent_fd, dir_fd, name, self._files)

    def _make_locked(self, parent_fd: int, rank: int) -> tuple[int, str]:
        """Creates this rank's directory and locks it; returns (dir_fd, name). See the module
        doc for why the directory is looked for again once locked."""
        for _ in range(_CREATE_ATTEMPTS):
            name = files.temporary_name(f"{PREFIX}{_host()}-{os.getpid()}-") + f"-rank{rank}"
            path = os.path.join(self.nvme_path, name)
            try:
                dir_fd = files.make_private_directory_at(parent_fd, name)
            except FileNotFoundError as e:
                if os.fstat(parent_fd).st_nlink > 0:
                    continue  # swept between our mkdir and our open of it: make another
                raise FileNotFoundError(e.errno, f"{self.what}: nvme_path {self.nvme_path!r} was removed",
                                        self.nvme_path) from None
            except OSError as e:
                raise type(e)(e.errno, f"{self.what}: cannot create the swap directory {path!r}: "
                                       f"{os.strerror(e.errno)}", path) from None
            try:
                files.lock(dir_fd)  # waits only for a sweep that is removing it right now
                if _in_place(parent_fd, name, dir_fd):
                    return dir_fd, name
            except BaseException:
                os.close(dir_fd)
                raise
            os.close(dir_fd)
        raise OSError(errno.EAGAIN, f"{self.what}: the swap directory was removed by another job's stale-directory "
                                    f"sweep {_CREATE_ATTEMPTS} times in a row under {self.nvme_path!r}",
                      self.nvme_path)

    def _reclaim_stale(self, parent_fd: int) -> list[str]:
        """Removes the swap directories of our dead processes with this host name: those whose
        lock can be taken (see the module doc)."""
        host, removed = _host(), []
        try:
            names = os.listdir(parent_fd)
        except OSError:
            return removed
        for name in names:
            m = _OURS.match(name)
            if m is None or m.group("host") != host:
                continue
            try:
                fd = files.open_directory_at(parent_fd, name, owned=True)
            except OSError:
                continue  # a link, not a directory, another user's: never ours to remove
            try:
                # Held until the removal is complete: an owner that had not locked it yet
                # finds it gone (_make_locked).
                if files.lock(fd, wait=False) and files.remove_tree_at(parent_fd, name):
                    removed.append(name)
            finally:
                os.close(fd)
        return removed

    # -- files -------------------------------------------------------------------------------------

    def create(self, name: str, size: int) -> str:
        """Creates `name` exclusively (0600), reserves `size` bytes (ENOSPC shows here, not in a
        later write) and returns the path to hand to AioHandle."""
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"SwapDirectory.create: bad file name {name!r}")
        path = os.path.join(self.path, name)
        try:
            fd = files.create_exclusive_at(self._dir_fd, name, 0o600)
        except OSError as e:
            raise type(e)(e.errno, f"{self.what}: cannot create swap file {path!r}: {os.strerror(e.errno)}",
                          path) from None
        self._files.add(name)
        try:
            self._reserve(fd, size, path)
        except BaseException:
            os.close(fd)
            self.remove(name)
            raise
        os.close(fd)
        return self.io_path(name)

    def track(self, name: str) -> None:
        """`name` is a file that someone else creates in this directory (the C++ swap store,
        through its own descriptor of it): counted by disk_bytes, removed by close."""
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"SwapDirectory.track: bad file name {name!r}")
        self._files.add(name)

    def grow(self, name: str, size: int) -> None:
        """Reserves `size` bytes for an existing file of ours (a record that grew)."""
        path = os.path.join(self.path, name)
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        try:
            self._reserve(fd, size, path)
        finally:
            os.close(fd)

    def _reserve(self, fd: int, size: int, path: str) -> None:
        if size <= 0:
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise type(e)(e.errno, f"{self.what}: cannot reserve {size} bytes for swap file {path!r}: "
                                       f"{e.strerror}", path) from None
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)

    def replace(self, src: str, dst: str) -> None:
        """Renames our file `src` over our file `dst` (atomic, inside this directory)."""
        try:
            os.replace(src, dst, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError as e:
            path = os.path.join(self.path, dst)
            raise type(e)(e.errno, f"{self.what}: cannot replace swap file {path!r}: {os.strerror(e.errno)}",
                          path) from None
        self._files.discard(src)
        self._files.add(dst)

    def remove(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        self._files.discard(name)

    def io_path(self, name: str) -> str:
        return f"{self._io_root}/{name}"

    def display_path(self, name: str) -> str:
        """The path users see in error messages."""
        return os.path.join(self.path, name)

    def disk_bytes(self) -> int:
        """Bytes allocated on disk by our files."""
        total = 0
        for name in self._files:
            try:
                total += os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False).st_blocks * 512
            except OSError:
                pass
        return total

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Removes the files and the directory; idempotent."""
        self._finalizer()
