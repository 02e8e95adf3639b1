#!/usr/bin/env bash
# Tensor parallel x ZeRO vs ZeRO-3, one command: fp32 and bf16, 4 CPU ranks on backend zeroplus.
#   bash bench/tensor_parallel/run.sh   -> bench/results/tp_zero_{fp32,bf16}.{md,json,png}
# Extra arguments go to bench_tp_zero.py (e.g. --steps 10 --dim 512). Bytes are exact on any
# machine; step times want a quiet one. matplotlib is installed into the venv for the PNGs if
# missing (bench/plotting.py).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${ZEROPLUS_PYTHON:-$repo_root/.venv/bin/python}"
export PYTHONPATH="$repo_root/plugin/python${PYTHONPATH:+:$PYTHONPATH}"
for precision in fp32 bf16; do
  "$py" "$repo_root/bench/tensor_parallel/bench_tp_zero.py" --precision "$precision" \
    --out "$repo_root/bench/results/tp_zero_$precision" "$@"
done
