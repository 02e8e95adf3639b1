#!/usr/bin/env bash
# Tensor parallel x ZeRO vs ZeRO-3, one command: fp32 and bf16, 4 CPU ranks on backend zeroplus,
# then fp32 again at 4x the batch (tensor parallelism's traffic grows with the tokens, ZeRO's
# does not: the crossover of docs/tensor_parallel_vs_zero3.md).
#   bash bench/tensor_parallel/run.sh
#     -> bench/results/tp_zero_{fp32,bf16,fp32_batch16}.{md,json,png}, tp_zero_crossover_fp32.png
#   SWEEP=0 leaves the batch-16 run out. Extra arguments go to every bench_tp_zero.py run.
# Bytes are exact on any machine; step times want a quiet one. matplotlib is installed into the
# venv for the PNGs if missing (bench/plotting.py).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${ZEROPLUS_PYTHON:-$repo_root/.venv/bin/python}"
export PYTHONPATH="$repo_root/plugin/python${PYTHONPATH:+:$PYTHONPATH}"
bench="$repo_root/bench/tensor_parallel/bench_tp_zero.py"
for precision in fp32 bf16; do
  "$py" "$bench" --precision "$precision" --out "$repo_root/bench/results/tp_zero_$precision" "$@"
done
if [[ "${SWEEP:-1}" == "1" ]]; then
  "$py" "$bench" --precision fp32 --batch 16 --out "$repo_root/bench/results/tp_zero_fp32_batch16" "$@"
fi
if [[ "${SWEEP:-1}" == "1" ]]; then
  # Bytes against tokens per step: the measured points of both fp32 runs and the formulas' lines.
  "$py" "$repo_root/bench/tensor_parallel/plot_crossover.py" "$repo_root/bench/results/tp_zero_fp32.json" \
    "$repo_root/bench/results/tp_zero_fp32_batch16.json" --out "$repo_root/bench/results/tp_zero_crossover_fp32.png"
fi
