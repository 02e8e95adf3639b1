"""What one rank owns, in checkpoint terms: the only code that knows how an optimizer holds state.

An adapter turns (model, optimizer) into:
  * `meta()`: the world-size independent description of the model (every rank computes the same):
    tensor name -> global shape, dtype, kind; aliases (tied parameters); param groups by name;
  * `pieces()` at save: a `Piece` (name, value key, lo, hi, tensor; plan.py) for every flat element range this rank
    writes: the fp32 master (key "param") or the parameter itself where there is no master,
    buffers ("value", rank 0 only), and elementwise optimizer state tensors;
  * `destinations()` at load: a `Destination` (name, lo, hi, tensor) for every flat range this rank
    holds now; `optimizer_ranges()`: an `OptimizerRange` per segment of optimizer state it owns;
  * `stage_optimizer(...)` / `commit_optimizer(...)` / `finish_load()`: validate and stage the read
    state through the optimizer's own load (nothing changes; swapped buckets' records are written
    to side files), apply it once every rank has read everything, and publish masters.

Swapped state (docs/offload.md): a bucket whose master or optimizer state lives in swap files
(offload_param nvme in fp32, where the master IS the offloaded parameter shard; offload_optimizer
nvme) is one LazyPieces item among the pieces: its values exist only inside
`with item.resident() as pieces:` (the shard pinned, the state read through its store) and are
released after, so a save holds one such bucket at a time, never the model. At load, the
destinations of offloaded parameter shards come apart (`offloaded_destinations()`): each bucket's
new shard is staged as a side record (`stage_offloaded`) while nothing else changes, and becomes
current only after every rank has read everything (`commit_offloaded`; `discard_offloaded` on any
error).

Two adapters: EngineAdapter for the flat-bucket engines (zeroplus.initialize stages 1-3 and
ZeroRedundancyOptimizer(stage=2)), TorchZeroAdapter for zeroplus.ZeroRedundancyOptimizer stage 1
(torch's partition: whole parameters per rank). Engine accessors used: buckets, masters,
bucket_optimizers (segments, segment_state, segment_scalars, master_values, swapped), frozen_buckets
and param_store (stage 3: ParamSwapper pin/unpin and stage/commit/discard_replacements), scaler,
skipped_steps, stage_load/commit_load/discard_load, publish_masters(); zero.state's public sharded
format.
"""

from __future__ import annotations

import contextlib
import errno
import math

import torch

