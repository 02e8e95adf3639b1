"""The C++ ZeRO engine (zeroplus::zero::initialize) on a GPU: skipped without one (CI); run by
scripts/gpu_check.sh (docs/gpu.md), which builds the two programs below against the machine's torch.

  * test_cpp_engine_cuda_gtests: tests/cpp/plugin/zero_cuda_test (GoogleTest, no Python): stages 1-3,
    AdamW and SGD, on CUDA parameters at 1 rank (NCCL) equal to single-process LibTorch on the GPU
    (1e-5), clip_grad_norm included; bf16 close to fp32; the engine's buffers and state on the GPU;
    a checkpoint of CUDA training resuming bit for bit and loading into the model trained on CPU; the
    argument checks. Every case must run: a skip there (a build without CUDA, no device) fails here.
  * test_python_and_cpp_engines_train_bit_identically_on_the_gpu: every case of
    test_cpp_engine_parity.py (stages 1-3; fp32, bf16 and fp16 with overflows; AdamW and SGD;
    clipping; the holder model), trained on the GPU by both front-ends at 2 ranks on the one GPU
    (zeroplus's host-staged transport), each rank its own process on both sides (the C++ program in
    its --rank form: autograd runs a process's CUDA backward on one thread per device, so rank
    threads would wait on each other), bit for bit, as on CPU.
"""

import os
import pathlib
import subprocess

import pytest
import torch

from harness import run_on_one_gpu
from test_cpp_engine_parity import CASES, WORLD, _program, check_engines_agree

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (docs/gpu.md)")

_REPO = pathlib.Path(__file__).resolve().parents[2]


def _built(name: str) -> pathlib.Path:
    path = pathlib.Path(os.environ.get("ZEROPLUS_BUILD_DIR") or _REPO / "build") / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} is not built: scripts/gpu_check.sh builds it against this machine's torch "
                    f"(ZEROPLUS_GPU_BUILD=1 forces that)")
    return path


def test_cpp_engine_cuda_gtests():
    program = _built("zero_cuda_test")
    run = subprocess.run([str(program)], capture_output=True, text=True, timeout=600)
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-40:])
    assert run.returncode == 0, f"{program} failed ({run.returncode}):\n{tail}"
    assert "[  SKIPPED ]" not in run.stdout, f"cases were skipped on a machine with a GPU:\n{tail}"
    assert "[  PASSED  ]" in run.stdout, tail


def test_python_and_cpp_engines_train_bit_identically_on_the_gpu(tmp_path):
    assert _program() == _built("zero_engine_crosscheck")
    check_engines_agree(tmp_path, list(CASES), "cuda",
                        lambda fn, *args: run_on_one_gpu(fn, WORLD, *args, timeout=300), cpp_processes=True)
