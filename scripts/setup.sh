#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 + Python 3.11 machine for building and testing zeroplus.
# Installs the Debian packages the build needs and a virtual environment at $ZEROPLUS_VENV
# (default: .venv in the repository) holding torch==2.13.0 (CPU), scikit-build-core (the build
# backend of `pip install --no-build-isolation .`, pyproject.toml), pytest and numpy, and the
# frameworks the integration tests drive (tests/python/test_integration_*.py; docs/integrations.md):
# transformers, accelerate, lightning, peft and deepspeed at pinned versions known to work with torch 2.13 CPU.
# A second run checks what is there and returns in about a second.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZEROPLUS_VENV:-$repo_root/.venv}"
torch_version="${ZEROPLUS_TORCH_VERSION:-2.13.0}"

# clang + libclang-rt-14-dev: libFuzzer and its sanitizer runtimes for scripts/fuzz.sh (the
# sanitizer builds of scripts/sanitizers.sh use g++ and its libasan/libubsan/libtsan).
# iproute2 + util-linux (ip, unshare, nsenter): the network-namespace hosts of the multi-host
# tests and bench (tests/python/netns.py).
debian_packages=(cmake ninja-build ccache g++ liburing-dev libgtest-dev pkg-config fio python3-venv
                 clang libclang-rt-14-dev iproute2 util-linux)

missing=()
for pkg in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "[setup] installing Debian packages: ${missing[*]}"
  sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

python_bin="${ZEROPLUS_PYTHON:-python3}"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "[setup] creating virtual environment $venv"
  "$python_bin" -m venv "$venv"
fi

stamp="$venv/.zeroplus-setup-$torch_version-skbuild"
if [[ ! -f "$stamp" ]]; then
  echo "[setup] installing torch==$torch_version, scikit-build-core, pytest, numpy into $venv"
  "$venv/bin/python" -m pip install -q "torch==$torch_version" "scikit-build-core>=0.10" pytest numpy
  touch "$stamp"
fi
# Pinned, installed with torch held at its version (a framework must never pull another torch).
# The integration tests fail, not skip, when these are missing under CI.
# deepspeed: the reference of tests/python/test_checkpoint_deepspeed.py (DeepSpeed's own engine writes
# the checkpoints zeroplus loads); DS_BUILD_OPS=0: no compiled ops at install, and the test compiles
# none (it turns off the JIT build of DeepSpeed's CPU shared-memory allreduce). zeroplus itself
# never imports it. `import deepspeed` costs ~0.5 s over torch's import (measured: 0.51-0.57 s).
integration_packages=(transformers==5.24.0 accelerate==1.15.0 lightning==2.6.6 peft==0.21.2 deepspeed==0.19.8)
integration_stamp="$venv/.zeroplus-setup-integrations-$(IFS=-; echo "${integration_packages[*]}")"
if [[ ! -f "$integration_stamp" ]]; then
  echo "[setup] installing ${integration_packages[*]} into $venv"
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q "${integration_packages[@]}" "torch==$torch_version"
  touch "$integration_stamp"
fi
echo "[setup] ok: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)')"