from ..optim.zero import ZeroRedundancyOptimizer
from ..zero import state as zero_state
from ..zero import state_dict_guard
from ..zero.bucket_optimizer import MasterHome
from ..zero.engine import ZeroEngine
from ..zero.stage3.units import compiled_inner
from .format import CheckpointError, encode_value
from .plan import (Destination, OffloadedBucket, OptimizerRange, Piece, ShardRange, StreamedBucket,
                   StreamedSegment)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _is_elementwise(value, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _first_step_state(optimizer_class, hyperparameters: dict, like: torch.Tensor) -> dict:
    """The state `optimizer_class` creates at its first step for a 2-element parameter like
    `like`, found the way torch's get_state_dict finds it (_init_optim_state: one step with zero
    gradients and lr 0), but on a scratch parameter: the real one is left alone."""
    scratch = torch.zeros(2, dtype=like.dtype, device=like.device, requires_grad=True)
    hyper = {k: v for k, v in hyperparameters.items() if k != "params"}
    if "lr" in hyper:
        hyper["lr"] = torch.tensor(0.0) if isinstance(hyper["lr"], torch.Tensor) else 0.0
    opt = optimizer_class([{**hyper, "params": [scratch]}])
    scratch.grad = torch.zeros_like(scratch)
    opt.step()
    return dict(opt.state.get(scratch, {}))


def _fresh_state(template: dict, numel: int) -> dict:
    """`template` (_first_step_state) for a parameter of `numel` elements, as it is before the
    first step changes it: elementwise tensors and per-parameter tensors (step) zero."""
    out = {}
    for key, value in template.items():
        if _is_elementwise(value, 2):
            out[key] = torch.zeros(numel, dtype=value.dtype, device=value.device)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        else:
            out[key] = value
    return out


class LazyPieces:
    """One bucket's pieces whose values live in swap files. `resident()` is a context manager
    giving its `Piece`s; the tensors are valid only inside it."""

    def __init__(self, open_fn):
        self._open = open_fn

    def resident(self):
        return self._open()


class _Base:
    def __init__(self, model: torch.nn.Module, opt, rank: int, world_size: int):
        self.model, self.opt, self.rank, self.world_size = model, opt, rank, world_size
        self.name_of: dict[int, str] = {}
        for name, p in model.named_parameters():
            self.name_of[id(p)] = name
        self.params = {name: p for name, p in model.named_parameters()}
        self.aliases = {}
        self.buffers = {}
        with state_dict_guard.allowed():  # identities of the live (possibly sharded) parameters
            live = model.state_dict(keep_vars=True)
        for key, value in live.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"checkpoint: model state_dict entry {key!r} is a {type(value).__name__} (extra "
                                f"state), which checkpoints do not support")
            canonical = self.name_of.get(id(value))
            if canonical is None:
                self.buffers[key] = value
            elif canonical != key:
                self.aliases[key] = canonical
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                if id(p) not in self.name_of:
                    raise ValueError(f"checkpoint: param group {gi} of the optimizer has a parameter of shape "
                                     f"{tuple(p.shape)} that is not a parameter of model")

    # -- description ---------------------------------------------------------------------------

    def global_shape(self, p: torch.nn.Parameter) -> tuple:
        return tuple(p.shape)

    def model_dtype(self, p: torch.nn.Parameter) -> torch.dtype:
        return p.dtype

    def meta(self) -> dict:
        tensors = {}
        for name, p in self.params.items():
            tensors[name] = {"shape": list(self.global_shape(p)), "dtype": dtype_name(self.model_dtype(p)),
                             "kind": "param", "trainable": bool(p.requires_grad)}
        for name, b in self.buffers.items():
            tensors[name] = {"shape": list(b.shape), "dtype": dtype_name(b.dtype), "kind": "buffer"}
        groups = [{**{k: encode_value(v) for k, v in g.items() if k != "params"},
                   "params": [self.name_of[id(p)] for p in g["params"]]} for g in self.opt.param_groups]
        return {"tensors": tensors, "aliases": dict(self.aliases), "param_groups": groups}

    def model_shapes(self) -> dict[str, tuple]:
        """Every state_dict key of the current model -> its global shape (the strict check)."""
        out = {name: self.global_shape(p) for name, p in self.params.items()}
        out.update({alias: out[c] for alias, c in self.aliases.items()})
        out.update({name: tuple(b.shape) for name, b in self.buffers.items()})
        return out

    def _replicated_pieces(self, names) -> list:
        """Whole tensors every rank holds the same: written once, by rank 0."""
        if self.rank != 0:
            return []
        return [Piece(n, "param" if n in self.params else "value", 0, t.numel(), t.detach().reshape(-1))
                for n, t in names if t.numel()]

    def changes_only_in_optimizer(self, name: str, key: str) -> bool:
        """Whether the piece (name, key) of pieces() changes only in the optimizer's step() and
        load_state_dict() or the model's load_state_dict() (never in forward or backward): an
        async save may copy it after returning (snapshot.py). Conservative default: no."""
        return False

    @staticmethod
    def _state_pieces(name, lo, hi, st, scalars, pieces) -> None:
        for key, value in st.items():
            if _is_elementwise(value, hi - lo):
                pieces.append(Piece(name, key, lo, hi, value.detach().reshape(-1)))
            else:
                scalars.setdefault(name, {})[key] = value


