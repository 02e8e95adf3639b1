"""What one rank owns, in checkpoint terms: the only code that knows how an optimizer holds state.

An adapter turns (model, optimizer) into:
  * `meta()`: the world-size independent description of the model (every rank computes the same):
    tensor name -> global shape, dtype, kind; aliases (tied parameters); param groups by name;
  * `pieces()` at save: (name, value key, lo, hi, tensor) for every flat element range this rank
    writes: the fp32 master (key "param") or the parameter itself where there is no master,
    buffers ("value", rank 0 only), and elementwise optimizer state tensors;
  * `destinations()` at load: (name, lo, hi, destination tensor) for every flat range this rank
    holds now; `optimizer_ranges()`: (name, lo, hi) of the optimizer state it owns;
  * `load_optimizer(...)` / `finish_load()`: hand the read state to the optimizer through its own
    load_state_dict (which validates before it replaces anything) and publish masters.

Two adapters: EngineAdapter for the flat-bucket engines (zeroplus.initialize stages 1-3 and
ZeroRedundancyOptimizer(stage=2)), TorchZeroAdapter for zeroplus.ZeroRedundancyOptimizer stage 1
(torch's partition: whole parameters per rank). Engine accessors used: buckets, masters,
bucket_optimizers (segments, segment_state), frozen_buckets (stage 3), scaler, skipped_steps,
publish_masters(); zero.state's public sharded format.
"""

from __future__ import annotations

import torch

from ..optim.zero import ZeroRedundancyOptimizer
from ..zero import state as zero_state
from ..zero.engine import ZeroEngine
from .format import encode_value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _is_elementwise(value, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


class _Base:
    def __init__(self, model: torch.nn.Module, opt, rank: int, world_size: int):
        self.model, self.opt, self.rank, self.world_size = model, opt, rank, world_size
        self.name_of: dict[int, str] = {}
        for name, p in model.named_parameters():
            self.name_of[id(p)] = name
        self.params = {name: p for name, p in model.named_parameters()}
        self.aliases = {}
        self.buffers = {}
        for key, value in model.state_dict(keep_vars=True).items():
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
        return [(n, "param" if n in self.params else "value", 0, t.numel(), t.detach().reshape(-1))
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
                pieces.append((name, key, lo, hi, value.detach().reshape(-1)))
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
        if getattr(opt.placement, "param_store", None) is not None:
            raise NotImplementedError("checkpoint: zeroplus checkpoints of a model with offload_param device 'nvme' "
                                      "are not built yet (the parameter shards live in swap files); nothing was "
                                      "read or written")
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

    def _own_frozen(self, persistent: bool = True):
        """(entry, piece, the tensor holding this rank's shard of the bucket) of the stage-3
        frozen buckets (persistent ones, kept whole on every rank, included unless told not to)."""
        for b in self.frozen_buckets:
            if b.persistent and not persistent:
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
        pieces, scalars = [], {}
        for b, bo, master in zip(self.opt.buckets, self.opt.bucket_optimizers, self.opt.masters):
            for seg in bo.segments:
                e = b.entries[seg.entry]
                pc = b.piece(e, self.rank)
                name = self.name_of[id(e.param)]
                pieces.append((name, "param", pc.param_lo, pc.param_hi, master[seg.lo:seg.hi]))
                self._state_pieces(name, pc.param_lo, pc.param_hi, bo.segment_state(seg), scalars, pieces)
        for e, pc, own in self._own_frozen():
            pieces.append((self.name_of[id(e.param)], "param", pc.param_lo, pc.param_hi,
                           own[pc.shard_lo:pc.shard_hi]))
        pieces += self._replicated_pieces(self._unbucketed() + list(self.buffers.items()))
        return pieces, scalars

    def changes_only_in_optimizer(self, name: str, key: str) -> bool:
        # A trainable parameter's master and elementwise state: written by the step loop and the
        # loads only (at fp32 stages 1-2 the master is the parameter's own memory, which forward
        # reads). Frozen shards, unbucketed parameters and buffers (BatchNorm statistics change
        # in forward) are copied at the call.
        return name in self.trainable

    def optimizer_meta(self) -> dict:
        return {"loss_scaler": self.opt.scaler.state_dict(), "skipped_steps": int(self.opt.skipped_steps)}

    # -- load --------------------------------------------------------------------------------------

    def destinations(self) -> list:
        out = []
        for b, bo, master in zip(self.opt.buckets, self.opt.bucket_optimizers, self.opt.masters):
            for seg in bo.segments:
                pc = b.piece(b.entries[seg.entry], self.rank)
                out.append((self.name_of[id(b.entries[seg.entry].param)], pc.param_lo, pc.param_hi,
                            master[seg.lo:seg.hi]))
        for b in self.frozen_buckets:
            if b.persistent:  # whole on every rank and never re-gathered: every rank reads all of it
                out += [(self.name_of[id(e.param)], 0, e.numel, b.flat[e.offset:e.offset + e.numel])
                        for e in b.entries if e.numel]
        for e, pc, own in self._own_frozen(persistent=False):
            out.append((self.name_of[id(e.param)], pc.param_lo, pc.param_hi, own[pc.shard_lo:pc.shard_hi]))
        for n, t in self._unbucketed() + list(self.buffers.items()):
            if t.numel():
                out.append((n, 0, t.numel(), t.data.view(-1)))
        return out

    def optimizer_ranges(self) -> list:
        """(segment index, name, lo, hi) in the order of the engine's sharded state dict."""
        out, i = [], 0
        for b, bo in zip(self.opt.buckets, self.opt.bucket_optimizers):
            for seg in bo.segments:
                e = b.entries[seg.entry]
                pc = b.piece(e, self.rank)
                out.append((i, self.name_of[id(e.param)], pc.param_lo, pc.param_hi))
                i += 1
        return out

    def load_optimizer(self, states: dict, groups: list, optimizer_meta: dict) -> None:
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
        self.opt.load_state_dict(sharded)

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
                pieces.append((name, "param", 0, p.numel(), p.detach().reshape(-1)))
                self._state_pieces(name, 0, p.numel(), self.opt.optim.state.get(p, {}), scalars, pieces)
        pieces += self._replicated_pieces([(n, p) for n, p in self.params.items() if id(p) not in self.managed]
                                          + list(self.buffers.items()))
        return pieces, scalars

    def optimizer_meta(self) -> dict:
        return {}

    def destinations(self) -> list:
        return [(n, 0, t.numel(), t.data.view(-1)) for n, t in list(self.params.items()) + list(self.buffers.items())
                if t.numel()]

    def optimizer_ranges(self) -> list:
        flat = [p for g in self.opt.param_groups for p in g["params"]]
        return [(i, self.name_of[id(p)], 0, p.numel()) for i, p in enumerate(flat) if id(p) in self.owned]

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


def adapter_for(model, opt):
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
