#!/usr/bin/env bash
# Fuzz stage of scripts/test.sh: builds the libFuzzer targets of tests/fuzz with clang
# (ASan+UBSan, torch-free cores only) into ${ZEROPLUS_FUZZ_BUILD_DIR:-build-fuzz} and runs each
# for ZEROPLUS_FUZZ_SECONDS (60) seconds, ZEROPLUS_JOBS (2) targets at a time (one core each:
# the same fuzzing as one after the other, in half the wall time on two cores), each starting
# from its committed seed corpus tests/fuzz/corpus/<target>/ (read only: new inputs go to
# build-fuzz/corpus/<target>/). A crash fails the stage (the other targets finish their run);
# its input is in build-fuzz/artifacts/<target>/. After fixing the bug, commit that input to
# tests/fuzz/corpus/<target>/ as a regression seed.
# Python targets (tests/fuzz/<target>.py, atheris: the checkpoint manifest parser) run the same
# way under the project's venv Python against the tree's build/ library; atheris (pinned) is
# installed on first use into ${ZEROPLUS_ATHERIS_DIR:-build-fuzz/python} (pip --target: the venv
# itself is left as setup.sh made it). A Python target fuzzes until ZEROPLUS_FUZZ_DEADLINE (the
# end of its slot: the time the interpreter takes to import torch comes out of the fuzzing), so
# its slot stays within ZEROPLUS_FUZZ_SECONDS.
# Usage: scripts/fuzz.sh [target]...   (default: every target)
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${ZEROPLUS_FUZZ_BUILD_DIR:-$repo_root/build-fuzz}"
jobs="${ZEROPLUS_JOBS:-2}"
seconds="${ZEROPLUS_FUZZ_SECONDS:-60}"
cpp_targets=(config_fuzz peer_address_fuzz tcp_wire_fuzz shm_setup_fuzz manifest_parse_fuzz)
py_targets=(checkpoint_manifest_fuzz)
atheris_version=3.0.0
python="${ZEROPLUS_VENV:-$repo_root/.venv}/bin/python"
py_deps="${ZEROPLUS_ATHERIS_DIR:-$build_dir/python}"
targets=("$@")
((${#targets[@]})) || targets=("${py_targets[@]}" "${cpp_targets[@]}")  # the Python one first: it overlaps a C++ one
is_py() { [[ -f "$repo_root/tests/fuzz/$1.py" ]]; }
build_targets=()
for t in "${targets[@]}"; do is_py "$t" || build_targets+=("$t"); done

export CCACHE_BASEDIR="$repo_root"
export CCACHE_NOHASHDIR=1  # -g's compile directory out of the hash: hits across clones and worktrees
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"

start=$(date +%s)
if ((${#build_targets[@]})) && [[ ! -f "$build_dir/build.ninja" ]]; then
  CC="${ZEROPLUS_FUZZ_CC:-clang}" CXX="${ZEROPLUS_FUZZ_CXX:-clang++}" \
    cmake -S "$repo_root" -B "$build_dir" -G Ninja -DZEROPLUS_WITH_TORCH=OFF -DZEROPLUS_BUILD_TESTS=OFF \
      -DZEROPLUS_BUILD_EXAMPLES=OFF -DZEROPLUS_BUILD_FUZZERS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g" >/dev/null
fi
((${#build_targets[@]})) && cmake --build "$build_dir" -j "$jobs" --target "${build_targets[@]}"
if ((${#build_targets[@]} < ${#targets[@]})) &&
   ! PYTHONPATH="$py_deps" "$python" -c "import atheris" 2>/dev/null; then
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$py_deps" \
    "atheris==$atheris_version" 2>&1 | grep -v "^WARNING: Location" || true
  PYTHONPATH="$py_deps" "$python" -c "import atheris" || { echo "[fuzz] cannot install atheris" >&2; exit 1; }
fi
echo "[fuzz] build took $(( $(date +%s) - start )) s"

export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=1:quarantine_size_mb=64${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

# fuzz_one TARGET: one libFuzzer run; its whole log stays in build-fuzz/<target>.log.
fuzz_one() {
  local t="$1" start
  local seeds="$repo_root/tests/fuzz/corpus/$t" work="$build_dir/corpus/$t" artifacts="$build_dir/artifacts/$t"
  mkdir -p "$work" "$artifacts"
  local args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1
              -artifact_prefix="$artifacts/")
  [[ -f "$repo_root/tests/fuzz/$t.dict" ]] && args+=(-dict="$repo_root/tests/fuzz/$t.dict")
  local cmd=("$build_dir/bin/$t")
  if is_py "$t"; then
    cmd=(env PYTHONPATH="$py_deps" ZEROPLUS_FUZZ_DEADLINE="$(( $(date +%s) + seconds ))" "$python"
         "$repo_root/tests/fuzz/$t.py")
    args[3]="-max_len=16384"  # a real manifest is ~2 KB, with its shard ~3 KB
  fi
  start=$(date +%s)
  if ! "${cmd[@]}" "${args[@]}" "$work" "$seeds" >"$build_dir/$t.log" 2>&1; then
    tail -n 60 "$build_dir/$t.log"
    echo "[fuzz] $t FAILED; crashing input(s): $(ls "$artifacts")" >&2
    echo "[fuzz] reproduce: ${cmd[*]} $artifacts/<file>" >&2
    return 1
  fi
  echo "[fuzz] $t: $(grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$build_dir/$t.log" | tr '\n' ' ')" \
    "($(grep -oE "Done [0-9]+ runs in [0-9]+ second" "$build_dir/$t.log" | grep -oE "[0-9]+ second" | sed 's/ second/ s/' ||
        echo "$seconds s") of fuzzing, $(( $(date +%s) - start )) s)"
}

echo "[fuzz] ${targets[*]}: $seconds s each, $jobs at a time (seeds: tests/fuzz/corpus/<target>)"
start=$(date +%s)
failed=0
running=0
for t in "${targets[@]}"; do
  if (( running >= jobs )); then
    wait -n || failed=1
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
while (( running > 0 )); do
  wait -n || failed=1
  running=$((running - 1))
done
echo "[fuzz] runs took $(( $(date +%s) - start )) s"
exit "$failed"
