"""ZeRO stage 3: gather a unit's parameters just before use, release them after, prefetch ahead.

State per unit (units.py decides which submodules are units): RELEASED (each parameter's .data
is its resting view: full shape, no values, layout.resting_view; this rank's slice of it is in
the bucket's shard), IN FLIGHT (an
async all-gather into the bucket's flat buffer was issued) or GATHERED (.data is the full
parameter, a view into that flat buffer). Nothing is copied back (the optimizer writes the
shards, not the gathered copies).

A released unit's flat buffer is dropped. Autograd would keep views of it alive until the
unit's backward (F.linear saves weight.t()), i.e. the whole gathered model between forward and
backward. So while a root forward runs, a saved-tensor hook replaces every saved tensor that is
a view of a gathered flat buffer with a reference (unit, bucket, offset, size, stride); unpacking
it in backward gathers the unit again if needed and returns the same view of the new buffer.
Values are the same: parameters do not change between a forward and its backward.

When (hooks on the user's modules; all run on the thread that runs forward / backward):
  * forward pre-hook of a unit's module: gather what the unit needs (its own parameters and the
    units owning parameters it shares, e.g. a tied LM head needs the embedding); post-hook:
    release them, unless reshard_after_forward=False with grad enabled (then kept until backward
    is done with them);
  * the post-hook also puts a hook on the module's outputs: when the gradient of an output is
    computed (i.e. just before the module's own backward), the unit is gathered again and held;
  * a held unit is released when every parameter it owns has received its gradient in this
    backward (post-accumulate-grad hooks), or at the end of backward (a queued autograd
    callback) for units with frozen parameters or no gradient this pass;
  * the root module's forward brackets a pass: its post-hook releases anything prefetched but
    not used.

Prefetch: every pass records the sequence of units it gathered (forward and backward
separately). The next pass predicts with that sequence: while what it gathers matches the
prediction, each gather also issues the next predicted units' all-gathers asynchronously, as far
as prefetch_elems (elements gathered ahead and not yet used; None: one unit ahead, FSDP2's
depth) and max_live_elems (all gathered elements) allow. A pass that departs from the prediction (a conditional branch) stops
prefetching for the rest of that pass and gathers on demand, which is always correct; its own
sequence becomes the next prediction. Every rank must run the same modules in the same order
(as with DDP), so every rank issues the same collectives in the same order: each unit's gather is
first agreed across ranks (`agreement`, gather_agreement.py), so a rank that runs another module
raises RankDivergenceError on every rank instead of pairing its gather with another one.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from .. import comm
from ..backward_pass import BackwardPass
from ..buffer_pool import BufferPool
from .compile_boundary import opaque
from ..layout import Bucket, is_rest_storage, repair_rest_base
from .units import Unit



class Residency(enum.Enum):
    """Where a unit's parameters are (see the module doc)."""
    RELEASED = "released"    # .data is each parameter's resting view; its slice is in the shard
    IN_FLIGHT = "in flight"  # an all-gather into the flat buffers was issued
    GATHERED = "gathered"    # .data is the full parameter, a view into the flat buffer


RELEASED, IN_FLIGHT, GATHERED = Residency.RELEASED, Residency.IN_FLIGHT, Residency.GATHERED


def _wait_all(works) -> None:
    for w in works:
        w.wait()


class _GatheredView:
    """What autograd keeps instead of a saved view of a gathered unit (see the module doc)."""
    __slots__ = ("unit", "bucket", "offset", "shape", "stride")

    def __init__(self, unit, bucket, offset, shape, stride):
        self.unit, self.bucket, self.offset = unit, bucket, offset
        self.shape, self.stride = shape, stride


def _check_shard_homes(st: "_UnitState", states: list["_UnitState"]) -> None:
    """A released unit's parameters are still their resting views, unwritten; else the user moved,
    replaced or wrote them after initialize (the next gather would silently undo it): RuntimeError
    naming the parameter."""
    for b in st.buckets:
        stray = b.stray_at_rest()
        if stray is None:
            continue
        owner = st
        if stray.param is None:  # only the shared element shows a write: find whose version moved
            found = ((other, ob.stray_at_rest(check_base=False)) for other in states for ob in other.buckets)
            owner, stray = next(((o, f) for o, f in found if f is not None), (st, stray))
            repair_rest_base(b.dtype, b.device)  # reported once; the written parameter stays refused
        raise _stray_error(owner, stray)


