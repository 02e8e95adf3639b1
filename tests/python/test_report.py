"""python -m zeroplus.report: every check is present, a healthy machine exits 0, and each thing
zeroplus needs that is missing (library, matching torch, a valid ZEROPLUS_* value, an O_DIRECT
directory asked for) turns into a FAIL line and exit status 1."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from zeroplus import report

REPO = pathlib.Path(__file__).resolve().parents[2]
EXPECTED = {"zeroplus", "torch", "library", "built for", "load", "CPU ISA", "io_uring", "ZEROPLUS_*",
            "backend config", "/dev/shm", "CUDA"}


def _report(*args, env=None) -> tuple[int, list[dict]]:
    full_env = dict(os.environ)
    full_env.update(env or {})
    r = subprocess.run([sys.executable, "-m", "zeroplus.report", "--json", *args], env=full_env,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout)


def _by_name(checks):
    return {c["name"]: c for c in checks}


def test_report_healthy(tmp_path):
    rc, checks = _report("--dir", str(tmp_path))
    names = {c["name"] for c in checks}
    assert EXPECTED <= names, names
    assert any(n.startswith("O_DIRECT ") for n in names), names
    assert rc == 0, [c for c in checks if c["status"] == "FAIL"]
    by = _by_name(checks)
    assert by["CPU ISA"]["detail"].split()[0] in ("scalar", "avx2", "avx512")
    assert by["load"]["status"] == "ok"


def test_report_text_output_and_isa_cap():
    r = subprocess.run([sys.executable, "-m", "zeroplus.report"], env=dict(os.environ, ZEROPLUS_CPU_ISA="scalar"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("zeroplus report")
    assert "CPU ISA" in r.stdout and "scalar (ZEROPLUS_CPU_ISA=scalar" in r.stdout, r.stdout
    assert "ZEROPLUS_CPU_ISA=scalar" in r.stdout


def test_report_fails_on_malformed_variable():
    rc, checks = _report(env={"ZEROPLUS_SHM": "sometimes"})
    assert rc == 1
    env_check = _by_name(checks)["ZEROPLUS_*"]
    assert env_check["status"] == "FAIL" and "ZEROPLUS_SHM" in env_check["detail"], env_check


def test_report_fails_on_missing_library(tmp_path):
    rc, checks = _report(env={"ZEROPLUS_LIBRARY": str(tmp_path / "missing.so")})
    assert rc == 1
    assert _by_name(checks)["library"]["status"] == "FAIL"


def test_report_fails_on_mismatched_library(tmp_path):
    stub = tmp_path / "libzeroplus.so"
    stub.write_bytes(b"\x7fELF\0ZEROPLUS_BUILD_STAMP zeroplus=0.1.0 torch=2.99.0 cxx11_abi=1 cuda=0\0")
    rc, checks = _report(env={"ZEROPLUS_LIBRARY": str(stub)})
    assert rc == 1
    built = _by_name(checks)["built for"]
    assert built["status"] == "FAIL" and "built for torch 2.99.0" in built["detail"], built


def test_report_fails_on_missing_dir(tmp_path):
    rc, checks = _report("--dir", str(tmp_path / "nope"))
    assert rc == 1
    assert [c for c in checks if c["name"].startswith("O_DIRECT") and c["status"] == "FAIL"]


def test_o_direct_probe(tmp_path, monkeypatch):
    ok, detail = report.probe_o_direct(str(tmp_path))
    assert isinstance(ok, bool) and "O_DIRECT" in detail
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".zeroplus-odirect-")]  # cleaned up
    # A filesystem that refuses O_DIRECT (older tmpfs, some FUSE) makes open() fail with EINVAL.
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    ok, detail = report.probe_o_direct(str(tmp_path))
    assert not ok and "open(O_DIRECT) failed: Invalid argument" in detail
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".zeroplus-odirect-")]


def test_report_shm_off():
    rc, checks = _report(env={"ZEROPLUS_SHM": "off"})
    assert rc == 0 and "shm transport off" in _by_name(checks)["/dev/shm"]["detail"]


@pytest.mark.parametrize("mode, free, status", [("auto", 1 << 30, "ok"), ("on", 1 << 30, "ok"),
                                                ("auto", 5 << 20, "warn"), ("on", 5 << 20, "FAIL"),
                                                ("off", 0, "info")])
def test_shm_verdict(mode, free, status):
    check = report.shm_check(mode, 1 << 20, 64 << 20, free)  # 4 MiB + 4 KiB per rank
    assert check.status == status, check
    if status == "ok":
        assert f"up to {free // ((4 << 20) + 4096)} ranks" in check.detail


# --- ZEROPLUS_* names and the CPU ISA --------------------------------------------------------

def test_report_fails_on_unknown_variable_and_suggests_the_closest():
    # A typo is silently ignored by whatever would have read the variable: the shm transport
    # stays on here although the user asked for it off.
    rc, checks = _report(env={"ZEROPLUS_SHMM": "off", "ZEROPLUS_FOO": "1"})
    assert rc == 1
    env_check = _by_name(checks)["ZEROPLUS_*"]
    assert env_check["status"] == "FAIL", env_check
    assert "ZEROPLUS_SHMM is not a zeroplus variable (did you mean ZEROPLUS_SHM?)" in env_check["detail"], env_check
    assert "ZEROPLUS_FOO is not a zeroplus variable (see docs/configuration.md" in env_check["detail"], env_check


def test_report_fails_on_invalid_cpu_isa():
    # optimizers/core/cpu_isa.cpp ignores a value it does not parse (exact, lower case).
    rc, checks = _report(env={"ZEROPLUS_CPU_ISA": "AVX2"})
    assert rc == 1
    by = _by_name(checks)
    for name in ("CPU ISA", "ZEROPLUS_*"):
        assert by[name]["status"] == "FAIL", by[name]
        assert "ZEROPLUS_CPU_ISA='AVX2' is invalid, expected scalar, avx2 or avx512" in by[name]["detail"], by[name]


def test_unknown_variable_problems_ignores_known_and_other_names():
    problems = report._environment.unknown_variable_problems(
        {"ZEROPLUS_SHM": "on", "ZEROPLUS_BUILD_DIR": "build", "PATH": "/bin", "ZEROPLUS_spin_us": "5"})
    assert problems == ["ZEROPLUS_spin_us is not a zeroplus variable (did you mean ZEROPLUS_SPIN_US?)"]


def _names(text: str) -> set[str]:
    return set(re.findall(r"ZEROPLUS_[A-Z0-9_]*[A-Z0-9]", text))


def test_known_names_are_the_documented_ones_and_cover_every_reader():
    env = report._environment
    assert env.KNOWN == _names((REPO / "docs" / "configuration.md").read_text())
    cpp = "".join(p.read_text() for folder in ("aio", "optimizers", "process_group", "registration", "plugin")
                  for p in (REPO / folder).rglob("*.[ch]pp"))
    read_by_cpp = set(re.findall(r'getenv\("(ZEROPLUS_[A-Z0-9_]+)"\)', cpp))
    read_by_cpp |= set(re.findall(r'\{"\w+", "(ZEROPLUS_[A-Z0-9_]+)"\}', cpp))  # config.cpp's kKnobs
    assert "ZEROPLUS_CPU_ISA" in read_by_cpp and "ZEROPLUS_SHM" in read_by_cpp, read_by_cpp
    assert read_by_cpp <= set(env.RUNTIME), read_by_cpp - set(env.RUNTIME)
    scripts = "".join(p.read_text() for p in (REPO / "scripts").glob("*.sh"))
    read_by_scripts = set(re.findall(r"\$\{?(ZEROPLUS_[A-Z0-9_]+)", scripts))
    assert read_by_scripts <= env.KNOWN, read_by_scripts - env.KNOWN


def test_cpu_isa_values_are_the_kernels():
    source = (REPO / "optimizers" / "core" / "cpu_isa.cpp").read_text()
    parse = source[source.index("parseIsa("):]
    parse = parse[:parse.index("\n}")]
    assert tuple(re.findall(r'name == "(\w+)"', parse)) == report._environment.CPU_ISAS


# --- io_uring: why not -----------------------------------------------------------------------

@pytest.mark.parametrize("code, sysctl, seccomp, expected", [
    (errno.ENOSYS, None, "0", "ENOSYS: this kernel has no io_uring"),
    (errno.EPERM, "2", "0", "EPERM: the sysctl kernel.io_uring_disabled=2 turns io_uring off for every process"),
    (errno.EPERM, "1", "0", "kernel.io_uring_disabled=1 turns io_uring off for processes outside kernel.io_uring_group"),
    (errno.EPERM, None, "2", "EPERM: a seccomp filter (Seccomp: 2) denies io_uring_setup"),
    (errno.EACCES, "0", "2", "EACCES: a seccomp filter (Seccomp: 2) denies io_uring_setup"),
    (errno.EPERM, "2", "2", "kernel.io_uring_disabled=2 turns io_uring off for every process or a seccomp filter"),
    (errno.EPERM, "0", "0", "EPERM: neither kernel.io_uring_disabled nor seccomp is set"),
    (errno.ENOMEM, None, "0", "ENOMEM: the ring does not fit RLIMIT_MEMLOCK"),
])
def test_io_uring_reason_by_errno(monkeypatch, code, sysctl, seccomp, expected):
    def refused():
        raise OSError(code, f"zeroplus.aio: io_uring_setup failed: {os.strerror(code)} (errno {code})")

    files = {"/proc/sys/kernel/io_uring_disabled": sysctl, "/proc/self/status": f"Name:\tpython\nSeccomp:\t{seccomp}\n"}
    monkeypatch.setattr(report, "probe_io_uring", refused)
    monkeypatch.setattr(report, "_read", files.get)
    checks = []
    report._check_io_uring(checks)
    (check,) = checks
    assert check.status == "warn" and expected in check.detail, check
    assert check.detail.endswith("zeroplus.aio falls back to the pread/pwrite thread pool"), check
    if code == errno.ENOSYS:
        assert "seccomp" not in check.detail and "io_uring_disabled" not in check.detail, check


def test_io_uring_available(monkeypatch):
    monkeypatch.setattr(report, "probe_io_uring", lambda: None)
    checks = []
    report._check_io_uring(checks)
    assert [(c.name, c.status) for c in checks] == [("io_uring", "ok")]


# --- without torch ----------------------------------------------------------------------------

# Installed by a sitecustomize.py ahead of everything on sys.path: `import torch` fails as it
# does where torch is not installed.
_NO_TORCH = '''
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
'''


@pytest.fixture
def no_torch_env(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_NO_TORCH)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("how", ["module", "module-json", "console-script"])
def test_report_without_torch_is_one_fail_line(no_torch_env, how):
    cmd = {"module": [sys.executable, "-m", "zeroplus.report"],
           "module-json": [sys.executable, "-m", "zeroplus.report", "--json"],
           # what the zeroplus-report entry point runs
           "console-script": [sys.executable, "-c", "import sys; sys.argv[0] = 'zeroplus-report'; "
                                                  "from zeroplus.report import main; sys.exit(main())"]}[how]
    r = subprocess.run(cmd, env=no_torch_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    expected = f"torch is not installed: pip install '{report.TORCH_REQUIREMENT}'"
    if how == "module-json":
        assert _by_name(json.loads(r.stdout))["torch"] == {"name": "torch", "status": "FAIL", "detail": expected}
    else:
        assert f"[FAIL]  {expected}" in r.stdout, r.stdout
        assert "FAILED: torch" in r.stderr, r.stderr


def test_import_zeroplus_without_torch_still_fails_on_torch(no_torch_env):
    r = subprocess.run([sys.executable, "-c", "import zeroplus"], env=no_torch_env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "ModuleNotFoundError: No module named 'torch'" in r.stderr, r.stderr


def test_torch_requirement_is_pyprojects():
    assert f'dependencies = ["{report.TORCH_REQUIREMENT}"]' in (REPO / "pyproject.toml").read_text()
