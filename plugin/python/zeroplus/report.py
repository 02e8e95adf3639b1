"""``python -m zeroplus.report``: what zeroplus finds on this machine (like DeepSpeed's ds_report).

    python -m zeroplus.report [--dir /nvme/offload] [--json]

Prints one line per check with a status (``ok``, ``warn``: works with a fallback, ``FAIL``:
something zeroplus needs is missing) and exits 1 when any check failed, 0 otherwise:

* torch itself (a FAIL saying how to install it when it is missing; nothing else is checked);
* zeroplus, the library file and the torch it was built for (read from the file before it is
  loaded), against the running torch version and C++ ABI;
* the CPU instruction set the fused optimizer kernels picked (``ZEROPLUS_CPU_ISA`` caps it; a
  value the kernels do not accept is a FAIL, since they silently ignore it);
* io_uring: available, or why not, by io_uring_setup's errno: ENOSYS (a kernel without it),
  EPERM/EACCES (``kernel.io_uring_disabled``, a seccomp filter); zeroplus.aio then falls back to
  a pread/pwrite thread pool;
* O_DIRECT support of ``--dir`` (default: the temporary directory), the NVMe offload target;
* /dev/shm size and free space, and whether the shared-memory transport will be used;
* CUDA and NCCL presence (torch's and this build's);
* every ``ZEROPLUS_*`` environment variable in effect, checked by the backend's own parser; a
  name zeroplus does not know (a typo, silently ignored otherwise) is a FAIL suggesting the
  closest known one (``_environment.py``).

The report loads the library itself (``import zeroplus`` is skipped for ``-m zeroplus.report``),
so it also runs, and says why, when the library is missing or was built for another torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import mmap
import os
import platform
import sys
import tempfile

from . import __version__
from . import _environment
from . import _library

# pyproject.toml's dependency (a test keeps them equal).
TORCH_REQUIREMENT = "torch>=2.11,<2.16"

# Imported here rather than by the package (see __init__.py): without torch the report still
# runs, and says so in one FAIL line instead of a traceback.
try:
    import torch
except (ImportError, OSError) as _error:  # OSError: a torch whose shared libraries do not load
    torch = None
    if isinstance(_error, ModuleNotFoundError) and _error.name == "torch":
        _TORCH_PROBLEM = f"torch is not installed: pip install '{TORCH_REQUIREMENT}'"
    else:
        _TORCH_PROBLEM = f"torch is installed but does not import: {type(_error).__name__}: {_error}"


@dataclasses.dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "FAIL" | "info"
    detail: str


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _check_library(checks: list[Check]) -> bool:
    """Library, build stamp, version guard, load. True when the library is loaded."""
    checks.append(Check("zeroplus", "info", f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})"))
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    checks.append(Check("torch", "info", f"{torch.__version__} ({os.path.dirname(torch.__file__)}), C++11 ABI {abi}"))
    try:
        path = _library.library_path()
    except FileNotFoundError as e:
        checks.append(Check("library", "FAIL", str(e).replace("\n", " ")))
        return False
    stamp = _library.read_build_stamp(path)
    if "torch" not in stamp:
        checks.append(Check("library", "FAIL", f"{path} carries no zeroplus build stamp; rebuild it"))
        return False
    checks.append(Check("library", "ok", path))
    built = f"torch {stamp['torch']}, C++11 ABI {stamp.get('cxx11_abi', '?')}, CUDA {stamp.get('cuda', '?')}"
    mismatch = _library.torch_mismatch(stamp["torch"], torch.__version__)
    if mismatch:
        checks.append(Check("built for", "FAIL", mismatch))
        return False
    if stamp.get("cxx11_abi") not in (None, str(abi)):
        checks.append(Check("built for", "FAIL", f"{built}: C++11 ABI differs from the running torch's ({abi})"))
        return False
    checks.append(Check("built for", "ok", built))
    try:
        _library.load_library()
    except Exception as e:  # noqa: BLE001 (the report names any load failure)
        checks.append(Check("load", "FAIL", f"{type(e).__name__}: {e}"))
        return False
    registered = "zeroplus" in torch.distributed.Backend.backend_list if torch.distributed.is_available() else False
    checks.append(Check("load", "ok" if registered else "FAIL",
                        "loaded; backend 'zeroplus' registered" if registered else "loaded, but torch.distributed "
                        "is unavailable or the backend did not register"))
    return True


def _check_isa(checks: list[Check]) -> None:
    capped = os.environ.get("ZEROPLUS_CPU_ISA")
    picked = torch.ops.zeroplus.cpu_isa()
    problem = _environment.cpu_isa_problem(capped)
    if problem:
        checks.append(Check("CPU ISA", "FAIL", f"{picked} ({problem}; {platform.machine()})"))
        return
    note = f"ZEROPLUS_CPU_ISA={capped}" if capped else "best the CPU supports"
    checks.append(Check("CPU ISA", "ok", f"{picked} ({note}; {platform.machine()})"))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def probe_io_uring() -> None:
    """Creates an io_uring engine; raises OSError with io_uring_setup's errno when refused."""
    from .aio import AioHandle

    AioHandle(engine="io_uring")


