"""The main job: train TinyGPT with DDP over the "zeroplus" backend and ZeRO stage 1 on CPU.

    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --steps 30

Each rank keeps only its shard of the AdamW state (zeroplus.ZeroRedundancyOptimizer, fused C++
kernel); `--optimizer adamw` runs plain DDP + torch.optim.AdamW instead. Prints per-step loss and
throughput from rank 0 and each rank's optimizer-state bytes, and exits 0. Three lines differ
from a stock DDP script: `import zeroplus`, backend="zeroplus" and the optimizer class.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import TinyGPT, synthetic_batch  # noqa: E402

import zeroplus  # noqa: E402  registers backend "zeroplus"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", default="zeroplus")
    parser.add_argument("--optimizer", choices=["zero", "adamw"], default="zero",
                        help="zero: zeroplus.ZeroRedundancyOptimizer(AdamW); adamw: torch.optim.AdamW")
    parser.add_argument("--bucket-view", action="store_true", help="parameters_as_bucket_view=True (zero only)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    return args


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT(context=args.context)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if args.optimizer == "zero":
        optimizer = zeroplus.ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.AdamW, parameters_as_bucket_view=args.bucket_view, lr=args.lr)
        local_state = optimizer.optim.state
    else:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        local_state = optimizer.state
    generator = torch.Generator().manual_seed(1000 + rank)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"TinyGPT: {params / 1e6:.2f}M parameters, {world} ranks, backend={dist.get_backend()}, "
              f"optimizer={type(optimizer).__module__}.{type(optimizer).__name__}", flush=True)
    tokens_per_step = args.batch * args.context * world
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        inputs, targets = synthetic_batch(args.batch, args.context, 256, generator)
        logits = ddp(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported, op=dist.ReduceOp.AVG)
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(f"step {step:3d}  loss {reported.item():.4f}  {tokens_per_step / elapsed:9.0f} tokens/s  "
                  f"{elapsed * 1e3:7.1f} ms", flush=True)
    state_bytes = sum(t.numel() * t.element_size() for st in local_state.values()
                      for t in st.values() if isinstance(t, torch.Tensor))
    print(f"rank {rank}: optimizer state {state_bytes} bytes", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
