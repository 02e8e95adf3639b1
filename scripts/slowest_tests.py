"""Where pytest's time went, from its JUnit XML (scripts/test.sh writes build/pytest-junit.xml):
the slowest tests and the total per test module, so a slowdown shows in every CI log.

Usage: python3 scripts/slowest_tests.py build/pytest-junit.xml [--tests 25] [--modules 15]
Standard library only (it also runs when the venv is broken).
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="slowest_tests.py")
    parser.add_argument("junit", help="pytest --junitxml file")
    parser.add_argument("--tests", type=int, default=25, help="how many of the slowest tests (default 25)")
    parser.add_argument("--modules", type=int, default=15, help="how many of the slowest modules (default 15)")
    args = parser.parse_args(argv)
    try:
        root = ET.parse(args.junit).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"slowest_tests.py: cannot read {args.junit}: {e}", file=sys.stderr)
        return 1
    tests, modules, counts = [], collections.Counter(), collections.Counter()
    for case in root.iter("testcase"):
        seconds = float(case.get("time") or 0.0)
        module = case.get("classname", "?").rsplit(".", 1)[-1]
        tests.append((seconds, f"{module}::{case.get('name')}"))
        modules[module] += seconds
        counts[module] += 1
    total = sum(modules.values())
    print(f"pytest: {len(tests)} tests, {total:.0f} s in tests; {args.tests} slowest:")
    for seconds, name in sorted(tests, reverse=True)[:args.tests]:
        print(f"  {seconds:7.1f} s  {name}")
    print(f"pytest: {args.modules} slowest modules (tests, seconds):")
    for module, seconds in modules.most_common(args.modules):
        print(f"  {seconds:7.1f} s  {counts[module]:4d}  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
