#!/usr/bin/env bash
# ZeRO stage benchmark, one command: fp32 and bf16, backends zeroplus and gloo, 2 CPU ranks,
# with the real DeepSpeed (stage 1 and 2) beside zeroplus.
#   bash bench/zero/run.sh          -> bench/results/zero_stages_{fp32,bf16}.{md,json,png}
#   DEEPSPEED=0 bash bench/zero/run.sh   (without DeepSpeed)
# then stage 3 beside DDP, zeroplus stages 1-2 and FSDP2 (fully_shard), 50.7M-parameter TinyGPT:
#   -> bench/results/zero_stage3_{fp32,bf16}.{md,json,png}
#   STAGE3=0 leaves it out; STAGE3_ARGS overrides its arguments (default: 2 ranks, zeroplus backend)
# Run it on a quiet machine; the benches install matplotlib into the venv for the PNGs if missing
# (bench/plotting.py), and DeepSpeed (once) into ${ZEROPLUS_BUILD_DIR:-build}/deepspeed-site
# (bench/deepspeed_env.py).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${ZEROPLUS_PYTHON:-$repo_root/.venv/bin/python}"
export PYTHONPATH="$repo_root/plugin/python${PYTHONPATH:+:$PYTHONPATH}"
ds_flag=""
[[ "${DEEPSPEED:-1}" == "1" ]] && ds_flag="--deepspeed"
for precision in fp32 bf16; do
  "$py" "$repo_root/bench/zero/bench_stages.py" --precision "$precision" --steps "${STEPS:-30}" \
    ${ds_flag} --out "$repo_root/bench/results/zero_stages_$precision"
done
if [[ "${STAGE3:-1}" == "1" ]]; then
  for precision in fp32 bf16; do
    # shellcheck disable=SC2086  (STAGE3_ARGS is a word list)
    "$py" "$repo_root/bench/zero/bench_stage3.py" --precision "$precision" \
      ${STAGE3_ARGS:---worlds 2 --backends zeroplus --steps 4} ${ds_flag} --out "$repo_root/bench/results/zero_stage3_$precision"
  done
fi
