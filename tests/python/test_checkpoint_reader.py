"""CheckpointReader's read plan (reader.py _serve): how often it touches the disk.

A block that several small tensors share is read and checked once per read_many call, not once
per tensor (a model of many biases and norms re-read, and re-checksummed, the same 4 MiB block
for each of them); whole blocks go straight into their destination, and what is read is what was
saved, on the reader's threads as in one.
"""

from __future__ import annotations

import torch

from zeroplus.checkpoint import reader as reader_module


class _ManySmall(torch.nn.Module):
    def __init__(self, n: int, numel: int):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(numel)) for _ in range(n)])


def test_a_shared_block_is_read_once_and_reads_match(one_rank_group, tmp_path):
    import zeroplus

    torch.manual_seed(0)
    model = _ManySmall(60, 7)  # 60 tensors x 3 values (param, exp_avg, exp_avg_sq) in one block
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=2, lr=1e-2)
    sum(p.square().sum() for p in model.parameters()).backward()
    opt.step()
    path = str(tmp_path / "ck")
    zeroplus.save_checkpoint(path, model, opt)

    def read_bytes():  # bytes this process has read through read(2)/pread(2), every thread's
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])
    with reader_module.CheckpointReader(path) as r:
        names = list(r.manifest["tensors"])
        file_bytes = sum(f["bytes"] for f in r.manifest["files"])
        before = read_bytes()  # the manifest is read: count the shards' reads
        got = r.read_many([(n, "param", 0, 7) for n in names] + [(n, "exp_avg", 0, 7) for n in names])
        read = read_bytes() - before
        blocks = sum(-(-f["bytes"] // r.block) for f in r.manifest["files"])
        alone = [r.read_many([(n, "exp_avg", 0, 7)])[0] for n in names]  # one tensor per call
    assert len(names) == 60 and blocks == 1
    # The block once (and the /proc read itself), not once per tensor: 120 x the block.
    assert read <= file_bytes + 4096, f"{read} bytes read for a shard file of {file_bytes}"
    params = dict(model.named_parameters())
    for n, value in zip(names, got[:len(names)]):
        assert torch.equal(value, params[n].detach()), n
    for n, value, one in zip(names, got[len(names):], alone):
        assert torch.equal(value, one) and value.abs().sum() > 0, n
