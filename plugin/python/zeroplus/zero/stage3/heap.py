"""Handing freed heap memory back to the OS while a model is built shard by shard."""

from __future__ import annotations

import ctypes


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def return_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim). Building unit by unit frees a
    full unit after each one; glibc keeps such blocks in its heap (its mmap threshold rises
    after the first large free), so without this the resident size would still grow by every
    unit ever built, which is exactly what building shard by shard is meant to avoid."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
