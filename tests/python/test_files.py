"""zeroplus.files (issue 29): the Python door to common/core/exclusive_file.hpp. A planted symlink
or regular file is never followed, truncated or taken over; temporary names are unpredictable;
private directories are 0700 and verified; every bad argument raises naming it; errors are
OSError subclasses naming the path. Single process, no group."""

from __future__ import annotations

import errno
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


def test_open_directory_follows_only_links_of_this_user_or_root(tmp_path):
    """The rule docs/security.md states for a directory the user names (issue 40 item 9)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "inside").write_text("x")
    os.symlink(tmp_path / "real", tmp_path / "mine")
    os.symlink("mine", tmp_path / "chain")  # relative, and a link to a link
    for path in (tmp_path / "real", tmp_path / "mine", tmp_path / "chain", str(tmp_path / "chain") + "/"):
        fd = files.open_directory(path)
        assert os.listdir(fd) == ["inside"]
        os.close(fd)
    assert files.own_link_target(tmp_path / "chain") == str(tmp_path / "real")
    assert files.own_link_target(tmp_path / "absent") == str(tmp_path / "absent")
    with pytest.raises(NotADirectoryError):
        files.open_directory(tmp_path / "real" / "inside")
    with pytest.raises(TypeError, match="path"):
        files.open_directory(3)
    if os.geteuid() != 0:
        return  # giving a link to another user needs root
    os.lchown(tmp_path / "mine", 65534, 65534)
    for path in (tmp_path / "mine", tmp_path / "chain"):
        with pytest.raises(PermissionError, match="mine"):
            files.open_directory(path)


# -- descriptor-relative peers (what checkpoint/ and offload/ use) ---------------------------------

@pytest.fixture
def dir_fd(tmp_path):
    fd = files.open_directory_at(None, str(tmp_path), owned=True)
    yield fd
    os.close(fd)


def test_create_exclusive_at_refuses_every_existing_name(tmp_path, dir_fd):
    """O_EXCL: an existing file is neither opened nor truncated; O_NOFOLLOW|O_EXCL: a planted
    link (to a victim, or dangling) is neither followed nor used to create its target."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "link")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    for name in ("victim", "link", "dangling"):
        with pytest.raises(FileExistsError) as e:
            files.create_exclusive_at(dir_fd, name)
        assert e.value.filename == str(tmp_path / name)  # named by the directory's real path
    assert victim.read_text() == "precious" and not (tmp_path / "nowhere").exists()
    fd = files.create_exclusive_at(dir_fd, "new.bin")
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "new.bin").st_mode) == 0o600  # private by default
    fd, name = files.create_temporary_at(dir_fd, ".new.bin.tmp-")
    os.close(fd)
    assert name.startswith(".new.bin.tmp-") and len(name) == len(".new.bin.tmp-") + 16


