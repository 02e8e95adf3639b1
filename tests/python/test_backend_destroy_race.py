"""A rank that destroys its group right after its last op completed is a graceful close, not an
abort, even while its worker is still busy with that op's future callbacks.

Regression: shutdown() treated "worker busy" as "op in flight" and aborted; the abort alert
(urgent byte) then failed peers that were in the middle of an unrelated op on the same group
("lost peer 2: it aborted"). Rank 2 here keeps its worker busy in a future callback of its last
op, then destroys the group; ranks 0 and 1 meanwhile exchange a tensor point to point on the same
group, which must succeed. Rank 2 waits either on the Work or, as DDP's reducer does, on its
future: the future completes (and wakes its waiter) before the worker has run its callbacks and
marked the Work itself completed, so shutdown() must count an op whose future completed as done
(before, it did not, and DDP across two hosts failed a peer's last op about one launch in twenty).
Ranks 0 and 1 join the all-reduce late, so rank 2's callback is registered before the op completes
and runs on rank 2's worker thread, not inline.
"""

import time

import pytest
import torch

from harness import run_distributed


def _body(rank, world, wait_on):
    import torch.distributed as dist

    t = torch.ones(1000)
    if rank != 2:
        time.sleep(0.3)
    work = dist.all_reduce(t, async_op=True)
    if rank == 2:
        future = work.get_future()
        future.then(lambda f: time.sleep(1.0))  # keeps the worker busy after completion
        if wait_on == "future":
            future.wait()  # returns while the worker runs the callback, before the Work is marked completed
        else:
            while not work.is_completed():  # returns as soon as the data moved, callbacks still running
                time.sleep(0.001)
        dist.destroy_process_group()
        return "destroyed"
    work.wait()
    time.sleep(0.2)  # rank 2 is inside destroy_process_group by now
    payload = torch.full((1 << 18,), float(rank))
    if rank == 0:
        dist.send(payload, dst=1)
        dist.recv(payload, src=1)
    else:
        other = torch.empty_like(payload)
        dist.recv(other, src=0)
        dist.send(payload, dst=0)
        payload = other
    return payload[0].item()


@pytest.mark.parametrize("wait_on", ["work", "future"])
def test_destroy_right_after_the_last_op_does_not_abort_peers(wait_on):
    results = run_distributed(_body, 3, wait_on, timeout=60, pg_timeout=20)
    assert results == [1.0, 0.0, "destroyed"]
