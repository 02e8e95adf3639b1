"""`python -m zeroplus.checkpoint convert --to deepspeed ZP_CKPT OUT [--world-size N] [--stage S]`:
a zeroplus checkpoint rewritten in DeepSpeed 0.19.8's ZeRO checkpoint layout, streaming, so a user
can go back to DeepSpeed.

    convert_to_deepspeed("ckpt/step300", "runs/ds")   # -> {"tag", "stage", "world_size", "files", "bytes"}
    # then, in DeepSpeed: engine.load_checkpoint("runs/ds")   (its `latest` names global_stepN)

OUT gets what DeepSpeed's engine.save_checkpoint(OUT) writes for a ZeRO stage-S run at
data-parallel size N (deepspeed_layout.py describes the layout; runtime/zero/stage_1_and_2.py and
stage3.py state_dict / load_state_dict are what reads it back):
  OUT/latest                        "global_stepK" (K: extra["global_steps"], else the optimizer's
                                    step count, else 0), written last;
  OUT/global_stepK/mp_rank_00_model_states.pt (stages 1-2) or zero_pp_rank_R_mp_rank_00_model_states.pt
                                    per rank (stage 3): module state dict (stages 1-2 whole, in the
                                    model's dtype; stage 3 parameters empty, as DeepSpeed writes),
                                    param_shapes, frozen_param_shapes/_fragments (stages 2-3; None
                                    at stage 1, as DeepSpeed writes), shared_params
                                    (zeroplus's aliases), buffer_names, lr_scheduler
                                    (extra["lr_scheduler"]), global_steps, global_samples,
                                    skipped_steps, dp_world_size, ds_version, and every other key of
                                    extra as DeepSpeed client_state;
  OUT/global_stepK/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt per rank R < N: rank R's flat
                                    fp32 partition of each param group (stage 3: sub group), the
                                    torch optimizer's state_dict of those flat tensors (Adam's step,
                                    exp_avg, exp_avg_sq), paddings, partition counts, loss scaler.
Stages 1-2: a param group is one flat vector, its trainable parameters back to back (DeepSpeed's
default parameter_alignment: no padding between them), padded to a multiple of 2 N; rank R owns
the R-th of N equal parts. The fp32 partition is saved without its tail padding, the optimizer
state with it (as DeepSpeed's rigid checkpoint does). Stage 3: every parameter is split in N
pieces of ceil(numel / N) elements (the last zero-padded); a sub group (DeepSpeed's default
sub_group_size, 1e9 elements) is its parameters' pieces back to back.

What DeepSpeed needs to load it: a run with the same parameter groups in the same order (the
zeroplus checkpoint's, frozen parameters left out), ZeRO stage S at data-parallel size N,
precision as the zeroplus run (bf16 -> DeepSpeed's bf16 file names; fp16 checkpoints are refused:
DeepSpeed's dynamic loss scaler state is not written), default parameter_alignment and
round_robin_gradients off, and a torch Adam/AdamW client optimizer (or DeepSpeed's with the same
state keys). `clip_grad` is not written, so the loading run's gradient_clipping applies.

Streaming: rank R's files are written one rank at a time; its partition tensors (fp32 masters and
each elementwise state) are filled piece by piece from the zeroplus shards (CheckpointReader reads
only the ranges asked, checksums verified), saved, synced and dropped before the next rank's: the
peak is one DeepSpeed rank's partition plus one parameter's piece. The stages 1-2 model states
file holds the whole module (DeepSpeed's layout): its parameters are assembled one at a time in a
scratch file (unlinked at creation) and saved from its mapping: file-backed pages the kernel can
write back and reclaim (they count in the resident set while mapped), never anonymous memory.

Crash consistency and errors: OUT (one plain path component) is created 0700 and exclusively
(FileExistsError if it exists, nothing touched); every file is created exclusively through
zeroplus.files (never through a link) and fdatasync'ed; `latest` is written last. On any error
OUT is removed. Arguments are checked before anything is written: world_size (int >= 1) and stage
(1, 2 or 3) raise TypeError/ValueError naming them; a checkpoint DeepSpeed cannot hold (an
optimizer other than Adam/AdamW, parameters of one group at different step counts, an extra key
that is one of DeepSpeed's own) raises ValueError naming what.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import torch

from .. import files
from . import fsutil
from .deepspeed_pickle import FragmentAddress, LossScaler, ZeroStageEnum, save
from .format import LATEST, check_dir_name, decode_value
from .reader import CheckpointReader

DS_VERSION = "0.19.8"
_ALIGN = 2  # stage_1_and_2.py: nccl_start_alignment_factor; a flat group is padded to a multiple of 2 N
_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size (stage 3)
_ADAM = {"Adam", "AdamW"}
# model-states keys DeepSpeed's engine writes and reads itself: an extra key of these names is refused
_DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
            "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
            "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
            "checkpoint_parallel_dimensions", "ds_config", "ds_version"}
_EXTRA_COUNTERS = {"lr_scheduler", "global_steps", "global_samples", "skipped_steps", "ds_version", "client_state"}


def _check_args(src, out, world_size, stage):
    for arg, value in (("src", src), ("out", out)):
        if not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"convert: {arg} must be a str or os.PathLike, got {type(value).__name__}")
    for arg, value in (("world_size", world_size), ("stage", stage)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"convert: {arg} must be an int, got {type(value).__name__}")
    if world_size is not None and world_size < 1:
        raise ValueError(f"convert: world_size must be >= 1, got {world_size}")
    if stage is not None and stage not in (1, 2, 3):
        raise ValueError(f"convert: stage must be 1, 2 or 3 (DeepSpeed ZeRO stage), got {stage}")


class _Plan:
    """What goes where: flat groups (stages 1-2: param groups; stage 3: sub groups) and per rank
    the pieces of each parameter, from the zeroplus manifest alone (no tensor read)."""

    def __init__(self, m: dict, where: str, world: int, stage: int):
        self.world, self.stage, self.where = world, stage, where
        tensors = m["tensors"]
        source = m["source"]
        if source.get("mixed_precision") == "fp16":
            raise ValueError(f"convert --to deepspeed: {where} was saved with fp16 mixed precision; its dynamic "
                             f"loss scaler is not written in DeepSpeed's form (fp32 and bf16 checkpoints convert)")
        self.bf16 = source.get("mixed_precision") == "bf16"
        # (a manifest without "trainable", as version 1 may be: every parameter trains)
        trainable = [n for n, t in tensors.items() if t["kind"] == "param" and t.get("trainable", True)]
        self.frozen = [n for n, t in tensors.items() if t["kind"] == "param" and not t.get("trainable", True)]
        self.buffers = [n for n, t in tensors.items() if t["kind"] == "buffer"]
        self.numel = {n: math.prod(t["shape"]) for n, t in tensors.items()}
        stateful = [n for n in trainable if tensors[n].get("state")]
        if stateful and source.get("optimizer_class") not in _ADAM:
            raise ValueError(f"convert --to deepspeed: {where} holds {source.get('optimizer_class')} state; "
                             f"DeepSpeed's checkpoint is written for torch's Adam/AdamW (exp_avg, exp_avg_sq, step)")
        if stateful and len(stateful) != len(trainable):
            missing = sorted(set(trainable) - set(stateful))
            raise ValueError(f"convert --to deepspeed: {where}: parameters {missing} have no optimizer state while "
                             f"the others have (DeepSpeed keeps one state per flat group)")
        self.state_keys = sorted(tensors[stateful[0]]["state"]) if stateful else []
        for n in stateful:
            if sorted(tensors[n]["state"]) != self.state_keys:
                raise ValueError(f"convert --to deepspeed: {where}: {n!r} has optimizer state "
                                 f"{sorted(tensors[n]['state'])}, others {self.state_keys}")
        # DeepSpeed's param groups: zeroplus's, frozen parameters left out (DeepSpeed keeps them apart)
        self.hyper, self.group_names = [], []
        seen = set()
        for i, g in enumerate(m["param_groups"]):
            names = [n for n in g["params"] if n in tensors and tensors[n]["kind"] == "param"
                     and tensors[n]["trainable"]]
            if not names:
                raise ValueError(f"convert --to deepspeed: {where}: param group {i} holds no trainable parameter "
                                 f"(DeepSpeed's ZeRO refuses such a group)")
            seen.update(names)
            self.group_names.append(names)
            self.hyper.append({k: decode_value(v) for k, v in g.items() if k != "params"})
        if seen != set(trainable):
            raise ValueError(f"convert --to deepspeed: {where}: parameters {sorted(set(trainable) - seen)} are in no "
                             f"param group")
        self.flat = []  # per flat group: (param group index, [(name, offset in the flat vector)], flat numel)
        for gi, names in enumerate(self.group_names):
            if stage < 3:
                self.flat.append((gi, self._offsets(names, lambda n: self.numel[n])))
                continue
            if sum(self._piece(n) for n in names) <= _SUB_GROUP_SIZE:
                self.flat.append((gi, self._offsets(names, self._piece)))
                continue
            sub, size = [], 0  # stage3.py _create_fp16_sub_groups: cut where a sub group reaches the size
            for n in names:
                sub.append(n)
                size += self._piece(n)
                if size >= _SUB_GROUP_SIZE or n == names[-1]:
                    self.flat.append((gi, self._offsets(sub, self._piece)))
                    sub, size = [], 0
        self.scalars = []  # per flat group: the optimizer's scalars (Adam's step), equal over its parameters
        for gi, (offsets, _total) in ((f[0], f[1]) for f in self.flat):
            values = {n: tensors[n].get("scalars", {}) for n, _o in offsets}
            first = next(iter(values.values()))
            differ = [n for n, v in values.items() if v != first]
            if differ:
                raise ValueError(f"convert --to deepspeed: {where}: parameters of param group {gi} have different "
                                 f"optimizer step counts ({differ[0]!r}: {values[differ[0]]}, {offsets[0][0]!r}: "
                                 f"{first}); DeepSpeed keeps one per group")
            self.scalars.append({k: decode_value(v) for k, v in first.items()})

    def _piece(self, name: str) -> int:
        return -(-self.numel[name] // self.world)

    @staticmethod
    def _offsets(names, size) -> tuple[list, int]:
        out, at = [], 0
        for n in names:
            out.append((n, at))
            at += size(n)
        return out, at

    def partition(self, f: int) -> int:
        """Stages 1-2: elements per rank of flat group f (padded to a multiple of 2 N, split evenly)."""
        total = self.flat[f][1][1]
        return -(-total // (_ALIGN * self.world)) * _ALIGN

    def pieces(self, f: int, rank: int):
        """(name, lo, hi, at): flat elements [lo, hi) of `name` go to element `at` of rank's tensor of group f."""
        offsets, total = self.flat[f][1]
        if self.stage < 3:
            size = self.partition(f)
            start, end = rank * size, (rank + 1) * size
            for n, off in offsets:
                lo, hi = max(start, off), min(end, off + self.numel[n])
                if lo < hi:
                    yield n, lo - off, hi - off, lo - start
        else:
            for n, off in offsets:
                c = self._piece(n)
                lo, hi = min(rank * c, self.numel[n]), min((rank + 1) * c, self.numel[n])
                if lo < hi:
                    yield n, lo, hi, off

    def flat_numel(self, f: int) -> int:
        return self.partition(f) if self.stage < 3 else self.flat[f][1][1]


