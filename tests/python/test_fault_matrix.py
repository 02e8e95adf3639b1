"""Fault test matrix (issue 12, CI guards): signals at seeded random points of a 200-op mixed
workload (allreduce of several sizes and dtypes, broadcast, allgather, reduce_scatter, barrier,
async ops and bursts of queued async allreduces) over both transports (shared memory, and TCP
with ZEROPLUS_SHM=off).

* SIGKILL: 20 trials at 2-4 ranks; a seeded RNG picks the world size, the victim, the op before
  which it dies and whether that op is still in flight (issued async) when it dies. Every
  survivor raises DistBackendError within the group timeout + 5 s of the kill, naming the
  victim ("lost peer <victim> ...", also when it learnt of it from a survivor's abort: issue 29
  item 4; before, a third of the 3-4-rank survivors blamed a survivor), and no
  /dev/shm/zeroplus-<pid>-* segment of any rank of the trial is left behind.
* SIGSTOP/SIGCONT: a rank stopped for less than the timeout and then continued leaves the
  workload correct on every rank; one stopped for good makes every other rank raise within the
  timeout + 5 s (it is SIGKILLed afterwards).
* SIGINT at a seeded point of the workload (right after issuing an async op, or from a timer
  while the rank runs ops): that rank gets KeyboardInterrupt, its peers raise within the
  timeout + 5 s, told of the abort rather than timed out, also when the signal lands between
  two ops (the timer cases, regression seeds SEED + 5 and SEED + 6: the group used to be
  aborted only when an op was in flight on the interrupted rank).

Already covered elsewhere and not repeated here: SIGINT in a blocked allreduce (sync/async,
shm/tcp) and a program's own SIGINT handler in test_backend_interrupt.py; a small /dev/shm
(a tmpfs in a private mount namespace, skipped without root) in test_backend_small_devshm.py;
a dead peer, a stalled peer, a peer that never joins, per-op wait timeouts and destroy with an
op in flight in test_backend_faults.py.

The only timing assertions are the issue's hang guards (timeout + 5 s), measured from the
moment of the fault (time.time() written by the faulting side, same host) to the survivor's
exception; every run is also under the harness's wall-clock timeout. Results of the ops that
complete are checked exactly (small integer values, exact in every dtype used). Ranks fork
from a preloaded forkserver (harness start_method), so the 28 runs take well under a minute.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed

N_OPS = 200
PG_TIMEOUT_S = 10.0
GUARD_S = PG_TIMEOUT_S + 5  # the issue's bound: every survivor raises within timeout + 5 s
RUN_TIMEOUT_S = 90  # harness wall clock per run (spawn + import on a loaded machine included)
SEED = 20261123
TRANSPORTS = {"shm": {}, "tcp": {"ZEROPLUS_SHM": "off"}}

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64]
# 1 and 7 elements, one shared-memory chunk of <= 64 KiB (single synchronisation) and one above it.
_SIZES = [1, 7, 1000, 20000]


# ---------------------------------------------------------------------------------------------
# The workload: the same seeded op list on every rank; inputs and expected outputs are small
# integers computed from (op index, rank), so every completed op is checked exactly.


def make_workload(seed, world):
    rng = random.Random(seed)
    ops = []
    for _ in range(N_OPS):
        kind = rng.choices(
            ["allreduce", "broadcast", "allgather", "reduce_scatter", "barrier", "burst"],
            weights=[5, 2, 2, 2, 1, 1],
        )[0]
        ops.append({
            "kind": kind,
            "numel": rng.choice(_SIZES),
            "dtype": rng.choice(_DTYPES),
            "reduce": rng.choice(["sum", "max"]),
            "root": rng.randrange(world),
            "async": rng.random() < 0.3,
            "burst": rng.randint(2, 6),
        })
    return ops


def _fill(i, rank, numel, dtype):
    return torch.full((numel,), (i % 5) + rank + 1, dtype=dtype)


def _reduced(i, world, numel, dtype, reduce):
    values = [(i % 5) + r + 1 for r in range(world)]
    return torch.full((numel,), sum(values) if reduce == "sum" else max(values), dtype=dtype)


def _issue(i, op, rank, world, async_op):
    """Issues op i; returns (works, check) where check() verifies the outputs once waited."""
    numel, dtype = op["numel"], op["dtype"]
    red = dist.ReduceOp.SUM if op["reduce"] == "sum" else dist.ReduceOp.MAX
    kind = op["kind"]
    if kind == "allreduce":
        t = _fill(i, rank, numel, dtype)
        want = _reduced(i, world, numel, dtype, op["reduce"])
        return [dist.all_reduce(t, op=red, async_op=async_op)], lambda: _expect(i, op, t, want)
    if kind == "broadcast":
        t = _fill(i, rank, numel, dtype)
        want = _fill(i, op["root"], numel, dtype)
        return [dist.broadcast(t, src=op["root"], async_op=async_op)], lambda: _expect(i, op, t, want)
    if kind == "allgather":
        out = torch.empty(world * numel, dtype=dtype)
        want = torch.cat([_fill(i, r, numel, dtype) for r in range(world)])
        work = dist.all_gather_single(out, _fill(i, rank, numel, dtype), async_op=async_op)
        return [work], lambda: _expect(i, op, out, want)
    if kind == "reduce_scatter":
        out = torch.empty(numel, dtype=dtype)
        inp = _fill(i, rank, world * numel, dtype)
        want = _reduced(i, world, numel, dtype, op["reduce"])
        work = dist.reduce_scatter_single(out, inp, op=red, async_op=async_op)
        return [work], lambda: _expect(i, op, out, want)
    if kind == "barrier":
        return [dist.barrier(async_op=async_op)], lambda: None
    # burst: queued async allreduces (fused on shared memory), waited together
    ts = [_fill(i + j, rank, numel, dtype) for j in range(op["burst"])]
    wants = [_reduced(i + j, world, numel, dtype, op["reduce"]) for j in range(op["burst"])]
    works = [dist.all_reduce(t, op=red, async_op=True) for t in ts]
    return works, lambda: [_expect(i, op, t, w) for t, w in zip(ts, wants)]


def _expect(i, op, got, want):
    if not torch.equal(got, want):
        raise AssertionError(f"op {i} {op}: wrong result {got[:4].tolist()}..., expected {want[:4].tolist()}...")


def _run_op(i, op, rank, world, async_op=None):
    works, check = _issue(i, op, rank, world, op["async"] if async_op is None else async_op)
    for w in works:
        if w is not None:
            w.wait()
    check()


def _run_until_failure(ops, rank, world, first=0, tail_s=0.0):
    """Runs ops[first:], then one allreduce, then more for tail_s seconds (a fault that comes
    after the last op); returns (ops completed, time.time() of the failure, 'Type: message'),
    or raises AssertionError if nothing failed."""
    i = first
    try:
        for i in range(first, len(ops)):
            _run_op(i, ops[i], rank, world)
        end = time.monotonic() + tail_s
        while True:
            dist.all_reduce(torch.ones(4))
            i += 1
            if time.monotonic() > end:
                break
    except RuntimeError as e:  # DistBackendError is a RuntimeError
        return i, time.time(), f"{type(e).__name__}: {e}"
    raise AssertionError(f"rank {rank}: the whole workload and the allreduces after it succeeded despite the fault")


def _write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _read(path):
    with open(path) as f:
        return f.read()


def _wait_for_files(paths, limit_s):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not all(os.path.exists(p) for p in paths):
        time.sleep(0.05)


def _publish_pid(flag_dir, rank):
    _write(os.path.join(flag_dir, f"pid.{rank}"), str(os.getpid()))


def _leftover_segments(pids):
    prefixes = tuple(f"zeroplus-{pid}-" for pid in pids)
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefixes))


def _pids(flag_dir, world):
    return [int(_read(os.path.join(flag_dir, f"pid.{r}"))) for r in range(world)]


def _check_survivors(results, fault_rank, fault_time, label, names_fault=False):
    for r, res in enumerate(results):
        if r == fault_rank:
            continue
        done, failed_at, message = res
        assert "DistBackendError" in message or "RuntimeError" in message, (label, r, message)
        assert "zeroplus" in message and ("rank" in message or "peer" in message), (label, r, message)
        if names_fault:
            # Issue 29 item 4: the rank that died, not a survivor that relayed the abort.
            assert f"lost peer {fault_rank} " in message, (label, r, message)
        delay = failed_at - fault_time
        assert delay < GUARD_S, f"{label}: rank {r} raised {delay:.1f} s after the fault (> {GUARD_S} s): {message}"
        print(f"{label}: rank {r} raised at op {done}, {delay:.3f} s after the fault: {message.splitlines()[0][:160]}")


# ---------------------------------------------------------------------------------------------
# SIGKILL of a random rank at a random point.


def _kill_trials(n):
    rng = random.Random(SEED)
    trials = []
    for t in range(n):
        world = 2 + t % 3  # 2, 3, 4 in turn: every world size gets its share
        trials.append({
            "trial": t,
            "world": world,
            "victim": rng.randrange(world),
            "at": rng.randrange(N_OPS),
            "inflight": rng.random() < 0.5,
            "transport": "shm" if t % 2 == 0 else "tcp",
            "seed": rng.randrange(1 << 30),
        })
    return trials


KILL_TRIALS = _kill_trials(20)


def _sigkill_rank(rank, world, trial, flag_dir):
    _publish_pid(flag_dir, rank)
    ops = make_workload(trial["seed"], world)
    at = trial["at"]
    if rank != trial["victim"]:
        return _run_until_failure(ops, rank, world)
    for i in range(at):
        _run_op(i, ops[i], rank, world)
    if trial["inflight"]:
        _issue(at, ops[at], rank, world, async_op=True)  # dies with op `at` queued or moving
    _write(os.path.join(flag_dir, "killed_at"), repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


@pytest.mark.parametrize(
    "trial", KILL_TRIALS,
    ids=[f"{t['trial']}-w{t['world']}-kill{t['victim']}-op{t['at']}{'-inflight' if t['inflight'] else ''}-{t['transport']}"
         for t in KILL_TRIALS],
)
def test_sigkill_random_rank_at_random_point(trial, tmp_path):
    world, victim = trial["world"], trial["victim"]
    results = run_distributed(
        _sigkill_rank, world, trial, str(tmp_path), env=TRANSPORTS[trial["transport"]],
        pg_timeout=PG_TIMEOUT_S, timeout=RUN_TIMEOUT_S, start_method="forkserver", expected_exits={victim: -signal.SIGKILL},
    )
    killed_at = float(_read(tmp_path / "killed_at"))
    _check_survivors(results, victim, killed_at, f"trial {trial['trial']}", names_fault=True)
    leftovers = _leftover_segments(_pids(tmp_path, world))
    assert not leftovers, f"trial {trial}: /dev/shm leftovers {leftovers}"


# ---------------------------------------------------------------------------------------------
# SIGSTOP / SIGCONT.


def _sigstop_rank(rank, world, seed, victim, stop_s, flag_dir):
    """Rank `controller` SIGSTOPs `victim` before its op `at` (seeded); with stop_s set a timer
    thread SIGCONTs it stop_s later, else the controller SIGKILLs it once every other rank is
    done."""
    _publish_pid(flag_dir, rank)
    ops = make_workload(seed, world)
    at = random.Random(seed).randrange(N_OPS)
    controller = (victim + 1) % world
    done_flags = [os.path.join(flag_dir, f"done.{r}") for r in range(world) if r != victim]
    try:
        if rank == controller:
            _wait_for_files([os.path.join(flag_dir, f"pid.{r}") for r in range(world)], 30)
            victim_pid = int(_read(os.path.join(flag_dir, f"pid.{victim}")))
        if stop_s is None and rank not in (victim, controller):
            return _run_until_failure(ops, rank, world)
        for i in range(N_OPS):
            if rank == controller and i == at:
                os.kill(victim_pid, signal.SIGSTOP)
                _write(os.path.join(flag_dir, "stopped_at"), repr(time.time()))
                if stop_s is None:
                    return _run_until_failure(ops, rank, world, first=i)
                threading.Timer(stop_s, os.kill, (victim_pid, signal.SIGCONT)).start()
            _run_op(i, ops[i], rank, world)
        return "completed"
    finally:
        if rank != victim:
            _write(os.path.join(flag_dir, f"done.{rank}"), "")
        if stop_s is None and rank == controller:
            _wait_for_files(done_flags, GUARD_S + 10)
            os.kill(victim_pid, signal.SIGKILL)


STOP_CASES = [  # (transport, world, victim, seed)
    ("shm", 3, 1, SEED + 1),
    ("tcp", 2, 0, SEED + 2),
]


@pytest.mark.parametrize("transport,world,victim,seed", STOP_CASES, ids=[c[0] for c in STOP_CASES])
def test_sigstop_shorter_than_timeout_then_sigcont_completes(transport, world, victim, seed, tmp_path):
    results = run_distributed(
        _sigstop_rank, world, seed, victim, 1.5, str(tmp_path), env=TRANSPORTS[transport],
        pg_timeout=PG_TIMEOUT_S, timeout=RUN_TIMEOUT_S, start_method="forkserver",
    )
    assert results == ["completed"] * world, results  # every op's result was checked on every rank
    assert os.path.exists(tmp_path / "stopped_at")
    assert not _leftover_segments(_pids(tmp_path, world))


@pytest.mark.parametrize("transport,world,victim,seed", STOP_CASES, ids=[c[0] for c in STOP_CASES])
def test_sigstop_longer_than_timeout_fails_every_other_rank(transport, world, victim, seed, tmp_path):
    results = run_distributed(
        _sigstop_rank, world, seed, victim, None, str(tmp_path), env=TRANSPORTS[transport],
        pg_timeout=PG_TIMEOUT_S, timeout=RUN_TIMEOUT_S, start_method="forkserver", expected_exits={victim: -signal.SIGKILL},
    )
    stopped_at = float(_read(tmp_path / "stopped_at"))
    _check_survivors(results, victim, stopped_at, f"stop {transport} world {world} victim {victim}")
    assert not _leftover_segments(_pids(tmp_path, world))


# ---------------------------------------------------------------------------------------------
# SIGINT at a random point of the workload (test_backend_interrupt.py covers a blocked allreduce).


def _sigint_rank(rank, world, seed, victim, mode, flag_dir):
    _publish_pid(flag_dir, rank)
    ops = make_workload(seed, world)
    rng = random.Random(seed)
    at = rng.randrange(N_OPS)
    if rank != victim:
        try:
            return _run_until_failure(ops, rank, world, tail_s=GUARD_S + 5)
        finally:
            _write(os.path.join(flag_dir, f"done.{rank}"), "")
    raised = []
    try:
        try:
            for i in range(N_OPS):
                if i == at:
                    _write(os.path.join(flag_dir, "interrupted_at"), repr(time.time()))
                    if mode == "inflight":
                        _issue(i, ops[i], rank, world, async_op=True)
                        os.kill(os.getpid(), signal.SIGINT)  # with op `at` queued or moving
                    else:
                        threading.Timer(rng.uniform(0, 0.05), os.kill, (os.getpid(), signal.SIGINT)).start()
                _run_op(i, ops[i], rank, world)
            end = time.monotonic() + GUARD_S + 5
            while time.monotonic() < end:  # the timer fires after the last op: stay busy until it lands
                dist.all_reduce(torch.ones(4))
        except dist.DistBackendError:
            raised.append("DistBackendError")  # a wait() saw the abort first
            time.sleep(GUARD_S)  # KeyboardInterrupt follows at the next Python call
    except KeyboardInterrupt:
        raised.append("KeyboardInterrupt")
    # Stay alive and in the group (an exit would tell the peers by itself) until they are done.
    _wait_for_files([os.path.join(flag_dir, f"done.{r}") for r in range(world) if r != victim], GUARD_S + 10)
    return raised


SIGINT_CASES = [  # (transport, world, victim, mode, seed)
    ("shm", 3, 0, "inflight", SEED + 3),
    ("tcp", 3, 2, "inflight", SEED + 4),
    ("shm", 2, 1, "timer", SEED + 5),
    ("tcp", 4, 1, "timer", SEED + 6),
]


@pytest.mark.parametrize("transport,world,victim,mode,seed", SIGINT_CASES,
                         ids=[f"{c[0]}-w{c[1]}-{c[3]}" for c in SIGINT_CASES])
def test_sigint_at_random_point_of_workload(transport, world, victim, mode, seed, tmp_path):
    results = run_distributed(
        _sigint_rank, world, seed, victim, mode, str(tmp_path), env=TRANSPORTS[transport],
        pg_timeout=PG_TIMEOUT_S, timeout=RUN_TIMEOUT_S, start_method="forkserver",
    )
    assert results[victim] in (["KeyboardInterrupt"], ["DistBackendError", "KeyboardInterrupt"]), results[victim]
    interrupted_at = float(_read(tmp_path / "interrupted_at"))
    _check_survivors(results, victim, interrupted_at, f"sigint {transport} {mode} world {world} rank {victim}")
    # Told of the abort, not left to wait out the op timeout (30 min by default), also when the
    # SIGINT lands between two ops (the "timer" cases; before the fix they timed out).
    for r, res in enumerate(results):
        assert r == victim or "timed out" not in res[2], (r, res)
    assert not _leftover_segments(_pids(tmp_path, world))
