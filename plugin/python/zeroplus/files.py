"""Creating files and directories in places other users can write to (``zeroplus.files``).

The Python face of ``common/core/exclusive_file.hpp`` (docs/security.md): checkpoint and
offload code written in Python creates its files by these rules, never with a plain ``open``:

* ``create_exclusive(directory, name)`` creates the new regular file ``directory/name``
  (``O_CREAT|O_EXCL|O_NOFOLLOW`` relative to a descriptor of ``directory``) and returns an open
  ``O_RDWR`` descriptor; any existing name, a symbolic link included, raises
  ``FileExistsError`` and is left untouched.
* ``create_temporary(directory, prefix)`` does the same under ``prefix`` + 16 random hex digits
  and returns ``(fd, name)``: nobody can plant the name in advance.
* ``private_directory(parent, name)`` creates ``parent/name`` with mode 0700, or opens an
  existing one, and returns a descriptor of it after checking it is a directory owned by this
  user with no group/other bits (``PermissionError`` / ``NotADirectoryError`` otherwise). Use it
  as ``dir_fd=`` for ``os.open`` and ``create_exclusive``'s peers.

``directory`` itself is followed only when its last component is not a symbolic link, or is one
owned by this user or root.

* ``open_directory(path, owned=False)`` opens the existing directory ``path`` by that same rule
  (what a checkpoint ROOT, a checkpoint NAME being read and an output's directory are opened
  with: ``~/ckpt -> /scratch/ckpt`` works); a link of another user raises ``PermissionError``,
  a non-directory ``NotADirectoryError``. ``own_link_target(path)`` is the path it opens.

The descriptor-relative peers (``openat``-style; what checkpoint/ and offload/ use, so that a
path component renamed after the directory was opened cannot redirect the next call) never
follow a symbolic link in the name they are given:

* ``open_directory_at(dir_fd, path, owned=False)`` opens a directory (``dir_fd=None``: the
  working directory); a symbolic link or non-directory raises ``NotADirectoryError``; with
  ``owned``, one of another user ``PermissionError``.
* ``make_private_directory_at(dir_fd, name)`` creates the new directory ``name`` (0700,
  exclusively: any existing name raises ``FileExistsError``) and returns it verified.
* ``create_exclusive_at(dir_fd, name, mode=0o600)`` / ``create_temporary_at(dir_fd, prefix,
  mode=0o600)``: as their path-based namesakes (``O_CREAT|O_EXCL|O_NOFOLLOW``, ``O_RDWR``).
* ``open_regular_at(dir_fd, name, owned=False)`` opens an existing regular file read-only
  (``O_NOFOLLOW``, never blocking on a FIFO): a link raises ``OSError`` (ELOOP), anything else
  that is not a regular file ``OSError`` (EINVAL).
* ``remove_tree_at(dir_fd, name)`` removes a directory of this user and everything in it
  without following any link (a link inside is unlinked, never its target; a directory of
  another user is left); best effort, returns whether ``name`` is gone.
* ``temporary_name(prefix)`` is ``prefix`` + 16 random hex digits, for names chosen before
  the object is created (a staging directory).
* ``lock(fd, wait=True)`` takes ``flock(LOCK_EX)`` on an open descriptor (a directory's): the
  liveness mark of a directory a running job owns (a checkpoint's staging directory, a swap
  directory), held until the descriptor is closed, released by the kernel when the process dies
  in any way. Unlike a pid it means the same in every PID namespace (containers sharing one
  disk). ``wait=False`` returns ``False`` instead of waiting when someone holds it.

Descriptors belong to the caller (``os.fdopen(fd, "wb")`` or ``os.close``). Errors are
``OSError`` subclasses chosen by errno, naming the path; bad argument types raise
``TypeError``, empty or out-of-range ones ``ValueError``. The shared library must be loaded
(``import zeroplus`` does it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
from typing import Optional, Tuple, Union

import torch

__all__ = ["create_exclusive", "create_temporary", "private_directory", "open_directory", "own_link_target",
           "open_directory_at",
           "make_private_directory_at", "create_exclusive_at", "create_temporary_at", "open_regular_at",
           "remove_tree_at", "temporary_name", "lock"]

PathLike = Union[str, "os.PathLike[str]"]
_ERRNO = re.compile(r"\(errno (\d+)\)")
_PATH = re.compile(r"failed on '([^']*)'")


def _path(arg: str, value) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{arg} must be a str or os.PathLike, got {type(value).__name__}")
    path = os.fspath(value)
    if not path:
        raise ValueError(f"{arg} must not be empty")
    return path


def _name(arg: str, value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str, got {type(value).__name__}")
    if not value or "/" in value or value in (".", ".."):
        raise ValueError(f"{arg} must be one path component (no '/', not '.' or '..'), got {value!r}")
    return value


def _fd(value, allow_none: bool = False) -> int:
    if value is None and allow_none:
        return -1
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"dir_fd must be an int (an open directory descriptor), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"dir_fd must be >= 0, got {value}")
    return value


def _prefix(value) -> str:
    if not isinstance(value, str) or "/" in value:
        raise ValueError(f"prefix must be a str without '/', got {value!r}")
    return value


def _mode(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"mode must be an int, got {type(value).__name__}")
    if not 0 <= value <= 0o7777:
        raise ValueError(f"mode must be in [0, 0o7777], got {oct(value)}")
    return value


def call_op(fn, *args):
    """fn(*args) for a zeroplus op or custom-class method: its RuntimeError whose text ends in
    "(errno N)" ("zeroplus <op> failed on '<file>': ...", or an aio error's "... failed on '<file>'
    ...") is raised as the OSError subclass of that errno, naming the file; any other error as it
    is. The one mapping of C++ file errors for the package (files, aio, checkpoint shard_io)."""
    try:
        return fn(*args)
    except RuntimeError as e:
        text = str(e).split("\nException raised from", 1)[0].strip()
        m = _ERRNO.search(text)
        if not m:
            raise
        p = _PATH.search(text)
        raise OSError(int(m.group(1)), text, p.group(1) if p else None) from None


def create_exclusive(directory: PathLike, name: str, mode: int = 0o644) -> int:
    """Creates the new file ``directory/name`` (``mode`` less the umask); returns its fd."""
    return call_op(torch.ops.zeroplus.create_exclusive, _path("directory", directory), _name("name", name), _mode(mode))


def create_temporary(directory: PathLike, prefix: str, mode: int = 0o644) -> Tuple[int, str]:
    """Creates ``directory/<prefix><16 random hex digits>``; returns ``(fd, name)``."""
    fd, name = call_op(torch.ops.zeroplus.create_temporary, _path("directory", directory), _prefix(prefix), _mode(mode))
    return int(fd), str(name)


def private_directory(parent: PathLike, name: str) -> int:
    """Creates or opens ``parent/name`` as a verified 0700 directory of this user; returns its fd."""
    return call_op(torch.ops.zeroplus.private_directory, _path("parent", parent), _name("name", name))


_MAX_LINKS = 40  # the kernel's own limit on links followed while resolving one path


def own_link_target(path: PathLike) -> str:
    """``path`` with its last component resolved while it is a symbolic link owned by this user
    or root (the user's own ``~/ckpt -> /scratch/ckpt``); a link of anyone else raises
    ``PermissionError`` naming it and is never followed. Components before the last resolve as
    the kernel resolves them."""
    path = _path("path", path)
    for _ in range(_MAX_LINKS):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return path
        if not stat.S_ISLNK(st.st_mode):
            return path
        if st.st_uid not in (os.geteuid(), 0):
            raise PermissionError(errno.EPERM, f"symbolic link owned by uid {st.st_uid} (neither this user nor root); "
                                               f"not followed", path)
        target = os.readlink(path)
        again = os.lstat(path)  # the link we checked is the one we read (not swapped in between)
        if (again.st_ino, again.st_dev, again.st_uid) != (st.st_ino, st.st_dev, st.st_uid):
            raise PermissionError(errno.EPERM, "symbolic link replaced while it was being read; not followed", path)
        path = os.path.join(os.path.dirname(path.rstrip("/")) or ".", target)
    raise OSError(errno.ELOOP, f"more than {_MAX_LINKS} symbolic links in a row", path)


def open_directory(path: PathLike, owned: bool = False) -> int:
    """Opens the existing directory ``path``, following its last component only while it is a
    link of this user or root (own_link_target); returns its descriptor."""
    return open_directory_at(None, own_link_target(path), owned)


# -- descriptor-relative (openat) ------------------------------------------------------------------

def open_directory_at(dir_fd: Optional[int], path: PathLike, owned: bool = False) -> int:
    """Opens directory ``path`` relative to ``dir_fd`` without following a link in its last component."""
    return call_op(torch.ops.zeroplus.open_directory_at, _fd(dir_fd, allow_none=True), _path("path", path), bool(owned))


def make_private_directory_at(dir_fd: int, name: str) -> int:
    """Creates the new directory ``dir_fd/name`` (0700, exclusively); returns its verified fd."""
    return call_op(torch.ops.zeroplus.make_private_directory_at, _fd(dir_fd), _name("name", name))


def create_exclusive_at(dir_fd: int, name: str, mode: int = 0o600) -> int:
    """Creates the new file ``dir_fd/name`` (``O_CREAT|O_EXCL|O_NOFOLLOW``); returns its fd."""
    return call_op(torch.ops.zeroplus.create_exclusive_at, _fd(dir_fd), _name("name", name), _mode(mode))


def create_temporary_at(dir_fd: int, prefix: str, mode: int = 0o600) -> Tuple[int, str]:
    """Creates ``dir_fd/<prefix><16 random hex digits>``; returns ``(fd, name)``."""
    fd, name = call_op(torch.ops.zeroplus.create_temporary_at, _fd(dir_fd), _prefix(prefix), _mode(mode))
    return int(fd), str(name)


def open_regular_at(dir_fd: int, name: str, owned: bool = False) -> int:
    """Opens the existing regular file ``dir_fd/name`` read-only, never through a link."""
    return call_op(torch.ops.zeroplus.open_regular_at, _fd(dir_fd), _name("name", name), bool(owned))


def remove_tree_at(dir_fd: int, name: str) -> bool:
    """Removes directory ``dir_fd/name`` of this user and all in it, never following a link."""
    try:
        fd = open_directory_at(_fd(dir_fd), _name("name", name), owned=True)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # a link, not a directory, or another user's: left as it is
    try:
        for entry in os.listdir(fd):
            try:
                os.unlink(entry, dir_fd=fd)  # unlink removes a link itself, never its target
            except IsADirectoryError:
                remove_tree_at(fd, entry)
            except OSError:
                pass
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def temporary_name(prefix: str) -> str:
    """``prefix`` + 16 random hex digits (64 bits from the kernel): nobody can plant it in advance."""
    return _prefix(prefix) + secrets.token_hex(8)


def lock(fd: int, wait: bool = True) -> bool:
    """flock(LOCK_EX) on ``fd``; ``wait=False``: ``False`` at once when another open file holds it.
    Locks of two opens conflict even inside one process, so every owner must hold its own."""
    try:
        fcntl.flock(_fd(fd), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
