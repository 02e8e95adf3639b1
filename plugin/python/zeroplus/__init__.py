"""zeroplus: ZeRO memory savings for stock PyTorch, as a c10d backend and a drop-in optimizer.

    import zeroplus
    opt = zeroplus.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4)

Importing this package loads ``libzeroplus.so`` into the running torch. Loading the library
registers the ``"zeroplus"`` backend for ``torch.distributed.init_process_group`` (a bare
``torch.ops.load_library(zeroplus.library_path())`` does the same, without this package).
"""

from __future__ import annotations

import sys

from ._library import built_torch_version, library_path, load_library  # torch-free until called

__version__ = "0.1.0"


def _report_requested() -> bool:
    # `python -m zeroplus.report` imports this package first; the report must run (and say why)
    # even when the library is missing or built for another torch, so it loads it itself.
    # The console script zeroplus-report does the same through its own name. The report also
    # imports torch itself, so that a missing torch is a FAIL line rather than a traceback.
    argv = getattr(sys, "orig_argv", [])
    as_module = any(a == "-m" and b == "zeroplus.report" for a, b in zip(argv, argv[1:]))
    return as_module or (bool(sys.argv) and sys.argv[0].endswith("zeroplus-report"))


if not _report_requested():
    import torch  # noqa: F401  (without torch, `import zeroplus` fails here, as it always has)

    load_library()

    from . import aio, files, optim  # noqa: E402  (need the library loaded)
    from .backend_options import BackendOptions  # noqa: E402
    from .comm_stats import CommStats, OpStats, comm_stats, reset_comm_stats  # noqa: E402
    from .optim import ZeroRedundancyOptimizer  # noqa: E402
    from .topology import Topology, topology  # noqa: E402
    from .zero import GradScaler, estimate_memory, full_state_dict, init_context, initialize, memory_report  # noqa: E402
    from . import checkpoint  # noqa: E402
    from . import tensor_parallel  # noqa: E402
    from .checkpoint import load_checkpoint, save_checkpoint  # noqa: E402

__all__ = [
    "__version__",
    "aio",
    "BackendOptions",
    "checkpoint",
    "comm_stats",
    "CommStats",
    "built_torch_version",
    "estimate_memory",
    "files",
    "full_state_dict",
    "GradScaler",
    "init_context",
    "initialize",
    "memory_report",
    "library_path",
    "load_checkpoint",
    "load_library",
    "optim",
    "OpStats",
    "reset_comm_stats",
    "save_checkpoint",
    "tensor_parallel",
    "Topology",
    "topology",
    "ZeroRedundancyOptimizer",
]
