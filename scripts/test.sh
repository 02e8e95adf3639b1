#!/usr/bin/env bash
# The test command: set up (idempotent), install zeroplus into the venv with pip (the user's
# route, scripts/install.sh; it builds the library in the shared build directory), build the
# rest (GoogleTests), run the GoogleTest suite through ctest and the pytest suite (against the
# source tree), the packaging stage (wheel into a fresh venv, CMake package, C++ examples), then
# the CI guards (sanitizer and fuzz stages, docs/build.md) and the CUDA compile check. Exits
# non-zero when anything fails. Used by README.md and .ci/run.
# It ends with a timing table (every stage, pytest's slowest tests and modules), printed even
# when a stage fails, so a slowdown shows in every CI log; budgets: docs/build.md.
# Local runs may skip stages: ZEROPLUS_SKIP_PACKAGE=1, ZEROPLUS_SKIP_SANITIZERS=1,
# ZEROPLUS_SKIP_FUZZ=1, ZEROPLUS_SKIP_CUDA_CHECK=1 (CI runs them all).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZEROPLUS_VENV:-$repo_root/.venv}"
build_dir="${ZEROPLUS_BUILD_DIR:-$repo_root/build}"
export ZEROPLUS_BUILD_DIR="$build_dir"
junit="$build_dir/pytest-junit.xml"

# --- timing table ------------------------------------------------------------------------------
stage_rows=()         # "name|seconds|status", in the order the stages ran
current_stage=""      # set while a stage runs: the table names it if the script dies inside it
current_start=0
run_start=$(date +%s)

# stage NAME COMMAND...: runs COMMAND as one timed stage; a failure stops the script (set -e).
stage() {
  local name="$1" rc=0
  shift
  echo "[test] ---- $name"
  current_stage="$name"
  current_start=$(date +%s)
  "$@" || rc=$?
  stage_rows+=("$name|$(( $(date +%s) - current_start ))|$([[ $rc == 0 ]] && echo ok || echo "FAILED ($rc)")")
  current_stage=""
  return "$rc"
}

skipped() { stage_rows+=("$1|0|skipped ($2=1)"); }

print_table() {
  local rc=$1 row name secs status
  [[ -n "$current_stage" ]] && stage_rows+=("$current_stage|$(( $(date +%s) - current_start ))|interrupted")
  echo
  echo "[test] ==== timing (budgets: docs/build.md)"
  printf '[test] %-34s %7s  %s\n' stage seconds status
  for row in "${stage_rows[@]}"; do
    IFS='|' read -r name secs status <<<"$row"
    printf '[test] %-34s %7s  %s\n' "$name" "$secs" "$status"
  done
  printf '[test] %-34s %7s  %s\n' total "$(( $(date +%s) - run_start ))" "$([[ $rc == 0 ]] && echo ok || echo "FAILED ($rc)")"
  if [[ -f "$junit" ]]; then
    python3 "$repo_root/scripts/slowest_tests.py" "$junit" --tests 25 --modules 15 | sed 's/^/[test] /' || true
  fi
}
trap 'rc=$?; print_table "$rc"; exit "$rc"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- stages -------------------------------------------------------------------------------------
rm -f "$junit"
stage "setup" bash "$repo_root/scripts/setup.sh"
stage "install (pip: library)" bash "$repo_root/scripts/install.sh"
stage "build (GoogleTests)" bash "$repo_root/scripts/build.sh"

stage "GoogleTest (ctest)" ctest --test-dir "$build_dir" --output-on-failure -j 2 --timeout 300

cd "$repo_root"
# --durations: the slowest tests also appear in pytest's own report; the junit file feeds the
# table at the end (slowest tests and the total per module).
stage "pytest" "$venv/bin/python" -m pytest tests/python -q -rs -p no:cacheprovider --durations=25 \
  --junitxml="$junit" -o junit_family=xunit2 "$@"

if [[ "${ZEROPLUS_SKIP_PACKAGE:-0}" != "1" ]]; then
  # wheel -> fresh venv, report, 2-rank smoke, uninstall; cmake --install -> C++ examples
  stage "packaging" bash "$repo_root/scripts/package_check.sh"
else
  skipped "packaging" ZEROPLUS_SKIP_PACKAGE
fi

# CI guards, each in its own build directories of the torch-free cores (docs/build.md).
if [[ "${ZEROPLUS_SKIP_SANITIZERS:-0}" != "1" ]]; then
  stage "sanitizers (ASan+UBSan, TSan)" bash "$repo_root/scripts/sanitizers.sh"
else
  skipped "sanitizers (ASan+UBSan, TSan)" ZEROPLUS_SKIP_SANITIZERS
fi
if [[ "${ZEROPLUS_SKIP_FUZZ:-0}" != "1" ]]; then
  stage "fuzz (${ZEROPLUS_FUZZ_SECONDS:-60} s per target)" bash "$repo_root/scripts/fuzz.sh"
else
  skipped "fuzz" ZEROPLUS_SKIP_FUZZ
fi

# A separate step with its own build directory, so it never slows or dirties the CPU build.
if [[ "${ZEROPLUS_SKIP_CUDA_CHECK:-0}" != "1" ]]; then
  # torch CUDA wheel + NCCL, nvcc; nothing runs without a GPU
  stage "CUDA compile check" bash "$repo_root/scripts/cuda_build_check.sh"
  # The oldest torch the README promises: its C++ API differs (torch 2.11's grad_accumulator
  # returns a shared_ptr, 2.13's an intrusive_ptr), and the GPU machines run 2.11.
  stage "CUDA compile check, torch 2.11" env ZEROPLUS_CUDA_TORCH_VERSION=2.11.0 \
    ZEROPLUS_CUDA_VENV="$repo_root/.venv-cuda-2.11" ZEROPLUS_CUDA_BUILD_DIR="$repo_root/build-cuda-2.11" \
    bash "$repo_root/scripts/cuda_build_check.sh"
else
  skipped "CUDA compile check" ZEROPLUS_SKIP_CUDA_CHECK
fi
