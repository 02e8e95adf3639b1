"""The version guard: a libzeroplus.so built for another torch minor version is refused before
it is opened, with both versions named (no undefined-symbol error, no crash). The mismatched
library is a stub compiled here: it carries a build stamp for torch 2.99.0 and an undefined
c10d symbol, like a real library built against another torch."""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

import zeroplus
import zeroplus._library as zlib

REPO = pathlib.Path(__file__).resolve().parents[2]
STUB_C = r"""
/* A symbol of another torch's c10d: dlopen fails with "undefined symbol" unless refused first. */
extern void _ZN4c10d23ProcessGroupFromTorch299C1Ev(void);
void zeroplus_stub_entry(void) { _ZN4c10d23ProcessGroupFromTorch299C1Ev(); }
const char zeroplus_build_stamp[] = "ZEROPLUS_BUILD_STAMP zeroplus=0.1.0 torch=2.99.0+cpu cxx11_abi=1 cuda=0";
"""


@pytest.fixture(scope="module")
def stub_library(tmp_path_factory) -> pathlib.Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("a C compiler (cc) is required to build the mismatched stub library")
    d = tmp_path_factory.mktemp("stub")
    (d / "stub.c").write_text(STUB_C)
    out = d / "libzeroplus.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(d / "stub.c")], check=True)
    return out


def _import_with(library: pathlib.Path, code: str = "import zeroplus") -> subprocess.CompletedProcess:
    env = dict(os.environ, ZEROPLUS_LIBRARY=str(library))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_stub_really_has_an_undefined_symbol(stub_library):
    # Without the guard this is what a user would see.
    with pytest.raises(OSError, match="undefined symbol"):
        ctypes.CDLL(str(stub_library), mode=os.RTLD_NOW)


def test_import_refuses_mismatched_library_before_dlopen(stub_library):
    r = _import_with(stub_library)
    assert r.returncode != 0
    assert "ImportError" in r.stderr, r.stderr
    assert "built for torch 2.99.0+cpu but this process runs torch " + torch.__version__ in r.stderr, r.stderr
    assert "undefined symbol" not in r.stderr, r.stderr
    assert "Segmentation" not in r.stderr and r.returncode == 1, (r.returncode, r.stderr)


def test_load_library_refuses_mismatched_library(stub_library, monkeypatch):
    monkeypatch.setenv("ZEROPLUS_LIBRARY", str(stub_library))
    with pytest.raises(ImportError, match=r"built for torch 2\.99\.0\+cpu but this process runs torch"):
        zlib.load_library()
    assert str(stub_library) not in torch.ops.loaded_libraries


def test_library_without_stamp_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / "libzeroplus.so"
    fake.write_bytes(b"\x7fELF" + b"\0" * 64)
    monkeypatch.setenv("ZEROPLUS_LIBRARY", str(fake))
    with pytest.raises(ImportError, match="no zeroplus build stamp"):
        zlib.load_library()


def test_build_stamp_of_the_real_library():
    stamp = zlib.read_build_stamp(zeroplus.library_path())
    assert stamp["zeroplus"] == zeroplus.__version__
    assert stamp["torch"] == zeroplus.built_torch_version()
    assert stamp["cxx11_abi"] == str(int(torch._C._GLIBCXX_USE_CXX11_ABI))
    assert stamp["cuda"] in ("0", "1")


@pytest.mark.parametrize(
    "built, running, refused",
    [
        ("2.13.0+cpu", "2.13.0+cpu", False),
        ("2.13.0+cpu", "2.13.1", False),  # patch releases keep the ABI
        ("2.13.0", "2.13.0+cu130", False),  # the local tag is no ABI
        ("2.13.0+cpu", "2.14.0+cpu", True),
        ("2.14.1", "2.11.0", True),
        ("3.13.0", "2.13.0", True),
    ],
)
def test_torch_mismatch_rule(built, running, refused):
    message = zlib.torch_mismatch(built, running)
    assert (message is not None) == refused
    if refused:
        assert f"built for torch {built} but this process runs torch {running}" in message


