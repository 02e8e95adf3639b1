"""zeroplus.load_checkpoint: any world size, any stage, validate everything before changing anything.

    extra = zeroplus.load_checkpoint("ckpt/step100", model, opt)   # or "ckpt" (follows ckpt/latest)

Collective over the optimizer's process group. Every rank:
  1. reads and validates the manifest (format version, names, ranges; reader.py);
  2. checks the model against it as model.load_state_dict(strict=True) would (missing and
     unexpected keys, size mismatches: RuntimeError with torch's wording) and the param groups;
  3. reads the element ranges it owns now (master or parameter, buffers, optimizer state),
     verifying the checksum of every block it touches; ranges whose home is a swap file
     (offload_param nvme, offload_optimizer nvme) are read one bucket at a time and staged as
     side records of their swapper (adapters.py), so a model larger than memory loads in bounded
     memory; the optimizer's load is validated and staged the same way (its own class's
     load_state_dict on a scratch copy, the loss scaler's state checked), changing nothing;
then the ranks agree (one all_gather_object) that all of them succeeded. Only then is anything
changed: the staged optimizer records are renamed into place and the optimizer's state and loss
scaler set, masters/parameters and buffers are copied, the staged parameter records replace the
swapped ones, and the engine publishes the masters into the (possibly sharded) parameters. On
any error every rank raises, the staged records are removed, and model and optimizer are
untouched. A swap record that was lost (deleted, refused) is simply written anew: loading is its
repair.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..zero.bucket_optimizer import MasterHome
from .adapters import adapter_for
from .format import MANIFEST, decode_value
from .plan import StreamedSegment
from .reader import CheckpointReader
from .save import wait_for_pending_save
from .sources import open_reader  # DeepSpeed checkpoints too (deepspeed_reader.py)


def _check_model(manifest: dict, adapter, model) -> None:
    saved = {name: tuple(t["shape"]) for name, t in manifest["tensors"].items()}
    saved.update({alias: saved[target] for alias, target in manifest["aliases"].items()})
    check_model_shapes(saved, adapter, model)


def check_model_shapes(saved: dict, adapter, model) -> None:
    """`saved` (state_dict key -> global shape) against the model, as model.load_state_dict(strict=True)
    checks a state dict: RuntimeError with torch's wording naming every missing, unexpected and
    mis-shaped key. Also used by dcp_state.set_state_dict."""
    current = adapter.model_shapes()
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    errors = []
    if unexpected:
        errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
    if missing:
        errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    for k in current:
        if k in saved and saved[k] != current[k]:
            errors.append(f"size mismatch for {k}: copying a param with shape {torch.Size(saved[k])} from checkpoint, "
                          f"the shape in current model is {torch.Size(current[k])}.")
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(type(model).__name__,
                                                                                  "\n\t".join(errors)))


def _check_groups(manifest: dict, adapter) -> list[dict]:
    saved, mine = manifest["param_groups"], adapter.opt.param_groups
    if len(saved) != len(mine):
        raise ValueError(f"load_checkpoint: the checkpoint has {len(saved)} param groups, the optimizer has {len(mine)}")
    out = []
    for i, (s, g) in enumerate(zip(saved, mine)):
        names = [adapter.name_of[id(p)] for p in g["params"]]
        if sorted(s["params"]) != sorted(names):
            diff = sorted(set(s["params"]) ^ set(names))
            raise ValueError(f"load_checkpoint: param group {i} holds other parameters in the checkpoint than in the "
                             f"optimizer (differing: {diff[:5]})")
        out.append({k: decode_value(v) for k, v in s.items() if k != "params"})
    return out


def _read_everything(reader: CheckpointReader, adapter, streamed: set) -> tuple[list, list, dict]:
    """The in-memory destinations' values and the optimizer state of every segment not in
    `streamed` (indices of segments whose state is read bucket by bucket: _read_streamed)."""
    m = reader.manifest
    dests = adapter.destinations()
    requests = [(d.name, "param" if m["tensors"][d.name]["kind"] == "param" else "value", d.lo, d.hi) for d in dests]
    state_requests, plan = [], []
    for r in adapter.optimizer_ranges():
        if r.segment in streamed:
            continue
        t = m["tensors"][r.name]
        keys = sorted(t.get("state", {}))
        if not keys and not t.get("scalars"):
            continue
        plan.append((r.segment, r.name, keys, len(state_requests)))
        state_requests += [(r.name, k, r.lo, r.hi) for k in keys]
    values = reader.read_many(requests + state_requests)
    param_values, state_values = values[:len(requests)], values[len(requests):]
    states = {}
    for i, name, keys, at in plan:
        st = {k: decode_value(v) for k, v in m["tensors"][name].get("scalars", {}).items()}
        st.update({k: state_values[at + j] for j, k in enumerate(keys)})
        states[i] = st
    return dests, param_values, states


def _read_streamed(reader: CheckpointReader, bo, segs: list[StreamedSegment]) -> tuple[list, list | None]:
    """One streamed bucket (adapters.streamed_buckets): its segments' state dicts (None: no
    state) and, where its optimizer store holds the master, the master's pieces."""
    m = reader.manifest
    requests, plan = [], []
    for s in segs:
        keys = sorted(m["tensors"][s.name].get("state", {}))
        plan.append((s.name, keys, len(requests)))
        requests += [(s.name, k, s.lo, s.hi) for k in keys]
    masters_at = len(requests)
    if bo.master_home is MasterHome.OPTIMIZER_RECORD:
        requests += [(s.name, "param", s.lo, s.hi) for s in segs]
    values = reader.read_many(requests)
    states = []
    for name, keys, at in plan:
        st = {k: decode_value(v) for k, v in m["tensors"][name].get("scalars", {}).items()}
        st.update({k: values[at + j] for j, k in enumerate(keys)})
        states.append(st or None)
    return states, (values[masters_at:] if bo.master_home is MasterHome.OPTIMIZER_RECORD else None)


