"""Drop-in subclasses of torch.optim.Adam, AdamW and SGD whose step runs zeroplus's fused
multi-tensor kernels (one pass over p, g and state per element): C++ on CPU (AVX-512/AVX2/scalar
chosen at run time), and CUDA multi-tensor kernels in builds against a CUDA torch
(torch.ops.zeroplus.has_cuda_kernels()). See docs/optimizers.md.

They keep torch's constructor, param_groups, state_dict format and step semantics. A step falls
back to torch's own implementation (the "generic path") whenever something is outside what the
kernels support: tensors on other devices, sparse tensors, dtypes other than float32/bfloat16/float16,
non-contiguous tensors, complex params, capturable/differentiable, or a tensor lr/betas that
needs autograd. Deliberate difference: 16-bit parameters keep fp32 optimizer state (torch keeps
state in the param dtype); loaded 16-bit state is widened on first use.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _as_float(x) -> float | None:
    """Hyperparameters may be tensors in torch 2.x; the kernels take plain floats."""
    if isinstance(x, Tensor):
        if x.requires_grad or x.numel() != 1:
            return None
        return float(x.item())
    return float(x)


def _fused_devices() -> tuple[str, ...]:
    # CUDA kernels exist only in builds against a CUDA torch (CMake ZEROPLUS_CUDA_ENABLED).
    return ("cpu", "cuda") if torch.ops.zeroplus.has_cuda_kernels() else ("cpu",)


_FUSED_DEVICES = _fused_devices()


def _param_fusable(p: Tensor) -> bool:
    return (p.device.type in _FUSED_DEVICES and p.dtype in _SUPPORTED_DTYPES and p.layout is torch.strided
            and p.is_contiguous())


def _grads_fusable(grads) -> bool:
    # torch's .grad setter already guarantees grad dtype == param dtype, same device and shape;
    # what it allows and the kernels do not is a sparse or non-contiguous gradient.
    return all(g.layout is torch.strided and g.is_contiguous() for g in grads)


def _fp32_state(state: dict, key: str, p: Tensor) -> Tensor:
    t = state.get(key)
    if t is None:
        t = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        state[key] = t
    elif t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to(torch.float32).contiguous()  # e.g. bf16 state loaded from a torch checkpoint
        state[key] = t
    return t


class _GroupPlan:
    """What one param group's fused step needs, built once and reused while valid.

    Rebuilding the tensor lists every step costs several microseconds per parameter in Python
    (state lookups, dtype checks), which at 1000 tensors is as long as the kernel. The plan is
    keyed by which params have a gradient and the options that change the state layout
    (amsgrad / momentum on-off); it is revalidated each step by identity of the group's params,
    element by element (the list object alone misses `params[0] = new_param`, an in-place edit
    torch.optim honours), and of the per-parameter state dicts, which catches load_state_dict
    and ZeroRedundancyOptimizer's direct writes into `optim.state`. Both are C-level identity
    scans (10-25 us at 1000 tensors, against 0.3-0.6 ms for the rest of the
    per-step Python work). Replacing a single tensor inside a state dict by hand
    is not detected; call `_zp_invalidate()` after doing that.
    """

    __slots__ = ("key", "params", "live", "states", "batches")

    def valid(self, key, params, state) -> bool:
        return (self.key == key and len(params) == len(self.params)
                and all(map(operator.is_, params, self.params))
                and all(map(operator.is_, map(state.get, self.live), self.states)))


def _position(group, p) -> int:
    return next(i for i, q in enumerate(group["params"]) if q is p)


class _FusedBase:
    """Plan cache and the fall-back decision shared by the Adam family and SGD.

    Validation happens before anything moves, so a failed step leaves params and state (`step`
    included) as they were: hyperparameters every step (torch checks their ranges only in the
    constructor, then steps with whatever is set: a NaN or negative lr set later corrupts the
    params silently; here it raises ValueError naming the field), state when a plan is built,
    i.e. on the first step after a load (KeyError for a missing key, as torch; RuntimeError for
    a tensor whose shape or device is not the param's, where torch raises or broadcasts).
    """

    _zp_hparams = ()  # (field, ok(value), what is expected), checked each step

    def _zp_check_hparams(self, index, group) -> None:
        for field, ok, expected in self._zp_hparams:
            values = group[field] if field == "betas" else (group[field],)
            for k, raw in enumerate(values):
                value = _as_float(raw)
                if value is not None and not ok(value):
                    name = f"param_groups[{index}]['{field}']" + (f"[{k}]" if field == "betas" else "")
                    raise ValueError(f"zeroplus.optim.{type(self).__name__}.step: {name} is {value!r}, expected "
                                     f"{expected} (the range torch checks at construction); nothing was updated")

    def _zp_check_state(self, index, group, live, required, tensors) -> None:
        """State of `live` params (non-empty ones: empty state is created by the step) has every
        key in `required`, and each tensor in `tensors` that is present has the param's shape."""
        cls = f"zeroplus.optim.{type(self).__name__}.step"
        for p in live:
            st = self.state.get(p)
            if not st:
                continue
            for key in required:
                if key not in st:
                    raise KeyError(f"'{key}' is missing from the state of param_groups[{index}]['params']"
                                   f"[{_position(group, p)}] ({cls}; torch.optim raises KeyError too); "
                                   "nothing was updated")
            for key in tensors:
                t = st.get(key)
                if t is None:
                    continue
                where = f"param_groups[{index}]['params'][{_position(group, p)}]"
                if not isinstance(t, Tensor) or t.shape != p.shape or t.device != p.device:
                    got = (f"a {type(t).__name__}" if not isinstance(t, Tensor)
                           else f"shape {list(t.shape)} on {t.device}")
                    raise RuntimeError(f"{cls}: state '{key}' of {where} is {got}, expected shape "
                                       f"{list(p.shape)} on {p.device} (the param's); nothing was updated")
            step = st.get("step")
            if step is not None and not (isinstance(step, Tensor) and step.numel() == 1):
                raise RuntimeError(f"{cls}: state 'step' of param_groups[{index}]['params'][{_position(group, p)}] "
                                   f"is {step!r}, expected a one-element tensor; nothing was updated")

    def _zp_invalidate(self) -> None:
        self.__dict__["_zp_plans"] = {}

    def _zp_plan_for(self, index, group, grads):
        """A valid _GroupPlan, or None when the group must take torch's generic path."""
        params = group["params"]
        key = ([g is not None for g in grads], self._zp_layout_key(group))
        plans = self.__dict__.setdefault("_zp_plans", {})
        plan = plans.get(index)
        if plan is None or not plan.valid(key, params, self.state):
            live = [p for p, g in zip(params, grads) if g is not None]
            if not all(_param_fusable(p) and not p.is_complex() for p in live):
                return None
            plan = _GroupPlan()
            plan.key, plan.params, plan.live = key, tuple(params), live  # a copy: the list may be edited
            # Checks loaded state, then creates missing state like torch's _init_group.
            plan.batches = self._zp_build(index, group, live)
            plan.states = [self.state.get(p) for p in live]
            plans[index] = plan
        return plan

    def _zp_prepare(self):
        """Per group (plan, grads, hyperparameters), or None if any group needs the generic path.
        No parameter is updated before every group is known to be fusable; state a plan created
        in the meantime has torch's keys and step dtype, so a fallback step accepts it."""
        for index, group in enumerate(self.param_groups):
            self._zp_check_hparams(index, group)
        prepared = []
        for index, group in enumerate(self.param_groups):
            hp = self._zp_group_args(group)
            if hp is None:
                return None
            grads = [p.grad for p in group["params"]]
            plan = self._zp_plan_for(index, group, grads)
            live_grads = [g for g in grads if g is not None]
            if plan is None or not _grads_fusable(live_grads):
                return None
            prepared.append((plan, live_grads, hp))
        return prepared

    _zp_required_at_load = ()  # state keys torch's __setstate__ reads (KeyError mid-load)

    def load_state_dict(self, state_dict) -> None:
        # torch replaces self.state before Adam.__setstate__ reads state["step"], so a state
        # without it would raise with this optimizer half loaded: check first, change nothing.
        ids = [(g, i, pid) for g, group in enumerate(state_dict.get("param_groups", ()))
               for i, pid in enumerate(group.get("params", ()))]
        loaded = state_dict.get("state", {})
        for g, i, pid in ids:
            st = loaded.get(pid)
            for key in self._zp_required_at_load:
                if st and key not in st:
                    raise KeyError(f"'{key}' is missing from the state of param_groups[{g}]['params'][{i}] "
                                   f"(zeroplus.optim.{type(self).__name__}.load_state_dict; torch.optim raises "
                                   "KeyError too); nothing was loaded")
        self._zp_invalidate()
        super().load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self._zp_invalidate()
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # torch runs the closure first: it usually produces the grads
            with torch.enable_grad():
                loss = closure()
        prepared = self._zp_prepare()
        if prepared is None:
            super().step()
            return loss
        for plan, grads, hp in prepared:
            for batch in plan.batches:
                self._zp_run(batch, grads if batch[0] is None else [grads[i] for i in batch[0]], hp)
        return loss


def _split_by_dtype(live):
    """[(indices or None when all tensors share dtype and device, tensors)] per (dtype, device):
    one kernel call handles one dtype on one device."""
    kinds = {(p.dtype, p.device) for p in live}
    if len(kinds) <= 1:
        return [(None, live)] if live else []
    out = []
    for kind in kinds:
        idx = [i for i, p in enumerate(live) if (p.dtype, p.device) == kind]
        out.append((idx, [live[i] for i in idx]))
    return out


class _FusedAdamBase(_FusedBase):
    """Shared step for Adam and AdamW (the op differs only in how weight decay is applied)."""

    _decoupled_default = False
    _zp_required_at_load = ("step",)
    _zp_hparams = (("lr", lambda v: v >= 0, ">= 0"), ("eps", lambda v: v >= 0, ">= 0"),
                   ("betas", lambda v: 0 <= v < 1, "in [0, 1)"), ("weight_decay", lambda v: v >= 0, ">= 0"))

    def _zp_layout_key(self, group):
        return bool(group["amsgrad"])

    def _zp_group_args(self, group):
        if group.get("capturable") or group.get("differentiable"):
            return None
        lr, (b1, b2) = _as_float(group["lr"]), group["betas"]
        b1, b2 = _as_float(b1), _as_float(b2)
        if lr is None or b1 is None or b2 is None:
            return None
        decoupled = bool(group.get("decoupled_weight_decay", self._decoupled_default))
        op = torch.ops.zeroplus.adamw_step if decoupled else torch.ops.zeroplus.adam_step
        return op, (lr, b1, b2, float(group["weight_decay"]), float(group["eps"]),
                    bool(group["amsgrad"]), bool(group["maximize"]))

    def _zp_build(self, index, group, live):
        amsgrad = group["amsgrad"]
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        self._zp_check_state(index, group, live, ("step",) + keys, keys)
        batches = []
        for idx, params in _split_by_dtype(live):
            m, v, vmax, steps = [], [], [], []
            for p in params:
                st = self.state[p]
                if len(st) == 0:
                    # Same keys and step dtype as torch's _init_group, so state_dicts interchange.
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                step = st["step"]
                if step.device.type != "cpu" or step.dtype not in (torch.float32, torch.float64):
                    step = st["step"] = step.to("cpu", torch.float32)
                m.append(_fp32_state(st, "exp_avg", p))
                v.append(_fp32_state(st, "exp_avg_sq", p))
                if amsgrad:
                    vmax.append(_fp32_state(st, "max_exp_avg_sq", p))
                steps.append(step)
            batches.append((idx, params, m, v, vmax, steps))
        return batches

    @staticmethod
    def _zp_run(batch, grads, hp):
        op, args = hp
        _, params, m, v, vmax, steps = batch
        op(params, grads, m, v, vmax, steps, *args)


class Adam(_FusedAdamBase, torch.optim.Adam):
    """torch.optim.Adam with the fused zeroplus CPU step."""


class AdamW(_FusedAdamBase, torch.optim.AdamW):
    """torch.optim.AdamW with the fused zeroplus CPU step."""

    _decoupled_default = True


class SGD(_FusedBase, torch.optim.SGD):
    """torch.optim.SGD with the fused zeroplus CPU step (momentum buffers are fp32)."""

    # NaN compares false: `v >= 0` rejects it; dampening may be any number.
    _zp_hparams = (("lr", lambda v: v >= 0, ">= 0"), ("momentum", lambda v: v >= 0, ">= 0"),
                   ("dampening", lambda v: v == v, "a number"), ("weight_decay", lambda v: v >= 0, ">= 0"))

    def _zp_layout_key(self, group):
        return group["momentum"] != 0

    def _zp_group_args(self, group):
        lr = _as_float(group["lr"])
        if lr is None or group.get("differentiable"):
            return None
        return (lr, float(group["momentum"]), float(group["dampening"]), float(group["weight_decay"]),
                bool(group["nesterov"]), bool(group["maximize"]))

    def _zp_build(self, index, group, live):
        self._zp_check_state(index, group, live, (), ("momentum_buffer",))  # a missing buffer is created
        batches = []
        for idx, params in _split_by_dtype(live):
            bufs, init = [], []
            if group["momentum"] != 0:
                for p in params:
                    st = self.state[p]
                    buf = st.get("momentum_buffer")
                    # torch creates the buffer on the first step as a copy of the gradient; the
                    # kernel does that copy itself when init is True.
                    if buf is None:
                        buf = st["momentum_buffer"] = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                        init.append(True)
                    else:
                        if buf.dtype != torch.float32 or not buf.is_contiguous():
                            buf = st["momentum_buffer"] = buf.to(torch.float32).contiguous()
                        init.append(False)
                    bufs.append(buf)
            batches.append((idx, params, bufs, init))
        return batches

    @staticmethod
    def _zp_run(batch, grads, hp):
        _, params, bufs, init = batch
        torch.ops.zeroplus.sgd_step(params, grads, bufs, init, *hp)
        if any(init):  # the buffers are initialised now; later steps accumulate into them
            init[:] = [False] * len(init)


FUSED_CLASSES = {torch.optim.Adam: Adam, torch.optim.AdamW: AdamW, torch.optim.SGD: SGD}


def fused_class_for(optimizer_class):
    """The zeroplus fused twin of a torch optimizer class, or None (generic path)."""
    return FUSED_CLASSES.get(optimizer_class)
