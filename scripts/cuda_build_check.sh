#!/usr/bin/env bash
# Compile check of the CUDA build: builds libzeroplus.so (every torch adapter, the NCCL
# transport and the .cu kernels) against the torch 2.14.1 CUDA wheel and the NCCL wheel with the
# machine's nvcc. Nothing is run: this machine has no GPU. A separate build directory and a
# separate environment (.venv-cuda, wheels unpacked with --no-deps: torch cannot be imported
# here) keep it from touching the CPU build. Idempotent; a second run only rebuilds what changed.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZEROPLUS_CUDA_VENV:-$repo_root/.venv-cuda}"
build_dir="${ZEROPLUS_CUDA_BUILD_DIR:-$repo_root/build-cuda}"
torch_version="${ZEROPLUS_CUDA_TORCH_VERSION:-2.14.1}"

if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "[cuda-check] FAILED: nvcc not found (expected on PATH or /usr/local/cuda/bin)" >&2
  exit 1
fi
export PATH="/usr/local/cuda/bin:$PATH"
bash "$repo_root/scripts/setup.sh" >/dev/null  # Debian packages (cmake, ninja, ccache)

stamp="$venv/.zeroplus-cuda-$torch_version"
if [[ ! -f "$stamp" ]]; then
  echo "[cuda-check] unpacking torch==$torch_version (CUDA) and nvidia-nccl-cu13 into $venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --no-deps "torch==$torch_version" nvidia-nccl-cu13
  # ATen's CUDA headers include cuBLAS/cuSPARSE/cuSOLVER headers; only the headers are needed,
  # so unpack just those from the wheels instead of installing ~800 MB of libraries.
  site_dir="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  wheels="$venv/wheels"
  mkdir -p "$wheels"
  "$venv/bin/python" -m pip download -q --no-deps -d "$wheels" nvidia-cublas nvidia-cusparse nvidia-cusolver
  for wheel in "$wheels"/*.whl; do
    python3 -m zipfile -l "$wheel" >/dev/null  # fail early on a broken download
    python3 - "$wheel" "$site_dir" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if "/include/" in n])
PY
  done
  rm -rf "$wheels"
  touch "$stamp"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

export CCACHE_BASEDIR="$repo_root"
export CCACHE_NOHASHDIR=1  # -g's compile directory out of the hash: hits across clones and worktrees
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
if [[ ! -f "$build_dir/build.ninja" ]]; then
  cmake -S "$repo_root" -B "$build_dir" -G Ninja \
    -DZEROPLUS_TORCH_DIR="$site/torch" -DZEROPLUS_NCCL_DIR="$site/nvidia/nccl" \
    -DZEROPLUS_WITH_CUDA=ON -DZEROPLUS_BUILD_TESTS=OFF -DZEROPLUS_BUILD_EXAMPLES=OFF
fi
start=$(date +%s)
cmake --build "$build_dir" --target zeroplus -j "${ZEROPLUS_JOBS:-2}"
echo "[cuda-check] ok: libzeroplus.so built against torch $torch_version+CUDA in $(( $(date +%s) - start )) s"
nm -D --defined-only "$build_dir/lib/libzeroplus.so" | grep -c "ProcessGroupNCCL\|zeroplus" | sed 's/^/[cuda-check] exported zeroplus\/NCCL-related symbols: /'