def test_open_directory_at_never_follows_a_link(tmp_path, dir_fd):
    """O_NOFOLLOW on the last component: even a link of our own to our own directory."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "inside").write_text("x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    sub = files.open_directory_at(dir_fd, "real", owned=True)
    assert os.listdir(sub) == ["inside"]
    os.close(sub)
    for target in ("link", str(tmp_path / "link")):
        with pytest.raises(NotADirectoryError):
            files.open_directory_at(dir_fd, target)
    with pytest.raises(NotADirectoryError):
        files.open_directory_at(dir_fd, "real/inside")
    with pytest.raises(FileNotFoundError, match="missing"):
        files.open_directory_at(dir_fd, "missing")


def test_make_private_directory_at_is_exclusive_and_0700(tmp_path, dir_fd):
    old = os.umask(0o277)  # takes the owner's write bit: undone on the directory we create
    try:
        fd = files.make_private_directory_at(dir_fd, "staging")
    finally:
        os.umask(old)
    st = os.fstat(fd)
    os.close(fd)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    (tmp_path / "victim").mkdir()
    os.symlink(tmp_path / "victim", tmp_path / "link")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    for name in ("staging", "victim", "link", "dangling"):  # never an existing name, never a link's target
        with pytest.raises(FileExistsError):
            files.make_private_directory_at(dir_fd, name)
    assert not (tmp_path / "nowhere").exists()


def test_open_regular_at_refuses_links_fifos_and_directories(tmp_path, dir_fd):
    (tmp_path / "data").write_bytes(b"bytes")
    os.symlink(tmp_path / "data", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    fd = files.open_regular_at(dir_fd, "data", owned=True)
    assert os.pread(fd, 5, 0) == b"bytes"
    os.close(fd)
    with pytest.raises(OSError) as e:
        files.open_regular_at(dir_fd, "link")
    assert e.value.errno == errno.ELOOP and e.value.filename == str(tmp_path / "link")
    for name in ("fifo", "dir"):  # and the FIFO did not block the open
        with pytest.raises(OSError) as e:
            files.open_regular_at(dir_fd, name)
        assert e.value.errno == errno.EINVAL


def test_remove_tree_at_removes_ours_and_never_follows_links(tmp_path, dir_fd):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    tree = tmp_path / "tree"
    (tree / "sub" / "deeper").mkdir(parents=True)
    (tree / "a.bin").write_bytes(b"a")
    (tree / "sub" / "deeper" / "b.bin").write_bytes(b"b")
    os.symlink(victim, tree / "sub" / "dirlink")
    os.symlink(victim / "keep.txt", tree / "filelink")
    os.symlink(victim, tmp_path / "toplink")
    assert files.remove_tree_at(dir_fd, "toplink") is False  # a link named as the tree: left alone
    assert files.remove_tree_at(dir_fd, "tree") is True
    assert not tree.exists() and (tmp_path / "toplink").is_symlink()
    assert (victim / "keep.txt").read_text() == "mine"
    assert files.remove_tree_at(dir_fd, "tree") is True  # already gone


@pytest.mark.parametrize("call,exc,text", [
    (lambda d: files.create_exclusive_at("3", "a"), TypeError, "dir_fd"),
    (lambda d: files.create_exclusive_at(-1, "a"), ValueError, "dir_fd"),
    (lambda d: files.create_exclusive_at(True, "a"), TypeError, "dir_fd"),
    (lambda d: files.create_exclusive_at(d, "a/b"), ValueError, "name"),
    (lambda d: files.create_exclusive_at(d, "a", -1), ValueError, "mode"),
    (lambda d: files.create_temporary_at(d, "a/"), ValueError, "prefix"),
    (lambda d: files.make_private_directory_at(d, ".."), ValueError, "name"),
    (lambda d: files.open_regular_at(d, ""), ValueError, "name"),
    (lambda d: files.open_directory_at(d, ""), ValueError, "path"),
    (lambda d: files.remove_tree_at(d, "x/y"), ValueError, "name"),
    (lambda d: files.temporary_name(3), ValueError, "prefix"),
    (lambda d: files.lock("3"), TypeError, "dir_fd"),
    (lambda d: files.lock(-1), ValueError, "dir_fd"),
])
def test_descriptor_variants_reject_bad_arguments_naming_them(dir_fd, call, exc, text):
    with pytest.raises(exc, match=text):
        call(dir_fd)


def test_lock_is_held_per_open_and_dropped_at_close(dir_fd, tmp_path):
    """files.lock is a directory's liveness mark (issue 40): a second open of the same directory,
    even in this process, cannot take it while the first holds it; closing drops it."""
    first = files.open_directory_at(dir_fd, ".")
    second = files.open_directory_at(dir_fd, ".")
    try:
        assert files.lock(first) is True
        assert files.lock(second, wait=False) is False
        os.close(first)
        first = None
        assert files.lock(second, wait=False) is True
    finally:
        for fd in (first, second):
            if fd is not None:
                os.close(fd)
