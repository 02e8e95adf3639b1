#!/usr/bin/env bash
# Sanitizer stage of scripts/test.sh: builds the torch-free cores and their GoogleTests twice,
# with g++'s sanitizers, each in its own build directory, and runs them through ctest:
#   build-asan  -DZEROPLUS_SANITIZE=address,undefined  every torch-free GoogleTest
#   build-tsan  -DZEROPLUS_SANITIZE=thread              process-group, aio and optimizer core tests
# Any report aborts the test that made it (halt_on_error=1, -fno-sanitize-recover=all).
# Usage: scripts/sanitizers.sh [asan|tsan]... (default: both). Environment: ZEROPLUS_JOBS,
# ZEROPLUS_ASAN_BUILD_DIR (build-asan), ZEROPLUS_TSAN_BUILD_DIR (build-tsan).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${ZEROPLUS_JOBS:-2}"

export CCACHE_BASEDIR="$repo_root"
export CCACHE_NOHASHDIR=1  # -g's compile directory out of the hash: hits across clones and worktrees
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"

# -O1 keeps stack traces exact and the tests quick; no -DNDEBUG, so asserts stay armed.
common=(-G Ninja -DZEROPLUS_WITH_TORCH=OFF -DZEROPLUS_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
        "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g")

# configure + build + ctest of one flavour: name, build dir, -fsanitize list, test components
# (tests/cpp folders), optional GoogleTest filter. Configuring again is cheap and keeps an old build directory in step.
run_flavour() {
  local name="$1" dir="$2" sanitize="$3" components="$4" start
  start=$(date +%s)
  cmake -S "$repo_root" -B "$dir" "${common[@]}" "-DZEROPLUS_SANITIZE=$sanitize" \
    "-DZEROPLUS_TEST_COMPONENTS=$components" >/dev/null
  cmake --build "$dir" -j "$jobs"
  echo "[sanitizers] $name build took $(( $(date +%s) - start )) s"
  start=$(date +%s)
  GTEST_FILTER="${5:-*}" ctest --test-dir "$dir" --output-on-failure -j 2 --timeout 600
  echo "[sanitizers] $name tests took $(( $(date +%s) - start )) s"
}

# Reports go to stderr of the failing test, which ctest prints (--output-on-failure).
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
# Suppressions: only proven false positives, each with its reason (tests/sanitizers/tsan.supp).
export TSAN_OPTIONS="halt_on_error=1:abort_on_error=1:second_deadlock_stack=1:suppressions=$repo_root/tests/sanitizers/tsan.supp${TSAN_OPTIONS:+:$TSAN_OPTIONS}"

flavours=("$@")
((${#flavours[@]})) || flavours=(asan tsan)
for f in "${flavours[@]}"; do
  case "$f" in
    asan) run_flavour "ASan+UBSan" "${ZEROPLUS_ASAN_BUILD_DIR:-$repo_root/build-asan}" "address,undefined" \
            "common;process_group;optimizers;aio" ;;
    # Under TSan the "EveryTypeAndOp" collectives at ~1M elements take 7 of the 8 minutes of
    # collectives_test (every dtype x op through instrumented reduction loops, ~80x slower): they
    # test arithmetic, which the ASan build covers. The other ~1M-element cases (multi-segment
    # pipelines, every algorithm, 2-4 ranks) stay.
    # optimizers: the swap store's pump thread (records read, checked, sealed and written off
    # the training thread); its kernel tests are small and fast even instrumented.
    tsan) run_flavour "TSan" "${ZEROPLUS_TSAN_BUILD_DIR:-$repo_root/build-tsan}" "thread" "process_group;aio;optimizers" \
            "-*EveryTypeAndOp*countLarge" ;;
    *) echo "scripts/sanitizers.sh: unknown flavour '$f' (asan, tsan)" >&2; exit 2 ;;
  esac
done
