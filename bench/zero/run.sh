#!/usr/bin/env bash
# ZeRO stage benchmark, one command: fp32 and bf16, backends zeroplus and gloo, 2 CPU ranks.
#   bash bench/zero/run.sh          -> bench/results/zero_stages_{fp32,bf16}.{md,json,png}
# Run it on a quiet machine; it installs matplotlib into the venv for the PNGs if missing.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${ZEROPLUS_PYTHON:-$repo_root/.venv/bin/python}"
"$py" -c "import matplotlib" 2>/dev/null || "$py" -m pip install -q matplotlib
export PYTHONPATH="$repo_root/plugin/python${PYTHONPATH:+:$PYTHONPATH}"
for precision in fp32 bf16; do
  "$py" "$repo_root/bench/zero/bench_stages.py" --precision "$precision" --steps "${STEPS:-30}" \
    --out "$repo_root/bench/results/zero_stages_$precision"
done
