"""ZeRO stage 3: which submodules form a gather unit, and which parameters each one needs.

A unit is a submodule whose parameters are gathered together just before its forward (and again
before its backward) and released after. Every parameter is owned by exactly one unit (its flat
storage lives there); a unit also *needs* the parameters its subtree uses that another unit owns
(a tied LM head needs the embedding's weight), so those are gathered with it.

Default policy (unit_classes=None), coarse enough that parameters a module reads from a child
without calling it (nn.MultiheadAttention reads out_proj.weight directly) stay inside one unit:
  * every element of an nn.ModuleList / nn.Sequential (a transformer's blocks, an MLP's layers),
    outermost first (a block that is a unit is not split further);
  * every direct child of the root that owns parameters and holds no such list (a child that
    does, like nn.TransformerEncoder, is split into its list's elements instead; its other
    parameters go to the root unit);
  * the root itself, for what is left (parameters registered on the root, e.g. a positional
    embedding).
unit_classes=[Block, ...] replaces the first two rules: every instance of those classes (again
outermost first) is a unit, like FSDP's ModuleWrapPolicy; the root takes the rest.

torch.compile wrappers (OptimizedModule, which holds the compiled module as `_orig_mod`) are
seen through, so a model gets the same units compiled or not: a compiled root's `_orig_mod`
children count as the root's own, and a wrapper around a unit (torchtitan's order: each block
compiled, then sharded) is the unit itself, so the gather hooks go on the wrapper and run
outside its compiled graph (compile_boundary.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from torch import nn


@dataclass
class Unit:
    index: int
    name: str                     # the module's qualified name ("" for the root)
    module: nn.Module
    owned: list[nn.Parameter] = field(default_factory=list)   # registration order
    needs: list[int] = field(default_factory=list)            # units whose parameters forward reads


def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module a torch.compile wrapper runs (OptimizedModule._orig_mod), or None. No model
    is compiled before torch._dynamo is imported, so it is not imported here."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule):
        return module._orig_mod
    return None


def _unit_modules(root: nn.Module, unit_classes) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []
    covered: set[int] = set()
    roots = [root]  # the root and the modules it runs compiled (their children are the root's)
    while compiled_inner(roots[-1]) is not None:
        roots.append(compiled_inner(roots[-1]))
    root_ids = {id(m) for m in roots}

    def unwrapped(m: nn.Module) -> nn.Module:
        while compiled_inner(m) is not None:
            m = compiled_inner(m)
        return m

    def has_params(m: nn.Module) -> bool:
        return any(True for _ in m.parameters())

    def has_list_elements(m: nn.Module) -> bool:
        return any(isinstance(sub, (nn.ModuleList, nn.Sequential)) and any(has_params(c) for c in sub.children())
                   for sub in m.modules())

    def visit(name: str, module: nn.Module, parent: nn.Module | None) -> None:
        if id(module) in covered:
            return
        if parent is not None and id(module) not in root_ids and has_params(module):
            if unit_classes is not None:
                pick = isinstance(unwrapped(module), tuple(unit_classes))
            else:
                pick = (isinstance(parent, (nn.ModuleList, nn.Sequential))
                        or (id(parent) in root_ids and not has_list_elements(module)))
            if pick:
                chosen.append((name, module))
                for sub in module.modules():
                    covered.add(id(sub))
                return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, module)

    visit("", root, None)
    if unit_classes is None:
        # Direct children of the root come after list elements in registration order anyway;
        # nothing to reorder. Containers themselves are never units (they have no forward of
        # their own that a pre-hook could bracket: nn.ModuleList is not callable).
        chosen = [(n, m) for n, m in chosen if not isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    return chosen


def build_units(root: nn.Module, unit_classes=None) -> list[Unit]:
    """Units in registration order, the root last; each owns the parameters first reached
    through it (a tied parameter belongs to the first module that registers it)."""
    if unit_classes is not None:
        if isinstance(unit_classes, type):
            unit_classes = [unit_classes]
        unit_classes = list(unit_classes)
        for c in unit_classes:
            if not (isinstance(c, type) and issubclass(c, nn.Module)):
                raise TypeError(f"zeroplus.initialize: unit_classes must hold nn.Module subclasses, got {c!r}")
    picked = _unit_modules(root, unit_classes)
    units = [Unit(i, name, m) for i, (name, m) in enumerate(picked)]
    units.append(Unit(len(units), "", root))

    module_unit: dict[int, int] = {}
    for u in units[:-1]:
        for sub in u.module.modules():
            module_unit.setdefault(id(sub), u.index)
    owner: dict[int, int] = {}
    # Walk modules in registration order (remove_duplicate=False: a module reached twice keeps its
    # first unit), each module's own parameters with duplicates, to assign owners and needs.
    for _name, sub in root.named_modules(remove_duplicate=False):
        u = module_unit.get(id(sub), units[-1].index)
        for p in sub.parameters(recurse=False):
            if id(p) not in owner:
                owner[id(p)] = u
                units[u].owned.append(p)
            if owner[id(p)] not in units[u].needs:
                units[u].needs.append(owner[id(p)])
    root_unit = units[-1]
    for u in units:
        if u.index not in u.needs and u.owned:
            u.needs.insert(0, u.index)
    # The root unit's forward encloses every other unit's: its needs are only its own parameters.
    root_unit.needs = [root_unit.index] if root_unit.owned else []
    return units




def kept_whole(root: nn.Module, specs, name: str = "zeroplus.initialize") -> set[int]:
    """The ids of the parameters that Stage3Policy.persistent_modules keeps whole: every parameter
    in the subtree of a listed module (a class: each of its instances; a qualified name: as
    root.named_modules() gives it, torch.compile's `_orig_mod.` steps optional). An item that
    matches nothing raises ValueError, so a typo never silently shards the module."""
    if not specs:
        return set()
    named = list(root.named_modules(remove_duplicate=False))
    by_name = {}
    for n, m in named:
        by_name.setdefault(n, m)
        by_name.setdefault(".".join(part for part in n.split(".") if part != "_orig_mod"), m)
    ids = {id(m) for _, m in named}
    picked: list[nn.Module] = []
    for spec in specs:
        if isinstance(spec, str):
            if spec not in by_name:
                some = [n for n, _ in root.named_children()][:8]
                raise ValueError(f"{name}: persistent_modules: {spec!r} is not a submodule of the model (qualified "
                                 f"names as model.named_modules() gives them; the model's children: {some})")
            picked.append(by_name[spec])
        elif isinstance(spec, type):
            found = [m for _, m in named if isinstance(m, spec) or isinstance(compiled_inner(m), spec)]
            if not found:
                raise ValueError(f"{name}: persistent_modules: no submodule of the model is a {spec.__name__}")
            picked.extend(found)
        else:
            if id(spec) not in ids:
                raise ValueError(f"{name}: persistent_modules: a {type(spec).__name__} instance that is not a "
                                 f"submodule of the model")
            picked.append(spec)
    return {id(p) for m in picked for p in m.parameters()}
