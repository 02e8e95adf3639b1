"""Drop-in subclasses of torch.optim.Adam, AdamW and SGD whose CPU step runs zeroplus's fused
multi-tensor C++ kernels (one pass over p, g and state per element; AVX-512/AVX2/scalar chosen
at run time, see docs/optimizers.md).

They keep torch's constructor, param_groups, state_dict format and step semantics. A step falls
back to torch's own implementation (the "generic path") whenever something is outside what the
kernels support: non-CPU or sparse tensors, dtypes other than float32/bfloat16/float16,
non-contiguous tensors, complex params, capturable/differentiable, or a tensor lr/betas that
needs autograd. Deliberate difference: 16-bit parameters keep fp32 optimizer state (torch keeps
state in the param dtype); loaded 16-bit state is widened on first use.
"""

from __future__ import annotations

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


def _fusable(p: Tensor, g: Tensor) -> bool:
    return (
        p.device.type == "cpu"
        and p.dtype in _SUPPORTED_DTYPES
        and not g.is_sparse
        and g.dtype == p.dtype
        and p.is_contiguous()
        and g.is_contiguous()
    )


def _group_fusable(group) -> bool:
    for p in group["params"]:
        g = p.grad
        if g is not None and (not _fusable(p, g) or p.is_complex()):
            return False
    return True


def _fp32_state(state: dict, key: str, p: Tensor) -> Tensor:
    t = state.get(key)
    if t is None:
        t = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        state[key] = t
    elif t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to(torch.float32).contiguous()  # e.g. bf16 state loaded from a torch checkpoint
        state[key] = t
    return t


class _FusedAdamBase:
    """Shared step for Adam and AdamW (the op differs only in how weight decay is applied)."""

    _decoupled_default = False

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

    def _zp_collect(self, group):
        """Per dtype: params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps (after
        _group_fusable said yes); creates missing state like torch's _init_group."""
        amsgrad = group["amsgrad"]
        lists: dict = {}
        state_of = self.state
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            st = state_of[p]
            if len(st) == 0:
                # Same keys and step dtype as torch's _init_group, so state_dicts interchange.
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
            step = st["step"]
            if step.device.type != "cpu" or step.dtype not in (torch.float32, torch.float64):
                step = st["step"] = step.to("cpu", torch.float32)
            ls = lists.get(p.dtype)
            if ls is None:
                ls = lists[p.dtype] = ([], [], [], [], [], [])
            ls[0].append(p)
            ls[1].append(g)
            ls[2].append(_fp32_state(st, "exp_avg", p))
            ls[3].append(_fp32_state(st, "exp_avg_sq", p))
            if amsgrad:
                ls[4].append(_fp32_state(st, "max_exp_avg_sq", p))
            ls[5].append(step)
        return lists

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # torch runs the closure first: it usually produces the grads
            with torch.enable_grad():
                loss = closure()
        args = [self._zp_group_args(g) for g in self.param_groups]
        # Check everything before touching state, so a fallback sees torch-shaped state only.
        if any(a is None or not _group_fusable(g) for a, g in zip(args, self.param_groups)):
            super().step()
            return loss
        for (op, hp), group in zip(args, self.param_groups):
            for params, grads, m, v, vmax, steps in self._zp_collect(group).values():
                op(params, grads, m, v, vmax, steps, *hp)
        return loss


class Adam(_FusedAdamBase, torch.optim.Adam):
    """torch.optim.Adam with the fused zeroplus CPU step."""


class AdamW(_FusedAdamBase, torch.optim.AdamW):
    """torch.optim.AdamW with the fused zeroplus CPU step."""

    _decoupled_default = True


class SGD(torch.optim.SGD):
    """torch.optim.SGD with the fused zeroplus CPU step (momentum buffers are fp32)."""

    def _zp_collect(self, group):
        momentum = group["momentum"]
        lists: dict = {}
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            ls = lists.get(p.dtype)
            if ls is None:
                ls = lists[p.dtype] = ([], [], [], [])
            ls[0].append(p)
            ls[1].append(g)
            if momentum != 0:
                st = self.state[p]
                buf = st.get("momentum_buffer")
                # torch creates the buffer on the first step as a copy of the gradient; the kernel
                # does that copy itself when init is True.
                init = buf is None
                if init:
                    buf = torch.empty(p.shape, dtype=torch.float32)
                    st["momentum_buffer"] = buf
                elif buf.dtype != torch.float32 or not buf.is_contiguous():
                    buf = st["momentum_buffer"] = buf.to(torch.float32).contiguous()
                ls[2].append(buf)
                ls[3].append(init)
        return lists

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lrs = [_as_float(g["lr"]) for g in self.param_groups]
        if any(lr is None or g.get("differentiable") or not _group_fusable(g)
               for lr, g in zip(lrs, self.param_groups)):
            super().step()
            return loss
        for group, lr in zip(self.param_groups, lrs):
            for params, grads, bufs, init in self._zp_collect(group).values():
                torch.ops.zeroplus.sgd_step(
                    params, grads, bufs, init, lr, float(group["momentum"]), float(group["dampening"]),
                    float(group["weight_decay"]), bool(group["nesterov"]), bool(group["maximize"]))
        return loss


FUSED_CLASSES = {torch.optim.Adam: Adam, torch.optim.AdamW: AdamW, torch.optim.SGD: SGD}


def fused_class_for(optimizer_class):
    """The zeroplus fused twin of a torch optimizer class, or None (generic path)."""
    return FUSED_CLASSES.get(optimizer_class)
