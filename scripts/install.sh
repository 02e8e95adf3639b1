#!/usr/bin/env bash
# Installs zeroplus into the venv the way a user does: pip install --no-build-isolation . (CMake
# through scikit-build-core, pyproject.toml), building against the venv's torch. The build
# directory is ${ZEROPLUS_BUILD_DIR:-build}, shared with scripts/build.sh, so installing after a
# build (or building after an install) recompiles nothing. Extra arguments go to pip.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZEROPLUS_VENV:-$repo_root/.venv}"
build_dir="${ZEROPLUS_BUILD_DIR:-$repo_root/build}"

# ccache exactly as scripts/build.sh sets it, so both routes share hits.
export CCACHE_BASEDIR="$repo_root"
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
export CCACHE_NOHASHDIR=1
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
export CMAKE_BUILD_PARALLEL_LEVEL="${ZEROPLUS_JOBS:-2}"

start=$(date +%s)
"$venv/bin/python" -m pip install -q --no-build-isolation --no-deps "$@" \
  -C "build-dir=$build_dir" "$repo_root"
# Ask the installed package (not a source tree on PYTHONPATH) where its library is.
echo "[install] zeroplus installed into $venv in $(( $(date +%s) - start )) s:" \
  "$(cd / && env -u PYTHONPATH -u ZEROPLUS_LIBRARY "$venv/bin/python" -c 'import zeroplus; print(zeroplus.library_path())')"
