"""`p.grad` after backward, at every ZeRO stage: what torch's own gradient code reads.

A DDP script reads gradients through `p.grad`: torch.nn.utils.clip_grad_norm_, clip_grad_value_,
get_total_norm, logging. The engine keeps the reduced gradient in its accumulators (grad_reducer.py)
and frees each `p.grad` as its bucket is sent, so without this module every `p.grad` is None
after backward and torch's clip_grad_norm_ silently returns 0 and clips nothing.

After each backward outside no_sync (the end of the pass, after the reducer and, at stage 3, the
gatherer ended it) every managed trainable parameter gets a `p.grad`:

  * Stage 1 with the accumulator in the parameter's dtype: a plain view of the parameter's slice
    of the all-reduced accumulator (every rank holds the whole averaged gradient, as under DDP).
    Every torch op works on it exactly as under DDP; in-place changes reach the step.
  * Otherwise (stages 2-3, a stage-1 accumulator in another dtype, or a tensor-parallel parameter):
    a ShardedGrad, a tensor subclass with the parameter's full shape and dtype whose values are
    this rank's piece of the averaged gradient (the rest lives on the other ranks), as FSDP2's
    DTensor gradients are. Its
    __torch_dispatch__ implements exactly what torch.nn.utils.clip_grad's functions call:
    linalg_vector_norm / _foreach_norm give a per-rank partial norm (_PartialNorm), torch.stack
    of partials stays partial, and linalg_vector_norm of that stack is ONE all-reduce for the
    whole list (collective: every rank calls it, as with FSDP2); mul_ / _foreach_mul_ (clipping
    by the global norm), clamp_ / clamp_min_ / clamp_max_ and their foreach forms (clip_grad_value_),
    zero_ (zero_grad(set_to_none=False)) act on the piece in place, so the step uses the result.
    Any other op raises RuntimeError naming the zeroplus call to use (opt.clip_grad_norm_,
    opt.gradient_shards()): nothing silently reads a piece as if it were the whole gradient.
    fp16: the accumulators hold loss-scaled values; norms are divided by the scale and
    clamp bounds multiplied by it, so the values seen are the true gradient.
    A gradient held by an offload tier (offload_param "nvme" spill, the host tier of
    offload_optimizer on CUDA) is not in memory: every op raises naming opt.clip_grad_norm_.

The next backward clears these views before autograd accumulates into them (a tensor pre-hook on
every parameter, which runs before AccumulateGrad, for the first; the pass's begin_backward, from
that first gradient's hook, for the rest, which the reducer would otherwise read as local
gradients); zero_grad frees them with the accumulators.

Tensor-parallel (DTensor) parameters (stages 1-2, dtensor_params.py) always get a ShardedGrad with the
DTensor's global shape, even at stage 1 beside plain views: a DTensor p.grad would make torch's clip
functions refuse the list (DTensor ops reject a mix of DTensor and plain tensors, and a TP model's
norms stay plain), so the foreach handlers below also take plain tensors beside ShardedGrads. Each
norm term says over which mesh dimension it is partial (_PartialNorm.kinds): every piece over the
data-parallel group, a tensor-parallel shard's also over the tensor-parallel group; a term whole
over a dimension (a plain gradient's norm; a Replicate DTensor's piece over tp) is counted on that
dimension's rank 0 only, so the reduced norm is opt.clip_grad_norm_'s (clipping.global_norm_of_terms).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist

from . import dtensor_params
from .grad_reducer import GradientHome

aten = torch.ops.aten

_USE = ("use opt.clip_grad_norm_(max_norm) for the global norm, torch.nn.utils.clip_grad_norm_ / clip_grad_value_ / "
        "get_total_norm on every rank (collective), or opt.gradient_shards() for this rank's shards")


# What a norm term is a part of (bit flags): PARTIAL_DP, each data-parallel rank holds another piece
# (summed over the dp group); PARTIAL_TP, each tensor-parallel rank holds another piece (summed over
# the tp group). A term without a flag is the same on every rank of that dimension: counted once.
WHOLE, PARTIAL_DP, PARTIAL_TP = 0, 1, 2


class _PartialNorm(torch.Tensor):
    """Norms (0-d, or a 1-d stack) of which each rank holds a part: for a p-norm the sum of
    |g|^p over its pieces, for inf the max |g|; `kinds` says per term over which mesh dimensions
    it is partial (WHOLE terms, plain tensors' norms, are counted once). Reduced by
    linalg_vector_norm of the same order."""

    @staticmethod
    def __new__(cls, terms: torch.Tensor, kinds: tuple[int, ...], ord_: float, views: "GradViews"):
        t = torch.Tensor._make_wrapper_subclass(cls, terms.shape, dtype=torch.float32, device=terms.device)
        t._terms, t._kinds, t._ord, t._views_ref = terms, kinds, ord_, weakref.ref(views)
        return t

    @property
    def _views(self) -> "GradViews":
        return _alive(self._views_ref)

    def __repr__(self):
        return f"_PartialNorm(ord={self._ord}, shape={tuple(self.shape)}: a part of a global gradient norm)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default:
            src = args[0]
            device = kwargs.get("device") or src.device
            if torch.device(device) != src.device:
                return _PartialNorm(src._terms.to(device), src._kinds, src._ord, src._views)
            return src
        if func is aten.stack.default:
            parts = args[0]
            partial = [p for p in parts if isinstance(p, _PartialNorm)]
            ord_, views = partial[0]._ord, partial[0]._views
            if any(p._ord != ord_ for p in partial) or (len(args) > 1 and args[1] not in (0, -1)):
                raise RuntimeError("zeroplus: torch.stack of gradient norms of different orders; " + _USE)
            terms, kinds = [], []
            for p in parts:
                if isinstance(p, _PartialNorm):
                    terms.append(p._terms.reshape(()))
                    kinds.extend(p._kinds)
                else:  # a plain gradient's norm (whole on every rank): counted once
                    value = p.detach().float().reshape(()).abs()
                    terms.append(value if math.isinf(ord_) else value ** ord_)
                    kinds.append(WHOLE)
            return _PartialNorm(torch.stack(terms), tuple(kinds), ord_, views)
        if func is aten.linalg_vector_norm.default:
            src = args[0]
            ord_ = float(args[1]) if len(args) > 1 else float(kwargs.get("ord", 2.0))
            dim = args[2] if len(args) > 2 else kwargs.get("dim")
            if ord_ != src._ord or dim not in (None, [], ()):
                raise RuntimeError(f"zeroplus: norm of order {ord_} over partial norms of order {src._ord}; " + _USE)
            return src._views.reduce_norm(src)
        raise RuntimeError(f"zeroplus: {func} on a partial gradient norm (this rank's part of a norm over sharded "
                           f"gradients; only torch.linalg.vector_norm(torch.stack(norms)) reduces it, as "
                           f"torch.nn.utils.get_total_norm does); " + _USE)


class ShardedGrad(torch.Tensor):
    """p.grad of a managed parameter whose gradient is sharded (see the module doc)."""

    @staticmethod
    def __new__(cls, views: "GradViews", bucket: int, entry: int, shape, dtype, device):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        # Weak: the parameter holds its .grad from C++, where the collector cannot see a cycle
        # parameter -> grad -> GradViews -> parameter.
        t._views_ref, t._bucket, t._entry = weakref.ref(views), bucket, entry
        return t

    @property
    def _views(self) -> "GradViews":
        return _alive(self._views_ref)

    def __repr__(self):
        return (f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}: this rank's piece of a ZeRO stage "
                f"{self._views.stage} gradient; {_USE})")

    def piece(self) -> torch.Tensor | None:
        return self._views.piece(self._bucket, self._entry)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            first = args[0] if args else None
            first = first[0] if isinstance(first, (list, tuple)) and first else first  # a foreach op's list
            shape = tuple(first.shape) if isinstance(first, torch.Tensor) else "?"
            raise RuntimeError(f"zeroplus: {func} on p.grad of a ZeRO parameter, which holds only this rank's piece of "
                               f"the averaged gradient (shape {shape}); {_USE}")
        return handler(*args, **kwargs)


def _alive(ref) -> "GradViews":
    views = ref()
    if views is None:
        raise RuntimeError("zeroplus: this p.grad belongs to a ZeRO optimizer that no longer exists")
    return views


def _grads(x) -> list[torch.Tensor]:
    """The tensors of a (foreach) op's first argument: ShardedGrads, and plain tensors beside them
    (at stage 1 a plain parameter's p.grad is a plain view next to a tensor-parallel one's
    ShardedGrad; the clip functions pass them in one list). Other subclasses are refused."""
    grads = list(x) if isinstance(x, (list, tuple)) else [x]
    for g in grads:
        if not isinstance(g, ShardedGrad) and type(g) not in (torch.Tensor, torch.nn.Parameter):
            raise RuntimeError(f"zeroplus: a foreach op mixes a ZeRO p.grad with a {type(g).__name__}; {_USE}")
    return grads


def _norm(g: ShardedGrad, ord_=2.0, dim=None, keepdim=False, dtype=None) -> _PartialNorm:
    ord_ = float(ord_)
    if dim not in (None, [], ()) or not (ord_ > 0):
        raise RuntimeError(f"zeroplus: only a whole-tensor norm of order > 0 is supported on a ZeRO p.grad, got "
                           f"ord={ord_}, dim={dim}; {_USE}")
    return g._views.partial_norm(g, ord_)


def _foreach_norm(grads, ord_=2.0, dtype=None):
    return [_norm(g, ord_) if isinstance(g, ShardedGrad) else torch.linalg.vector_norm(g, ord_, dtype=dtype)
            for g in _grads(grads)]


def _scalar(value, like: torch.Tensor):
    return value.to(device=like.device, dtype=like.dtype) if isinstance(value, torch.Tensor) else value


def _mul_(g, coef):
    for x in _grads(g):
        piece = x.piece() if isinstance(x, ShardedGrad) else x
        if piece is not None:
            piece.mul_(_scalar(coef, piece))
    return g


def _foreach_mul_(grads, coefs):
    grads = _grads(grads)
    coefs = coefs if isinstance(coefs, (list, tuple)) else [coefs] * len(grads)
    for g, c in zip(grads, coefs):
        _mul_(g, c)


def _clamp_(g, min=None, max=None):  # noqa: A002 - torch's argument names
    for x in _grads(g):
        if not isinstance(x, ShardedGrad):
            x.clamp_(min=_scalar(min, x), max=_scalar(max, x))
            continue
        piece = x.piece()
        if piece is None:
            continue
        scale = x._views.grad_scale()  # fp16: the piece holds loss-scaled values
        lo = None if min is None else _scalar(min, piece) * scale
        hi = None if max is None else _scalar(max, piece) * scale
        piece.clamp_(min=lo, max=hi)
    return g


def _foreach_clamp_(grads, min=None, max=None) -> None:  # noqa: A002
    for g in _grads(grads):
        _clamp_(g, min=min, max=max)


def _amp_unscale(*_args, **_kwargs):
    raise RuntimeError("zeroplus: torch.amp.GradScaler.unscale_ reads p.grad, which at ZeRO stages 2-3 holds only this "
                       "rank's piece of the gradient (its inf check would not be agreed across ranks); use "
                       "zeroplus.GradScaler (same interface), or mixed_precision='fp16' with opt.backward(loss)")


def _zero_(g):
    piece = g.piece()
    if piece is not None:
        piece.zero_()
    return g


_HANDLERS = {
    aten.linalg_vector_norm.default: _norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten.mul_.Tensor: _mul_,
    aten.mul_.Scalar: _mul_,
    aten._foreach_mul_.Tensor: _foreach_mul_,
    aten._foreach_mul_.Scalar: _foreach_mul_,
    aten._foreach_mul_.List: _foreach_mul_,
    aten.clamp_.default: _clamp_,
    aten.clamp_.Tensor: _clamp_,
    aten.clamp_min_.default: lambda g, v: _clamp_(g, min=v),
    aten.clamp_max_.default: lambda g, v: _clamp_(g, max=v),
    aten._foreach_clamp_min_.Scalar: lambda gs, v: _foreach_clamp_(gs, min=v),
    aten._foreach_clamp_max_.Scalar: lambda gs, v: _foreach_clamp_(gs, max=v),
    aten.zero_.default: _zero_,
    aten._amp_foreach_non_finite_check_and_unscale_.default: _amp_unscale,
}


class _ClearHook:
    """A tensor pre-hook on each parameter (runs before AccumulateGrad): drops the view this
    module set, so autograd stores the new gradient instead of adding into the accumulator."""

    __slots__ = ("_views", "_param")

    def __init__(self, views: "GradViews", param):
        self._views = weakref.ref(views)
        self._param = weakref.ref(param)

    def __call__(self, grad):
        views, p = self._views(), self._param()
        if views is not None and p is not None and p.grad is not None and views.owns(p):
            p.grad = None
        return None


class GradViews:
    """A BackwardPass participant (attached last) that sets `p.grad` after each backward."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self.stage = engine.stage
        self.rank = engine.rank
        reducer = engine.reducer
        self._entries = []  # (bucket index, entry index, param)
        for b in engine.buckets:
            for ei, e in enumerate(b.entries):
                if e.param.requires_grad:
                    self._entries.append((b.index, ei, e.param))
        # Stage 1 with the accumulator in the parameters' dtype: plain views of plain parameters
        # (see the module doc); tensor-parallel (DTensor) parameters always get a ShardedGrad.
        self._plain = [not reducer.shard_gradients and reducer.accum_dtypes[b.index] == b.dtype
                       for b in engine.buckets]
        self._tp_group = engine.tp_group
        self._tp_rank = dist.get_rank(group=engine.tp_group) if engine.tp_group is not None else 0
        self._sharded = {}   # (bucket, entry) -> its ShardedGrad (made once)
        self._set: dict[int, torch.Tensor] = {}  # id(param) -> the view this module set
        self._hooks = [p.register_hook(_ClearHook(self, p)) for _b, _e, p in self._entries]

    # -- BackwardPass participant ---------------------------------------------------------------

    def on_grad(self, param) -> None:
        pass

    def begin_backward(self) -> None:
        # The reducer reads the p.grad of a parameter that got no gradient in this pass as a local
        # gradient to send (no_sync accumulation): none of these views may be left for it.
        for _b, _e, p in self._entries:
            if p.grad is not None and self.owns(p):
                p.grad = None
        self._set.clear()

    def abandon_backward(self) -> None:
        pass

    def end_backward(self) -> None:
        engine = self._engine()
        if engine is None or engine.reducer.no_sync:
            return  # under no_sync p.grad holds the local gradients, as under DDP
        self.expose()

    # -- the views --------------------------------------------------------------------------------

    def owns(self, p) -> bool:
        return self._set.get(id(p)) is p.grad

    def expose(self) -> None:
        engine = self._engine()
        reducer = engine.reducer
        for b, ei, p in self._entries:
            if reducer.home(b) is GradientHome.NONE:
                continue  # no gradient (zero_grad freed it)
            if p.grad is not None and not self.owns(p):
                continue  # a gradient the reducer left (no_sync accumulation)
            bucket = engine.buckets[b]
            e = bucket.entries[ei]
            tensor_parallel = dtensor_params.is_dtensor(p)
            shape = tuple(p.shape) if tensor_parallel else e.shape  # a DTensor's global shape
            if self._plain[b] and reducer.accum[b] is not None and not tensor_parallel:
                view = reducer.accum[b][e.offset:e.offset + e.numel].view(e.shape)
            else:
                view = self._sharded.get((b, ei))
                if view is None:
                    view = self._sharded[(b, ei)] = ShardedGrad(self, b, ei, shape, p.dtype, p.device)
            _assign(p, view, shape)
            self._set[id(p)] = view

    def forget(self) -> None:
        """zero_grad(set_to_none=True) cleared every p.grad."""
        self._set.clear()

    def grad_scale(self) -> float:
        return self._engine()._grad_scale()

    def piece(self, b: int, ei: int) -> torch.Tensor | None:
        """Bucket b entry ei's piece of this rank's gradient shard (a view: writes reach the
        step), or None where this rank holds none of it."""
        engine = self._engine()
        reducer = engine.reducer
        if reducer.home(b) in (GradientHome.SPILL, GradientHome.HOST):
            raise RuntimeError(f"zeroplus: this gradient lives in the offload tier (offload_param/offload_optimizer), "
                               f"not in memory, so p.grad cannot be read or changed; use opt.clip_grad_norm_(max_norm)")
        acc = reducer.accum[b]
        bucket = engine.buckets[b]
        pc = bucket.piece(bucket.entries[ei], self.rank)
        if acc is None or not pc.numel:
            return None
        base = 0 if reducer.shard_gradients else bucket.shard_range(self.rank)[0]
        return acc[base + pc.shard_lo:base + pc.shard_hi]

    def partial_norm(self, g: ShardedGrad, ord_: float) -> _PartialNorm:
        piece = g.piece()
        engine = self._engine()
        device = engine.buckets[0].device
        if piece is None or not piece.numel():
            term = torch.zeros((), dtype=torch.float32, device=device)
        elif math.isinf(ord_):
            term = piece.detach().abs().max().float()
        else:
            term = torch.linalg.vector_norm(piece.detach(), ord_, dtype=torch.float32) ** ord_
        # Each dp rank holds another piece; a tensor-parallel shard is also another piece on each tp rank.
        kind = PARTIAL_DP | (PARTIAL_TP if engine.buckets[g._bucket].tp_sharded else WHOLE)
        return _PartialNorm(term, (kind,), ord_, self)

    def reduce_norm(self, partial: _PartialNorm) -> torch.Tensor:
        """The global norm: ONE all-reduce over the data-parallel group, and with a tensor-parallel
        model one more over the tensor-parallel group (collective), as opt.clip_grad_norm_ does."""
        engine = self._engine()
        terms, kinds, ord_ = partial._terms.reshape(-1), partial._kinds, partial._ord
        if math.isinf(ord_):  # a max is a max: whole terms are equal on every rank
            local = terms.max() if terms.numel() else torch.zeros((), device=terms.device)
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=engine.process_group)
            if self._tp_group is not None:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._tp_group)
            return local / self.grad_scale()
        # A term whole over a dimension is counted on that dimension's rank 0 only.
        keep = [bool(k & PARTIAL_DP) or engine.rank == 0 for k in kinds]
        if self._tp_group is not None:
            keep = [c and (bool(k & PARTIAL_TP) or self._tp_rank == 0) for c, k in zip(keep, kinds)]
        if all(keep):
            local = terms.sum()
        else:
            local = (terms * torch.tensor(keep, dtype=terms.dtype).to(terms.device, non_blocking=True)).sum()
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=engine.process_group)
        if self._tp_group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self._tp_group)
        return local ** (1.0 / ord_) / self.grad_scale()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _assign(p: torch.nn.Parameter, grad: torch.Tensor, shape) -> None:
    """p.grad = grad. torch's setter requires the gradient's shape; a stage-3 parameter at rest
    already has its full shape (layout.resting_view). Any other parameter whose .data has another
    shape is shown the full shape for the assignment only (a zero-stride view, no memory)."""
    if tuple(p.shape) == tuple(shape):
        p.grad = grad
        return
    saved = p.data
    p.data = torch.empty((), dtype=saved.dtype, device=saved.device).expand(shape)
    try:
        p.grad = grad
    finally:
        p.data = saved
