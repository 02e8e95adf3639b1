"""The real DeepSpeed (PyPI) for the benchmarks, installed idempotently beside the test venv.

    from deepspeed_env import ensure_deepspeed   # bench/ on sys.path
    site = ensure_deepspeed()                    # installs once, then only puts it on sys.path

Why a separate directory and not the venv: DeepSpeed is an sdist whose dependencies include
torch. A plain `pip install deepspeed` may resolve a different torch, and build isolation would
download one just to run setup.py. So it is installed with `pip install --target DIR
--no-deps --no-build-isolation` (setup.py imports the venv's torch; no ops are prebuilt), together
with its pure-Python/binary-wheel dependencies listed below, into
`$ZEROPLUS_BUILD_DIR/deepspeed-site` (default `build/deepspeed-site`). The test venv, and its torch
version, are never touched. Only processes that call ensure_deepspeed() see DeepSpeed.

Environment set here (children inherit it): DS_ACCELERATOR=cpu (no CUDA on the CI machines),
TORCH_EXTENSIONS_DIR=<build>/torch_extensions so the JIT-built ops (cpu_adam takes minutes on
2 cores) are built once per build directory, and PYTHONPATH gains the site directory so spawned
ranks import the same DeepSpeed.

Set ZEROPLUS_DEEPSPEED_VERSION to pin another version (default 0.19.8, the one measured in
docs/benchmarks.md).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_VERSION = "0.19.8"
# requirements/requirements.txt of deepspeed 0.19.8 less torch/numpy/packaging (already in the
# venv), plus pydantic's own dependencies, because --no-deps resolves nothing.
DEPENDENCIES = ["einops", "hjson", "msgpack", "ninja", "psutil", "py-cpuinfo", "pydantic>=2.0.0",
                "pydantic-core", "annotated-types", "typing-inspection", "tqdm"]


def build_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("ZEROPLUS_BUILD_DIR") or ROOT / "build").resolve()


def ensure_deepspeed() -> pathlib.Path:
    """Installs DeepSpeed once into <build>/deepspeed-site and makes it importable here and in
    children. Returns the site directory. Raises RuntimeError with pip's output on failure."""
    version = os.environ.get("ZEROPLUS_DEEPSPEED_VERSION", DEFAULT_VERSION)
    site = build_dir() / "deepspeed-site"
    stamp = site / f".installed-{version}"
    if not stamp.is_file():
        site.mkdir(parents=True, exist_ok=True)
        print(f"installing deepspeed=={version} into {site} (once per build directory)", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
               "--no-build-isolation", "--upgrade", "--target", str(site), f"deepspeed=={version}", *DEPENDENCIES]
        env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install deepspeed failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        stamp.write_text(" ".join(cmd) + "\n")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ext = build_dir() / "torch_extensions"
    ext.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ext))
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(site) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in paths if p])
    os.environ["PATH"] = os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")])
    return site


if __name__ == "__main__":
    where = ensure_deepspeed()
    import deepspeed

    print(f"deepspeed {deepspeed.__version__} from {where}")
