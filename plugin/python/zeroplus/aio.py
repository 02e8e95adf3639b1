"""Asynchronous tensor <-> file I/O on io_uring (``zeroplus.aio``).

``AioHandle`` follows DeepSpeed's ``aio_handle`` names::

    h = zeroplus.aio.AioHandle(block_size=1 << 20, queue_depth=32, threads=1)
    buf = h.new_cpu_locked_tensor(n, torch.float32)   # page-aligned, mlocked, exact size
    h.async_pwrite(buf, "/nvme/x.swp")                 # returns 0 at once
    h.wait()                                           # -> 1 (ops completed); raises OSError

``h.atomic_write(buf, path)`` replaces a whole file atomically (temp + fsync + rename), so an
error never destroys the old contents; ``async_pwrite`` writes in place. Only regular files and
block devices are accepted (FIFOs, sockets and character devices raise at the call).

Argument and open errors (missing file, permission denied) raise at the call; I/O errors
(read past end of file, EFBIG, ENOSPC, EIO) raise at ``wait()`` / ``sync_*``. Either way the
error is an ``OSError`` subclass chosen by errno (``FileNotFoundError``, ``PermissionError``,
...) whose message names the operation, path, offset, length and strerror. Knobs and the full
error policy: docs/aio.md. The shared library must be loaded (``import zeroplus`` does it).
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from .files import call_op

__all__ = ["AioHandle"]

PathLike = Union[str, "os.PathLike[str]"]

_ENGINES = ("auto", "io_uring", "threads")
_DIRECT = ("auto", "on", "off")


_INT64_MAX = (1 << 63) - 1


def _int_arg(name: str, value, minimum: int, maximum: int = _INT64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def _path_arg(name: str, value) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike, got {type(value).__name__}")
    path = os.fspath(value)
    if not path:
        raise ValueError(f"{name} must not be empty")
    return path


def _tensor_arg(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(value.stride())})")
    if value.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be on cpu or cuda, got {value.device}")
    return value


class AioHandle:
    """Queue of asynchronous tensor reads/writes sharing one I/O engine.

    Args:
        block_size: bytes per I/O request (default 1 MiB).
        queue_depth: requests in flight per I/O thread (default 32).
        threads: I/O threads, each with its own io_uring (default 1). DeepSpeed's
            ``intra_op_parallelism`` / ``thread_count`` are accepted as aliases.
        engine: ``"auto"`` (io_uring, else a pread/pwrite thread pool), ``"io_uring"`` or ``"threads"``.
        direct: O_DIRECT policy, ``"auto"`` (use it where the file system allows), ``"on"``, ``"off"``.
        staging_bytes: size of each of the two pinned staging buffers used for CUDA tensors and
            unaligned CPU tensors (default 16 MiB).

    Thread-safe. Tensors passed to ``async_*`` are kept alive by the handle until ``wait()``;
    do not touch their contents before then.
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 32, threads: int = 1, *,
                 engine: str = "auto", direct: str = "auto", staging_bytes: int = 16 << 20,
                 intra_op_parallelism: Optional[int] = None, thread_count: Optional[int] = None):
        for alias, value in (("intra_op_parallelism", intra_op_parallelism), ("thread_count", thread_count)):
            if value is not None:
                threads = value
        _int_arg("block_size", block_size, 1)
        _int_arg("queue_depth", queue_depth, 1)
        _int_arg("threads", threads, 1)
        _int_arg("staging_bytes", staging_bytes, 4096)
        if engine not in _ENGINES:
            raise ValueError(f"engine must be one of {_ENGINES}, got {engine!r}")
        if direct not in _DIRECT:
            raise ValueError(f"direct must be one of {_DIRECT}, got {direct!r}")
        self._h = call_op(torch.classes.zeroplus.AioHandle, block_size, queue_depth, threads, engine, direct,
                        staging_bytes)

    # I/O -------------------------------------------------------------------------------------
    def async_pread(self, tensor: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        """Queues a read of ``tensor.nbytes`` bytes at ``file_offset`` into ``tensor``; returns 0."""
        return call_op(self._h.async_pread, _tensor_arg("tensor", tensor), _path_arg("filename", filename),
                     _int_arg("file_offset", file_offset, 0))

    def async_pwrite(self, tensor: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        """Queues a write of ``tensor`` at ``file_offset`` (file created if missing, never truncated)."""
        return call_op(self._h.async_pwrite, _tensor_arg("tensor", tensor), _path_arg("filename", filename),
                     _int_arg("file_offset", file_offset, 0))

    def sync_pread(self, tensor: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        """``async_pread`` + ``wait()``; returns wait()'s count."""
        return call_op(self._h.sync_pread, _tensor_arg("tensor", tensor), _path_arg("filename", filename),
                     _int_arg("file_offset", file_offset, 0))

    def sync_pwrite(self, tensor: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        """``async_pwrite`` + ``wait()``; returns wait()'s count."""
        return call_op(self._h.sync_pwrite, _tensor_arg("tensor", tensor), _path_arg("filename", filename),
                     _int_arg("file_offset", file_offset, 0))

    def atomic_write(self, tensor: torch.Tensor, filename: PathLike) -> int:
        """Replaces ``filename`` with exactly ``tensor``'s bytes, all or nothing; returns 1.

        Writes a temporary file next to ``filename`` (space reserved first, so a full disk fails
        before any write), fsyncs it, renames it over ``filename`` and fsyncs the directory.
        Blocks until done and waits only for this write. On any error (``ENOSPC``, ``EFBIG``,
        ``EIO``...) the temporary file is removed and ``filename`` keeps its old contents.
        Use it instead of ``async_pwrite`` whenever an existing file must survive a failure:
        ``async_pwrite`` overwrites in place.
        """
        return call_op(self._h.atomic_write, _tensor_arg("tensor", tensor), _path_arg("filename", filename))

    def wait(self) -> int:
        """Blocks until every queued operation finished; returns how many did.

        Raises the first failure as OSError after all operations have finished.
        """
        return call_op(self._h.wait)

    def pending(self) -> int:
        """Operations queued since the last ``wait()``."""
        return self._h.pending()

    # Memory ----------------------------------------------------------------------------------
    def new_cpu_locked_tensor(self, numel: int, dtype: Union[torch.dtype, torch.Tensor] = torch.uint8) -> torch.Tensor:
        """1-D CPU tensor of exactly ``numel`` elements in page-aligned, mlocked memory.

        ``dtype`` may be a dtype or an example tensor (DeepSpeed's signature). The memory is
        registered with the I/O engine, so reads and writes of it are zero-copy.
        """
        _int_arg("numel", numel, 0)
        if isinstance(dtype, torch.Tensor):
            dtype = dtype.dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or a tensor, got {type(dtype).__name__}")
        return call_op(self._h.new_cpu_locked_tensor, numel, dtype)

    # Knobs -----------------------------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._h.get_block_size()

    def get_queue_depth(self) -> int:
        return self._h.get_queue_depth()

    def get_threads(self) -> int:
        return self._h.get_threads()

    get_intra_op_parallelism = get_threads
    get_thread_count = get_threads

    def get_direct(self) -> str:
        return self._h.get_direct()

    def get_staging_bytes(self) -> int:
        return self._h.get_staging_bytes()

    def get_engine(self) -> str:
        """The engine actually in use: ``"io_uring"`` or ``"threads"``."""
        return self._h.get_engine()

    def __repr__(self) -> str:
        return (f"AioHandle(engine={self.get_engine()!r}, block_size={self.get_block_size()}, "
                f"queue_depth={self.get_queue_depth()}, threads={self.get_threads()}, direct={self.get_direct()!r})")
