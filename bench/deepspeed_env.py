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

    from deepspeed_env import ensure_deepspeed_ops
    ensure_deepspeed_ops(["async_io", "cpu_adam"])   # what NVMe offload needs (bench_offload.py)

ensure_deepspeed_ops JIT-builds DeepSpeed's C++ ops with ninja (through its CPU accelerator's op
builders: deepspeed/ops/op_builder/cpu/) into TORCH_EXTENSIONS_DIR, once: a later call only loads
them (ninja finds nothing to do). async_io (DeepNVMe, the swappers' I/O) links libaio; when its
probe fails and this process is root on a machine with apt-get, `apt-get install -y libaio-dev`
(after an `apt-get update` if the first try fails) is run, which is a no-op when it is installed.
Neither is part of CI's setup: only the benchmarks that ask for DeepSpeed call this.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

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


# Op name -> the builder class its CPU accelerator hands out (get_accelerator().get_op_builder).
_OP_BUILDERS = {"async_io": "AsyncIOBuilder", "cpu_adam": "CPUAdamBuilder"}


def _install_libaio() -> str:
    """apt-get install -y libaio-dev where that is possible; returns what was done, for the error."""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "libaio-dev not installed automatically (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", "libaio-dev"]
    proc = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, check=False)
        proc = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    return f"`{' '.join(install)}` exited {proc.returncode}: {proc.stderr.strip()[-500:]}"


def ensure_deepspeed_ops(names=("async_io", "cpu_adam")) -> dict:
    """Builds (first call: minutes on 2 cores) or loads DeepSpeed's ops `names` in this process, so
    spawned ranks find them built. Returns {name: path of the built library}. Raises ValueError for
    an op this helper does not know and RuntimeError when an op cannot be built here."""
    unknown = [n for n in names if n not in _OP_BUILDERS]
    if unknown:
        raise ValueError(f"ensure_deepspeed_ops: names: unknown op(s) {unknown}, "
                         f"expected some of {sorted(_OP_BUILDERS)}")
    ensure_deepspeed()
    from deepspeed.accelerator import get_accelerator

    built = {}
    for name in names:
        builder = get_accelerator().create_op_builder(_OP_BUILDERS[name])
        if builder is None:
            raise RuntimeError(f"DeepSpeed's {get_accelerator().device_name()} accelerator has no {name} op builder")
        note = ""
        if name == "async_io" and not builder.is_compatible():
            note = _install_libaio()
            builder = get_accelerator().create_op_builder(_OP_BUILDERS[name])
        if not builder.is_compatible(verbose=True):
            raise RuntimeError(f"DeepSpeed op {name} cannot be built here (libaio's headers and library are "
                               f"needed for async_io: apt-get install libaio-dev). {note}")
        t0 = time.perf_counter()
        module = builder.load(verbose=False)
        seconds = time.perf_counter() - t0
        if seconds > 10:
            print(f"built DeepSpeed op {name} in {seconds:.0f} s (once per build directory)", flush=True)
        built[name] = getattr(module, "__file__", str(module))
    return built


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="install DeepSpeed into the build directory (once)")
    parser.add_argument("--ops", default="", help="comma-separated ops to build too, e.g. async_io,cpu_adam; "
                        "then run ds_report")
    args = parser.parse_args()
    where = ensure_deepspeed()
    import deepspeed

    print(f"deepspeed {deepspeed.__version__} from {where}")
    if args.ops:
        for op, path in ensure_deepspeed_ops([n for n in args.ops.split(",") if n]).items():
            print(f"op {op}: {path}")
        subprocess.run([sys.executable, str(where / "bin" / "ds_report")], check=False)