def load_checkpoint(path, model, opt):
    """Load a checkpoint saved by zeroplus.save_checkpoint into (model, opt); returns its extra."""
    adapter = adapter_for(model, opt)
    try:
        return _load(path, model, opt, adapter)
    finally:
        adapter.discard_offloaded()  # side records not committed (an error): removed; else a no-op


def _stage_offloaded(reader: CheckpointReader, adapter) -> None:
    """Offloaded shards: read bucket by bucket, each written as a side record (nothing changes)."""
    for item in adapter.offloaded_destinations():
        values = reader.read_many([(r.name, "param", r.lo, r.hi) for r in item.ranges])
        adapter.stage_offloaded(item.bucket, item.ranges, values)
        del values


def _load(path, model, opt, adapter):
    group = opt.process_group
    wait_for_pending_save()  # an async save of this process finishes first (it may be this path)
    error, which, reader, staged = None, None, None, None
    streamed = adapter.streamed_buckets()
    try:
        reader = open_reader(path, adapter)
        manifest = reader.manifest
        which = (reader.path, reader.manifest_crc32)
        _check_model(manifest, adapter, model)
        groups = _check_groups(manifest, adapter)
        adapter.check_optimizer_meta(manifest["optimizer"], os.path.join(reader.path, MANIFEST))
        dests, values, states = _read_everything(reader, adapter, {s.segment for b in streamed for s in b.segments})
        _stage_offloaded(reader, adapter)
        # Swapped optimizer state: read one bucket at a time and written to side records.
        staged = adapter.stage_optimizer(states, groups, manifest["optimizer"],
                                         lambda bo, segs: _read_streamed(reader, bo, segs))
        del states
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised
        error = e
    try:
        return _change(adapter, group, path, error, which, None if error else (manifest, dests, values, staged))
    finally:
        if staged is not None:
            adapter.discard_optimizer(staged)  # side records not committed (an error); else a no-op
        if reader is not None:
            reader.close()


def _change(adapter, group, path, error, which, loaded):
    """Agree with the other ranks, then change the model and the optimizer."""
    everyone = [None] * dist.get_world_size(group)
    mine = (None if error is None else f"{type(error).__name__}: {error}", which)
    dist.all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise error
    failed = [(r, e) for r, (e, _w) in enumerate(everyone) if e is not None]
    if failed:
        raise RuntimeError(f"load_checkpoint: rank {failed[0][0]} could not load {path}: {failed[0][1]} (nothing was "
                           f"changed)")
    if len({w for _e, w in everyone}) > 1:  # `latest` moved or the checkpoint was replaced meanwhile
        raise RuntimeError(f"load_checkpoint: the ranks read different checkpoints at {path} (it was replaced, or "
                           f"`latest` moved, during the load: {sorted({w for _e, w in everyone})}); nothing was changed")
    manifest, dests, values, staged = loaded
    adapter.commit_optimizer(staged)  # first: renaming its side records is the step that can fail
    with torch.no_grad():
        for dest, value in zip(dests, values):
            dest.tensor.copy_(value)
    adapter.commit_offloaded()
    adapter.finish_load()
    return manifest.get("extra")
