#!/usr/bin/env bash
# The test command: set up (idempotent), install zeroplus into the venv with pip (the user's
# route, scripts/install.sh; it builds the library in the shared build directory), build the
# rest (GoogleTests), run the GoogleTest suite through ctest and the pytest suite (against the
# source tree), the packaging stage (wheel into a fresh venv, CMake package, C++ examples), then
# the CI guards (sanitizer and fuzz stages, docs/build.md) and the CUDA compile check. Exits
# non-zero when anything fails. Used by README.md and .ci/run.
# Local runs may skip stages: ZEROPLUS_SKIP_PACKAGE=1, ZEROPLUS_SKIP_SANITIZERS=1,
# ZEROPLUS_SKIP_FUZZ=1, ZEROPLUS_SKIP_CUDA_CHECK=1 (CI runs them all).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZEROPLUS_VENV:-$repo_root/.venv}"
build_dir="${ZEROPLUS_BUILD_DIR:-$repo_root/build}"
export ZEROPLUS_BUILD_DIR="$build_dir"

bash "$repo_root/scripts/setup.sh"
start=$(date +%s)
bash "$repo_root/scripts/install.sh"
bash "$repo_root/scripts/build.sh"
echo "[test] install + build took $(( $(date +%s) - start )) s"

echo "[test] GoogleTest suite (ctest)"
ctest --test-dir "$build_dir" --output-on-failure -j 2 --timeout 300

echo "[test] pytest suite"
cd "$repo_root"
"$venv/bin/python" -m pytest tests/python -q -p no:cacheprovider "$@"

if [[ "${ZEROPLUS_SKIP_PACKAGE:-0}" != "1" ]]; then
  echo "[test] packaging stage (wheel -> fresh venv, report, 2-rank smoke, uninstall; cmake --install -> C++ examples; ZEROPLUS_SKIP_PACKAGE=1 skips)"
  start=$(date +%s)
  bash "$repo_root/scripts/package_check.sh"
  echo "[test] packaging stage took $(( $(date +%s) - start )) s"
fi

# CI guards, each in its own build directories of the torch-free cores (docs/build.md).
if [[ "${ZEROPLUS_SKIP_SANITIZERS:-0}" != "1" ]]; then
  echo "[test] sanitizer stage (ASan+UBSan and TSan GoogleTests; ZEROPLUS_SKIP_SANITIZERS=1 skips)"
  start=$(date +%s)
  bash "$repo_root/scripts/sanitizers.sh"
  echo "[test] sanitizer stage took $(( $(date +%s) - start )) s"
fi
if [[ "${ZEROPLUS_SKIP_FUZZ:-0}" != "1" ]]; then
  echo "[test] fuzz stage (libFuzzer, ${ZEROPLUS_FUZZ_SECONDS:-60} s per target; ZEROPLUS_SKIP_FUZZ=1 skips)"
  start=$(date +%s)
  bash "$repo_root/scripts/fuzz.sh"
  echo "[test] fuzz stage took $(( $(date +%s) - start )) s"
fi

# A separate step with its own build directory, so it never slows or dirties the CPU build.
if [[ "${ZEROPLUS_SKIP_CUDA_CHECK:-0}" != "1" ]]; then
  echo "[test] CUDA compile check (torch CUDA wheel + NCCL, nvcc; nothing runs without a GPU)"
  bash "$repo_root/scripts/cuda_build_check.sh"
fi
