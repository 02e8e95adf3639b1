"""Train a GPT whose fp32 model states are larger than this machine's memory (ZeRO-Infinity style).

    python examples/offload/train_larger_than_memory.py --nvme-path /work/zp-nvme          # ~2.12e9 params
    python examples/offload/train_larger_than_memory.py --nvme-path /tmp/x --layers 2 --dim 256   # a smoke run
    ... --checkpoint /work/zp-ckpt     # resume from /work/zp-ckpt/latest if there is one; save after the steps
    torchrun --nproc-per-node 2 examples/offload/train_larger_than_memory.py ...               # 2 ranks

Stage 3 with parameter and optimizer-state offload to NVMe (docs/offload.md): the model is built
on the meta device (no memory), materialised one gather unit at a time straight into the
parameter swap files, and trained for --steps AdamW steps (fp32) on one fixed batch, so the loss
must fall. Per step it prints the forward/backward/step times, the bytes the two swappers read
and wrote, the time the step waited for them, the bytes on disk and the peak RSS as a share of
the machine's RAM. Not a CI test: it moves ~60 GB per step at the default size (run once, with
the machine to itself; see docs/offload.md "Larger than memory").
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "plugin", "python"))
import zeroplus  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, GPT-2 style

    def forward(self, tokens):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def init_module(module: nn.Module) -> None:
    """GPT-2's init, for one module's own parameters (param_init_fn: called unit by unit)."""
    with torch.no_grad():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()


def fs_type(path: str) -> str:
    """The file system type of the mount holding `path` (longest matching mount point)."""
    path, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mount = parts[1]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, parts[2]
    return kind


def ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvme-path", required=True, help="directory for the swap files (not tmpfs)")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--buffer-count", type=int, default=2, help="pooled buffers of each swapper")
    ap.add_argument("--checkpoint", help="checkpoint root: resume from its `latest`, save ROOT/stepN after training")
    args = ap.parse_args()
    for key in ("layers", "dim", "heads", "vocab", "seq", "batch", "steps", "buffer_count"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.dim % args.heads:
        ap.error("--dim must be a multiple of --heads")
    kind = fs_type(args.nvme_path)
    if kind in ("tmpfs", "ramfs"):
        ap.error(f"--nvme-path {args.nvme_path!r} is on {kind} (memory): offloading there saves nothing")

    if "RANK" not in os.environ:  # a plain `python` run: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    dist.init_process_group("zeroplus")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    def say(*a):
        if rank == 0:
            print(*a, flush=True)

    ram = ram_bytes()
    torch.manual_seed(0)  # the same initial weights on every run (rank 0's are broadcast)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    psi = sum(p.numel() for p in model.parameters())
    say(f"GPT: {psi / 1e9:.3f}e9 parameters ({args.layers} blocks, dim {args.dim}, vocab {args.vocab}); "
        f"fp32 model states 16 B/param = {gib(16 * psi)}; RAM {gib(ram)} -> {16 * psi / ram:.2f}x RAM")
    say(f"ranks {world}, threads/rank {torch.get_num_threads()}, swap files under {args.nvme_path} ({kind})")
    offload = {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": args.buffer_count}
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=3, lr=args.lr, weight_decay=0.0,
                                     offload_param=offload, offload_optimizer=dict(offload),
                                     param_init_fn=init_module)
    pstore, ostore, spill = opt.placement.param_store, opt.offload, opt.reducer.spill
    say(f"built in {time.perf_counter() - t0:.1f}s: {len(opt.buckets)} buckets, parameter records on disk "
        f"{gib(pstore.disk_bytes())}, peak RSS so far {gib(peak_rss())} ({peak_rss() / ram:.1%} of RAM)")

    first = 0
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, "latest")):
        t_load = time.perf_counter()
        first = zeroplus.load_checkpoint(args.checkpoint, model, opt)["step"]
        say(f"resumed from {args.checkpoint} (step {first}) in {time.perf_counter() - t_load:.1f}s, peak RSS "
            f"{gib(peak_rss())} ({peak_rss() / ram:.1%} of RAM); pooled buffers (peak): params "
            f"{gib(pstore.peak_buffer_bytes)} optimizer {gib(ostore.peak_buffer_bytes)}")
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for step in range(first, first + args.steps):
        io0 = (pstore.bytes_read, pstore.bytes_written, ostore.bytes_read, ostore.bytes_written,
               spill.bytes_read, spill.bytes_written,
               pstore.read_wait_s + ostore.read_wait_s, pstore.write_wait_s + ostore.write_wait_s)
        t_start = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        t_fwd = time.perf_counter()
        opt.backward(loss)
        t_bwd = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t_end = time.perf_counter()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
        io = (pstore.bytes_read, pstore.bytes_written, ostore.bytes_read, ostore.bytes_written,
              spill.bytes_read, spill.bytes_written,
              pstore.read_wait_s + ostore.read_wait_s, pstore.write_wait_s + ostore.write_wait_s)
        d = [b - a for a, b in zip(io0, io)]
        moved = sum(d[:6])
        say(f"step {step}: loss {losses[-1]:.4f}  forward {t_fwd - t_start:.1f}s  backward {t_bwd - t_fwd:.1f}s  "
            f"step {t_end - t_bwd:.1f}s  total {t_end - t_start:.1f}s")
        say(f"  I/O rank 0: params read {gib(d[0])} written {gib(d[1])}; gradients read {gib(d[4])} written "
            f"{gib(d[5])}; optimizer read {gib(d[2])} written {gib(d[3])}; {moved / (t_end - t_start) / 1e9:.2f} "
            f"GB/s over the step; the step waited for parameter/optimizer reads {d[6]:.1f}s, writes {d[7]:.1f}s")
        say(f"  on disk: params + gradients {gib(pstore.disk_bytes())}, optimizer {gib(ostore.disk_bytes())}; pooled "
            f"buffers: params {gib(pstore.peak_buffer_bytes)} optimizer {gib(ostore.peak_buffer_bytes)} (peak); "
            f"peak RSS {gib(peak_rss())} ({peak_rss() / ram:.1%} of RAM)")
    falling = all(b < a for a, b in zip(losses, losses[1:]))
    peak = peak_rss()
    say(f"losses {['%.4f' % v for v in losses]}: {'falling' if falling else 'NOT falling'}; peak RSS rank 0 "
        f"{gib(peak)} = {peak / ram:.1%} of RAM ({'<=' if peak <= 0.6 * ram else '>'} 60%); "
        f"{time.perf_counter() - t0:.0f}s in all")
    if args.checkpoint:  # streamed: one swapped bucket in memory at a time (docs/checkpoints.md)
        t_save = time.perf_counter()
        where = os.path.join(args.checkpoint, f"step{first + args.steps}")
        zeroplus.save_checkpoint(where, model, opt, extra={"step": first + args.steps})
        say(f"saved {where} in {time.perf_counter() - t_save:.1f}s, peak RSS {gib(peak_rss())} "
            f"({peak_rss() / ram:.1%} of RAM)")
    pstore.close()
    ostore.close()
    dist.destroy_process_group()
    return 0 if falling and peak <= 0.6 * ram else 1


if __name__ == "__main__":
    sys.exit(main())
