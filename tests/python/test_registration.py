"""Loading and registration: load_library alone registers the backend, no libpython link,
the package API, and the refusal of a mismatched torch."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

import zeroplus
import zeroplus._library as zlib
from harness import run_distributed


def _env_init(rank, world_size, port):
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("zeroplus", timeout=datetime.timedelta(seconds=30))  # env:// as under torchrun
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t


def test_env_init_method_like_torchrun():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = run_distributed(_env_init, 2, port, backend=None, timeout=90)
    assert all(torch.equal(t, torch.full((4,), 3.0)) for t in results)


def test_library_does_not_link_libpython():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.fail("readelf (binutils) is required by this test")
    dynamic = subprocess.run([readelf, "-d", zeroplus.library_path()], capture_output=True, text=True, check=True).stdout
    needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed, dynamic
    assert not [line for line in needed if "python" in line.lower()], needed


def test_package_api():
    assert zeroplus.__version__ == "0.1.0"
    assert zeroplus.library_path().endswith("libzeroplus.so")
    assert zeroplus.built_torch_version().split(".")[:2] == torch.__version__.split(".")[:2]
    assert "zeroplus" in dist.Backend.backend_list
    assert zeroplus.load_library() == zeroplus.library_path()  # idempotent


def test_mismatched_torch_version_is_refused(monkeypatch):
    monkeypatch.setattr(zlib, "built_torch_version", lambda: "2.99.0")
    with pytest.raises(ImportError, match=r"built for torch 2\.99\.0 but this process runs torch " + torch.__version__.replace("+", r"\+")):
        zlib.load_library()


def test_missing_library_path_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROPLUS_LIBRARY", str(tmp_path / "nope.so"))
    with pytest.raises(FileNotFoundError, match="ZEROPLUS_LIBRARY=.*nope.so does not exist"):
        zlib.library_path()


def _direct_create():
    # pg_options reaches the creator only through init/new_group with a custom backend.
    creator = dist.Backend._plugins["ZEROPLUS"].creator_fn
    opts = torch._C._distributed_c10d._DistributedBackendOptions()
    opts.store = dist.HashStore()
    opts.group_rank, opts.group_size = 0, 1
    import datetime

    opts.timeout = datetime.timedelta(seconds=5)
    creator(opts, object())


def test_pg_options_other_than_none_are_rejected():
    with pytest.raises(TypeError, match="pg_options must be None or a zeroplus.BackendOptions, got object"):
        _direct_create()
