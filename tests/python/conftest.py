import os
import pathlib
import sys

# Tests import the harness as a top-level module and zeroplus from the source tree.
_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
for path in (str(_HERE), str(_REPO / "plugin" / "python")):
    if path not in sys.path:
        sys.path.insert(0, path)
# Spawned ranks inherit this, so they find the same modules.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(_HERE), str(_REPO / "plugin" / "python")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _rank_pools():
    """Pooled ranks (harness.run_pooled) live for one test module: the next module starts from
    fresh processes, and idle ranks never outlive the module that used them."""
    yield
    import harness

    harness.close_pools()


@pytest.fixture(scope="module")
def one_rank_group():
    """A world-size-1 zeroplus group in this process, for unit tests of the ZeRO engine's parts
    (collectives are identities, every code path around them runs). Destroyed after the module."""
    import datetime
    import tempfile

    import torch.distributed as dist

    import zeroplus  # noqa: F401  (registers the backend)

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("zeroplus", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            yield
        finally:
            dist.destroy_process_group()
