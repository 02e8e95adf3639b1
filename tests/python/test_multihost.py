"""Two hosts x two ranks in network namespaces (tests/python/netns.py): every collective of the
correctness suite on gloo (proves the fixture) and zeroplus (hierarchical with Gloo between the
hosts, and flat with ZEROPLUS_INTERHOST=tcp), host topology, DDP and ZeRO-1/2/3 parity, the
interface choice, the ZEROPLUS_INTERHOST knob, and a link cut mid-run on either path. Skipped, with the reason, where
namespaces cannot be made. Every launch has a timeout; the namespaces are removed whatever happens."""

from __future__ import annotations

import re
import time

import pytest
import torch

import netns

_REASON = netns.skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
WORLD = 4


@pytest.fixture(scope="module")
def hosts():
    with netns.two_hosts() as h:
        yield h


def _rank(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 100 * rank


def _expected(rank: int) -> dict:
    ranks = range(WORLD)
    e = {f"allreduce_{n}": sum(_rank(q, n) for q in ranks) for n in (1, 7, 1 << 18)}
    e["allreduce_max"] = torch.full((5,), float(WORLD))
    e["allreduce_big_odd"] = sum(_rank(q, (1 << 18) + 1) for q in ranks)
    e["allreduce_int64"] = sum(_rank(q, 7) for q in ranks).to(torch.int64)
    e["allreduce_bf16"] = sum(torch.arange(7) + q for q in ranks).to(torch.bfloat16)
    e["allreduce_avg"] = sum(_rank(q, 7) for q in ranks) / WORLD
    e["broadcast_big"] = _rank(1, (1 << 18) + 3)
    e["allgather_big"] = torch.cat([_rank(q, 80001) for q in ranks])
    e["reduce_scatter_big"] = sum(_rank(q, 70001 * WORLD)[70001 * rank:70001 * (rank + 1)] for q in ranks)
    e["broadcast"] = _rank(2, 33)
    e["allgather"] = torch.stack([_rank(q, 9) for q in ranks])
    e["allgather_into_tensor"] = torch.cat([_rank(q, 9) for q in ranks])
    e["reduce_scatter_tensor"] = sum(_rank(q, 5 * WORLD)[5 * rank:5 * rank + 5] for q in ranks)
    e["reduce_scatter"] = e["reduce_scatter_tensor"]
    e["all_to_all_single"] = torch.cat([_rank(q, 3 * WORLD)[3 * rank:3 * rank + 3] for q in ranks])
    e["all_to_all"] = torch.stack([_rank(q, 2 * WORLD)[2 * rank:2 * rank + 2] for q in ranks])
    e["send_recv"] = _rank((rank + 2) % WORLD, 11)
    return e


# gloo needs its interface named; zeroplus runs once with none at all (it must publish an
# address that the other host can reach, not the unresolvable host name; the inter-host Gloo
# group binds that address), once through GLOO_SOCKET_IFNAME, as a user moving from gloo would
# set it, and with each inter-host transport named explicitly.
HIER = "shm+tcp within hosts, gloo between 2 hosts"
IFNAME_ENV = {"GLOO_SOCKET_IFNAME": netns.IFNAME}


@pytest.mark.parametrize("backend,env,transport", [
    ("gloo", IFNAME_ENV, None),
    ("zeroplus", {}, HIER),
    ("zeroplus", {**IFNAME_ENV, "ZEROPLUS_DEBUG": "1"}, HIER),
    ("zeroplus", {**IFNAME_ENV, "ZEROPLUS_INTERHOST": "gloo"}, HIER),
    ("zeroplus", {**IFNAME_ENV, "ZEROPLUS_INTERHOST": "tcp"}, "tcp"),
], ids=["gloo", "zeroplus-no-ifname", "zeroplus-gloo-ifname", "zeroplus-interhost-gloo", "zeroplus-interhost-tcp"])
def test_every_collective_across_hosts(hosts, backend, env, transport):
    results = netns.run(hosts, "collectives", backend, env=env)
    for rank, res in enumerate(results):
        got = res.value
        for name, want in _expected(rank).items():
            assert torch.equal(got[name], want), f"{backend} rank {rank} {name}: {got[name]} != {want}"
        if backend == "zeroplus":
            # Two hosts by identity (separate /dev/shm, names nobody resolves), leaders 0 and 2.
            host_count, host_of, names, local, leaders = got["topology"]
            assert (host_count, host_of, names, leaders) == (2, (0, 0, 1, 1), ("zphost0", "zphost1"), (0, 2))
            assert local == ((0, 1) if rank < 2 else (2, 3))
            # Which path ran: hierarchical (shm within a host, Gloo between) or flat TCP.
            assert got["transport"] == transport, got["transport"]


def test_debug_logs_the_topology_once(hosts):
    launch = netns.Launch(hosts, "init", "zeroplus", env={"ZEROPLUS_DEBUG": "1"}).start()
    try:
        results = launch.wait(60)
    finally:
        launch.kill()
    assert all(r is not None and r.status == "ok" for r in results), launch.output
    lines = [ln for ln in launch.output.splitlines() if "topology" in ln]
    assert len(lines) == 1, launch.output
    assert "2 hosts: host 0 'zphost0' ranks 0,1; host 1 'zphost1' ranks 2,3; transport tcp" in lines[0]
    # The inter-host choice, once: auto picks the Gloo group the Python hook made.
    lines = [ln for ln in launch.output.splitlines() if "inter-host" in ln]
    assert lines == ["zeroplus: group '0' inter-host: gloo (hierarchical: " + HIER + ")"], launch.output


def test_debug_logs_the_flat_choice_with_interhost_tcp(hosts):
    launch = netns.Launch(hosts, "init", "zeroplus", env={"ZEROPLUS_DEBUG": "1", "ZEROPLUS_INTERHOST": "tcp"}).start()
    try:
        results = launch.wait(60)
    finally:
        launch.kill()
    assert all(r is not None and r.status == "ok" for r in results), launch.output
    lines = [ln for ln in launch.output.splitlines() if "inter-host" in ln]
    assert lines == ["zeroplus: group '0' inter-host: tcp (flat: ZEROPLUS_INTERHOST=tcp)"], launch.output


def test_a_bad_interhost_value_is_a_value_error_naming_the_variable(hosts):
    launch = netns.Launch(hosts, "init", "zeroplus", env={"ZEROPLUS_INTERHOST": "nccl"}, pg_timeout=10).start()
    try:
        results = launch.wait(60)
    finally:
        launch.kill()
    for rank, res in enumerate(results):
        assert res is not None and res.status == "error", f"rank {rank} did not fail:\n{launch.output}"
        text, _ = res.value
        assert "ValueError: zeroplus: ZEROPLUS_INTERHOST='nccl' is invalid, expected auto, gloo or tcp" in text, text


BACKENDS = [("gloo", {}), ("zeroplus", {"ZEROPLUS_INTERHOST": "gloo"}), ("zeroplus", {"ZEROPLUS_INTERHOST": "tcp"})]
BACKEND_IDS = ["gloo", "zeroplus-interhost-gloo", "zeroplus-interhost-tcp"]


@pytest.mark.parametrize("backend,env", BACKENDS, ids=BACKEND_IDS)
def test_ddp_parity_across_hosts(hosts, backend, env):
    results = netns.run(hosts, "ddp", backend, env={**IFNAME_ENV, **env})
    for rank, res in enumerate(results):
        assert res.value < 1e-5, f"{backend} rank {rank}: DDP drifted from the full-batch model by {res.value}"


@pytest.mark.parametrize("interhost", ["gloo", "tcp"])
@pytest.mark.parametrize("case", ["zero1", "zero2", "zero3"])
def test_zero_parity_across_hosts(hosts, case, interhost):
    results = netns.run(hosts, case, "zeroplus", env={**IFNAME_ENV, "ZEROPLUS_INTERHOST": interhost})
    for rank, res in enumerate(results):
        assert res.value < 1e-5, f"rank {rank}: {case} AdamW drifted from the full-batch model by {res.value}"


def test_a_rank_on_the_wrong_interface_is_named_within_the_timeout(hosts):
    pg_timeout = 10.0
    launch = netns.Launch(hosts, "init", "zeroplus", env={"GLOO_SOCKET_IFNAME": netns.IFNAME},
                          rank_env={1: {"ZEROPLUS_SOCKET_IFNAME": "lo"}}, pg_timeout=pg_timeout).start()
    try:
        results = launch.wait(pg_timeout + 45)
    finally:
        launch.kill()
    for rank, res in enumerate(results):
        assert res is not None and res.status == "error", f"rank {rank} did not fail:\n{launch.output}"
        text, started = res.value
        assert res.finished_at - started < pg_timeout + 5, f"rank {rank} took {res.finished_at - started:.1f} s"
        assert "DistBackendError" in text, text
        if rank >= 2:  # the other host cannot reach rank 1's loopback listener, and says so at once
            assert "rank 1 on host 'zphost0' listens on loopback address 127.0.0.1" in text, text
            assert res.finished_at - started < pg_timeout / 2, text
        else:
            assert re.search(r"timed out after [\d.]+ s waiting for ranks 2, 3 to connect", text), text


# gloo: the hierarchical path, where the lost host shows up in the Gloo phase (or in the shm
# phase, for a rank whose local peer failed first); tcp: the flat mesh.
@pytest.mark.parametrize("interhost", ["gloo", "tcp"])
def test_link_cut_fails_every_rank_within_the_timeout(hosts_for_cut, interhost):
    pg_timeout = 10.0
    launch = netns.Launch(hosts_for_cut, "linkcut", "zeroplus",
                          env={**IFNAME_ENV, "ZEROPLUS_INTERHOST": interhost}, pg_timeout=pg_timeout).start()
    try:
        until = time.monotonic() + 60
        while not launch.ready() and time.monotonic() < until:
            time.sleep(0.1)
        assert launch.ready(), "the ranks never reached the link cut"
        time.sleep(0.3)
        hosts_for_cut.cut_link()
        cut = time.time()
        results = launch.wait(pg_timeout + 30)
    finally:
        launch.kill()
    for rank, res in enumerate(results):
        assert res is not None and res.status == "error", f"rank {rank} did not fail:\n{launch.output}"
        text, _ = res.value
        assert res.finished_at - cut < pg_timeout + 5, f"rank {rank} raised {res.finished_at - cut:.1f} s after the cut"
        assert "DistBackendError" in text and re.search(r"zeroplus allreduce: rank \d", text), text
        assert re.search(r"(peer|rank) \d", text.split("zeroplus allreduce: rank", 1)[1]), text
    texts = [res.value[0] for res in results]
    if interhost == "gloo":  # the hierarchical path ran, and Gloo's error surfaced as the backend's
        assert any(re.search(r"rank \d inter-host phase over gloo with rank \d \(host \d 'zphost\d'\) failed", t)
                   for t in texts), "\n".join(texts)
    else:
        assert not any("inter-host" in t for t in texts), "\n".join(texts)


@pytest.fixture
def hosts_for_cut():
    # Its own namespaces: the cut removes the link, and later tests must not inherit that.
    with netns.two_hosts() as h:
        yield h