def io_uring_reason(error: BaseException) -> str:
    """Why io_uring_setup failed, from its errno and the kernel settings that produce it."""
    code = getattr(error, "errno", None)
    kernel = f"kernel {platform.release()}"
    if code == errno.ENOSYS:
        return f"ENOSYS: this kernel has no io_uring (older than 5.1, or built without CONFIG_IO_URING; {kernel})"
    if code in (errno.EPERM, errno.EACCES):
        # Both refusals look alike from user space; name each setting that can cause them.
        causes = []
        disabled = _read("/proc/sys/kernel/io_uring_disabled")  # Linux 6.6+
        if disabled not in (None, "0"):
            who = {"1": "for processes outside kernel.io_uring_group without CAP_SYS_ADMIN",
                   "2": "for every process"}.get(disabled, "")
            causes.append(f"the sysctl kernel.io_uring_disabled={disabled} turns io_uring off {who}".rstrip())
        status = _read("/proc/self/status") or ""
        seccomp = next((line.split(":", 1)[1].strip() for line in status.splitlines()
                        if line.startswith("Seccomp:")), None)
        if seccomp not in (None, "0"):
            causes.append(f"a seccomp filter (Seccomp: {seccomp}) denies io_uring_setup, as container "
                          "runtimes' default profiles do")
        if not causes:
            causes.append("neither kernel.io_uring_disabled nor seccomp is set, so a security module "
                          "(SELinux, AppArmor) refused it")
        return f"{errno.errorcode[code]}: {' or '.join(causes)} ({kernel})"
    if code == errno.ENOMEM:
        return f"ENOMEM: the ring does not fit RLIMIT_MEMLOCK (kernels before 5.12 charge it there: ulimit -l; {kernel})"
    return f"{str(error).splitlines()[0] if str(error) else type(error).__name__} ({kernel})"


def _check_io_uring(checks: list[Check]) -> None:
    try:
        probe_io_uring()
    except Exception as e:  # noqa: BLE001 (any refusal is reported, with the reason)
        checks.append(Check("io_uring", "warn", f"unavailable: {io_uring_reason(e)}; "
                                                "zeroplus.aio falls back to the pread/pwrite thread pool"))
        return
    checks.append(Check("io_uring", "ok", f"available (kernel {platform.release()})"))


def probe_o_direct(directory: str) -> tuple[bool, str]:
    """Writes one 4 KiB block with O_DIRECT to a temporary file in ``directory``."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, "no such directory", directory)
    fd, path = tempfile.mkstemp(prefix=".zeroplus-odirect-", dir=directory)
    os.close(fd)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
        except OSError as e:
            return False, f"open(O_DIRECT) failed: {os.strerror(e.errno)} (filesystem without direct I/O, e.g. tmpfs)"
        try:
            with mmap.mmap(-1, 4096) as block:  # page aligned, as O_DIRECT requires
                os.write(fd, block)
        except OSError as e:
            return False, f"aligned O_DIRECT write failed: {os.strerror(e.errno)}"
        finally:
            os.close(fd)
        return True, "aligned 4 KiB O_DIRECT write works"
    finally:
        os.unlink(path)


def _check_o_direct(checks: list[Check], directory: str, explicit: bool) -> None:
    try:
        ok, detail = probe_o_direct(directory)
    except OSError as e:
        checks.append(Check(f"O_DIRECT {directory}", "FAIL" if explicit else "warn",
                            f"cannot test: {e.strerror or e} ({directory})"))
        return
    checks.append(Check(f"O_DIRECT {directory}", "ok" if ok else "warn",
                        detail if ok else f"{detail}; zeroplus.aio direct='auto' uses buffered I/O there"))


def _backend_config() -> dict[str, str]:
    return dict(item.split("=", 1) for item in torch.ops.zeroplus.backend_config())


def shm_check(mode: str, chunk: int, size: int, free: int) -> Check:
    """The /dev/shm verdict for ZEROPLUS_SHM=``mode`` and ``chunk`` bytes per pipeline stage,
    given /dev/shm's ``size`` and ``free`` bytes (a pure function, for tests)."""
    segment = 4096 + 4 * chunk  # process_group/core/shm_communicator.cpp, segmentBytes()
    fits = free // segment
    line = f"{_gib(size)}, {_gib(free)} free; a rank's segment is {_gib(segment)} (shm_chunk_bytes={chunk})"
    if mode == "off":
        return Check("/dev/shm", "info", f"{line}; shm transport off (ZEROPLUS_SHM=off): TCP only")
    if fits < 2:
        status = "FAIL" if mode == "on" else "warn"
        return Check("/dev/shm", status, f"{line}; too small for 2 ranks: the shm transport will not be used")
    return Check("/dev/shm", "ok", f"{line}; shm transport used ({mode}) by same-host groups of up to {fits} ranks")


