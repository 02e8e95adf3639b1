#!/usr/bin/env bash
# Configures and builds zeroplus into ${ZEROPLUS_BUILD_DIR:-build} with the project's venv
# Python (scripts/setup.sh). Extra arguments go to the configure step (-DZEROPLUS_...=...).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZEROPLUS_VENV:-$repo_root/.venv}"
build_dir="${ZEROPLUS_BUILD_DIR:-$repo_root/build}"
jobs="${ZEROPLUS_JOBS:-2}"

# ccache: share hits between build directories and tolerate precompiled headers.
export CCACHE_BASEDIR="$repo_root"
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
# -g puts the compile directory into the object; without this ccache would hash it and never
# share hits between build directories (build/, a worktree, the wheel build).
export CCACHE_NOHASHDIR=1
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"

if [[ ! -f "$build_dir/build.ninja" ]]; then
  cmake -S "$repo_root" -B "$build_dir" -G Ninja -DZEROPLUS_PYTHON="$venv/bin/python" "$@"
elif (($#)); then
  cmake "$build_dir" "$@"
fi
cmake --build "$build_dir" -j "$jobs"