class EngineAdapter(_Base):
    """Stage1/2/3Optimizer: masters and state per segment (a parameter's piece of a bucket shard)."""

    def __init__(self, model, opt: ZeroEngine):
        super().__init__(model, opt, opt.rank, opt.world_size)
        if getattr(opt, "tp_group", None) is not None:
            # Shards are named by data-parallel rank: the tp ranks of one dp rank would write one file.
            raise ValueError("checkpoint: does not support tensor-parallel models yet (opt has DTensor parameters): "
                             "save model.state_dict() and opt's consolidated state_dict (both DTensors) with "
                             "torch.distributed.checkpoint (docs/tensor_parallel.md)")
        if opt.module is not None and opt.module is not model:
            raise ValueError("checkpoint: model is not the module this optimizer was built for (zeroplus.initialize "
                             "returned another one)")
        self.param_store = getattr(opt.placement, "param_store", None)
        self.frozen_buckets = list(opt.placement.frozen_buckets)
        self.entry_of = {id(e.param): e for b in list(opt.buckets) + self.frozen_buckets for e in b.entries}
        self.bucketed = set(self.entry_of)
        self.trainable = {self.name_of[id(e.param)] for b in opt.buckets for e in b.entries}

    def global_shape(self, p):
        e = self.entry_of.get(id(p))
        return tuple(e.shape) if e is not None else tuple(p.shape)

    def model_dtype(self, p):
        return p.dtype

    def source(self) -> dict:
        inner = next((bo.inner for bo in self.opt.bucket_optimizers if bo.inner is not None), None)
        return {"stage": self.opt.stage, "world_size": self.world_size, "mixed_precision": self.opt.mixed_precision,
                "engine": type(self.opt).__name__, "optimizer_class": type(inner).__name__ if inner else None}

    def _offloaded(self, b) -> bool:
        """The bucket's shard lives in a parameter swap file (offload_param nvme)."""
        return self.param_store is not None and self.param_store.offloads(b)

    def _own_frozen(self, persistent: bool = True):
        """(entry, piece, the tensor holding this rank's shard of the bucket) of the stage-3
        frozen buckets in memory (persistent ones, kept whole on every rank, included unless
        told not to)."""
        for b in self.frozen_buckets:
            if (b.persistent and not persistent) or self._offloaded(b):
                continue
            lo, hi = b.shard_range(self.rank)
            own = b.flat[lo:hi] if b.persistent else b.shard
            for e in b.entries:
                pc = b.piece(e, self.rank)
                if pc.numel:
                    yield e, pc, own

    def _unbucketed(self):
        return [(n, p) for n, p in self.params.items() if id(p) not in self.bucketed]

    def pieces(self) -> tuple[list, dict]:
        """Pieces in memory as tuples; buckets with swapped values as LazyPieces (module doc)."""
        pieces, scalars = [], {}
        for b, bo, master in zip(self.opt.buckets, self.opt.bucket_optimizers, self.opt.masters):
            if bo.swapped or bo.master_home is MasterHome.PARAM_RECORD:
                for seg in bo.segments:
                    pc = b.piece(b.entries[seg.entry], self.rank)
                    st = bo.segment_scalars(seg)
                    if st:
                        scalars.setdefault(self.name_of[id(b.entries[seg.entry].param)], {}).update(st)
                pieces.append(LazyPieces(lambda b=b, bo=bo: self._swapped_bucket(b, bo)))
                continue
            for seg in bo.segments:
                e = b.entries[seg.entry]
                pc = b.piece(e, self.rank)
                name = self.name_of[id(e.param)]
                pieces.append(Piece(name, "param", pc.param_lo, pc.param_hi, master[seg.lo:seg.hi]))
                self._state_pieces(name, pc.param_lo, pc.param_hi, bo.segment_state(seg), scalars, pieces)
        for b in self.frozen_buckets:
            if self._offloaded(b):
                pieces.append(LazyPieces(lambda b=b: self._pinned_frozen(b)))
        for e, pc, own in self._own_frozen():
            pieces.append(Piece(self.name_of[id(e.param)], "param", pc.param_lo, pc.param_hi,
                                own[pc.shard_lo:pc.shard_hi]))
        pieces += self._replicated_pieces(self._unbucketed() + list(self.buffers.items()))
        return pieces, scalars

    @contextlib.contextmanager
    def _swapped_bucket(self, b, bo):
        """A trainable bucket whose master and/or optimizer state is swapped: the master from the
        pinned parameter shard (fp32 offload_param) or the optimizer's store, the state through
        the store (copies of one bucket)."""
        pin = bo.master_home is MasterHome.PARAM_RECORD
        source = self.param_store.pin(b) if pin else bo.master_values()
        try:
            pieces = []
            for seg in bo.segments:
                pc = b.piece(b.entries[seg.entry], self.rank)
                name = self.name_of[id(b.entries[seg.entry].param)]
                pieces.append(Piece(name, "param", pc.param_lo, pc.param_hi, source[seg.lo:seg.hi]))
                n = pc.param_hi - pc.param_lo
                pieces += [Piece(name, k, pc.param_lo, pc.param_hi, v.detach().reshape(-1))
                           for k, v in bo.segment_state(seg).items() if _is_elementwise(v, n)]
            yield pieces
        finally:
            if pin:
                self.param_store.unpin(b)

    @contextlib.contextmanager
    def _pinned_frozen(self, b):
        shard = self.param_store.pin(b)
        try:
            yield [Piece(self.name_of[id(e.param)], "param", pc.param_lo, pc.param_hi, shard[pc.shard_lo:pc.shard_hi])
                   for e in b.entries for pc in (b.piece(e, self.rank),) if pc.numel]
        finally:
            self.param_store.unpin(b)

    def changes_only_in_optimizer(self, name: str, key: str) -> bool:
        # A trainable parameter's master and elementwise state: written by the step loop and the
        # loads only (at fp32 stages 1-2 the master is the parameter's own memory, which forward
        # reads). Frozen shards, unbucketed parameters and buffers (BatchNorm statistics change
        # in forward) are copied at the call.
        return name in self.trainable

    def optimizer_meta(self) -> dict:
        return {"loss_scaler": self.opt.scaler.state_dict(), "skipped_steps": int(self.opt.skipped_steps)}

    def check_optimizer_meta(self, optimizer_meta: dict, where: str) -> None:
        """The manifest's engine state (loss scaler, skipped steps) is what load_optimizer can
        install, checked before anything changes: CheckpointError naming the manifest and field."""
        def refuse(field, value, expected):
            raise CheckpointError(errno.EINVAL, f"checkpoint: optimizer.{field} is {value!r}, expected {expected}",
                                  where)
        scaler = optimizer_meta.get("loss_scaler")
        current = self.opt.scaler.state_dict()
        if isinstance(scaler, dict) and set(scaler) == set(current):  # else this run keeps its own (load_optimizer)
            for key, mine in current.items():
                value = scaler[key]
                if isinstance(mine, bool):
                    if not isinstance(value, bool):
                        refuse(f"loss_scaler.{key}", value, "a bool")
                elif isinstance(mine, int):
                    if isinstance(value, bool) or not isinstance(value, int):
                        refuse(f"loss_scaler.{key}", value, "an int")
                elif isinstance(mine, float):
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                            or (key == "scale" and value <= 0):
                        refuse(f"loss_scaler.{key}", value, "a finite number" + (" > 0" if key == "scale" else ""))
        skipped = optimizer_meta.get("skipped_steps", 0)
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            refuse("skipped_steps", skipped, "an int >= 0")

    # -- load --------------------------------------------------------------------------------------

    def destinations(self) -> list:
        """In-memory destinations; those of offloaded shards are offloaded_destinations()'s."""
        out = []
        for b, bo, master in zip(self.opt.buckets, self.opt.bucket_optimizers, self.opt.masters):
            if bo.master_home in (MasterHome.PARAM_RECORD, MasterHome.OPTIMIZER_RECORD):
                continue  # offloaded_destinations(), streamed_buckets()
            for seg in bo.segments:
                pc = b.piece(b.entries[seg.entry], self.rank)
                out.append(Destination(self.name_of[id(b.entries[seg.entry].param)], pc.param_lo, pc.param_hi,
                                       master[seg.lo:seg.hi]))
        for b in self.frozen_buckets:
            if b.persistent:  # whole on every rank and never re-gathered: every rank reads all of it
                out += [Destination(self.name_of[id(e.param)], 0, e.numel, b.flat[e.offset:e.offset + e.numel])
                        for e in b.entries if e.numel]
        for e, pc, own in self._own_frozen(persistent=False):
            out.append(Destination(self.name_of[id(e.param)], pc.param_lo, pc.param_hi, own[pc.shard_lo:pc.shard_hi]))
        for n, t in self._unbucketed() + list(self.buffers.items()):
            if t.numel():
                out.append(Destination(n, 0, t.numel(), t.data.view(-1)))
        return out

    def offloaded_destinations(self) -> list:
        """An OffloadedBucket (bucket, its ShardRanges) for every bucket whose shard lives in a
        parameter swap file and is what a load replaces (fp32 masters, frozen parameters; a
        mixed-precision shard is written from its master by finish_load)."""
        trainable = [b for b, bo in zip(self.opt.buckets, self.opt.bucket_optimizers)
                     if bo.master_home is MasterHome.PARAM_RECORD]
        out = []
        for b in trainable + [b for b in self.frozen_buckets if self._offloaded(b)]:
            ranges = [ShardRange(self.name_of[id(e.param)], pc.param_lo, pc.param_hi, pc.shard_lo, pc.shard_hi)
                      for e in b.entries for pc in (b.piece(e, self.rank),) if pc.numel]
            out.append(OffloadedBucket(b, ranges))
        return out

    def stage_offloaded(self, bucket, ranges: list, values: list) -> None:
        """Stages the bucket's new shard (ranges and bucket: an item of offloaded_destinations;
        values: one tensor per range). Raises OSError naming the swap file."""
        shard = torch.zeros(bucket.shard_numel, dtype=bucket.dtype)
        for r, v in zip(ranges, values):
            shard[r.shard_lo:r.shard_hi].copy_(v.reshape(-1))
        self.param_store.stage_replacement(bucket, shard)

    def commit_offloaded(self) -> None:
        if self.param_store is not None:
            self.param_store.commit_replacements()

    def discard_offloaded(self) -> None:
        if self.param_store is not None:
            self.param_store.discard_replacements()

    def optimizer_ranges(self) -> list:
        """An OptimizerRange per segment, in the order of the engine's sharded state dict."""
        out, i = [], 0
        for b, bo in zip(self.opt.buckets, self.opt.bucket_optimizers):
            for seg in bo.segments:
                e = b.entries[seg.entry]
                pc = b.piece(e, self.rank)
                out.append(OptimizerRange(i, self.name_of[id(e.param)], pc.param_lo, pc.param_hi))
                i += 1
        return out

    def fresh_optimizer_states(self) -> dict:
        """{segment index: the state its optimizer would create at its first step} for every
        range of optimizer_ranges() (the destinations of a load into an optimizer that has not
        stepped yet)."""
        out, i = {}, 0
        for bo in self.opt.bucket_optimizers:
            template = _first_step_state(type(bo.inner), bo.inner.param_groups[0], bo.master) if bo.segments else {}
            for seg in bo.segments:
                out[i] = _fresh_state(template, seg.hi - seg.lo)
                i += 1
        return out

    def load_optimizer(self, states: dict, groups: list, optimizer_meta: dict) -> None:
        """stage_optimizer then commit_optimizer, every segment's state in `states` (set_state_dict)."""
        staged = self.stage_optimizer(states, groups, optimizer_meta)
        try:
            self.commit_optimizer(staged)
        finally:
            self.discard_optimizer(staged)

    def stage_optimizer(self, states: dict, groups: list, optimizer_meta: dict, read_streamed=None):
        """Validates and stages the optimizer's load, changing nothing (ZeroEngine.stage_load):
        with read_streamed, the buckets of streamed_buckets() are read one at a time through
        read_streamed(bo, segs) -> (states, masters) instead of from `states`, and staged as side
        records of their store. Returns what commit_optimizer applies (discard_optimizer: what an
        error leaves is removed)."""
        index = {id(p): i for i, p in enumerate(p for g in self.opt.param_groups for p in g["params"])}
        scaler = optimizer_meta.get("loss_scaler")
        if not isinstance(scaler, dict) or set(scaler) != set(self.opt.scaler.state_dict()):
            scaler = self.opt.scaler.state_dict()  # another precision saved it: keep this run's scaler
        sharded = {
            "state": {i: {k: (v.reshape(-1) if _is_elementwise(v, v.numel()) else v) for k, v in st.items()}
                      for i, st in states.items()},
            "param_groups": [{**hyper, "params": [index[id(p)] for p in g["params"]]}
                             for hyper, g in zip(groups, self.opt.param_groups)],
            "zeroplus": {"format": zero_state.FORMAT, "version": zero_state.VERSION, "stage": self.opt.stage,
                         "world_size": self.world_size, "rank": self.rank,
                         "layout": zero_state.layout_signature(self.opt), "loss_scaler": scaler,
                         "skipped_steps": int(optimizer_meta.get("skipped_steps", 0))},
        }
        bucket_of = {id(bo): b for b, bo in enumerate(self.opt.bucket_optimizers)}
        streamed = {bucket_of[id(bo)]: (lambda bo=bo, segs=segs: self._streamed(bo, segs, read_streamed))
                    for bo, segs in (self.streamed_buckets() if read_streamed is not None else ())}
        return self.opt.stage_load(sharded, streamed, owned=True)  # the reader's tensors: no copy

    def commit_optimizer(self, staged) -> None:
        self.opt.commit_load(staged)

    def discard_optimizer(self, staged) -> None:
        self.opt.discard_load(staged)

    def streamed_buckets(self) -> list:
        """A StreamedBucket (bucket optimizer, its StreamedSegments) for every bucket whose
        optimizer state (and, in mixed precision, master) lives in an offload store: a load reads
        and stages them one bucket at a time (stage_optimizer), never the whole state at once."""
        out, i = [], 0
        for b, bo in zip(self.opt.buckets, self.opt.bucket_optimizers):
            segs = []
            for seg in bo.segments:
                pc = b.piece(b.entries[seg.entry], self.rank)
                segs.append(StreamedSegment(i, self.name_of[id(b.entries[seg.entry].param)], pc.param_lo,
                                            pc.param_hi, seg))
                i += 1
            if bo.swapped and segs:
                out.append(StreamedBucket(bo, segs))
        return out

    @staticmethod
    def _streamed(bo, segs, read_streamed) -> tuple[list, torch.Tensor | None]:
        """One streamed bucket's (segment states, new fp32 master where its store holds it)."""
        states, masters = read_streamed(bo, segs)
        if masters is None:
            return states, None
        master = torch.zeros(bo.bucket.shard_numel, dtype=torch.float32)
        for seg, value in zip(bo.segments, masters):
            master[seg.lo:seg.hi].copy_(value)
        return states, master

    def finish_load(self) -> None:
        self.opt.publish_masters()


