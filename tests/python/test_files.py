"""zeroplus.files (issue 29): the Python door to common/core/exclusive_file.hpp. A planted symlink
or regular file is never followed, truncated or taken over; temporary names are unpredictable;
private directories are 0700 and verified; every bad argument raises naming it; errors are
OSError subclasses naming the path. Single process, no group."""

from __future__ import annotations

import os
import stat

import pytest

import zeroplus
from zeroplus import files


def test_create_exclusive_makes_a_new_file_and_refuses_existing_names(tmp_path):
    fd = files.create_exclusive(tmp_path, "ckpt.bin", 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(b"data")
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt.bin").st_mode) == 0o600
    with pytest.raises(FileExistsError, match="ckpt.bin"):
        files.create_exclusive(tmp_path, "ckpt.bin")
    assert (tmp_path / "ckpt.bin").read_bytes() == b"data"


def test_planted_links_are_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "link")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    for name in ("link", "dangling"):
        with pytest.raises(FileExistsError) as e:
            files.create_exclusive(tmp_path, name)
        assert e.value.filename == str(tmp_path / name)
    assert victim.read_text() == "precious" and not (tmp_path / "nowhere").exists()
    with pytest.raises(NotADirectoryError):
        files.private_directory(tmp_path, "link")


def test_temporary_names_are_unique_and_random(tmp_path):
    names = set()
    for _ in range(20):
        fd, name = files.create_temporary(tmp_path, ".x.tmp-")
        os.close(fd)
        assert name.startswith(".x.tmp-") and len(name) == len(".x.tmp-") + 16
        names.add(name)
    assert len(names) == 20


def test_private_directory_is_0700_and_verified(tmp_path):
    fd = files.private_directory(tmp_path, "swap")
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o700
        os.close(files.create_exclusive(f"/proc/self/fd/{fd}", "rank0.swp"))
    finally:
        os.close(fd)
    os.close(files.private_directory(tmp_path, "swap"))  # an existing private one is reused
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(PermissionError, match="open"):
        files.private_directory(tmp_path, "open")


@pytest.mark.parametrize("call,exc,text", [
    (lambda d: files.create_exclusive(d, "a/b"), ValueError, "name"),
    (lambda d: files.create_exclusive(d, ".."), ValueError, "name"),
    (lambda d: files.create_exclusive(3, "a"), TypeError, "directory"),
    (lambda d: files.create_exclusive(d, "a", 0o10000), ValueError, "mode"),
    (lambda d: files.create_exclusive(d, "a", "644"), TypeError, "mode"),
    (lambda d: files.create_temporary(d, "a/"), ValueError, "prefix"),
    (lambda d: files.private_directory("", "a"), ValueError, "parent"),
    (lambda d: files.create_exclusive(d / "missing", "a"), FileNotFoundError, "missing"),
])
def test_bad_arguments_raise_naming_them(tmp_path, call, exc, text):
    with pytest.raises(exc, match=text):
        call(tmp_path)


def test_exported_from_the_package():
    assert zeroplus.files is files
