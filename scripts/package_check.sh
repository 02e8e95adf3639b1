#!/usr/bin/env bash
# Packaging stage of scripts/test.sh (so of CI): the ways users get zeroplus, each checked from
# the outside, without PYTHONPATH or ZEROPLUS_* variables:
#   1. pip wheel --no-build-isolation .  in the shared build directory (test.sh's first step,
#      scripts/install.sh, already did a fresh pip configure + build there, so this only packs);
#   2. a fresh venv installs that wheel (+ torch), runs `python -m zeroplus.report` and a 2-rank
#      torchrun smoke test (tests/install/smoke_2rank.py), then `pip uninstall` must leave nothing;
#   3. cmake --install of the build directory into a prefix, then examples/cpp configured with
#      find_package(zeroplus) against that prefix only, built, and run (2-rank allreduce, aio,
#      2-rank ZeRO-1/2/3 training matched against a single-process run, a 2-rank stage-3 bf16 GPT
#      with NVMe optimizer offload whose loss must fall).
# Needs scripts/build.sh to have run (test.sh does). Usage: scripts/package_check.sh [wheel|cmake]...
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZEROPLUS_VENV:-$repo_root/.venv}"
build_dir="${ZEROPLUS_BUILD_DIR:-$repo_root/build}"
work="${ZEROPLUS_PACKAGE_DIR:-$repo_root/build-package}"
torch_version="$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
jobs="${ZEROPLUS_JOBS:-2}"

export CCACHE_BASEDIR="$repo_root"
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
export CCACHE_NOHASHDIR=1
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
export CMAKE_BUILD_PARALLEL_LEVEL="$jobs"
# What a user's shell has: none of the developer variables.
clean_env=(env -u PYTHONPATH -u ZEROPLUS_LIBRARY -u ZEROPLUS_BUILD_DIR)

