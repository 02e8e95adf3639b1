"""Fuzz target (atheris) for the checkpoint manifest and shard-block parsing of zeroplus.checkpoint.

An input is a manifest (JSON bytes), optionally followed by SEPARATOR and the bytes of a shard
file. check_one(data) runs everything a load, `inspect` and `consolidate` do with them:
  1. format.parse_manifest (every field the reader trusts) and format.decode_value of every
     param-group hyperparameter and optimizer scalar (load_checkpoint decodes those);
  2. when the manifest parses: the manifest and, under every file name it lists, the shard bytes
     (cut or zero-padded to the size the manifest declares, up to 1 MiB; larger declared sizes
     keep the bytes as they are) are written to a scratch directory, which CheckpointReader opens;
     every file is verified block by block against its CRC-32 list (inspect) and every tensor is
     read whole (consolidate's iter_tensors: chunk lookup, range assembly, dtype checks).
The validator under parse_manifest is C++ (manifest.cpp, through zeroplus::check_manifest), which
atheris does not instrument: tests/fuzz/manifest_parse_fuzz.cpp fuzzes it with coverage; this
target checks what Python does with what it accepted.
The contract it asserts: each step returns a validated result or raises CheckpointError (or a
subclass: CheckpointCorruptError, CheckpointVersionError), the documented error of every parser
of checkpoint bytes; any other exception is a crash (atheris reports it with the input). Hangs
are caught by libFuzzer's -timeout.

    scripts/fuzz.sh checkpoint_manifest_fuzz          # as CI runs it (atheris installed there)
    python tests/fuzz/checkpoint_manifest_fuzz.py -runs=0 tests/fuzz/corpus/checkpoint_manifest_fuzz

Seeds (tests/fuzz/corpus/checkpoint_manifest_fuzz/): a real checkpoint's manifest and shard
(tests/fuzz/make_checkpoint_seeds.py) and the regression inputs of bugs this target found;
tests/python/test_checkpoint_fuzz_corpus.py replays them in the ordinary test suite.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import os
import pathlib
import shutil
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugin" / "python"))

import zeroplus  # noqa: E402,F401  (loads the library: zeroplus.files opens the scratch files)
from zeroplus.checkpoint import format as fmt, fsutil, reader  # noqa: E402
# The package's `consolidate` is the function of that name: the module comes from sys.modules.
consolidate_module = importlib.import_module("zeroplus.checkpoint.consolidate")  # noqa: E402
iter_tensors = consolidate_module.iter_tensors

SEPARATOR = b"\n--zeroplus-shard--\n"
_MAX_FILE = 1 << 20  # bytes written per shard file at most
_MAX_FILES = 4  # shard files written at most (the manifest may list more: the rest are missing)
_scratch = None
_artifacts = None  # main(): where libFuzzer writes crashing inputs (-artifact_prefix)


def _scratch_dir() -> str:
    global _scratch
    if _scratch is None:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        _scratch = tempfile.mkdtemp(prefix="zeroplus-fuzz-", dir=base)
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


def _write(directory: str, name: str, data: bytes) -> None:
    path = os.path.join(directory, name)
    if os.path.lexists(path):
        os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)


def _decode_all(m: dict) -> None:
    for g in m["param_groups"]:
        for k, v in g.items():
            if k != "params":
                fmt.decode_value(v)
    for t in m["tensors"].values():
        for v in t.get("scalars", {}).values():
            fmt.decode_value(v)


def write_checkpoint(m: dict, manifest: bytes, shard: bytes) -> str:
    """The scratch directory, holding the manifest and the shard files it lists (see the module doc)."""
    d = _scratch_dir()
    for n in os.listdir(d):
        os.unlink(os.path.join(d, n))
    _write(d, fmt.MANIFEST, manifest)
    for f in m["files"][:_MAX_FILES]:
        size = f["bytes"]
        data = shard if size > _MAX_FILE else (shard[:size] + bytes(max(0, size - len(shard))))
        _write(d, f["name"], data)
    return d


def consolidate_path(d: str, m: dict) -> None:
    """What `consolidate` reads: every tensor whole (no file verified first)."""
    with reader.CheckpointReader(d) as r:
        for _name, _value in iter_tensors(r):
            pass


def inspect_path(d: str, m: dict) -> None:
    """What `inspect` reads: every file, block by block, against its checksums."""
    with reader.CheckpointReader(d) as r:
        for fi in range(len(m["files"])):
            r.verify_file(fi)


def parse(manifest: bytes) -> dict:
    """What load_checkpoint does with the manifest before reading shards."""
    m = fmt.parse_manifest(manifest, "fuzz/manifest.json")
    _decode_all(m)
    return m


def check_one(data: bytes) -> None:
    """One input (see the module doc); raises only for a bug (an exception other than CheckpointError)."""
    manifest, _sep, shard = data.partition(SEPARATOR)
    try:
        try:
            m = parse(manifest)
        except fmt.CheckpointError:
            return
        d = write_checkpoint(m, manifest, shard)
        for step in (consolidate_path, inspect_path):  # separately: each is a reader of its own
            try:
                step(d, m)
            except fmt.CheckpointError:
                pass
    except Exception as e:  # the bug this target looks for: reported compactly, with where it came from
        text = str(e).split("\nException raised from", 1)[0][:2000]  # not torch's pages of C++ frames
        where = "".join(traceback.format_tb(e.__traceback__)[-6:])
        report = f"{type(e).__name__} escaped the checkpoint parsers: {text}\n{where}"
        if _artifacts is None:  # replayed by pytest
            raise AssertionError(report) from None
        # Fuzzing: save the input and leave at once. atheris's own route for an uncaught exception
        # (exit, then libFuzzer's exit hook writes the input) twice hung in the interpreter's
        # shutdown after many runs until the -timeout alarm killed it, and no input was written.
        path = f"{_artifacts}crash-{hashlib.sha1(data).hexdigest()}"
        with open(path, "wb") as f:
            f.write(data)
        sys.stderr.write(f"\n=== {report}\n==ERROR: checkpoint_manifest_fuzz: crashing input written to {path}\n")
        sys.stderr.flush()
        os._exit(1)


def main() -> None:
    import atheris

    # Coverage of the checkpoint parsers only (instrumenting torch would make every run slow).
    for module in (fmt, reader, consolidate_module, fsutil):
        for obj in list(vars(module).values()):
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if isinstance(obj, type):
                for attr in vars(obj).values():
                    if hasattr(attr, "__code__"):
                        atheris.instrument_func(attr)
            elif hasattr(obj, "__code__"):
                atheris.instrument_func(obj)
    global _artifacts
    argv = sys.argv
    _artifacts = next((a.split("=", 1)[1] for a in argv if a.startswith("-artifact_prefix=")), "./")
    deadline = os.environ.get("ZEROPLUS_FUZZ_DEADLINE")  # scripts/fuzz.sh: the end of this target's slot
    if deadline:  # the time torch took to import comes out of the fuzzing, not on top of the slot
        left = max(1, int(float(deadline) - time.time()))
        argv = [a for a in argv if not a.startswith("-max_total_time=")] + [f"-max_total_time={left}"]
    atheris.Setup(argv, check_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