def convert_to_deepspeed(src, out, *, world_size: int | None = None, stage: int | None = None) -> dict:
    """Writes the zeroplus checkpoint `src` (a checkpoint directory, or a root whose `latest` names
    one) as DeepSpeed 0.19.8's ZeRO stage-`stage` checkpoint of `world_size` data-parallel ranks
    into the new directory `out` (defaults: the stage and world size `src` was saved at)."""
    _check_args(src, out, world_size, stage)
    out = os.path.abspath(os.fspath(out))
    parent, name = os.path.split(out)
    check_dir_name(name, f"convert: out {out!r}")
    with CheckpointReader(src) as reader:
        m = reader.manifest
        source = m["source"]
        world = world_size if world_size is not None else int(source.get("world_size") or 1)
        zstage = stage if stage is not None else int(source.get("stage") or 1)
        if zstage not in (1, 2, 3):  # a stage-0 (DDP-like) engine's checkpoint: no default DeepSpeed stage
            raise ValueError(f"convert: {reader.path} was saved at stage {source.get('stage')}; give stage=1, 2 or 3")
        plan = _Plan(m, reader.path, world, zstage)
        common, steps = _model_states_common(m, plan)
        tag = f"global_step{steps}"
        with fsutil.new_output_directory(parent, name) as out_fd:  # removed again on any error
            written = _write_tag(reader, plan, common, out_fd, tag)
            fsutil.write_small_file(out_fd, LATEST, tag.encode())  # last: DeepSpeed follows it
    return {"tag": tag, "stage": zstage, "world_size": world, "files": len(written), "bytes": sum(written.values())}


