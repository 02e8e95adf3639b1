"""zeroplus::verified_read, the op behind CheckpointReader's reads (optimizers/core/checkpoint/
verified_read.hpp; its plan and errors are tested in tests/cpp/optimizers/verified_read_test.cpp):
Python threads keep running while it reads (the GIL is not held), and bad arguments are refused
with ValueError naming them.
"""

from __future__ import annotations

import os
import threading
import time
import zlib

import pytest
import torch

import zeroplus  # noqa: F401  (loads the library: torch.ops.zeroplus)

_BLOCK = 4 << 20


def _sparse_file(tmp_path, blocks: int) -> tuple[int, torch.Tensor]:
    """An open descriptor of a file of `blocks` blocks of zeros (a hole: nothing on disk) and its CRCs."""
    path = tmp_path / "holes.bin"
    with open(path, "wb") as f:
        f.truncate(blocks * _BLOCK)
    crcs = torch.full((blocks,), zlib.crc32(bytes(_BLOCK)), dtype=torch.int64)
    return os.open(path, os.O_RDONLY), crcs


def test_python_threads_run_while_the_op_reads(tmp_path):
    # One byte of each block: every block is read into a buffer and checked (1 GiB on one thread,
    # a few hundred ms), while the destination stays 256 bytes.
    blocks = 256
    fd, crcs = _sparse_file(tmp_path, blocks)
    dst = torch.zeros(blocks, dtype=torch.uint8)
    count, stop = [0], threading.Event()

    def counting():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=counting)
    t.start()
    try:
        time.sleep(0.05)
        before, t0 = count[0], time.perf_counter()
        rc, corrupt, message = torch.ops.zeroplus.verified_read(
            fd, blocks * _BLOCK, _BLOCK, crcs, [b * _BLOCK + 7 for b in range(blocks)],
            [b * _BLOCK + 8 for b in range(blocks)], [dst] * blocks, list(range(blocks)), 1)
        during, seconds = count[0] - before, time.perf_counter() - t0
    finally:
        stop.set()
        t.join(timeout=10)
        os.close(fd)
    assert (rc, corrupt, message) == (0, False, "")
    assert int(dst.sum()) == 0
    # Holding the GIL, the op would let the counter advance only at its edges (a few switch
    # intervals); released, it counts for the whole call.
    assert during > 10_000, f"the counting thread advanced {during} in {seconds:.3f} s of verified_read"


def test_bad_arguments_are_value_errors_naming_them(tmp_path):
    fd, crcs = _sparse_file(tmp_path, 2)
    try:
        small = torch.empty(10, dtype=torch.uint8)
        with pytest.raises(ValueError, match="does not fit its destination of 10 bytes"):
            torch.ops.zeroplus.verified_read(fd, 2 * _BLOCK, _BLOCK, crcs, [0], [11], [small], [0], 2)
        with pytest.raises(ValueError, match="outside the file"):
            torch.ops.zeroplus.verified_read(fd, 2 * _BLOCK, _BLOCK, crcs, [2 * _BLOCK], [2 * _BLOCK + 1], [small],
                                             [0], 2)
        with pytest.raises(ValueError, match="needs 2 block CRCs, got 1"):
            torch.ops.zeroplus.verified_read(fd, 2 * _BLOCK, _BLOCK, crcs[:1], [0], [1], [small], [0], 2)
        with pytest.raises(ValueError, match="threads"):
            torch.ops.zeroplus.verified_read(fd, 2 * _BLOCK, _BLOCK, crcs, [0], [1], [small], [0], -1)
        with pytest.raises(ValueError, match="one entry per piece"):
            torch.ops.zeroplus.verified_read(fd, 2 * _BLOCK, _BLOCK, crcs, [0, 1], [1], [small], [0], 2)
    finally:
        os.close(fd)


def test_a_mismatch_is_reported_not_raised_by_the_op(tmp_path):
    fd, crcs = _sparse_file(tmp_path, 2)
    try:
        crcs[1] ^= 1
        dst = torch.empty(2 * _BLOCK, dtype=torch.uint8)
        rc, corrupt, message = torch.ops.zeroplus.verified_read(fd, 2 * _BLOCK, _BLOCK, crcs, [0], [2 * _BLOCK],
                                                                [dst], [0], 4)
    finally:
        os.close(fd)
    assert (rc, corrupt) == (-5, True)
    assert message == f"checkpoint: checksum mismatch in bytes [{_BLOCK}, {2 * _BLOCK}) (corrupt file)"
