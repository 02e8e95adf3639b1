"""Checkpoints of offloaded optimizer state (docs/checkpoints.md, docs/offload.md), 2 ranks: an
engine whose optimizer state lives in NVMe swap files saves a checkpoint that an in-memory engine
loads, and the reverse; training on from either equals training on from the engine that saved
(bitwise in fp32). The state a checkpoint holds is read through the swap store, never from a stale
buffer. Stages 2 and 3, one launch; stage 3 with sharded parameters (persistence threshold 0
saving, 8 loading; asserted)."""

from __future__ import annotations

import os

import torch

import checkpoint_models as cm
from harness import run_pooled


def _engine(stage, nvme_dir, group, persist):
    """persist: stage 3's persistence threshold (the default would keep all of CkptNet whole)."""
    import zeroplus

    offload = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir}} if nvme_dir else {}
    config = {"zero_optimization": {"stage3_param_persistence_threshold": persist}} if stage == 3 else None
    model, opt = zeroplus.initialize(cm.make(0), torch.optim.AdamW, stage=stage, lr=1e-2, weight_decay=0.1,
                                     process_group=group, config=config, **offload)
    return model, opt


def _round_trips(rank, world, root):
    import torch.distributed as dist

    import zeroplus

    out = {}
    group = dist.group.WORLD
    for stage in (2, 3):
        nvme = os.path.join(root, f"nvme{stage}")
        if rank == 0:
            os.makedirs(nvme, exist_ok=True)
        dist.barrier()
        saver, saver_opt = _engine(stage, nvme, group, persist=0)
        cm.train(saver, saver_opt, 3, rank)
        path = os.path.join(root, f"ckpt{stage}")
        zeroplus.save_checkpoint(path, saver, saver_opt, extra={"step": 3})
        results = {}
        for label, target_nvme in (("into memory", None), ("into nvme", nvme)):
            model, opt = _engine(stage, target_nvme, group, persist=cm.PERSIST_SOME)
            results[label] = (model, opt, zeroplus.load_checkpoint(path, model, opt))
        cm.train(saver, saver_opt, 2, rank, first_step=3)
        want = cm.full_params("engine", saver)
        for label, (model, opt, extra) in results.items():
            cm.train(model, opt, 2, rank, first_step=3)
            got = cm.full_params("engine", model)
            out[(stage, label)] = (extra, max((got[k].float() - want[k].float()).abs().max().item() for k in want),
                                   (cm.sharded_names(saver, saver_opt), cm.sharded_names(model, opt)))
    return out


def test_offloaded_state_checkpoints_both_ways(tmp_path):
    for per_rank in run_pooled(_round_trips, 2, str(tmp_path), timeout=300):
        assert set(per_rank) == {(s, l) for s in (2, 3) for l in ("into memory", "into nvme")}
        for key, (extra, diff, sharded) in per_rank.items():
            assert extra == {"step": 3}, key
            assert diff == 0.0, (key, diff)
            if key[0] == 3:  # sharded parameters saved (all of them) and loaded (all but the 8-element ones)
                assert sharded == (["emb.weight", "frozen", "lin1.bias", "lin1.weight", "lin2.bias", "lin2.weight"],
                                   ["emb.weight", "lin1.bias", "lin1.weight", "lin2.weight"]), (key, sharded)