def _stray_error(st: "_UnitState", stray) -> RuntimeError:
    if stray.param is None:
        name = f"of unit {st.unit.name or '<root>'} (or of another stage-3 model)"
    else:
        names = {id(p): n for n, p in st.unit.module.named_parameters()}
        local_name = names.get(id(stray.param), f"<parameter of shape {tuple(stray.param.shape)}>")
        name = ".".join(x for x in (st.unit.name, local_name) if x)
    if stray.how == "replaced":
        return RuntimeError(
            f"zeroplus stage 3: parameter {name} no longer lives in zeroplus's shard buffers: the model was "
            f"moved or its parameters replaced after zeroplus.initialize (model.to(...), param.data = ...), "
            f"which the next gather would silently undo; move or convert the model before initialize")
    return RuntimeError(
        f"zeroplus stage 3: parameter {name} was written in place between uses (fill_, zero_, "
        f"torch.nn.init.*_, p.data.copy_(...)), but between steps a stage-3 parameter holds no values (its "
        f"slice lives in zeroplus's shard), so the next gather would silently drop the write; set values with "
        f"model.load_state_dict(full_state_dict) (each rank takes its slice) or before zeroplus.initialize, "
        f"and read them with zeroplus.full_state_dict(model)")


class _UnitState:
    def __init__(self, unit: Unit, buckets: list[Bucket], rank: int):
        self.unit = unit
        self.buckets = buckets  # sharded buckets whose parameters this unit owns
        self.numel = sum(b.numel for b in buckets)
        self.state = RELEASED
        self.works: list = []
        self.refs = 0             # forward holds (a module can be running twice: recursion, reuse)
        self.held = False         # held for backward
        self.prefetched = False   # gathered ahead, not used yet in this pass
        owned = [e.param for b in buckets for e in b.entries]
        self.trainable = {id(p) for p in owned if p.requires_grad}
        self.has_frozen = any(not p.requires_grad for p in owned)
        self.grads_seen: set[int] = set()
        self.rank = rank
        self.pinned: list[Bucket] = []  # offloaded shards pinned for the in-flight all-gather


