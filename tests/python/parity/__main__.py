"""python -m parity [--write]  (run from tests/python): runs the parity suite on gloo and
zeroplus at 2 and 3 ranks, prints case counts and the table; --write puts the table into
docs/backend.md."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parents[1]
for _p in (str(_HERE), str(_HERE.parents[1] / "plugin" / "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ["PYTHONPATH"] = os.pathsep.join([str(_HERE), str(_HERE.parents[1] / "plugin" / "python"),
                                            os.environ.get("PYTHONPATH", "")])

import parity  # noqa: E402
from harness import run_distributed  # noqa: E402
from parity import table  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity")
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/backend.md")
    args = parser.parse_args(argv)
    parity.case_names()
    runs = {}
    for backend in parity.BACKENDS:
        for world_size in parity.WORLD_SIZES:
            per_rank = run_distributed(parity.run_all_cases, world_size, backend, backend=backend, timeout=420.0,
                                       pg_timeout=15.0, start_method="forkserver")
            runs[(backend, world_size)] = per_rank
            passed = sum(parity.outcome(c, backend, per_rank)[0] for c in parity.CASES.values())
            print(f"{backend} x {world_size} ranks: {passed}/{len(parity.CASES)} cases pass")
    rendered = table.render(runs)
    print(rendered)
    if args.write:
        doc = pathlib.Path(__file__).resolve().parents[3] / "docs" / "backend.md"
        doc.write_text(table.replace(doc.read_text(), rendered))
        print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
