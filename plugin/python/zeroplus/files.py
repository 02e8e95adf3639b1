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
owned by this user or root. Descriptors belong to the caller (``os.fdopen(fd, "wb")`` or
``os.close``). Errors are ``OSError`` subclasses chosen by errno, naming the path; bad argument
types raise ``TypeError``, empty or out-of-range ones ``ValueError``. The shared library must
be loaded (``import zeroplus`` does it).
"""

from __future__ import annotations

import os
import re
from typing import Tuple, Union

import torch

__all__ = ["create_exclusive", "create_temporary", "private_directory"]

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


def _mode(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"mode must be an int, got {type(value).__name__}")
    if not 0 <= value <= 0o7777:
        raise ValueError(f"mode must be in [0, 0o7777], got {oct(value)}")
    return value


def _call(fn, *args):
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
    return _call(torch.ops.zeroplus.create_exclusive, _path("directory", directory), _name("name", name), _mode(mode))


def create_temporary(directory: PathLike, prefix: str, mode: int = 0o644) -> Tuple[int, str]:
    """Creates ``directory/<prefix><16 random hex digits>``; returns ``(fd, name)``."""
    if not isinstance(prefix, str) or "/" in prefix:
        raise ValueError(f"prefix must be a str without '/', got {prefix!r}")
    fd, name = _call(torch.ops.zeroplus.create_temporary, _path("directory", directory), prefix, _mode(mode))
    return int(fd), str(name)


def private_directory(parent: PathLike, name: str) -> int:
    """Creates or opens ``parent/name`` as a verified 0700 directory of this user; returns its fd."""
    return _call(torch.ops.zeroplus.private_directory, _path("parent", parent), _name("name", name))
