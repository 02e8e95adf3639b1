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
    with pytest.raises(AssertionError, match="BackendOptions.socket_ifname=nosuchif0: no such interface"):
        run_distributed(_with_options, 2, {"socket_ifname": "nosuchif0"}, backend="gloo", timeout=60, pg_timeout=10)
    with pytest.raises(AssertionError, match="BackendOptions.socket_ifname='a/b' is invalid"):
        run_distributed(_with_options, 2, {"socket_ifname": "a/b"}, backend="gloo", timeout=60)


def test_gloo_socket_ifname_is_honoured_and_a_bad_name_is_named():
    # Users coming from backend="gloo" set GLOO_SOCKET_IFNAME (first entry of Gloo's list form).
    out = run_distributed(_allreduce, 2, env={"GLOO_SOCKET_IFNAME": "lo,nosuchif9", "ZEROPLUS_SHM": "off"}, timeout=60)
    assert all(torch.equal(t, torch.full((3,), 2.0)) for t in out)
    with pytest.raises(AssertionError, match="GLOO_SOCKET_IFNAME=nosuchif1: no such interface"):
        run_distributed(_allreduce, 2, env={"GLOO_SOCKET_IFNAME": "nosuchif1"}, timeout=60, pg_timeout=10)
    # ZEROPLUS_SOCKET_IFNAME wins over GLOO_SOCKET_IFNAME, and its error names it.
    with pytest.raises(AssertionError, match="ZEROPLUS_SOCKET_IFNAME=nosuchif2: no such interface"):
        run_distributed(_allreduce, 2, env={"GLOO_SOCKET_IFNAME": "lo", "ZEROPLUS_SOCKET_IFNAME": "nosuchif2"},
                        timeout=60, pg_timeout=10)


def _topology(rank, world):
    import zeroplus

    t = zeroplus.topology()
    with pytest.raises(TypeError, match="group must be a ProcessGroup"):
        zeroplus.topology("default")
    gloo = dist.new_group(backend="gloo")
    with pytest.raises(ValueError, match="must use the zeroplus backend, got 'gloo'"):
        zeroplus.topology(gloo)
    # Gloo may finish connecting on one rank before the other; a rank that tears its group down
    # right away makes the peer's connectFullMesh fail ("Connection closed by peer").
    dist.barrier(group=gloo)
    return t.host_count, t.host_of, t.local_ranks, t.leaders, t.local_rank


def test_topology_of_a_one_host_group(capfd):
    out = run_distributed(_topology, 2, env={"ZEROPLUS_DEBUG": "1"}, timeout=60)
    assert out == [(1, (0, 0), (0, 1), (0,), 0), (1, (0, 0), (0, 1), (0,), 1)]
    err = capfd.readouterr().err
    # Logged once per group, by its rank 0.
    assert err.count("topology 1 host: host 0") == 1, err


def _transport(rank, world, fields):
    import zeroplus

    pg = dist.new_group(backend="zeroplus", pg_options=zeroplus.BackendOptions(**fields))
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)
    return zeroplus.topology(pg).transport, t


def test_interhost_leaves_a_one_host_group_as_it_was_and_is_validated():
    # One host: ZEROPLUS_INTERHOST / BackendOptions.interhost change nothing (docs/multihost.md).
    for fields, env in (({"interhost": "gloo"}, {}), ({}, {"ZEROPLUS_INTERHOST": "gloo"}), ({"interhost": "tcp"}, {})):
        for transport, t in run_distributed(_transport, 2, fields, backend="gloo", env=env, timeout=60):
            assert transport == "shm+tcp" and torch.equal(t, torch.full((3,), 2.0)), (fields, env, transport)
    with pytest.raises(AssertionError, match=r"BackendOptions.interhost='nccl' is invalid, expected auto, gloo or tcp"):
        run_distributed(_transport, 2, {"interhost": "nccl"}, backend="gloo", timeout=60)
