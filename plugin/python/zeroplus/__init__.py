"""zeroplus: ZeRO memory savings for stock PyTorch, as a c10d backend and a drop-in optimizer.

    import zeroplus
    opt = zeroplus.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4)

Importing this package loads ``libzeroplus.so`` into the running torch. Loading the library
registers the ``"zeroplus"`` backend for ``torch.distributed.init_process_group`` (a bare
``torch.ops.load_library(zeroplus.library_path())`` does the same, without this package).
"""

from __future__ import annotations

import torch

from ._library import built_torch_version, library_path, load_library

__version__ = "0.1.0"

load_library()

from . import aio, optim  # noqa: E402  (need the library loaded)
from .backend_options import BackendOptions  # noqa: E402
from .optim import ZeroRedundancyOptimizer  # noqa: E402
from .zero import GradScaler, estimate_memory, full_state_dict, initialize, memory_report  # noqa: E402

__all__ = [
    "__version__",
    "aio",
    "BackendOptions",
    "built_torch_version",
    "estimate_memory",
    "full_state_dict",
    "GradScaler",
    "initialize",
    "memory_report",
    "library_path",
    "load_library",
    "optim",
    "ZeroRedundancyOptimizer",
]
