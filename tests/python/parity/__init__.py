"""Backend parity suite: every c10d collective and argument form Gloo supports on CPU.

The cases are ports of the collective families of PyTorch's own tests
(test/distributed/test_c10d_gloo.py, test_c10d_common.py and
torch/testing/_internal/distributed/distributed_test.py), with only the backend name adapted.
They run against `gloo` (which proves the suite) and `zeroplus`.

Shape: every case is a plain function `fn(ctx)` registered with @case(op, form, dtype). All
cases of one backend x world size run one after the other in ONE process group
(run_all_cases, launched once per backend x world size by test_backend_parity.py), so the suite
costs a few process launches, not one per case. Cases are symmetric: every rank issues the same
collectives, and an argument check raises on every rank before any data moves, so one case
failing never leaves the ranks out of step.

`gloo=False` marks what zeroplus supports beyond Gloo on CPU: on gloo such a case must raise
(the table then says so); `zeroplus=False` marks what torch's Python layer reserves to gloo
(monitored_barrier), which must raise on zeroplus.

`python -m parity` (from tests/python) or scripts/parity_table.sh rewrites the table in
docs/backend.md from a run of the suite; test_backend_parity.py checks it is current.
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from typing import Callable

import torch

BACKENDS = ("gloo", "zeroplus")
WORLD_SIZES = (2, 3)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    op: str       # c10d operation as users call it (dist.all_reduce, ProcessGroup.allreduce, ...)
    form: str     # argument form (tensor, tensor list, async, complex, sparse, checks, ...)
    dtype: str    # dtype name, "-" where the case has no single dtype
    fn: Callable
    gloo: bool = True      # False: zeroplus only (gloo must raise)
    zeroplus: bool = True  # False: gloo only (zeroplus must raise)


CASES: dict[str, Case] = {}

# Cases Gloo passes that zeroplus does not yet (issue #13): xfail, and the table says "no".
KNOWN_GAPS: dict[str, str] = {
}


def case(op: str, form: str, dtype: str = "-", *, gloo: bool = True, zeroplus: bool = True, name: str | None = None):
    """Registers fn(ctx) as a case; the name defaults to op:form:dtype and must be unique."""

    def register(fn):
        key = name or f"{op}:{form}:{dtype}"
        if key in CASES:
            raise ValueError(f"parity: duplicate case name {key!r}")
        CASES[key] = Case(key, op, form, dtype, fn, gloo, zeroplus)
        return fn

    return register


class Ctx:
    """What a case sees: rank, world size, backend name and the default group."""

    def __init__(self, rank: int, world_size: int, backend: str):
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.pg = dist.group.WORLD


def raises(exc_type, fn, *args, match: str | None = None, **kwargs):
    """Asserts fn(*args, **kwargs) raises exc_type (or a subclass) whose text matches `match`."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"raised {type(e).__name__} without /{match}/: {e}") from e
        return e
    except BaseException as e:
        raise AssertionError(f"expected {exc_type.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {exc_type.__name__}, nothing was raised")


def assert_equal(actual, expected, msg: str = ""):
    """torch.testing.assert_close with the dtype checked; tensors, lists or nested lists."""
    torch.testing.assert_close(actual, expected, msg=(lambda m: f"{msg}: {m}") if msg else None)


def _load_all():
    # Registration order is execution order, identical on every rank.
    from parity import cases_reduce, cases_gather, cases_misc  # noqa: F401


def case_names() -> list[str]:
    _load_all()
    return list(CASES)


def run_all_cases(rank: int, world_size: int, backend: str) -> dict[str, str]:
    """Runs every case on this rank; returns {name: "" (passed) or the failure text}."""
    import torch.distributed as dist

    _load_all()
    ctx = Ctx(rank, world_size, backend)
    results = {}
    for c in CASES.values():
        try:
            c.fn(ctx)
            results[c.name] = ""
        except BaseException:  # noqa: BLE001 - every failure is reported per case
            results[c.name] = traceback.format_exc(limit=6)
    try:
        dist.barrier()  # no rank tears the group down while a peer still runs the last case
    except Exception:  # noqa: BLE001 - a group broken by a failed case; the failures are reported
        pass
    return results


def outcome(c: Case, backend: str, per_rank: list[dict[str, str]]) -> tuple[bool, str]:
    """(supported, failure text) of case c on `backend` from every rank's results."""
    failures = [f"rank {r}: {res[c.name]}" for r, res in enumerate(per_rank) if res[c.name]]
    return (not failures, "\n".join(failures))


def expected_supported(c: Case, backend: str) -> bool:
    return c.gloo if backend == "gloo" else c.zeroplus