free_port() { "$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

check_wheel() {
  local start wheel smoke="$work/venv" site
  start=$(date +%s)
  rm -rf "$work/dist"
  # The shared build directory: a separate one would recompile every torch translation unit
  # (the precompiled header is rebuilt with new bytes, so ccache misses everything that uses it).
  "$venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" \
    -C "build-dir=$build_dir" "$repo_root"
  wheel="$(ls "$work"/dist/zeroplus-*.whl)"
  echo "[package] wheel $(basename "$wheel") ($(du -h "$wheel" | cut -f1)) built in $(( $(date +%s) - start )) s"
  "$venv/bin/python" - "$wheel" <<'PY' || { echo "[package] FAILED: the wheel lacks the library or the package" >&2; exit 1; }
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
missing = [n for n in ("zeroplus/libzeroplus.so", "zeroplus/__init__.py", "zeroplus/report.py") if n not in names]
stray = [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
print(f"[package] wheel: {len(names)} files; missing {missing}; stray {stray[:3]}")
sys.exit(1 if missing or stray else 0)
PY

  start=$(date +%s)
  rm -rf "$smoke"
  # The interpreter the wheel was built with (its tag names that Python): the system python3 may
  # be another version, whose pip would refuse the wheel or find no torch==$torch_version for it.
  local base_python
  base_python="$("$venv/bin/python" -c 'import sys; print(sys._base_executable)')"
  "$base_python" -m venv "$smoke"
  "$smoke/bin/python" -m pip install -q "torch==$torch_version" numpy "$wheel"  # numpy: quiets a torch warning
  echo "[package] fresh venv ($base_python) with torch $torch_version and the wheel in $(( $(date +%s) - start )) s"
  site="$("$smoke/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

  start=$(date +%s)
  cd /tmp  # nothing of the repository on sys.path
  "${clean_env[@]}" "$smoke/bin/python" -m zeroplus.report --dir "$work"
  "${clean_env[@]}" "$smoke/bin/zeroplus-report" --json > "$work/report.json"  # the console scripts
  "${clean_env[@]}" "$smoke/bin/zeroplus-estimate" --params 1e9 --world-size 8 > /dev/null
  "${clean_env[@]}" "$smoke/bin/zeroplus-checkpoint" --help > /dev/null
  "${clean_env[@]}" "$smoke/bin/torchrun" --nproc_per_node 2 --master_port "$(free_port)" \
    "$repo_root/tests/install/smoke_2rank.py"
  cd "$repo_root"
  echo "[package] report + 2-rank smoke test of the installed wheel in $(( $(date +%s) - start )) s"

  "$smoke/bin/python" -m pip uninstall -q -y zeroplus
  local left
  left="$(ls -d "$site"/zeroplus* "$smoke"/bin/zeroplus-* 2>/dev/null || true)"
  if [[ -n "$left" ]]; then
    echo "[package] FAILED: pip uninstall zeroplus left: $left" >&2
    exit 1
  fi
  echo "[package] pip uninstall removed everything"
}

check_cmake() {
  local start prefix="$work/prefix" examples="$work/examples" port
  start=$(date +%s)
  rm -rf "$prefix" "$examples"
  cmake --install "$build_dir" --prefix "$prefix" >/dev/null
  for f in lib/libzeroplus.so lib/cmake/zeroplus/zeroplusConfig.cmake include/zeroplus/process_group/adapter/backend.hpp; do
    [[ -f "$prefix/$f" ]] || { echo "[package] FAILED: cmake --install did not install $f" >&2; exit 1; }
  done
  # Only the prefix: the examples must not see the source or build tree.
  "${clean_env[@]}" cmake -S "$repo_root/examples/cpp" -B "$examples" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER_LAUNCHER=ccache > "$work/examples-configure.log" 2>&1 \
    || { cat "$work/examples-configure.log"; echo "[package] FAILED: find_package(zeroplus) from $prefix" >&2; exit 1; }
  # Imported targets' include directories reach the compiler as -isystem, not -I: the helper
  # matches both, and after the build also the headers the compiler really opened.
  "$repo_root/scripts/source_tree_leaks.sh" flags "$repo_root" "$build_dir" "$prefix" "$examples" \
    < "$examples/build.ninja" || { echo "[package] FAILED: the examples' include options reach into the source or build tree" >&2; exit 1; }
  cmake --build "$examples" -j "$jobs"
  (cd "$examples" && ninja -t deps | "$repo_root/scripts/source_tree_leaks.sh" deps "$repo_root" "$build_dir" "$prefix" "$examples") \
    || { echo "[package] FAILED: the examples compiled headers of the source or build tree" >&2; exit 1; }
  echo "[package] cmake --install + examples/cpp from find_package(zeroplus) in $(( $(date +%s) - start )) s"

  start=$(date +%s)
  port="$(free_port)"
  "$examples/cpp_allreduce" 0 2 127.0.0.1 "$port" > "$work/allreduce0.log" 2>&1 &
  local pid=$!
  "$examples/cpp_allreduce" 1 2 127.0.0.1 "$port" > "$work/allreduce1.log" 2>&1 || { cat "$work"/allreduce*.log; exit 1; }
  wait "$pid" || { cat "$work"/allreduce*.log; exit 1; }
  # Each rank exits 1 unless its result is exactly 1 + 2 (checked above); this only makes sure
  # the run got as far as the check.
  grep -q "over 2 ranks = 3: ok" "$work/allreduce0.log" || { cat "$work"/allreduce*.log; echo "[package] FAILED: allreduce result" >&2; exit 1; }
  head -n 1 "$work/allreduce0.log"
  "$examples/cpp_aio_roundtrip" "$work" 8
  # ZeRO stages 1-3 from C++ (zeroplus.hpp) on 2 ranks; each rank exits 1 unless it matches the
  # single-process run.
  for zero_stage in 1 2 3; do
    port="$(free_port)"
    "$examples/cpp_train_mlp" 0 2 127.0.0.1 "$port" 30 "$zero_stage" > "$work/train0.log" 2>&1 &
    pid=$!
    "$examples/cpp_train_mlp" 1 2 127.0.0.1 "$port" 30 "$zero_stage" || { cat "$work/train0.log"; exit 1; }
    wait "$pid" || { cat "$work/train0.log"; exit 1; }
    cat "$work/train0.log"
  done
  # A small GPT (embeddings + a Sequential of transformer blocks + head) at stage 3 with bf16 and
  # the optimizer state on NVMe (swap files under $work/nvme); each rank exits 1 unless the loss
  # falls to below half of its first value.
  port="$(free_port)"
  rm -rf "$work/nvme"
  "$examples/cpp_train_gpt" 0 2 "$work/nvme" 127.0.0.1 "$port" > "$work/gpt0.log" 2>&1 &
  pid=$!
  "$examples/cpp_train_gpt" 1 2 "$work/nvme" 127.0.0.1 "$port" || { cat "$work/gpt0.log"; exit 1; }
  wait "$pid" || { cat "$work/gpt0.log"; exit 1; }
  grep -q "ZeRO stage 3, bf16, optimizer state on NVMe" "$work/gpt0.log" || { cat "$work/gpt0.log"; echo "[package] FAILED: cpp_train_gpt" >&2; exit 1; }
  tail -n 1 "$work/gpt0.log"
  echo "[package] C++ examples ran in $(( $(date +%s) - start )) s"
}

mkdir -p "$work"
stages=("$@")
((${#stages[@]})) || stages=(wheel cmake)
for s in "${stages[@]}"; do
  case "$s" in
    wheel) check_wheel ;;
    cmake) check_cmake ;;
    *) echo "scripts/package_check.sh: unknown stage '$s' (wheel, cmake)" >&2; exit 2 ;;
  esac
done
