"""Shared by the benchmarks: matplotlib for the PNGs written beside each table.

matplotlib is a bench-only dependency. `pyplot()` installs it into the running interpreter's
environment on first use (the bench commands are the documented way to get it), and returns
None with a printed reason when that is not possible, so a table is never lost to a missing
plotting library.
"""

from __future__ import annotations

import subprocess
import sys


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend, or None when unavailable."""
    try:
        import matplotlib
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=False)
        try:
            import matplotlib
        except ImportError:
            print("matplotlib unavailable (pip install matplotlib failed): no PNG", file=sys.stderr)
            return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def busbw_and_time_axes(axes, suffix: str = "") -> None:
    """Labels the (busbw, time per op) pair of axes of an allreduce size sweep: log2 bytes on x,
    time on a log scale; used by bench/collectives/run.py and multihost.py."""
    for ax, title, ylabel in ((axes[0], "allreduce busbw" + suffix, "busbw (GB/s)"),
                              (axes[1], "allreduce time" + suffix, "us per op")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[1].set_yscale("log")
