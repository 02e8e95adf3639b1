"""DDP + ZeroRedundancyOptimizer(overlap_with_ddp=True) on the zeroplus backend, CPU, 2 ranks.

Modelled on torch's test_zero_redundancy_optimizer.py::test_ddp_zero_overlap (which runs only on
NCCL: on Gloo it hangs): every combination of {hook_with_zero_step, hook_with_zero_step_interleaved}
x gradient_as_bucket_view x static_graph x shard_buckets trains to parity with DDP + a local
torch.optim.SGD. The interleaved hook broadcasts from a `Future.then` callback and waits for the
broadcasts there, so it needs collectives issued from callbacks to work
(test_backend_future_callbacks.py). One spawn per hook runs its eight combinations.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from harness import run_pooled


def _overlap_parity(rank, world_size, interleaved):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
        hook_with_zero_step, hook_with_zero_step_interleaved)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zeroplus import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    hook_constructor = hook_with_zero_step_interleaved if interleaved else hook_with_zero_step
    sgd = dict(lr=0.01, momentum=0.9, weight_decay=0.001)
    failures = []
    for gradient_as_bucket_view, static_graph, shard_buckets in itertools.product([False, True], repeat=3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.Linear(200, 50))
        inputs = [torch.randn(1, 100) for _ in range(4)]
        # bucket_cap_mb small enough for several buckets once DDP has rebuilt them.
        ddp_kwargs = dict(gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=0.05)
        overlap = DDP(copy.deepcopy(model), **ddp_kwargs)
        local = DDP(copy.deepcopy(model), **ddp_kwargs)
        if static_graph:
            overlap._set_static_graph()
            local._set_static_graph()
        zero = ZeroRedundancyOptimizer(overlap.parameters(), optimizer_class=torch.optim.SGD,
                                       overlap_with_ddp=True, **sgd)
        overlap.register_comm_hook(None, hook_constructor(allreduce_hook, overlap, zero,
                                                          shard_buckets=shard_buckets))
        local_optim = torch.optim.SGD(local.parameters(), **sgd)
        initial = [p.detach().clone() for p in overlap.parameters()]
        dist.barrier()
        # The hooks need 2 (3 with static_graph) iterations to learn DDP's buckets; no update then.
        for x in inputs[:3 if static_graph else 2]:
            overlap(x).sum().backward()
        for x in inputs:
            zero.zero_grad()
            overlap(x).sum().backward()
        for x in inputs:
            local_optim.zero_grad()
            local(x).sum().backward()
            local_optim.step()
        dist.barrier()
        combo = f"gradient_as_bucket_view={gradient_as_bucket_view} static_graph={static_graph} " \
                f"shard_buckets={shard_buckets}"
        try:
            for a, b in zip(overlap.parameters(), local.parameters()):
                torch.testing.assert_close(a, b)
            assert any(not torch.equal(a, b) for a, b in zip(initial, overlap.parameters())), "no update"
        except AssertionError as e:
            failures.append(f"{combo}: {e}")
    return failures


@pytest.mark.parametrize("interleaved", [False, True], ids=["hook_with_zero_step", "interleaved"])
def test_ddp_zero_overlap_matches_local_optimizer(interleaved):
    for failures in run_pooled(_overlap_parity, 2, interleaved, timeout=45, pg_timeout=30):
        assert not failures, "\n".join(failures)
