"""Set-up listener exposure (issue 12, defect 8): ZEROPLUS_SOCKET_IFNAME / BackendOptions.socket_ifname
choose the interface, an unknown or malformed one is named. Bind address, idle-connection cap and
timeout are covered by tests/cpp/process_group/tcp_mesh_test.cpp."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from test_backend_fastpaths import _with_options


def _allreduce(rank, world):
    t = torch.ones(3)
    dist.all_reduce(t)
    return t


def test_socket_ifname_environment_variable_selects_the_interface():
    out = run_distributed(_allreduce, 2, env={"ZEROPLUS_SOCKET_IFNAME": "lo", "ZEROPLUS_SHM": "off"}, timeout=60)
    assert all(torch.equal(t, torch.full((3,), 2.0)) for t in out)


def test_socket_ifname_option_is_forwarded_and_validated():
    out = run_distributed(_with_options, 2, {"socket_ifname": "lo", "shm": "off"}, backend="gloo", timeout=60)
    assert torch.equal(out[0], torch.full((3,), 2.0))
    with pytest.raises(AssertionError, match="ZEROPLUS_SOCKET_IFNAME=nosuchif0: no such interface"):
        run_distributed(_with_options, 2, {"socket_ifname": "nosuchif0"}, backend="gloo", timeout=60, pg_timeout=10)
    with pytest.raises(AssertionError, match="BackendOptions.socket_ifname='a/b' is invalid"):
        run_distributed(_with_options, 2, {"socket_ifname": "a/b"}, backend="gloo", timeout=60)
