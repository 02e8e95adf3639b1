"""TensorParallelPlan: what auto_plan found, and the one place that applies it to a model.

A plan is data (a frozen dataclass, built once by auto_plan, inspectable before anything changes):

    styles       module name -> ParallelStyle, exactly what torch's parallelize_module takes
    attributes   module name -> {attribute: per-rank value}: head counts and split sizes that a
                 module's forward reads and that tensor parallelism divides (GPT-2's num_heads and
                 split_size); set by apply()
    tied         (parameter name, parameter name) pairs that are one Parameter in the model (GPT-2's
                 wte / lm_head): parallelize_module replaces each module's parameter separately,
                 apply() makes them one DTensor parameter again
    replicated   module name -> why it stays whole on every rank (reported, not changed)

apply(model, tp_mesh) parallelises in place and returns the model: its parameters become DTensors
on tp_mesh (their values unchanged), its forward computes the same function. Everything is checked
before the model is touched (ValueError/TypeError naming the argument).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module


@dataclass(frozen=True)
class TensorParallelPlan:
    tp_size: int
    styles: dict[str, ParallelStyle]
    attributes: dict[str, dict[str, int]] = field(default_factory=dict)
    tied: tuple[tuple[str, str], ...] = ()
    replicated: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int):
            raise TypeError(f"TensorParallelPlan: tp_size must be an int, got {self.tp_size!r}")
        if self.tp_size < 1:
            raise ValueError(f"TensorParallelPlan: tp_size must be a positive int, got {self.tp_size!r}")
        for name, style in self.styles.items():
            if not isinstance(style, ParallelStyle):
                raise TypeError(f"TensorParallelPlan: styles[{name!r}] must be a ParallelStyle, got "
                                f"{type(style).__name__}")

    def apply(self, model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
        """Parallelise `model` in place over the 1-D tensor-parallel mesh `tp_mesh` (collective
        only where a style's first forward is). Returns model."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"TensorParallelPlan.apply: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(tp_mesh, DeviceMesh):
            raise TypeError(f"TensorParallelPlan.apply: tp_mesh must be a DeviceMesh, got {type(tp_mesh).__name__}")
        if tp_mesh.ndim != 1:
            raise ValueError(f"TensorParallelPlan.apply: tp_mesh must be 1-D (mesh['tp']), got a {tp_mesh.ndim}-D mesh "
                             f"{tp_mesh.mesh_dim_names}")
        if tp_mesh.size() != self.tp_size:
            raise ValueError(f"TensorParallelPlan.apply: the plan was made for tp_size={self.tp_size}, tp_mesh has "
                             f"{tp_mesh.size()} ranks")
        modules = dict(model.named_modules())
        for name in list(self.styles) + list(self.attributes):
            if name not in modules:
                raise ValueError(f"TensorParallelPlan.apply: model has no module {name!r} (a plan for another model?)")
        params = dict(model.named_parameters(remove_duplicate=False))
        for a, b in self.tied:
            if a not in params or b not in params or params[a] is not params[b]:
                raise ValueError(f"TensorParallelPlan.apply: {a!r} and {b!r} are not one tied parameter in model")
        for name in self.styles:
            if any(isinstance(p, DTensor) for p in modules[name].parameters()):
                raise ValueError(f"TensorParallelPlan.apply: {name} is already parallelised (DTensor parameters)")
        if any(getattr(p, "_zeroplus_managed", False) for p in params.values()):
            raise ValueError("TensorParallelPlan.apply: model is already managed by a zeroplus ZeRO optimizer; "
                             "parallelise before zeroplus.initialize")

        parallelize_module(model, tp_mesh, dict(self.styles))
        for a, b in self.tied:
            owner, _, leaf = b.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, leaf, model.get_parameter(a))
        for name, values in self.attributes.items():
            for attr, value in values.items():
                setattr(modules[name], attr, value)
        return model

    def describe(self) -> str:
        """One line per planned module, then the modules kept whole and why."""
        lines = [f"{name}: {style!r}" for name, style in self.styles.items()]
        lines += [f"{name}: per rank {values}" for name, values in self.attributes.items()]
        lines += [f"{a} tied to {b}" for a, b in self.tied]
        lines += [f"{name}: replicated ({why})" for name, why in self.replicated.items()]
        return "\n".join(lines)