def _model_states_common(m: dict, plan: _Plan) -> tuple[dict, int]:
    extra = m.get("extra") if isinstance(m.get("extra"), dict) else {}
    client = {k: v for k, v in extra.items() if k not in _EXTRA_COUNTERS}
    if isinstance(extra.get("client_state"), dict):  # a checkpoint converted from DeepSpeed: its client_state back
        client.update(extra["client_state"])
    clash = sorted(set(client) & _DS_KEYS)
    if clash:
        raise ValueError(f"convert --to deepspeed: extra keys {clash} are DeepSpeed's own model-states keys")
    steps = extra.get("global_steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        step = plan.scalars[0].get("step") if plan.scalars else None
        steps = int(step.item() if isinstance(step, torch.Tensor) else step or 0)
    skipped = extra.get("skipped_steps", (m.get("optimizer") or {}).get("skipped_steps", 0))
    tensors = m["tensors"]
    config = {"zero_optimization": {"stage": plan.stage}, "train_micro_batch_size_per_gpu": 1}
    if plan.bf16:
        config["bf16"] = {"enabled": True}
    common = {"buffer_names": list(plan.buffers), "optimizer": None,
              "param_shapes": [OrderedDict((n, torch.Size(tensors[n]["shape"])) for n, _o in f[1][0])
                               for f in plan.flat],
              # DeepSpeed records frozen parameters apart from stage 2 on (stage 1: only in the module)
              "frozen_param_shapes": ({n: torch.Size(tensors[n]["shape"]) for n in plan.frozen}
                                      if plan.stage >= 2 else None),
              "shared_params": dict(m.get("aliases") or {}), "lr_scheduler": extra.get("lr_scheduler"),
              "data_sampler": None, "random_ltd": None, "skipped_steps": int(skipped or 0), "global_steps": steps,
              "dp_world_size": plan.world, "mp_world_size": 1,
              "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_config": config,
              "ds_version": DS_VERSION, **client}
    if isinstance(extra.get("global_samples"), int):
        common["global_samples"] = extra["global_samples"]
    return common, steps


def _write_tag(reader: CheckpointReader, plan: _Plan, common: dict, out_fd: int, tag: str) -> dict:
    written = {}
    dir_fd = files.make_private_directory_at(out_fd, tag)
    try:
        if plan.stage < 3:
            module, frozen = _whole_module(reader, plan, dir_fd)
            _save_file(dir_fd, "mp_rank_00_model_states.pt",
                       {"module": module, **common, "frozen_param_fragments": frozen if plan.stage == 2 else None},
                       written)
            del module, frozen
        prefix = "bf16_" if plan.bf16 else ""
        for rank in range(plan.world):
            _save_file(dir_fd, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                       {"optimizer_state_dict": _optim_state(reader, plan, rank), "ds_config": common["ds_config"],
                        "ds_version": DS_VERSION}, written)
            if plan.stage == 3:
                _save_file(dir_fd, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                           {"module": _stage3_module(reader, plan), **common,
                            "frozen_param_fragments": _frozen_fragments(reader, plan, rank)}, written)
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return written


def _save_file(dir_fd: int, name: str, obj: dict, written: dict) -> None:
    fd = files.create_exclusive_at(dir_fd, name)
    try:
        save(obj, fd)
        written[name] = os.fstat(fd).st_size
    finally:
        os.close(fd)


def _optim_state(reader: CheckpointReader, plan: _Plan, rank: int) -> dict:
    """Rank `rank`'s optimizer_state_dict, as stage_1_and_2.py / stage3.py state_dict() returns it."""
    keys = ["param"] + plan.state_keys
    flats = []  # per flat group: {key: tensor}
    for f in range(len(plan.flat)):
        bufs = {k: torch.zeros(plan.flat_numel(f), dtype=torch.float32) for k in keys}
        for name, lo, hi, at in plan.pieces(f, rank):
            for k, value in zip(keys, reader.read_many([(name, k, lo, hi) for k in keys])):
                bufs[k][at:at + hi - lo] = value
        flats.append(bufs)
    state, groups = {}, []
    for f, bufs in enumerate(flats):
        if plan.state_keys:
            state[f] = {**plan.scalars[f], **{k: bufs[k] for k in plan.state_keys}}
    for gi, hyper in enumerate(plan.hyper):
        groups.append({**hyper, "params": [f for f, flat in enumerate(plan.flat) if flat[0] == gi]})
    torch_sd = {"state": state, "param_groups": groups}
    scaler = LossScaler()
    scaler.__dict__.update(cur_scale=1.0, dynamic=False)
    if plan.stage == 3:
        return {"zero_stage": ZeroStageEnum.weights, "loss_scaler": scaler, "dynamic_loss_scale": False,
                "overflow": False, "partition_count": plan.world, "optimizer_state_dict": torch_sd,
                "fp32_flat_groups": [bufs["param"] for bufs in flats]}
    paddings, masters, mappings = [], [], []
    for f, bufs in enumerate(flats):
        size, total = plan.partition(f), plan.flat[f][1][1]
        pad = max(0, min(size, (rank + 1) * size - total))
        paddings.append(pad)
        masters.append(bufs["param"][:size - pad].clone())  # saved without the tail padding
        mappings.append({n: FragmentAddress(numel=hi - lo, start=at) for n, lo, hi, at in plan.pieces(f, rank)})
    return {"loss_scaler": scaler, "dynamic_loss_scale": False, "overflow": False, "base_optimizer_state": torch_sd,
            "single_partition_of_fp32_groups": masters,
            "zero_stage": ZeroStageEnum.gradients if plan.stage == 2 else ZeroStageEnum.optimizer_states,
            "group_paddings": paddings, "param_alignment_paddings": [[0] * len(f[1][0]) for f in plan.flat],
            "partition_count": [plan.world] * len(plan.flat), "ds_version": DS_VERSION,
            "param_slice_mappings": mappings}


def _dtype(reader: CheckpointReader, name: str) -> torch.dtype:
    return getattr(torch, reader.manifest["tensors"][name]["dtype"])


def _buffers(reader: CheckpointReader, plan: _Plan) -> dict:
    return {n: reader.read_many([(n, "value", 0, plan.numel[n])])[0].reshape(reader.manifest["tensors"][n]["shape"])
            for n in plan.buffers}


def _whole_module(reader: CheckpointReader, plan: _Plan, dir_fd: int) -> tuple[dict, dict]:
    """Stages 1-2: the module state dict (parameters in the model's dtype, from the masters; tied
    names as views of their target; buffers) and the frozen parameters. The parameters live in one
    scratch file per dtype, unlinked at creation and mapped, assembled one parameter at a time."""
    tensors = reader.manifest["tensors"]
    params = [n for n, t in tensors.items() if t["kind"] == "param"]
    module = {}
    by_dtype = {}
    for n in params:
        by_dtype.setdefault(_dtype(reader, n), []).append(n)
    for dtype, names in by_dtype.items():
        es = torch.empty(0, dtype=dtype).element_size()
        total = sum(plan.numel[n] for n in names)
        if total == 0:
            module.update({n: torch.empty(tensors[n]["shape"], dtype=dtype) for n in names})
            continue
        fd, tmp = files.create_temporary_at(dir_fd, ".zeroplus-module-")
        try:
            os.unlink(tmp, dir_fd=dir_fd)  # nothing to clean up after a crash; the mapping keeps it
            at = 0
            for n in names:
                value = reader.read_many([(n, "param", 0, plan.numel[n])])[0].to(dtype)
                fsutil.write_all(fd, memoryview(value.view(torch.uint8).numpy()), at * es)
                at += plan.numel[n]
            storage = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=total, dtype=dtype)
        finally:
            os.close(fd)
        at = 0
        for n in names:
            module[n] = storage[at:at + plan.numel[n]].view(tensors[n]["shape"])
            at += plan.numel[n]
    for alias, target in (reader.manifest.get("aliases") or {}).items():
        module[alias] = module[target]
    module.update(_buffers(reader, plan))
    return module, {n: module[n] for n in plan.frozen}


def _stage3_module(reader: CheckpointReader, plan: _Plan) -> dict:
    """Stage 3: parameters empty (DeepSpeed's module state dict of partitioned parameters), buffers whole."""
    module = {n: torch.empty(0, dtype=_dtype(reader, n)) for n, t in reader.manifest["tensors"].items()
              if t["kind"] == "param"}
    for alias, target in (reader.manifest.get("aliases") or {}).items():
        module[alias] = module[target]
    module.update(_buffers(reader, plan))
    return module


def _frozen_fragments(reader: CheckpointReader, plan: _Plan, rank: int) -> dict:
    """Stage 3: rank's piece of each frozen parameter, ceil(numel / N) elements, zero-padded."""
    out = {}
    for n in plan.frozen:
        c = plan._piece(n)
        lo, hi = min(rank * c, plan.numel[n]), min((rank + 1) * c, plan.numel[n])
        piece = torch.zeros(c, dtype=_dtype(reader, n))
        if lo < hi:
            piece[:hi - lo] = reader.read_many([(n, "param", lo, hi)])[0]
        out[n] = piece
    return out
