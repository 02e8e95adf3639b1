"""The main job: train TinyGPT on CPU ranks over the "zeroplus" backend with ZeRO stage 1, 2 or 3.

    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --steps 30 [--stage 3]

--stage 3 (the default) shards parameters, gradients and AdamW state (zeroplus.initialize);
--stage 2 shards gradients and optimizer state; --stage 1 is DDP + zeroplus.ZeroRedundancyOptimizer
(the drop-in for torch's class); --stage 0 is plain DDP + torch.optim.AdamW, the reference.
Prints per-step loss and throughput from rank 0, then each rank's model-state bytes
(zeroplus.memory_report) beside what DDP + AdamW holds (16 bytes per parameter), and exits 0.
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
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3,
                        help="ZeRO stage (0: DDP + torch.optim.AdamW, the reference)")
    parser.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None, help="stages 1-3 only")
    parser.add_argument("--persistence-threshold", type=int, default=1000,
                        help="stage 3: parameters with at most this many elements stay whole (DeepSpeed's default "
                             "is 100000, which would keep all of this small model whole)")
    parser.add_argument("--bucket-view", action="store_true", help="parameters_as_bucket_view=True (stage 1 only)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if args.mixed_precision and args.stage == 0:
        parser.error("--mixed-precision needs --stage 1, 2 or 3")
    return args


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT(context=args.context)
    params = sum(p.numel() for p in model.parameters())
    if args.stage == 0:
        forward = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(forward.parameters(), lr=args.lr)
    elif args.stage == 1 and args.mixed_precision is None:
        forward = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = zeroplus.ZeroRedundancyOptimizer(
            forward.parameters(), torch.optim.AdamW, parameters_as_bucket_view=args.bucket_view, lr=args.lr)
    else:
        stage3 = {"param_persistence_threshold": args.persistence_threshold} if args.stage == 3 else {}
        model, optimizer = zeroplus.initialize(model, torch.optim.AdamW, stage=args.stage, lr=args.lr,
                                               mixed_precision=args.mixed_precision, **stage3)
        forward = model
    generator = torch.Generator().manual_seed(1000 + rank)
    if rank == 0:
        print(f"TinyGPT: {params / 1e6:.2f}M parameters, {world} ranks, backend={dist.get_backend()}, "
              f"ZeRO stage {args.stage}, optimizer={type(optimizer).__module__}.{type(optimizer).__name__}",
              flush=True)
    tokens_per_step = args.batch * args.context * world
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        inputs, targets = synthetic_batch(args.batch, args.context, 256, generator)
        logits = forward(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        if hasattr(optimizer, "backward"):
            optimizer.backward(loss)  # scales the loss for fp16
        else:
            loss.backward()
        optimizer.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported, op=dist.ReduceOp.AVG)
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(f"step {step:3d}  loss {reported.item():.4f}  {tokens_per_step / elapsed:9.0f} tokens/s  "
                  f"{elapsed * 1e3:7.1f} ms", flush=True)
    report = zeroplus.memory_report(model, optimizer)
    ddp_bytes = zeroplus.estimate_memory(params, world, 0)["model_state"]
    print(f"rank {rank}: model state {report['model_state']} bytes (parameters {report['parameters']}, "
          f"gradients {report['gradients']}, master {report['master_parameters']}, optimizer state "
          f"{report['optimizer_state']}); DDP + AdamW holds {ddp_bytes:.0f} bytes: "
          f"{report['model_state'] / ddp_bytes:.3f}x", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
