"""Writes the seed corpus of checkpoint_manifest_fuzz.py: a real checkpoint of a small model
(tied weights, a frozen parameter, a buffer, AdamW state after one step, 64-byte checksum blocks
so a shard has several) as manifest + separator + shard, and the manifest alone, both in version 1
form (the checksum member taken out: libFuzzer's byte mutations of a checksummed manifest nearly
all stop at the checksum, those of a version-1 one reach every check behind it), and the
manifest as saved (version 2, checksummed) + shard, which keeps the checksum path fuzzed.

    .venv/bin/python tests/fuzz/make_checkpoint_seeds.py    # rewrites seed-manifest-*
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "plugin" / "python"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zeroplus  # noqa: E402
from checkpoint_manifest_fuzz import SEPARATOR  # noqa: E402
from zeroplus.checkpoint import format as fmt  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.lin = torch.nn.Linear(3, 4)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x):
        h = self.emb(x)
        return self.head(h).sum() + self.lin(h).sum() * self.scale.sum()


def main() -> None:
    work = tempfile.mkdtemp()
    dist.init_process_group("zeroplus", store=dist.FileStore(os.path.join(work, "store"), 1), rank=0, world_size=1)
    torch.manual_seed(0)
    model, opt = zeroplus.initialize(Tiny(), torch.optim.AdamW, stage=1, lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).backward()
    opt.step()
    path = os.path.join(work, "ck")
    zeroplus.save_checkpoint(path, model, opt, extra={"step": 1},
                             options=zeroplus.checkpoint.CheckpointOptions(block_bytes=64))
    sealed = pathlib.Path(path, "manifest.json").read_bytes()
    fmt.parse_manifest(sealed, "manifest.json")  # what was saved is what the seeds start from
    m = json.loads(sealed)
    del m[fmt.MANIFEST_CHECKSUM]
    m["version"] = 1
    manifest = fmt.dumps(m)
    shard = pathlib.Path(path, "rank00000.bin").read_bytes()
    out = HERE / "corpus" / "checkpoint_manifest_fuzz"
    out.mkdir(parents=True, exist_ok=True)
    (out / "seed-manifest-and-shard").write_bytes(manifest + SEPARATOR + shard)
    (out / "seed-manifest-only").write_bytes(manifest)
    (out / "seed-sealed-manifest-and-shard").write_bytes(sealed + SEPARATOR + shard)
    print(f"wrote {out}: manifest {len(manifest)} bytes, shard {len(shard)} bytes")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
