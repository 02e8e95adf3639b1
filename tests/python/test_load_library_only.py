"""`torch.ops.load_library(path)` alone, with no `import zeroplus` anywhere in the rank
processes, makes backend="zeroplus" work. This module must not import zeroplus at top level:
the ranks import it to find the rank function."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed


def _allreduce_after_load_library_only(rank, world_size):
    assert "zeroplus" not in sys.modules, "the zeroplus package must not be needed"
    assert dist.get_backend() == "zeroplus"
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return t


@pytest.mark.parametrize("world_size", [1, 2])
def test_load_library_alone_registers_backend(world_size):
    results = run_distributed(_allreduce_after_load_library_only, world_size, load="library", timeout=90)
    expected = float(sum(range(1, world_size + 1)))
    for t in results:
        assert torch.equal(t, torch.full((3,), expected))