class TorchZeroAdapter(_Base):
    """zeroplus.ZeroRedundancyOptimizer (stage 1, torch's partition): whole parameters, replicated;
    each rank's local optimizer (opt.optim) owns the state of its partition."""

    def __init__(self, model, opt: ZeroRedundancyOptimizer):
        super().__init__(model, opt, opt.rank, opt.world_size)
        self.owned = {id(p) for g in opt.optim.param_groups for p in g["params"]}
        self.managed = {id(p) for g in opt.param_groups for p in g["params"]}

    def source(self) -> dict:
        return {"stage": 1, "world_size": self.world_size, "mixed_precision": None,
                "engine": "ZeroRedundancyOptimizer", "optimizer_class": type(self.opt.optim).__name__}

    def pieces(self) -> tuple[list, dict]:
        pieces, scalars = [], {}
        for name, p in self.params.items():
            if id(p) in self.owned and p.numel():
                pieces.append(Piece(name, "param", 0, p.numel(), p.detach().reshape(-1)))
                self._state_pieces(name, 0, p.numel(), self.opt.optim.state.get(p, {}), scalars, pieces)
        pieces += self._replicated_pieces([(n, p) for n, p in self.params.items() if id(p) not in self.managed]
                                          + list(self.buffers.items()))
        return pieces, scalars

    def optimizer_meta(self) -> dict:
        return {}

    def check_optimizer_meta(self, optimizer_meta: dict, where: str) -> None:
        pass  # torch's stage-1 optimizer has no engine state

    def destinations(self) -> list:
        return [Destination(n, 0, t.numel(), t.data.view(-1))
                for n, t in list(self.params.items()) + list(self.buffers.items()) if t.numel()]

    def optimizer_ranges(self) -> list:
        flat = [p for g in self.opt.param_groups for p in g["params"]]
        return [OptimizerRange(i, self.name_of[id(p)], 0, p.numel()) for i, p in enumerate(flat) if id(p) in self.owned]

    def fresh_optimizer_states(self) -> dict:
        """As EngineAdapter.fresh_optimizer_states, for the parameters this rank's optimizer owns."""
        group_of = {id(p): gi for gi, g in enumerate(self.opt.optim.param_groups) for p in g["params"]}
        flat = [p for g in self.opt.param_groups for p in g["params"]]
        templates, out = {}, {}
        for i, _name, lo, hi in self.optimizer_ranges():
            gi = group_of[id(flat[i])]
            key = (gi, flat[i].dtype, flat[i].device)
            if key not in templates:
                templates[key] = _first_step_state(type(self.opt.optim), self.opt.optim.param_groups[gi], flat[i])
            out[i] = _fresh_state(templates[key], hi - lo)
        return out

    def stage_optimizer(self, states: dict, groups: list, optimizer_meta: dict, read_streamed=None):
        return states, groups, optimizer_meta  # nothing swapped; torch's class loads at the commit

    def commit_optimizer(self, staged) -> None:
        self.load_optimizer(*staged)

    def discard_optimizer(self, staged) -> None:
        pass

    def load_optimizer(self, states: dict, groups: list, optimizer_meta: dict) -> None:
        flat = [p for g in self.opt.param_groups for p in g["params"]]
        plain, start = [], 0
        for hyper, g in zip(groups, self.opt.param_groups):
            plain.append({**hyper, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        state = {i: {k: (v.view(flat[i].shape) if _is_elementwise(v, flat[i].numel()) and k != "step" else v)
                     for k, v in st.items()} for i, st in states.items()}
        self.opt.load_state_dict({"state": state, "param_groups": plain})

    def finish_load(self) -> None:
        pass

    def offloaded_destinations(self) -> list:
        return []

    def streamed_buckets(self) -> list:
        return []

    def commit_offloaded(self) -> None:
        pass

    def discard_offloaded(self) -> None:
        pass


def adapter_for(model, opt):
    # torch.compile(model) after zeroplus.initialize (or around a DDP model): the module it runs,
    # so parameters are named as the uncompiled model names them (no "_orig_mod." prefix) and
    # the checkpoint loads with or without compile. A compiled module the engine was built on
    # (zeroplus.initialize(torch.compile(model))) is the engine's module itself and stays.
    while compiled_inner(model) is not None and model is not getattr(opt, "module", None):
        model = compiled_inner(model)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module  # names as the user's own module has them (no "module." prefix)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"checkpoint: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(opt, ZeroEngine):
        return EngineAdapter(model, opt)
    if isinstance(opt, ZeroRedundancyOptimizer):
        return TorchZeroAdapter(model, opt)
    raise TypeError(f"checkpoint: opt must be an optimizer from zeroplus.initialize or zeroplus.ZeroRedundancyOptimizer, "
                    f"got {type(opt).__name__}")
