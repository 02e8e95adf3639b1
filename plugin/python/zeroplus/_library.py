"""Finding and loading libzeroplus.so, and refusing a torch it was not built for."""

from __future__ import annotations

import os
import pathlib

import torch

_ENV_LIBRARY = "ZEROPLUS_LIBRARY"
_LIBRARY_NAME = "libzeroplus.so"


def _candidates() -> list[pathlib.Path]:
    package_dir = pathlib.Path(__file__).resolve().parent
    found = []
    if os.environ.get(_ENV_LIBRARY):
        found.append(pathlib.Path(os.environ[_ENV_LIBRARY]))
    # Installed layout: the library next to this file. Source-tree layout: plugin/python/zeroplus
    # -> <repo>/build/lib (scripts/build.sh), or the build dir named by ZEROPLUS_BUILD_DIR.
    found.append(package_dir / _LIBRARY_NAME)
    repo_root = package_dir.parents[2]
    if os.environ.get("ZEROPLUS_BUILD_DIR"):
        found.append(pathlib.Path(os.environ["ZEROPLUS_BUILD_DIR"]) / "lib" / _LIBRARY_NAME)
    found.append(repo_root / "build" / "lib" / _LIBRARY_NAME)
    return found


def library_path() -> str:
    """Absolute path of the libzeroplus.so this package loads.

    Looked up in order: $ZEROPLUS_LIBRARY, next to the package, $ZEROPLUS_BUILD_DIR/lib, and the
    repository's build/lib. Raises FileNotFoundError listing every place tried.
    """
    candidates = _candidates()
    if os.environ.get(_ENV_LIBRARY) and not candidates[0].is_file():
        raise FileNotFoundError(f"zeroplus: {_ENV_LIBRARY}={candidates[0]} does not exist")
    for path in candidates:
        if path.is_file():
            return str(path)
    tried = "\n  ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"zeroplus: {_LIBRARY_NAME} not found; build it with scripts/build.sh or set {_ENV_LIBRARY}. Tried:\n  {tried}"
    )


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def built_torch_version() -> str:
    """The torch version libzeroplus.so was compiled against (the library must be loaded)."""
    info = torch.ops.zeroplus.build_info()
    return info.rsplit("torch ", 1)[1]


def load_library() -> str:
    """Loads libzeroplus.so once (idempotent) and checks it matches the running torch.

    Raises ImportError naming both versions when the library was built for another torch minor
    version: the c10d classes it subclasses change layout between minors.
    """
    path = library_path()
    if path not in torch.ops.loaded_libraries:
        torch.ops.load_library(path)
    built = built_torch_version()
    if _minor(built) != _minor(torch.__version__):
        raise ImportError(
            f"zeroplus: {path} was built for torch {built} but this process runs torch {torch.__version__}; "
            f"rebuild zeroplus against torch {torch.__version__} (scripts/build.sh)"
        )
    return path
