"""Backend parity with Gloo on CPU (issue #13): the cases of tests/python/parity/ run against
gloo (proving the suite) and zeroplus, at 2 and 3 ranks.

All cases of one backend x world size run in one multi-process launch (cached for the module),
so the suite costs four launches; each launch has its own timeout. Each case is then reported
as its own pytest item, e.g. test_case[zeroplus-3-all_reduce:tensor SUM:float16].
"""

from __future__ import annotations

import pathlib

import pytest

import parity
from harness import run_distributed
from parity import table

LAUNCH_TIMEOUT_S = 420.0  # whole launch (every case, 3 ranks on 2 cores)
PG_TIMEOUT_S = 15.0       # a case that hangs fails at this op timeout, not at the launch timeout

_RESULTS: dict[tuple[str, int], list[dict[str, str]]] = {}


def results(backend: str, world_size: int) -> list[dict[str, str]]:
    key = (backend, world_size)
    if key not in _RESULTS:
        _RESULTS[key] = run_distributed(parity.run_all_cases, world_size, backend, backend=backend,
                                        timeout=LAUNCH_TIMEOUT_S, pg_timeout=PG_TIMEOUT_S,
                                        start_method="forkserver")
    return _RESULTS[key]


@pytest.mark.parametrize("name", parity.case_names())
@pytest.mark.parametrize("world_size", parity.WORLD_SIZES)
@pytest.mark.parametrize("backend", parity.BACKENDS)
def test_case(backend, world_size, name):
    c = parity.CASES[name]
    supported, failure = parity.outcome(c, backend, results(backend, world_size))
    if backend == "zeroplus" and name in parity.KNOWN_GAPS:
        assert not supported, f"{name} passes on zeroplus now: remove it from parity.KNOWN_GAPS"
        pytest.xfail(parity.KNOWN_GAPS[name])
    if parity.expected_supported(c, backend):
        assert supported, f"{name} failed on {backend} at {world_size} ranks:\n{failure}"
    else:
        assert not supported, (f"{name} is marked unsupported on {backend} but passed at {world_size} ranks: "
                               "update its gloo=/zeroplus= flag and the docs table")


def test_docs_table_is_current():
    """docs/backend.md carries the table this suite generates (python -m parity --write)."""
    runs = {(b, w): results(b, w) for b in parity.BACKENDS for w in parity.WORLD_SIZES}
    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "backend.md"
    current = table.extract(doc.read_text())
    assert current == table.render(runs), "docs/backend.md parity table is stale: run `python -m parity --write` " \
                                          "in tests/python (see docs/backend.md)"
