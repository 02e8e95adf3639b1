"""One bucket's step: the user's optimizer over this rank's shard of one flat bucket.

The engine's step walks the buckets (DeepSpeed's sub-groups) and runs, for each,

    fetch → set gradients → step → store → write back + all-gather (the engine's part)

so that an offload store can bring a bucket's master and optimizer state in (fetch) and write
them out (store) while the other buckets stay where they are, and so that the all-gather of one
bucket overlaps the step of the next. Today masters and state live in memory: fetch and store
are nothing unless an offload store is attached (attach_store: zeroplus.offload's NVMe
swapper), which keeps the bucket's optimizer state in a file between steps: fetch reads it,
store writes it back, and the state accessors below read through it.

Inside a bucket the optimizer steps *segments*: one view of the fp32 master per parameter piece
this rank owns (Bucket.owned_pieces). Each parameter therefore keeps its own optimizer state and
step count, exactly as torch.optim keeps them per parameter, and a parameter that no rank gave a
gradient (usage.py) keeps `.grad = None` on its segments, which torch's optimizers, and
zeroplus's fused twins, skip: no weight decay, no moment change, no step count. A bucket belongs
to one param group, so its optimizer has one group, whose hyperparameters are copied from the
user's group before every step (LR schedulers act on the user's groups).

Ownership: the segments are views of `master`; the inner optimizer owns their state. A bucket
whose shard holds only padding (a model smaller than the world) has no segments and no inner
optimizer.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass

import torch

from .layout import Bucket


class MasterHome(enum.Enum):
    """Where a bucket's fp32 master lives between steps: BucketOptimizer.master_home is the one
    answer (the step, publish, offload and checkpoints ask it, never the tensors' identity)."""
    PARAMS = "this rank's slice of the parameters, in memory (fp32)"
    PARAM_RECORD = ("this rank's shard of the parameters, kept in a parameter swap file (fp32 with offload_param "
                    "nvme): bucket.shard, empty between uses")
    COPY = "a copy of its own, in memory (mixed precision; CUDA training's host tier)"
    OPTIMIZER_RECORD = "a copy of its own, kept in the optimizer's swap record (a copy with offload_optimizer nvme)"


@dataclass(frozen=True)
class StagedBucket:
    """A bucket's load, prepared (BucketOptimizer.stage_load)."""
    state_dict: dict              # what the inner optimizer loads at the commit
    record: object | None         # the offload store's StagedRecord (its side file), or None
    handles: dict = None          # {(segment, key): the empty state tensor bound to the record}


@dataclass(frozen=True)
class Segment:
    """One parameter's piece of this rank's shard of a bucket: what the inner optimizer steps."""
    entry: int            # index into bucket.entries (its usage flag is usage.flag(bucket, entry))
    lo: int               # [lo, hi) in shard coordinates
    hi: int
    master: torch.Tensor  # master[lo:hi], the tensor the inner optimizer holds as a parameter


class BucketOptimizer:
    def __init__(self, bucket: Bucket, master: torch.Tensor, rank: int, inner_class: type, hyperparameters: dict,
                 shard_in_param_record: bool = False):
        """shard_in_param_record: the bucket's parameter shard lives in a parameter swap file
        (the placement's param_store offloads it)."""
        self.bucket = bucket
        self.master = master
        self.rank = rank
        # Mixed precision (and CUDA offload's host tier, at any precision): the master is a copy
        # of its own, which an offload store may keep in a file; fp32 otherwise: it is this
        # rank's slice of the parameters, which stay in memory.
        # (With offload_param the fp32 master is the bucket's shard object, empty between uses.)
        param_storages = {t.untyped_storage().data_ptr() for t in (bucket.flat, bucket.shard) if t is not None}
        self.master_is_copy = (master is not bucket.shard
                               and master.untyped_storage().data_ptr() not in param_storages)
        self._shard_in_param_record = shard_in_param_record
        self.segments = [Segment(e, lo, hi, master[lo:hi]) for e, lo, hi in bucket.owned_pieces(rank)]
        self.inner = (inner_class([{**hyperparameters, "params": [s.master for s in self.segments]}])
                      if self.segments else None)
        self.store_ = None          # an offload store (zeroplus.offload), or None: state in memory
        self._fetched = True        # False: the store could not produce the state; do not step
        self._segment_index = {id(s): i for i, s in enumerate(self.segments)}

    def attach_store(self, store) -> None:
        self.store_ = store

    @property
    def master_home(self) -> MasterHome:
        if self.master_is_copy:
            return MasterHome.OPTIMIZER_RECORD if self.store_ is not None else MasterHome.COPY
        return MasterHome.PARAM_RECORD if self._shard_in_param_record else MasterHome.PARAMS

    @property
    def swapped(self) -> bool:
        """The optimizer state lives in an offload store between steps (read it through
        segment_state / master_values, replace it through stage_load + commit_load / write_master)."""
        return self.store_ is not None

    def point_master(self, flat: torch.Tensor) -> None:
        """The master (and each segment, a view of it) now lives in `flat` (an offload store
        moved it; identity is kept, so the inner optimizer's parameters stay the same objects)."""
        self.master.data = flat
        for s in self.segments:
            s.master.data = flat[s.lo:s.hi]

    def param_shard(self) -> torch.Tensor:
        """This rank's shard of the bucket's parameters (compute dtype)."""
        if self.bucket.shard is not None:
            return self.bucket.shard
        lo, hi = self.bucket.shard_range(self.rank)
        return self.bucket.flat[lo:hi]

    def write_master(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """master[lo:hi] = values (a model state dict is being loaded), wherever the master is."""
        if self.store_ is not None:
            self.store_.write_master(self, lo, hi, values)
        else:
            self.master[lo:hi].copy_(values)

    # -- the step of one bucket ------------------------------------------------------------------

    def fetch(self) -> None:
        """Master and optimizer state are where the step needs them (in memory: nothing to do).
        A store that cannot read the state keeps the error for its end of step; the bucket then
        does not step."""
        if self.store_ is not None:
            self._fetched = self.store_.fetch(self)

    def store(self) -> None:
        """The step's results are where they live between steps (in memory: nothing to do)."""
        if self.store_ is not None and self._fetched:
            self.store_.store(self)

    def check(self, hyperparameters: dict, group_index: int) -> None:
        """Hyperparameters the fused kernels would refuse raise here, before any bucket steps
        (ValueError naming the field). torch's own classes check theirs only at construction."""
        if self.inner is not None and hasattr(self.inner, "_zp_check_hparams"):
            group = {**self.inner.param_groups[0], **{k: v for k, v in hyperparameters.items() if k != "params"}}
            self.inner._zp_check_hparams(group_index, group)

    def step(self, grad_shard: torch.Tensor, stepped: list[bool], first_flag: int, inv_scale: float,
             hyperparameters: dict) -> None:
        """One optimizer step of this rank's shard. grad_shard: the bucket's gradient shard (in
        the gradient dtype, multiplied by the loss scale); stepped[first_flag + entry]: whether
        the parameter of that entry is updated."""
        if self.inner is None or not self._fetched:
            return
        group = self.inner.param_groups[0]
        for k, v in hyperparameters.items():
            if k != "params":
                group[k] = v
        grad = grad_shard if grad_shard.dtype == self.master.dtype else grad_shard.to(self.master.dtype)
        if inv_scale != 1.0:
            grad = grad.mul(inv_scale) if grad is grad_shard else grad.mul_(inv_scale)
        any_stepped = False
        for s in self.segments:
            if stepped[first_flag + s.entry]:
                s.master.grad = grad[s.lo:s.hi]
                any_stepped = True
        if not any_stepped:
            return
        try:
            self.inner.step()
        finally:
            for s in self.segments:
                s.master.grad = None

    # -- state -------------------------------------------------------------------------------------

    def segment_state(self, segment: Segment) -> dict:
        if self.inner is None:
            return {}
        live = self.inner.state.get(segment.master, {})
        if self.store_ is None:
            return live
        swapped = self.store_.segment_states(self).get(self._segment_index[id(segment)])
        return {**live, **swapped} if swapped else live

    def segment_scalars(self, segment: Segment) -> dict:
        """The segment's state that is not elementwise (Adam's `step`), without reading a record:
        state keys an offload store swaps are left out."""
        if self.inner is None:
            return {}
        live = self.inner.state.get(segment.master, {})
        swapped = self.store_.swapped_keys(self).get(self._segment_index[id(segment)], set()) \
            if self.store_ is not None else set()
        n = segment.hi - segment.lo
        return {k: v for k, v in live.items() if k not in swapped
                and not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == n)}

    def master_values(self) -> torch.Tensor:
        """The fp32 master wherever it lives: a copy read through the offload store where the
        store holds it (mixed precision with offload_optimizer nvme), else the master itself."""
        if self.master_home is MasterHome.OPTIMIZER_RECORD:
            copy = self.store_.master_copy(self)
            if copy is not None:
                return copy
        return self.master

    @contextlib.contextmanager
    def resident_master(self):
        """The master readable for the duration, outside a step (publish_masters): where the
        offload store holds it (swapped out between steps), a copy read through the store is
        pointed at, then the master is emptied again as the store leaves it."""
        copy = self.store_.master_copy(self) if self.master_home is MasterHome.OPTIMIZER_RECORD else None
        if copy is None:
            yield self.master
            return
        self.point_master(copy)
        try:
            yield self.master
        finally:
            self.point_master(torch.empty(0, dtype=copy.dtype))

    # -- loading: stage everything, then commit (nothing changes before every bucket is staged) ----

    def stage_load(self, states: list[dict | None], hyperparameters: dict,
                   master: torch.Tensor | None = None) -> "StagedBucket | None":
        """Prepares replacing every segment's state (None or {}: no state) and the group's
        hyperparameters, as torch's load_state_dict would (it casts loaded tensors the way the
        optimizer class expects), and changes nothing: the load runs on a scratch optimizer of
        the same class over the same parameters, and an offload store writes the resulting record
        to a side file (master: the bucket's new fp32 master where the store holds it; None keeps
        it). Raises what the optimizer class or the store raises; commit_load applies the result,
        discard_load drops it."""
        if self.inner is None:
            return None
        group = {**{k: v for k, v in hyperparameters.items() if k != "params"},
                 "params": list(range(len(self.segments)))}
        loaded = {"state": {i: st for i, st in enumerate(states) if st}, "param_groups": [group]}
        current = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        scratch = type(self.inner)([{**current, "params": [s.master for s in self.segments]}])
        scratch.load_state_dict(loaded)
        if self.store_ is None:
            return StagedBucket(loaded, None)
        record = self.store_.stage_load(self, scratch.state, master)
        handles = record.handles()
        # What commit_load hands the inner optimizer: the scratch's (already cast) state with every
        # tensor the record holds replaced by its empty handle (torch's load keeps a tensor of the
        # parameter's dtype and device as it is, so the handles stay the state's objects).
        state = {}
        for i, seg in enumerate(self.segments):
            st = scratch.state.get(seg.master)
            if st:
                state[i] = {k: handles.get((i, k), v) for k, v in st.items()}
        groups = [{**{k: v for k, v in scratch.param_groups[0].items() if k != "params"}, "params": group["params"]}]
        return StagedBucket({"state": state, "param_groups": groups}, record, handles)

    def commit_load(self, staged: "StagedBucket | None") -> None:
        """Applies stage_load's result (the store's side file already renamed into place)."""
        if staged is None:
            return
        self.inner.load_state_dict(staged.state_dict)  # validated by stage_load on the same input
        if self.store_ is not None:
            self.store_.commit_load(self, staged.record, staged.handles)

    def discard_load(self, staged: "StagedBucket | None") -> None:
        if staged is not None and self.store_ is not None:
            self.store_.discard_load(staged.record)

    def state_tensors(self) -> list[torch.Tensor]:
        if self.inner is None:
            return []
        return [v for st in self.inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