def test_versions_agree():
    pyproject = (REPO / "pyproject.toml").read_text()
    cmake = (REPO / "CMakeLists.txt").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == zeroplus.__version__
    assert re.search(r"project\(zeroplus VERSION ([0-9.]+)", cmake).group(1) == zeroplus.__version__


@pytest.mark.parametrize("version, ok", [("2.10.1", False), ("2.11.0", True), ("2.15.2+cpu", True), ("2.16.0", False)])
def test_cmake_refuses_torch_outside_the_supported_range(tmp_path, version, ok):
    script = tmp_path / "check.cmake"
    script.write_text(f'include("{REPO}/cmake/ZeroplusHelpers.cmake")\nzeroplus_check_torch_version("{version}")\n')
    r = subprocess.run(["cmake", "-P", str(script)], capture_output=True, text=True, timeout=60)
    assert (r.returncode == 0) == ok, r.stderr
    if not ok:
        text = " ".join(r.stderr.split())  # CMake wraps long messages
        assert f"torch {version} is not supported" in text and "2.11 to 2.15" in text, r.stderr


# The bare `torch.ops.load_library` path: no zeroplus package, so no check before dlopen; the
# load-time hook (registration/backend_hook.py, embedded with the build's torch version) warns
# and the backend it registers refuses to create groups. Run here from its source with the
# version placeholder filled in, as registration/CMakeLists.txt's string(CONFIGURE) does, in
# __main__'s namespace as python_hook.cpp's PyRun_SimpleString does, in a process where the real
# library was never loaded (so the registered creator is the hook's).
HOOK = REPO / "registration" / "backend_hook.py"
_RUN_HOOK = r"""
import json, sys, warnings
import __main__
import torch.distributed as dist

path, built = sys.argv[1], sys.argv[2]
source = open(path).read().replace("@ZEROPLUS_TORCH_VERSION@", built)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exec(compile(source, path, "exec"), __main__.__dict__)
result = {
    "warnings": [[w.category.__name__, str(w.message)] for w in caught],
    "registered": "zeroplus" in dist.Backend.backend_list,
    "leftovers": [name for name in vars(__main__) if name.startswith("__zeroplus")],
    "init": None,
}
if built.startswith("2.99"):
    try:
        dist.init_process_group("zeroplus", store=dist.HashStore(), rank=0, world_size=1)
    except Exception as e:
        result["init"] = [type(e).__name__, str(e)]
print(json.dumps(result))
"""


def _run_hook(built: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _RUN_HOOK, str(HOOK), built], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_hook_template_has_only_the_version_placeholder():
    # The test fills in @ZEROPLUS_TORCH_VERSION@ only; CMake's string(CONFIGURE) fills every @VAR@.
    assert set(re.findall(r"@[A-Za-z_0-9]+@", HOOK.read_text())) == {"@ZEROPLUS_TORCH_VERSION@"}


def test_load_library_hook_with_mismatched_torch_warns_then_refuses_groups():
    result = _run_hook("2.99.0+cpu")
    message = f"built for torch 2.99.0+cpu but this process runs torch {torch.__version__}"
    assert [category for category, _ in result["warnings"]] == ["RuntimeWarning"], result
    assert message in result["warnings"][0][1], result
    # Registered anyway, so init_process_group names the version problem instead of an
    # "unknown backend" error.
    assert result["registered"] and result["leftovers"] == [], result
    assert result["init"] is not None and result["init"][0] == "RuntimeError", result
    assert message in result["init"][1] and "rebuild zeroplus" in result["init"][1], result


def test_load_library_hook_with_matching_torch_is_silent():
    result = _run_hook(torch.__version__)
    assert result["warnings"] == [] and result["registered"] and result["leftovers"] == [], result