class ParameterGatherer:
    def __init__(self, units: list[Unit], buckets: list[Bucket], group, rank: int, backward: BackwardPass, *,
                 prefetch_elems: int | None, max_live_elems: int, reshard_after_forward: bool,
                 shard_store=None):
        """shard_store: where offloaded shards live (zeroplus.offload's ParamSwapper: offloads,
        pin, unpin, read_ahead(buckets, then=next pass's buckets)), or None: every shard is in
        memory (`bucket.shard`)."""
        self.units = units
        self.store = shard_store
        self.group = group
        by_unit: dict[int, list[Bucket]] = {u.index: [] for u in units}
        for b in buckets:
            if not b.persistent:
                by_unit[b.unit].append(b)
        self.states = [_UnitState(u, by_unit[u.index], rank) for u in units]
        self.prefetch_elems = None if prefetch_elems is None else int(prefetch_elems)
        self.max_live_elems = int(max_live_elems)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.live_elems = 0
        self.peak_live_elems = 0
        self.pool = BufferPool()  # released flat buffers, reused by the next gather of that size
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        self.broadcast_gather = comm.owner_broadcast_gather(group)
        # gather_agreement.GatherAgreement, set by the placement: every rank agrees on each unit
        # gather before its collectives are issued (rank-divergent execution fails fast); None: no check.
        self.agreement = None
        self.stats = {"on_demand": 0, "prefetched": 0}  # all-gathers issued, by reason
        self._order = {"forward": [], "backward": []}   # prediction from the previous pass
        self._seen = {"forward": [], "backward": []}    # this pass
        self._on_track = {"forward": False, "backward": False}
        self._in_forward = 0  # depth of root forward calls
        self._handles = []
        self._state_of_param: dict[int, _UnitState] = {}
        # data_ptr of a gathered flat buffer's storage -> (unit index, bucket position), for the
        # saved-tensor hook.
        self._flat_of_storage: dict[int, tuple[int, int]] = {}
        self._saved_hooks = []  # saved_tensors_hooks contexts entered by root forwards
        for st in self.states:
            for b in st.buckets:
                for e in b.entries:
                    if e.param.requires_grad:
                        self._state_of_param[id(e.param)] = st
        self._backward = backward
        backward.attach(self, [e.param for st in self.states for b in st.buckets for e in b.entries
                               if e.param.requires_grad])
        self._install_module_hooks()

    # -- hooks on modules ----------------------------------------------------------------------

    def _install_module_hooks(self) -> None:
        # Every hook is opaque to torch.compile (compile_boundary.py): it swaps .data between
        # shard and full tensor, which a traced graph would bake in.
        root = self.units[-1].module
        for u in self.units:
            needs = [i for i in u.needs if self.states[i].buckets]
            if u.module is root:
                continue
            if needs:
                self._handles.append(u.module.register_forward_pre_hook(
                    opaque(self._make_pre_forward(needs), "stage-3 gather (forward pre-hook)")))
                self._handles.append(u.module.register_forward_hook(
                    opaque(self._make_post_forward(needs), "stage-3 release (forward hook)")))
        root_needs = [i for i in self.units[-1].needs if self.states[i].buckets]
        self._handles.append(root.register_forward_pre_hook(
            opaque(self._make_root_pre(root_needs), "stage-3 pass start (root forward pre-hook)")))
        self._handles.append(root.register_forward_hook(
            opaque(self._make_root_post(root_needs), "stage-3 pass end (root forward hook)")))
        # Leaves the saved-tensor hook context even when forward raises.
        self._handles.append(root.register_forward_hook(
            opaque(self._exit_saved_hooks, "stage-3 saved-tensor hooks exit"), always_call=True))

    def _make_pre_forward(self, needs):
        def hook(_module, _args):
            for i in needs:
                self._acquire(i)
        return hook

    def _make_post_forward(self, needs):
        def hook(_module, _args, output):
            self._register_pre_backward(output, needs)
            for i in needs:
                self._release_forward(i)
        return hook

    def _make_root_pre(self, needs):
        def hook(_module, _args):
            self._backward.close_stale()  # a backward that raised left its pass open
            if self._in_forward == 0 and not self._backward.running:
                self._start_pass("forward")
            self._in_forward += 1
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            self._saved_hooks.append(ctx)
            for i in needs:
                self._acquire(i)
        return hook

    def _exit_saved_hooks(self, _module, _args, _output) -> None:
        if self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)

    # -- saved tensors -------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            return t
        if is_rest_storage(ptr):
            # A parameter read while its unit is released: it holds no values (NaN) between uses.
            raise RuntimeError(
                f"zeroplus stage 3: a parameter of shape {tuple(t.shape)} was used by a forward outside every "
                f"unit that gathers it (e.g. a parent's forward doing F.linear(x, self.child.weight) when child "
                f"is its own unit), where it holds no values; make the parent and child one unit "
                f"(unit_classes=...) or call the child module (docs/zero.md, stage 3 caveat)")
        where = self._flat_of_storage.get(ptr)
        if where is None or t.dtype != self.states[where[0]].buckets[where[1]].flat.dtype:
            return t
        return _GatheredView(where[0], where[1], t.storage_offset(), tuple(t.shape), t.stride())

    def _unpack(self, saved):
        if not isinstance(saved, _GatheredView):
            return saved
        st = self.states[saved.unit]
        if st.state != GATHERED:
            # Backward needs it before this unit's pre-backward hook ran (or after its release):
            # gather and hold it like the pre-backward hook does.
            self._pre_backward([saved.unit])
        flat = st.buckets[saved.bucket].flat
        return flat.as_strided(saved.shape, saved.stride, saved.offset)

    def _make_root_post(self, needs):
        def hook(_module, _args, output):
            self._register_pre_backward(output, needs)
            for i in needs:
                self._release_forward(i)
            self._in_forward -= 1
            if self._in_forward == 0 and not self._backward.running:
                self._end_pass("forward")
                self._drop_unused_prefetches()
        return hook

    def _register_pre_backward(self, output, needs) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        hook = opaque(lambda _grad: self._pre_backward(needs), "stage-3 gather (pre-backward hook)")
        for t in tensors:
            t.register_hook(hook)

    # -- backward ------------------------------------------------------------------------------

    def _pre_backward(self, needs) -> None:
        self._backward.enter()  # the first hook of a backward opens the pass (begin_backward)
        for i in needs:
            st = self.states[i]
            if not st.held:
                self._gather(i, "backward")
                st.held = True
                st.prefetched = False

    # -- BackwardPass participant (attached after the reducer) ----------------------------------

    def begin_backward(self) -> None:
        self._start_pass("backward")

    def on_grad(self, param) -> None:
        # Runs after the gradient reducer's on_grad (attached first) took the gradient.
        st = self._state_of_param[id(param)]
        st.grads_seen.add(id(param))
        if st.held and not st.has_frozen and st.refs == 0 and len(st.grads_seen) == len(st.trainable):
            st.held = False
            self._release(st)

    def abandon_backward(self) -> None:
        self.end_backward()  # releasing is all there is to undo

    def end_backward(self) -> None:
        self._end_pass("backward")
        for st in self.states:
            st.grads_seen.clear()
            st.held = False
            st.prefetched = False
            if self._in_forward == 0:
                # A recomputation under non-reentrant checkpointing stops early (torch raises
                # inside the module once the saved tensors it needs exist), so a post-hook may
                # never have run: no forward is running now, so nothing holds a unit.
                st.refs = 0
            if st.refs == 0 and st.state != RELEASED:
                self._release(st)

    # -- gather / release ----------------------------------------------------------------------

    def _start_pass(self, kind: str) -> None:
        if kind == "forward":
            # Nothing may be held when a new forward starts: a forward that raised, or one with
            # reshard_after_forward=False whose backward never came, left units gathered.
            for st in self.states:
                st.refs = 0
                st.held = False
                self._release(st)
        self._seen[kind] = []
        self._on_track[kind] = bool(self._order[kind])

    def _end_pass(self, kind: str) -> None:
        self._order[kind] = self._seen[kind]

    def _acquire(self, i: int) -> None:
        st = self.states[i]
        if self._backward.running:
            # A forward inside backward (non-reentrant checkpointing recomputes a block): the
            # unit is held for backward like one its pre-backward hook gathered, and released
            # when its gradients are in. No forward reference: torch stops a recomputation
            # inside the module once it has what it needs, so the post-hook may never run and
            # a reference taken here would keep the unit gathered until backward ends.
            self._gather(i, "backward")
            st.held = True
        else:
            self._gather(i, "forward")
            st.refs += 1
        st.prefetched = False

    def _release_forward(self, i: int) -> None:
        st = self.states[i]
        if self._backward.running and st.refs == 0:
            return  # acquired inside backward (see _acquire): held until its gradients are in
        st.refs -= 1
        if st.refs > 0 or st.held:
            return
        if not self.reshard_after_forward and torch.is_grad_enabled() and not self._backward.running:
            st.held = True  # kept gathered for backward
            return
        self._release(st)

    def _gather(self, i: int, kind: str) -> None:
        """Make unit i GATHERED (waiting for its all-gather if needed) and prefetch what the
        prediction says comes next."""
        st = self.states[i]
        seen = self._seen[kind]
        position = len(seen)
        seen.append(i)
        order = self._order[kind]
        if self._on_track[kind] and (position >= len(order) or order[position] != i):
            self._on_track[kind] = False
        if st.state == RELEASED:
            self._issue(st, kind)
            self.stats["on_demand"] += 1
        st.prefetched = False  # in use now: no longer "ahead"
        if self._on_track[kind]:
            self._prefetch(order, position + 1, kind)
            if self.store is not None:
                # Offloaded shards: read the records of the units predicted next (beyond the
                # all-gathers just issued) while this one computes, as far as free buffers go:
                # this pass's rest, then the next pass's (forward -> backward -> the next step's
                # forward: the store plans across steps, issue 41).
                then = self._order["backward" if kind == "forward" else "forward"]
                self.store.read_ahead([b for j in order[position + 1:] for b in self.states[j].buckets],
                                      then=[b for j in then for b in self.states[j].buckets])
        self._complete(st)

    def _prefetch(self, order: list[int], start: int, kind: str) -> None:
        ahead = [s for s in self.states if s.prefetched]  # gathered ahead, not used yet
        ahead_elems = sum(s.numel for s in ahead)
        for j in order[start:]:
            st = self.states[j]
            if st.state != RELEASED:
                continue
            if self.prefetch_elems is None:
                if ahead:  # one unit ahead at most
                    break
            elif ahead_elems + st.numel > self.prefetch_elems:
                break
            if self.live_elems + st.numel > self.max_live_elems:
                break
            self._issue(st, kind)
            self.stats["prefetched"] += 1
            st.prefetched = True
            ahead.append(st)
            ahead_elems += st.numel

    def _shard_of(self, st: _UnitState, b: Bucket) -> torch.Tensor:
        """This rank's shard of b, resident (an offloaded one is pinned until _unpin)."""
        if self.store is None or not self.store.offloads(b):
            return b.shard
        shard = self.store.pin(b)
        st.pinned.append(b)
        return shard

    def _unpin(self, st: _UnitState) -> None:
        pinned, st.pinned = st.pinned, []
        for b in pinned:
            self.store.unpin(b)

    def _issue(self, st: _UnitState, kind: str) -> None:
        _check_shard_homes(st, self.states)  # on every rank, before the agreement: a refusal leaves nothing pending
        if self.agreement is not None:  # before anything is in flight: a mismatch leaves nothing pending
            self.agreement.agree(st.unit.index, kind)
        st.works = []
        try:
            for b in st.buckets:
                b.flat = self.pool.take(b.numel, b.dtype, b.device)
                shard = self._shard_of(st, b)
                if self.broadcast_gather:
                    # This rank's slice of the output is its shard: copy it, then one broadcast per owner.
                    lo, hi = b.shard_range(self.rank)
                    b.flat[lo:hi].copy_(shard)
                    st.works.append(comm.broadcast_from_owners(b.flat, b.shard_numel, self.group, self.world_size))
                else:
                    st.works.append(comm.all_gather(b.flat, shard, self.group, async_op=True))
                del shard
        except BaseException:
            works, st.works = st.works, []
            try:
                _wait_all(works)  # nothing may still read a pinned shard or write a buffer
            except BaseException:
                pass
            del works
            self._unpin(st)
            for b in st.buckets:  # the unit stays RELEASED: its buffers are not in use
                if b.flat is not None:
                    flat, b.flat = b.flat, None
                    self.pool.give(flat)
            raise
        st.state = IN_FLIGHT
        self.live_elems += st.numel
        self.peak_live_elems = max(self.peak_live_elems, self.live_elems)

    def _complete(self, st: _UnitState) -> None:
        if st.state != IN_FLIGHT:
            return
        works, st.works = st.works, []
        _wait_all(works)
        del works
        self._unpin(st)
        for j, b in enumerate(st.buckets):
            b.show_full()
            self._flat_of_storage[b.flat.untyped_storage().data_ptr()] = (self.states.index(st), j)
        st.state = GATHERED

    def _release(self, st: _UnitState) -> None:
        if st.state == RELEASED:
            return
        works, st.works = st.works, []
        try:
            _wait_all(works)  # IN_FLIGHT: the gather must be done before its buffer is reused
        finally:
            del works  # a work keeps its tensors referenced: the buffer would not be pooled
            self._unpin(st)
            for b in st.buckets:
                b.show_resting()
            for b in st.buckets:
                if b.flat is not None:
                    flat, b.flat = b.flat, None
                    self._flat_of_storage.pop(flat.untyped_storage().data_ptr(), None)
                    self.pool.give(flat)  # pooled only if nothing else (a failed work) still aliases it
            st.state = RELEASED
            st.prefetched = False
            self.live_elems -= st.numel

    def _drop_unused_prefetches(self) -> None:
        for st in self.states:
            if st.refs == 0 and not st.held and st.state != RELEASED:
                self._release(st)

    # -- outside forward/backward --------------------------------------------------------------

    def gather_units(self, indices) -> None:
        """Gather units for code outside forward (full state dicts); pair with release_units."""
        for i in indices:
            st = self.states[i]
            if st.state == RELEASED:
                self._issue(st, "outside")
        for i in indices:
            self._complete(self.states[i])
            self.states[i].refs += 1

    def release_units(self, indices) -> None:
        for i in indices:
            st = self.states[i]
            st.refs -= 1
            if st.refs == 0 and not st.held:
                self._release(st)

    def release_all(self) -> None:
        for st in self.states:
            st.refs = 0
            st.held = False
            self._release(st)

    def gathered_bytes(self) -> int:
        return sum(b.flat.numel() * b.flat.element_size() for st in self.states for b in st.buckets
                   if b.flat is not None)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
