#!/usr/bin/env bash
# The main job: set up (idempotent), install zeroplus into the venv with pip (scripts/install.sh:
# pip install --no-build-isolation .), then train TinyGPT on 2 local CPU ranks with torchrun and
# backend="zeroplus". No PYTHONPATH: the ranks import the installed package. Extra arguments go
# to examples/train_ddp.py.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZEROPLUS_VENV:-$repo_root/.venv}"
bash "$repo_root/scripts/setup.sh"
bash "$repo_root/scripts/install.sh"
unset PYTHONPATH ZEROPLUS_LIBRARY
exec "$venv/bin/torchrun" --standalone --nproc_per_node 2 "$repo_root/examples/train_ddp.py" "$@"
