"""The pooled-rank harness (harness.RankPool, run_pooled) keeps run_distributed's guarantees:
each case gets every rank's result or fails on its own with the ranks' tracebacks, a hang fails
at the case timeout with the hung rank's stacks, a crash names the exit code, and after any
failure the next case runs on fresh ranks. Cases see what a fresh rank would (seed, environment,
only the default group)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import DistributedTestError, RankPool


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2)
    yield p
    p.close()


def _allreduce(rank, world, x):
    t = torch.full((3,), float(x + rank))
    dist.all_reduce(t)
    return t, os.getpid()


def _sums(results):
    return [t.tolist() for t, _ in results]


def _leave_state_behind(rank, world):
    state = (torch.rand(2), os.environ.get("ZEROPLUS_POOL_PROBE"), len(dist.distributed_c10d._world.pg_map))
    os.environ["ZEROPLUS_POOL_PROBE"] = "set by an earlier case"
    torch.set_num_threads(1)
    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=sub)  # a subgroup left behind on purpose
    return state


def test_cases_reuse_the_ranks_and_see_fresh_state(pool):
    first = pool.run(_allreduce, 1)
    second = pool.run(_allreduce, 2)
    assert _sums(first) == [[3.0] * 3] * 2
    assert _sums(second) == [[5.0] * 3] * 2
    assert [pid for _, pid in first] == [pid for _, pid in second]  # the same processes
    a = pool.run(_leave_state_behind)
    b = pool.run(_leave_state_behind)
    for (rand_a, env_a, groups_a), (rand_b, env_b, groups_b) in zip(a, b):
        assert torch.equal(rand_a, rand_b)  # the generator restarts at torch's start-up seed
        assert env_a is None and env_b is None
        assert groups_a == groups_b  # the subgroup of the first run was destroyed
    assert torch.equal(a[0][0], a[1][0])


def _raise_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("case failed on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that will never come


def _hang_on_rank_0(rank, world):
    if rank == 0:
        time.sleep(600)
    return rank


def _die_on_rank_1(rank, world):
    if rank == 1:
        os._exit(9)
    return rank


def test_a_raising_rank_fails_the_case_fast_with_its_traceback(pool):
    starts = pool.starts
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 raised:.*ValueError: case failed on purpose"):
        pool.run(_raise_on_rank_1, timeout=60)
    assert time.monotonic() - start < 15  # the failure grace, not the case timeout
    assert _sums(pool.run(_allreduce, 1)) == [[3.0] * 3] * 2
    assert pool.starts == starts + 1  # fresh ranks after the failure


def test_a_hung_rank_fails_at_the_timeout_with_its_stacks(pool):
    with pytest.raises(DistributedTestError, match=r"(?s)rank 0: no result within 3 s; its stacks:.*_hang_on_rank_0"):
        pool.run(_hang_on_rank_0, timeout=3)
    assert _sums(pool.run(_allreduce, 0)) == [[1.0] * 3] * 2


def test_a_crashed_rank_fails_with_its_exit_code(pool):
    with pytest.raises(DistributedTestError, match="rank 1: exit code 9"):
        pool.run(_die_on_rank_1, timeout=60)
    assert _sums(pool.run(_allreduce, 1)) == [[3.0] * 3] * 2


def _destroy(rank, world):
    dist.destroy_process_group()


def test_a_case_that_destroys_the_group_is_refused(pool):
    with pytest.raises(DistributedTestError, match="destroyed the default process group"):
        pool.run(_destroy, timeout=60)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="world_size must be in"):
        RankPool(0)
    with pytest.raises(TypeError, match="backend=None needs run_distributed"):
        RankPool(2, backend=None)
    with pytest.raises(TypeError, match="fn must be callable"):
        RankPool(2).run(3)
    with pytest.raises(AttributeError, match="local object"):
        RankPool(2).run(lambda rank, world: None)  # pickled by reference: module level only
