"""Comparisons shared by the offload tests (CPU host tier, CPU parameter store, and their CUDA
twins): bitwise differences of state dicts, and the worst relative difference where CPU and GPU
arithmetic may round differently."""

from __future__ import annotations

import torch


def diffs(a: dict, b: dict) -> list[str]:
    """Keys whose tensors are not bitwise equal (or missing on one side)."""
    out = []
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            out.append(f"{k}: missing")
        elif isinstance(a[k], torch.Tensor) or isinstance(b[k], torch.Tensor):
            x, y = torch.as_tensor(a[k]), torch.as_tensor(b[k])
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                out.append(f"{k}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        elif a[k] != b[k]:
            out.append(f"{k}: {a[k]!r} vs {b[k]!r}")
    return out


def state_diffs(sa: dict, sb: dict) -> list[str]:
    """diffs() of every parameter's entry of two optimizer state dicts."""
    out = []
    for i in sorted(set(sa["state"]) | set(sb["state"])):
        out += [f"state[{i}].{d}" for d in diffs(sa["state"].get(i, {}), sb["state"].get(i, {}))]
    return out


def worst_relative(a: dict, b: dict) -> tuple[float, str]:
    """The largest difference of a from b, relative to b's largest magnitude (per tensor)."""
    worst, where = 0.0, ""
    for k in sorted(b):
        if k not in a:
            return float("inf"), f"{k} missing"
        x, y = torch.as_tensor(a[k]).float().cpu(), torch.as_tensor(b[k]).float().cpu()
        if x.shape != y.shape:
            return float("inf"), f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if not y.numel():
            continue
        rel = float((x - y).abs().max()) / max(float(y.abs().max()), 1e-12)
        if rel > worst:
            worst, where = rel, k
    return worst, where


def state_tensors(sd: dict) -> dict:
    """An optimizer state dict's elementwise tensors, keyed "index.name"."""
    return {f"{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0}
