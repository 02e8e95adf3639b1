"""ZeRO stage 3: the ranks agree on every unit gather, so rank-divergent execution fails fast.

A stage-3 unit's parameters are gathered by collectives, so every rank must run the sharded
modules in the same order. A module that some ranks run and others skip (a rank-conditional head,
MoE routing, a generation loop of different lengths per rank) breaks that: without a check the
ranks pair one unit's all-gather with another's (equal sizes: wrong parameters, silently) or wait
for collectives that never come, until the group timeout (30 minutes by default), naming nothing.

So before the all-gathers of a unit are issued (on demand or prefetched: the prediction is the
same on every rank that ran the same passes), the ranks all-gather a few integers saying what each
is about to gather: the unit, the pass (forward / backward / outside: full state dicts) and whether
autograd records (a no-grad generation step against a training forward). It is synchronous and
runs before the data collectives, so on a mismatch nothing of this gather is in flight: every rank
raises RankDivergenceError at the same collective of the group, naming what each rank was
gathering, and the group stays usable. Where a rank issued another kind of collective at that
point (a gradient reduce-scatter, a barrier) the zeroplus backend's op-descriptor check fails both
ranks at once (docs/backend.md); this rank's error then names the unit it was gathering.

The same agreement is where the gradient reducer launches its buckets at stage 3 (grad_reducer.py,
`gated`): each rank also sends how many leading buckets it has complete, and every rank launches
up to the minimum, so the reduce-scatters take the same places among the gathers on every rank even
when a module's parameters get gradients on some ranks only. With such a module's parameters kept
whole (persistent_modules, or param_persistence_threshold), a rank-conditional module then trains
as under DDP with find_unused_parameters=True (zeros from the ranks that skipped it).

Cost: one all-gather of 4 int64 per rank per unit gather, on the CPU where the backend takes CPU
tensors (zeroplus, gloo), else on the parameters' device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

_KINDS = ("forward", "backward", "outside forward and backward")


def _ranks(ranks) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class RankDivergenceError(RuntimeError):
    """Ranks gathered different stage-3 units at the same point (see the module doc)."""


class GatherAgreement:
    def __init__(self, units, largest: list[int], group, rank: int, world_size: int, device, threshold: int,
                 reducer=None):
        """largest[u]: the element count of unit u's largest gathered parameter (for the remedy)."""
        self.names = [u.name or "<root>" for u in units]
        self.largest = list(largest)
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.threshold = threshold
        cpu_ok = dist.get_backend(group) in ("zeroplus", "gloo")
        self.device = torch.device("cpu") if cpu_ok else device
        self.count = 0  # agreements so far (the gather's position in this group's sequence)
        self.reducer = reducer  # launches its buckets at the agreed points (see the module doc)

    def agree(self, unit: int, kind: str) -> None:
        """Collective: returns when every rank is about to gather the same unit in the same kind of
        pass; raises RankDivergenceError (or the backend's mismatch error, with context) otherwise."""
        if self.world_size == 1:
            return
        self.count += 1
        code = _KINDS.index(kind) if kind in _KINDS else 2
        # Whether autograd records matters in forward only (backward hooks run with it off).
        grad = int(torch.is_grad_enabled()) if code == 0 else 1
        ready = self.reducer.ready_prefix() if self.reducer is not None else 0
        mine = torch.tensor([unit, code, grad, ready], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world_size * 4, dtype=torch.int64, device=self.device)
        try:
            comm.agreement_all_gather(everyone, mine, self.group)
        except dist.DistBackendError as e:
            raise RankDivergenceError(
                f"ZeRO stage 3: rank {self.rank} was about to gather {self._describe(unit, kind, mine[2].item())} "
                f"(stage-3 gather #{self.count}), but another rank issued a different collective at this point: the "
                f"ranks ran different modules. {self._remedy([unit])} Backend error: {e}") from e
        table = everyone.view(self.world_size, 4).tolist()
        rows = [row[:3] for row in table]
        if all(row == rows[0] for row in rows):
            if self.reducer is not None:
                self.reducer.launch_agreed(min(row[3] for row in table))
            return
        by_what: dict[tuple, list[int]] = {}
        for r, row in enumerate(rows):
            by_what.setdefault(tuple(row), []).append(r)
        what = "; ".join(f"{_ranks(rs)}: {self._describe(row[0], _KINDS[row[1]], row[2])}"
                         for row, rs in by_what.items())
        skipped, which = self._which_skipped(by_what)
        units = sorted({row[0] for row in by_what})
        raise RankDivergenceError(
            f"ZeRO stage 3: the ranks ran different modules, so their parameter gathers no longer pair up "
            f"(stage-3 gather #{self.count}): {what}.{which} Every rank must run every "
            f"sharded module in the same order, as each gather is a collective. "
            f"{self._remedy(units, [skipped] if skipped is not None else units)}")

    def _which_skipped(self, by_what) -> tuple[int | None, str]:
        """Where some ranks are still in forward and the others already in backward, the former ran a
        module the latter skipped (the usual case: a rank-conditional module): its unit and a sentence."""
        forward = [(row, rs) for row, rs in by_what.items() if row[1] == 0]
        rest = sorted(r for row, rs in by_what.items() if row[1] != 0 for r in rs)
        if len(forward) != 1 or not rest:
            return None, ""
        row, rs = forward[0]
        return row[0], (f" So module '{self.names[row[0]]}' ran on {_ranks(rs)} and was skipped on {_ranks(rest)}, "
                        f"which had finished the forward pass.")

    def _describe(self, unit: int, kind: str, grad: int) -> str:
        name = self.names[unit] if 0 <= unit < len(self.names) else f"unit {unit}"
        return f"module '{name}' ({kind}{'' if grad else ', no grad'})"

    def _remedy(self, units, modules=None) -> str:
        """units: those the ranks were gathering (the threshold covers them all); modules: those to
        name for persistent_modules (the one some ranks skipped, where known)."""
        need = max((self.largest[u] for u in units if 0 <= u < len(self.largest)), default=0)
        names = [self.names[u] for u in (units if modules is None else modules)
                 if 0 <= u < len(self.names) and u != len(self.names) - 1]  # never the root: that is stage 2
        listed = f"persistent_modules={names!r}" if names else "persistent_modules=[the module]"
        return (f"For a module that only some ranks run: keep its parameters whole on every rank "
                f"({listed}: its qualified name, instance or class; or param_persistence_threshold >= {need}, "
                f"its largest parameter; now {self.threshold}), or run it "
                f"on every rank ('synced' execution: e.g. add its output times 0 where unused; "
                f"model.generate(..., synced_gpus=True) for generation loops of different lengths).")
