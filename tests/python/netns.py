"""Two "hosts" on one machine for multi-host tests: network namespaces joined by a veth pair.

Each host is a network namespace with its own loopback and one interface ``eth1`` (10.77.0.1
and 10.77.0.2, /24, joined by a veth pair). Its ranks run under ``unshare -m -u``: a private
tmpfs on /dev/shm and their own host name (``zphost0``, ``zphost1``, which nothing resolves),
so to the backend they are two machines in every way it can observe. Ranks get torchrun-style
environment variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR = host 0's address) and run
``python -m multihost_worker`` (tests/python/multihost_worker.py), which writes one result
file per rank.

Needs root with iproute2 and util-linux; ``skip_reason()`` says why not when they are missing.
Namespaces are always deleted, and every process a launch started is killed by its session at
its timeout, whatever the test's outcome.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

IFNAME = "eth1"
ADDRS = ("10.77.0.1", "10.77.0.2")
RANKS_PER_HOST = 2
_COUNT = 0  # namespaces made by this process (names must be unique while they exist)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def skip_reason() -> str | None:
    """None when namespaces can be made here, else why not (the test is skipped with it)."""
    if os.geteuid() != 0:
        return "multi-host tests need root to create network namespaces"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"multi-host tests need '{tool}' (iproute2 / util-linux)"
    probe = f"zpprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces are not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclasses.dataclass
class Hosts:
    namespaces: tuple[str, str]
    workdir: str

    def cut_link(self) -> None:
        """Deletes the veth pair (both ends go): the hosts can no longer reach each other."""
        _ip("-n", self.namespaces[0], "link", "del", IFNAME)


@contextlib.contextmanager
def two_hosts():
    global _COUNT
    _COUNT += 1
    tag = f"{os.getpid() % 100000}x{_COUNT}"
    names = (f"zp{tag}h0", f"zp{tag}h1")
    veth = (f"zp{tag}a", f"zp{tag}b")
    made: list[str] = []
    workdir = tempfile.mkdtemp(prefix="zeroplus-multihost-")
    try:
        for ns in names:
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for ns, end, addr in zip(names, veth, ADDRS):
            _ip("link", "set", end, "netns", ns)
            _ip("-n", ns, "link", "set", end, "name", IFNAME)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
        yield Hosts(names, workdir)
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)  # removes the veth end inside it too
        shutil.rmtree(workdir, ignore_errors=True)


@dataclasses.dataclass
class RankResult:
    status: str  # "ok" or "error"
    value: object  # the case's return value, or the traceback text
    finished_at: float  # time.time() when the rank wrote its result


class Launch:
    """One run of `case` on 2 hosts x 2 ranks; start() returns at once, wait() collects."""

    def __init__(self, hosts: Hosts, case: str, backend: str, *, env: dict[str, str] | None = None,
                 rank_env: dict[int, dict[str, str]] | None = None, pg_timeout: float = 20.0,
                 module: str = "multihost_worker"):
        self.hosts = hosts
        self.module = module  # what each rank runs (python -m); bench/collectives/multihost.py passes its own
        self.outdir = tempfile.mkdtemp(dir=hosts.workdir, prefix=f"{case}-{backend}-")
        self.world = RANKS_PER_HOST * len(hosts.namespaces)
        base = {
            "ZP_CASE": case, "ZP_BACKEND": backend, "ZP_OUT": self.outdir, "ZP_PG_TIMEOUT": str(pg_timeout),
            "WORLD_SIZE": str(self.world), "MASTER_ADDR": ADDRS[0], "MASTER_PORT": "29512",
            "OMP_NUM_THREADS": "1", **(env or {}),
        }
        self.env = {**os.environ, **base}
        self.rank_env = rank_env or {}
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "Launch":
        for h, ns in enumerate(self.hosts.namespaces):
            ranks = []
            for local in range(RANKS_PER_HOST):
                rank = h * RANKS_PER_HOST + local
                extra = {"RANK": rank, "LOCAL_RANK": local, **self.rank_env.get(rank, {})}
                prefix = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in extra.items())
                ranks.append(f"{prefix} {shlex.quote(sys.executable)} -m {self.module} &")
            # One mount and UTS namespace per host, shared by its ranks: they see one /dev/shm.
            script = (f"mount -t tmpfs -o size=512m zpshm /dev/shm && hostname zphost{h} && "
                      + " ".join(ranks) + " wait")
            cmd = ["ip", "netns", "exec", ns, "unshare", "-m", "-u", "--propagation", "private", "sh", "-c", script]
            self.procs.append(subprocess.Popen(cmd, env=self.env, start_new_session=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        return self

    def ready(self) -> bool:
        return all(os.path.exists(os.path.join(self.outdir, f"ready{r}")) for r in range(self.world))

    def wait(self, timeout: float) -> list[RankResult | None]:
        deadline = time.monotonic() + timeout
        output = []
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # the session this launch started
                out, _ = p.communicate()
            output.append(out.decode(errors="replace"))
        self.output = "\n".join(output)
        results: list[RankResult | None] = []
        for r in range(self.world):
            path = os.path.join(self.outdir, f"rank{r}.pt")
            results.append(RankResult(**torch.load(path, weights_only=False)) if os.path.exists(path) else None)
        return results

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def run(hosts: Hosts, case: str, backend: str, *, timeout: float = 90.0, **kw) -> list[RankResult]:
    """Runs `case` to completion; fails (AssertionError) with every rank's output unless every
    rank returned a value."""
    launch = Launch(hosts, case, backend, **kw).start()
    try:
        results = launch.wait(timeout)
    finally:
        launch.kill()
    bad = [r for r, res in enumerate(results) if res is None or res.status != "ok"]
    if bad:
        details = "\n".join(f"--- rank {r}: " + ("no result" if results[r] is None else str(results[r].value))
                            for r in bad)
        raise AssertionError(f"{case} on {backend} failed on ranks {bad}:\n{details}\n--- output:\n{launch.output}")
    return results