def _check_shm(checks: list[Check], config: dict[str, str] | None) -> None:
    mode = (config or {}).get("shm", "auto")
    chunk = int((config or {}).get("shm_chunk_bytes", 1 << 20))
    try:
        st = os.statvfs("/dev/shm")
    except OSError as e:
        status = "FAIL" if mode == "on" else "warn"
        checks.append(Check("/dev/shm", status, f"unusable ({e.strerror}); ZEROPLUS_SHM={mode}: "
                                                "same-host groups use TCP loopback"))
        return
    checks.append(shm_check(mode, chunk, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize))


def _check_cuda(checks: list[Check], stamp: dict[str, str]) -> None:
    cuda = torch.cuda.is_available()
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    built = stamp.get("cuda") == "1"
    detail = (f"torch CUDA {torch.version.cuda or 'none'}, {torch.cuda.device_count() if cuda else 0} device(s); "
              f"NCCL {'yes' if nccl else 'no'}; zeroplus CUDA kernels/NCCL transport "
              f"{'built' if built else 'not built (CPU build)'}")
    checks.append(Check("CUDA", "warn" if built and not cuda else "info", detail))


def _check_environment(checks: list[Check], loaded: bool) -> dict[str, str] | None:
    variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith("ZEROPLUS_")}
    shown = ", ".join(f"{k}={v}" for k, v in variables.items()) or "none set (defaults)"
    # Checked without the library too: names and the CPU ISA need no parser of its.
    problems = _environment.unknown_variable_problems(variables)
    isa = _environment.cpu_isa_problem(variables.get("ZEROPLUS_CPU_ISA"))
    problems += [isa] if isa else []
    config = None
    if loaded:
        try:
            config = _backend_config()
        except ValueError as e:
            problems.append(str(e).splitlines()[0])
    if problems:
        checks.append(Check("ZEROPLUS_*", "FAIL", f"{shown}: {'; '.join(problems)}"))
    else:
        checks.append(Check("ZEROPLUS_*", "ok" if loaded else "info", shown))
    if config is not None:
        checks.append(Check("backend config", "info", " ".join(f"{k}={v}" for k, v in config.items())))
    return config


def collect(directory: str | None = None) -> list[Check]:
    """Runs every check; ``directory`` is the O_DIRECT probe target (default: the temp dir)."""
    checks: list[Check] = []
    if torch is None:
        # Every other check needs torch (the library is a torch extension).
        checks.append(Check("zeroplus", "info", f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})"))
        checks.append(Check("torch", "FAIL", _TORCH_PROBLEM))
        return checks
    loaded = _check_library(checks)
    stamp = {}
    try:
        stamp = _library.read_build_stamp(_library.library_path())
    except OSError:
        pass
    if loaded:
        _check_isa(checks)
        _check_io_uring(checks)
    _check_o_direct(checks, directory or tempfile.gettempdir(), explicit=directory is not None)
    config = _check_environment(checks, loaded)
    _check_shm(checks, config)
    _check_cuda(checks, stamp)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroplus.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="directory whose O_DIRECT support to test (the NVMe offload path)")
    parser.add_argument("--json", action="store_true", help="print the checks as a JSON list")
    args = parser.parse_args(argv)
    checks = collect(args.dir)
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=1))
    else:
        width = max(len(c.name) for c in checks)
        print("zeroplus report")
        for c in checks:
            print(f"  {c.name:<{width}}  [{c.status:^4}]  {c.detail}")
    failed = [c.name for c in checks if c.status == "FAIL"]
    if failed and not args.json:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
