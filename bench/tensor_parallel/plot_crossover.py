"""The crossover plot of docs/tensor_parallel_vs_zero3.md: bus bytes per step per rank against the
global tokens per step (every variant of a run has the same global batch; a TP2 replica takes half
of them), measured points from bench_tp_zero.py runs at several batch sizes (same model, same
precision) and the formulas' lines.

    python bench/tensor_parallel/plot_crossover.py RESULT.json [RESULT.json ...] --out PATH.png
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORLD = 4


def _tokens(args: dict) -> int:
    return WORLD * args["batch"] * args["context"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    ns = parser.parse_args()
    runs = []
    for path in ns.results:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            parser.error(f"{path}: cannot read a bench_tp_zero.py result: {e}")
    shape = {k: runs[0]["args"][k] for k in ("dim", "layers", "heads", "context", "precision")}
    if any({k: r["args"][k] for k in shape} != shape for r in runs):
        parser.error("results: every run must have the same model shape and precision (only --batch may differ)")
    sys.path.insert(0, str(ROOT / "bench"))
    from plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    mib = 2**20
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colours = {"dp4_zero1": "tab:blue", "dp4_zero3": "tab:red", "tp2_zero1": "tab:orange", "tp2_zero2": "tab:green"}
    top = max(_tokens(r["args"]) for r in runs) * 1.15
    for variant, colour in colours.items():
        points = [(_tokens(r["args"]), (row["dp_bus"] + row["tp_bus"]) / mib, row, r["args"])
                  for r in runs for row in r["rows"] if row["variant"] == variant and "error" not in row]
        if not points:
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], "o", color=colour, label=f"{variant} (measured)")
        # The formula is linear in the tokens: the dp part is constant, the tp part proportional.
        _, _, row, args = points[0]
        f = row["formula"]
        per_token = f["tp_bus"] / _tokens(args) if f["tp_bus"] else 0.0
        xs = [0, top]
        ax.plot(xs, [(f["dp_bus"] + per_token * x) / mib for x in xs], "-", color=colour, alpha=0.6, linewidth=1)
    ax.set_xlim(0, top)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("global tokens per step (a TP2 replica takes half)")
    ax.set_ylabel("bus MiB per step per rank")
    ax.set_title(f"TP2 x ZeRO vs ZeRO-3, {WORLD} ranks, {runs[0]['params'] / 1e6:.2f}M params, {shape['precision']} "
                 "(lines: formulas)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ns.out, dpi=110)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
