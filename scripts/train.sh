#!/usr/bin/env bash
# The main job: set up (idempotent), build, then train TinyGPT on 2 local CPU ranks with
# torchrun and backend="zeroplus". Extra arguments go to examples/train_ddp.py.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZEROPLUS_VENV:-$repo_root/.venv}"
bash "$repo_root/scripts/setup.sh"
bash "$repo_root/scripts/build.sh"
export PYTHONPATH="$repo_root/plugin/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$venv/bin/torchrun" --standalone --nproc_per_node 2 "$repo_root/examples/train_ddp.py" "$@"
