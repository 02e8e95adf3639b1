"""Every ``ZEROPLUS_*`` name zeroplus knows, for ``python -m zeroplus.report``'s checks.

A misspelled variable is silently ignored by whatever would have read it (``ZEROPLUS_SHMM=off``
leaves the shared-memory transport on), so the report turns an unknown ``ZEROPLUS_*`` name into
a FAIL that suggests the closest known one. The names are docs/configuration.md's tables (a
test keeps them equal, and checks every name the C++ sources and the scripts read is here).

Torch-free: the report uses it even when torch is missing.
"""

from __future__ import annotations

import difflib
from typing import Mapping

# Read by the library or the package at run time.
RUNTIME = (
    # process_group/core/config.cpp, kKnobs (docs/backend.md)
    "ZEROPLUS_BUCKET_BYTES", "ZEROPLUS_FUSE", "ZEROPLUS_SHM", "ZEROPLUS_SHM_CHUNK_BYTES", "ZEROPLUS_SPIN_US",
    "ZEROPLUS_INLINE_SYNC", "ZEROPLUS_CUDA_TRANSPORT", "ZEROPLUS_SOCKET_IFNAME", "ZEROPLUS_INTERHOST",
    "ZEROPLUS_DEBUG",
    # optimizers/core/cpu_isa.cpp
    "ZEROPLUS_CPU_ISA",
    # plugin/python/zeroplus/_library.py (ZEROPLUS_BUILD_DIR: also the scripts and benches)
    "ZEROPLUS_LIBRARY", "ZEROPLUS_BUILD_DIR",
)

# Read by the scripts, the benchmarks or CMake (as -D options); harmless in a user's environment,
# and not typos.
TOOLING = (
    "ZEROPLUS_DEEPSPEED_VERSION",
    "ZEROPLUS_PYTHON", "ZEROPLUS_TORCH_DIR", "ZEROPLUS_NCCL_DIR", "ZEROPLUS_WITH_TORCH", "ZEROPLUS_WITH_CUDA",
    "ZEROPLUS_BUILD_TESTS", "ZEROPLUS_BUILD_EXAMPLES", "ZEROPLUS_USE_CCACHE", "ZEROPLUS_USE_PCH", "ZEROPLUS_WERROR",
    "ZEROPLUS_SANITIZE", "ZEROPLUS_TEST_COMPONENTS", "ZEROPLUS_BUILD_FUZZERS",
    "ZEROPLUS_VENV", "ZEROPLUS_TORCH_VERSION", "ZEROPLUS_JOBS", "ZEROPLUS_SKIP_CUDA_CHECK", "ZEROPLUS_SKIP_PACKAGE",
    "ZEROPLUS_PACKAGE_DIR", "ZEROPLUS_SKIP_SANITIZERS", "ZEROPLUS_SKIP_FUZZ", "ZEROPLUS_FUZZ_SECONDS", "ZEROPLUS_ATHERIS_DIR",
    "ZEROPLUS_FUZZ_CC", "ZEROPLUS_FUZZ_CXX", "ZEROPLUS_ASAN_BUILD_DIR", "ZEROPLUS_TSAN_BUILD_DIR",
    "ZEROPLUS_FUZZ_BUILD_DIR", "ZEROPLUS_CUDA_VENV", "ZEROPLUS_CUDA_BUILD_DIR", "ZEROPLUS_CUDA_TORCH_VERSION",
    # scripts/gpu_check.sh (docs/gpu.md)
    "ZEROPLUS_GPU_PYTHON", "ZEROPLUS_GPU_BUILD_DIR", "ZEROPLUS_GPU_BUILD", "ZEROPLUS_GPU_TEST_TIMEOUT",
    "ZEROPLUS_GPU_BENCH_TIMEOUT",
)

KNOWN = frozenset(RUNTIME + TOOLING)

# optimizers/core/cpu_isa.cpp, parseIsa: exact, lower case. Anything else is ignored there (the
# kernels then pick the best the CPU supports), which is why the report calls it out.
CPU_ISAS = ("scalar", "avx2", "avx512")


def unknown_variable_problems(environ: Mapping[str, str]) -> list[str]:
    """One message per ``ZEROPLUS_*`` name in ``environ`` that zeroplus does not know."""
    # Compared without the common prefix, which would make every name look close to every other;
    # upper-cased, so that ZEROPLUS_shm finds ZEROPLUS_SHM.
    prefix = len("ZEROPLUS_")
    suffixes = sorted(k[prefix:] for k in KNOWN)
    problems = []
    for name in sorted(n for n in environ if n.startswith("ZEROPLUS_") and n not in KNOWN):
        close = difflib.get_close_matches(name[prefix:].upper(), suffixes, n=1, cutoff=0.6)
        hint = f"did you mean ZEROPLUS_{close[0]}?" if close else "see docs/configuration.md for the known names"
        problems.append(f"{name} is not a zeroplus variable ({hint})")
    return problems


def cpu_isa_problem(value: str | None) -> str | None:
    """None when ``ZEROPLUS_CPU_ISA=value`` is valid or unset (None or empty), else why not."""
    if not value or value in CPU_ISAS:
        return None
    return (f"ZEROPLUS_CPU_ISA='{value}' is invalid, expected {', '.join(CPU_ISAS[:-1])} or {CPU_ISAS[-1]}; "
            f"the kernels ignore it and use the best the CPU supports")
