#!/usr/bin/env bash
# The CUDA checks, on a machine with a GPU (docs/gpu.md): the CUDA test files and the GPU bench.
# Not part of CI (CI machines have no GPU; there these tests are skipped).
#
# libzeroplus.so with CUDA: taken from $ZEROPLUS_GPU_BUILD_DIR/lib (default build-gpu/, e.g. built
# elsewhere by scripts/cuda_build_check.sh against the same torch version and copied there, with
# liburing.so.2 beside it), else built here against this machine's torch (needs nvcc, cmake, ninja;
# LIBURING_ROOT points at liburing's include/ and lib/ where the machine has no liburing-dev);
# ZEROPLUS_GPU_BUILD=1 builds here even when the copied library loads. The C++ engine's GPU checks
# (tests/python/test_cuda_cpp_engine.py) need two programs built against this machine's torch,
# bin/zero_cuda_test (GoogleTest: the machine's, or include/ and lib/ carried in $build/gtest) and
# bin/zero_engine_crosscheck: where tests are asked for and they are missing, the library and
# they are built here (device time: carry them where you can).
#
#   OUT=dir bash scripts/gpu_check.sh [tests|bench|all] [extra bench_gpu.py arguments]
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
what="${1:-all}"
shift || true
out="${OUT:-$repo_root/bench/results/gpu}"
mkdir -p "$out"
py="${ZEROPLUS_GPU_PYTHON:-python3}"
build="${ZEROPLUS_GPU_BUILD_DIR:-$repo_root/build-gpu}"
uring_lib="$build/uring/lib"  # carried beside the library; a build here links the same one
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

export PYTHONPATH="$repo_root/plugin/python${PYTHONPATH:+:$PYTHONPATH}"
build_here() {  # libzeroplus.so with CUDA against this machine's torch, into build-gpu-local/
  local site nccl_header local_build start
  site="$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
  nccl_header="$(find "$site/nvidia" -name nccl.h | head -1)"
  local_build="$repo_root/build-gpu-local"
  export LIBURING_ROOT="${LIBURING_ROOT:-$build/uring}"
  local configure=(cmake -S "$repo_root" -B "$local_build" -G Ninja -DZEROPLUS_TORCH_DIR="$site/torch"
    -DZEROPLUS_NCCL_DIR="$(dirname "$(dirname "$nccl_header")")" -DZEROPLUS_WITH_CUDA=ON
    -DZEROPLUS_BUILD_EXAMPLES=OFF -DCMAKE_CUDA_ARCHITECTURES=90)
  local targets=(zeroplus zero_cuda_test zero_engine_crosscheck)
  [[ -d "$build/gtest" ]] && configure+=(-DGTEST_ROOT="$build/gtest")
  start=$(date +%s)
  if ! "${configure[@]}" -DZEROPLUS_BUILD_TESTS=ON >"$out/configure.log" 2>&1; then
    tail -15 "$out/configure.log"
    echo "[gpu-check] configuring with the tests failed (above; no GoogleTest here? carry one in $build/gtest):" \
         "building the library only, without the C++ engine's GPU programs"
    rm -rf "$local_build"
    targets=(zeroplus)
    "${configure[@]}" -DZEROPLUS_BUILD_TESTS=OFF >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
  fi
  cmake --build "$local_build" --target "${targets[@]}" -j "$(nproc)" >"$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
  echo "[gpu-check] built ${targets[*]} in $local_build in $(( $(date +%s) - start )) s"
  build="$local_build"
}
programs_missing() { [[ ! -x "$build/bin/zero_cuda_test" || ! -x "$build/bin/zero_engine_crosscheck" ]]; }
if [[ "${ZEROPLUS_GPU_BUILD:-0}" == 1 ]] || { [[ "$what" != bench ]] && programs_missing; }; then
  build_here
fi
export LD_LIBRARY_PATH="$build/lib:$uring_lib:${LD_LIBRARY_PATH:-}"
export ZEROPLUS_BUILD_DIR="$build"
if ! "$py" -c "import torch, zeroplus; assert torch.ops.zeroplus.has_cuda_kernels()" 2>"$out/load_error.txt"; then
  echo "[gpu-check] the library in $build/lib does not load here ($(tail -1 "$out/load_error.txt")); building"
  build_here
  export ZEROPLUS_BUILD_DIR="$build"
  export LD_LIBRARY_PATH="$build/lib:$LD_LIBRARY_PATH"
fi
"$py" -c "import torch, zeroplus; print('[gpu-check] zeroplus', zeroplus.library_path(), 'cuda kernels', torch.ops.zeroplus.has_cuda_kernels())"

rc=0
if [[ "$what" == "tests" || "$what" == "all" ]]; then
  start=$(date +%s)
  timeout "${ZEROPLUS_GPU_TEST_TIMEOUT:-540}" "$py" -m pytest tests/python/test_cuda*.py -v -rs -p no:cacheprovider \
    2>&1 | tee "$out/tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error|assert" | cut -c1-300
  rc=${PIPESTATUS[0]}
  echo "[gpu-check] tests rc=$rc in $(( $(date +%s) - start )) s"
fi
if [[ "$what" == "bench" || "$what" == "all" ]]; then
  start=$(date +%s)
  timeout "${ZEROPLUS_GPU_BENCH_TIMEOUT:-300}" "$py" bench/gpu/bench_gpu.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | tail -60
  echo "[gpu-check] bench rc=${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
fi
exit "$rc"
