"""Finding and loading libzeroplus.so, and refusing a torch it was not built for.

Where the library is looked up (first hit wins):
  1. ``$ZEROPLUS_LIBRARY`` (an explicit file; an error when it does not exist),
  2. next to this package (the pip-installed layout: site-packages/zeroplus/libzeroplus.so),
  3. source tree only: ``$ZEROPLUS_BUILD_DIR/lib`` and ``<repo>/build/lib`` (scripts/build.sh).

The version guard reads the build stamp out of the file *before* it is opened: a library built
for another torch minor version would otherwise fail inside dlopen with an undefined-symbol
error, or load and crash later (the c10d classes it subclasses change layout between minors).

torch is imported by the functions that need it, not here: ``python -m zeroplus.report`` uses
this module to say that torch is missing, instead of failing on the import.
"""

from __future__ import annotations

import mmap
import os
import pathlib

_ENV_LIBRARY = "ZEROPLUS_LIBRARY"
_LIBRARY_NAME = "libzeroplus.so"
_STAMP_PREFIX = b"ZEROPLUS_BUILD_STAMP "  # registration/library.cpp, zeroplus_build_stamp


def _source_tree_root(package_dir: pathlib.Path) -> pathlib.Path | None:
    # plugin/python/zeroplus -> the repository, recognised by its top-level CMakeLists.txt.
    root = package_dir.parents[2]
    if (root / "CMakeLists.txt").is_file() and (root / "plugin" / "python" / "zeroplus").is_dir():
        return root
    return None


def _candidates() -> list[pathlib.Path]:
    package_dir = pathlib.Path(__file__).resolve().parent
    found = []
    if os.environ.get(_ENV_LIBRARY):
        found.append(pathlib.Path(os.environ[_ENV_LIBRARY]))
    found.append(package_dir / _LIBRARY_NAME)
    repo_root = _source_tree_root(package_dir)
    if repo_root is not None:
        if os.environ.get("ZEROPLUS_BUILD_DIR"):
            found.append(pathlib.Path(os.environ["ZEROPLUS_BUILD_DIR"]) / "lib" / _LIBRARY_NAME)
        found.append(repo_root / "build" / "lib" / _LIBRARY_NAME)
    return found


def library_path() -> str:
    """Absolute path of the libzeroplus.so this package loads.

    Looked up in order: $ZEROPLUS_LIBRARY, next to the package (pip install), and in a source
    checkout $ZEROPLUS_BUILD_DIR/lib and the repository's build/lib. Raises FileNotFoundError
    listing every place tried.
    """
    candidates = _candidates()
    if os.environ.get(_ENV_LIBRARY) and not candidates[0].is_file():
        raise FileNotFoundError(f"zeroplus: {_ENV_LIBRARY}={candidates[0]} does not exist")
    for path in candidates:
        if path.is_file():
            return str(path)
    tried = "\n  ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"zeroplus: {_LIBRARY_NAME} not found; install zeroplus with `pip install --no-build-isolation .`, "
        f"build it with scripts/build.sh, or set {_ENV_LIBRARY}. Tried:\n  {tried}"
    )


def read_build_stamp(path: str | os.PathLike[str]) -> dict[str, str]:
    """The build stamp of a libzeroplus.so file, without loading it.

    Returns e.g. ``{"zeroplus": "0.1.0", "torch": "2.13.0+cpu", "cxx11_abi": "1", "cuda": "0"}``;
    an empty dict when the file carries no stamp (not a zeroplus library).
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return {}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            start = m.find(_STAMP_PREFIX)
            if start < 0:
                return {}
            end = m.find(b"\0", start)
            text = m[start + len(_STAMP_PREFIX) : end if end >= 0 else start + 512]
    return dict(item.split("=", 1) for item in text.decode("ascii", "replace").split() if "=" in item)


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def torch_mismatch(built: str, running: str) -> str | None:
    """None when a library built for torch ``built`` may load into torch ``running`` (same
    major.minor), else the refusal message naming both versions."""
    if _minor(built) == _minor(running):
        return None
    return (
        f"zeroplus: libzeroplus.so was built for torch {built} but this process runs torch {running}; "
        f"the c10d ABI changes between torch minor versions. Rebuild zeroplus against torch {running} "
        f"(pip install --no-build-isolation . or scripts/build.sh), or install torch=={built.split('+')[0]}"
    )


def check_library(path: str) -> dict[str, str]:
    """Reads ``path``'s build stamp and raises ImportError unless it matches the running torch."""
    import torch

    stamp = read_build_stamp(path)
    if "torch" not in stamp:
        raise ImportError(f"zeroplus: {path} has no zeroplus build stamp (not a zeroplus library, or built before 0.1.0); rebuild it")
    mismatch = torch_mismatch(stamp["torch"], torch.__version__)
    if mismatch:
        raise ImportError(f"{mismatch} [{path}]")
    return stamp


def built_torch_version() -> str:
    """The torch version libzeroplus.so was compiled against (the library must be loaded)."""
    import torch

    info = torch.ops.zeroplus.build_info()
    return info.rsplit("torch ", 1)[1]


def load_library() -> str:
    """Loads libzeroplus.so once (idempotent) after checking it matches the running torch.

    Raises ImportError naming both versions, before the library is opened, when it was built for
    another torch minor version.
    """
    import torch

    path = library_path()
    if path not in torch.ops.loaded_libraries:
        check_library(path)
        torch.ops.load_library(path)
    mismatch = torch_mismatch(built_torch_version(), torch.__version__)
    if mismatch:
        raise ImportError(mismatch)
    return path
