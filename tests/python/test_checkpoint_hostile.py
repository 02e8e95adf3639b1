"""Checkpoints against a hostile or unlucky disk, single process (issue 40; the cases that need a
process group are in test_checkpoint_errors.py and test_checkpoint_async.py).

The checkpoints here are written by hand (a float32 tensor "w" cut into one chunk per shard file,
a version-1 manifest: the format before the manifest checksum, which every zeroplus reads), so each
test runs in milliseconds and also against the code before its fix:
  * one flipped bit anywhere in a checksummed manifest is refused by the parser (item 3);
  * a manifest over 16 MiB still marks its directory as a checkpoint a save may replace (6);
  * more shard files than the descriptors left (RLIMIT_NOFILE) read, inspect and consolidate
    (7); a checkpoint replaced under an open reader is read whole, or named as replaced (11);
  * a 2**40-byte checksum block is refused when parsed and when configured, and inspect of a
    sparse shard holds at most one 64 MiB block of it (8); version <= 0 (19);
  * the stale-temporary sweep removes only what zeroplus leaves (13), and a staging directory is
    locked before a sweep can see it (10);
  * rank > 0's check of the committed manifest never follows a link or blocks on a FIFO (14);
  * safetensors output refuses the key `__metadata__`, the parser an alias that is a tensor (17);
  * missing parents of ROOT are 0700 under umask 000 (18);
  * a ROOT, checkpoint or output directory that is the user's own link is followed, another
    user's is refused (9);
  * AioStorageReader refuses a `.metadata` pickle that would run code and a `relative_path`
    leaving the directory (5).
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import stat
import threading
import time
import zlib

import pytest
import torch

from zeroplus.checkpoint import format as fmt
from zeroplus.checkpoint.consolidate import consolidate, inspect
from zeroplus.checkpoint.reader import CheckpointReader

BLOCK = 64


def _write_checkpoint(d, files: int, per_file: int = 40, block: int = BLOCK, seed: int = 0, extra=None,
                      tensor: str = "w") -> torch.Tensor:
    """A version-1 checkpoint of one float32 tensor `tensor` of files * per_file elements, one
    chunk per shard file; returns the tensor."""
    os.makedirs(d, exist_ok=True)
    value = torch.arange(files * per_file, dtype=torch.float32) + seed
    records, chunks = [], []
    for fi in range(files):
        data = value[fi * per_file:(fi + 1) * per_file].numpy().tobytes()
        with open(os.path.join(d, fmt.shard_file_name(fi)), "wb") as f:
            f.write(data)
        records.append({"name": fmt.shard_file_name(fi), "bytes": len(data),
                        "block_crc32": [zlib.crc32(data[a:a + block]) for a in range(0, len(data), block)]})
        chunks.append([tensor, "param", fi * per_file, (fi + 1) * per_file, "float32", fi, 0])
    manifest = {"format": fmt.FORMAT, "version": 1, "source": {"stage": 1, "world_size": files},
                "block_bytes": block, "files": records,
                "tensors": {tensor: {"shape": [files * per_file], "dtype": "float32", "kind": "param"}},
                "aliases": {}, "chunks": chunks, "param_groups": [{"params": [tensor]}], "optimizer": {},
                "extra": extra}
    with open(os.path.join(d, fmt.MANIFEST), "wb") as f:
        f.write(fmt.dumps(manifest))
    return value


# -- item 3: the manifest's own checksum --------------------------------------------------------


def test_every_single_bit_flip_of_a_checksummed_manifest_is_refused(tmp_path):
    d = tmp_path / "ck"
    _write_checkpoint(d, 2)
    m = json.loads((d / fmt.MANIFEST).read_bytes())
    m["version"] = fmt.VERSION
    data = fmt.encode_manifest(m)
    fmt.parse_manifest(data, "manifest.json")  # the sealed original parses
    accepted = []
    for i in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            try:
                fmt.parse_manifest(bytes(flipped), "manifest.json")
                accepted.append((i, bit))
            except fmt.CheckpointError as e:
                assert "manifest.json" in str(e)
    assert accepted == [], f"{len(accepted)} one-bit flips parsed, e.g. byte {accepted[:3]}"


def test_a_version1_manifest_without_checksum_still_reads_and_a_claimed_one_must_match(tmp_path):
    value = _write_checkpoint(tmp_path / "old", 2)
    with CheckpointReader(tmp_path / "old") as r:  # written before the checksum existed
        assert torch.equal(r.read_many([("w", "param", 0, 80)])[0], value)
    data = bytearray(fmt.encode_manifest(json.loads((tmp_path / "old" / fmt.MANIFEST).read_bytes())))
    data[data.index(b'"param",40,80,"float32",1,') + len(b'"param",40,')] ^= 1  # 40 -> 50: still in range
    (tmp_path / "old" / fmt.MANIFEST).write_bytes(bytes(data))
    for read in (lambda p: CheckpointReader(p).close(), inspect, lambda p: consolidate(p, tmp_path / "out.pt")):
        with pytest.raises(fmt.CheckpointCorruptError, match="checksum mismatch in the manifest") as e:
            read(tmp_path / "old")
        assert e.value.filename.endswith("manifest.json")
    assert not (tmp_path / "out.pt").exists()


# -- items 8, 19: fields bounded when parsed ------------------------------------------------------


def _v1(tmp_path, **changes) -> bytes:
    _write_checkpoint(tmp_path / "ck", 1)
    m = json.loads((tmp_path / "ck" / fmt.MANIFEST).read_bytes())
    m.update(changes)
    return fmt.dumps(m)


def test_huge_checksum_block_is_refused_when_parsed_and_when_configured(tmp_path):
    from zeroplus.checkpoint import CheckpointOptions

    with pytest.raises(fmt.CheckpointError, match="block_bytes"):
        fmt.parse_manifest(_v1(tmp_path, block_bytes=1 << 40, files=[
            {"name": "rank00000.bin", "bytes": 160, "block_crc32": [0]}]), "manifest.json")
    with pytest.raises(ValueError, match="block_bytes"):
        CheckpointOptions(block_bytes=1 << 40)


def test_verifying_a_sparse_shard_holds_at_most_one_bound_of_it_in_memory(tmp_path):
    """inspect reads runs of blocks into one buffer: with the largest block a manifest may
    declare, a sparse shard (nothing on disk) must not cost its apparent size in memory."""
    block = fmt.MAX_BLOCK_BYTES
    d = tmp_path / "ck"
    _write_checkpoint(d, 1)
    with open(d / "rank00000.bin", "wb") as f:
        f.truncate(2 * block)  # 128 MiB apparent, no data blocks
    m = json.loads((d / fmt.MANIFEST).read_bytes())
    zeros = zlib.crc32(bytes(block))
    m.update(block_bytes=block, files=[{"name": "rank00000.bin", "bytes": 2 * block, "block_crc32": [zeros, zeros]}])
    (d / fmt.MANIFEST).write_bytes(fmt.dumps(m))
    with CheckpointReader(d) as reader:
        reader.verify_file(0)
        assert len(reader._bounce) <= block, f"verify_file held {len(reader._bounce) >> 20} MiB at once"


@pytest.mark.parametrize("version", [0, -1])
def test_version_below_one_is_refused(tmp_path, version):
    with pytest.raises(fmt.CheckpointError, match="version"):
        fmt.parse_manifest(_v1(tmp_path, version=version), "manifest.json")


# -- item 17: keys safetensors or a state dict cannot hold ----------------------------------------


def test_alias_naming_a_tensor_is_refused(tmp_path):
    with pytest.raises(fmt.CheckpointError, match="alias 'w'"):
        fmt.parse_manifest(_v1(tmp_path, aliases={"w": "w"}), "manifest.json")


def test_safetensors_refuses_a_tensor_named_metadata_and_writes_nothing(tmp_path):
    _write_checkpoint(tmp_path / "ck", 1, tensor="__metadata__")
    with pytest.raises(ValueError, match="__metadata__"):
        consolidate(tmp_path / "ck", tmp_path / "out.safetensors", "safetensors")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# -- item 6: a large manifest is still a checkpoint -----------------------------------------------


def test_a_manifest_over_16_mib_marks_a_checkpoint(tmp_path):
    from zeroplus import files
    from zeroplus.checkpoint import commit

    _write_checkpoint(tmp_path / "ck", 1, extra={"notes": "x" * (17 << 20)})
    fd = files.open_directory_at(None, str(tmp_path))
    try:
        assert commit.is_checkpoint(fd, "ck")
    finally:
        os.close(fd)


# -- items 7, 11: many shard files, and a checkpoint replaced under its reader ---------------------


def _limit_descriptors(spare: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + spare, hard))
    return soft, hard


def test_more_shard_files_than_descriptors_inspect_and_consolidate(tmp_path):
    value = _write_checkpoint(tmp_path / "ck", 120, per_file=4)
    limits = _limit_descriptors(40)
    try:
        summary = inspect(tmp_path / "ck")
        info = consolidate(tmp_path / "ck", tmp_path / "out.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert summary["ok"], [f["checksums"] for f in summary["files"] if f["checksums"] != "ok"][:3]
    assert info["tensors"] == 1
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], value)


def _replace(path, files: int, per_file: int):
    """What a save replacing `path` does to a reader: the old directory moves away and is emptied,
    a new checkpoint takes its name."""
    old = str(path) + ".old"
    os.rename(path, old)
    for n in os.listdir(old):
        os.unlink(os.path.join(old, n))
    os.rmdir(old)
    _write_checkpoint(path, files, per_file=per_file, seed=1000)


def test_a_checkpoint_replaced_under_its_reader_reads_whole_or_says_replaced(tmp_path):
    value = _write_checkpoint(tmp_path / "ck", 3)
    with CheckpointReader(tmp_path / "ck") as reader:
        _replace(tmp_path / "ck", 3, 40)
        assert torch.equal(reader.read_many([("w", "param", 0, 120)])[0], value)  # the one it opened
    _write_checkpoint(tmp_path / "many", 120, per_file=4)
    limits = _limit_descriptors(40)
    try:
        with CheckpointReader(tmp_path / "many") as reader:
            _replace(tmp_path / "many", 120, 4)
            with pytest.raises(fmt.CheckpointError, match="replaced"):
                reader.read_many([("w", "param", 0, 480)])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


# -- items 10, 13: the stale-temporary sweep -------------------------------------------------------


def test_sweep_removes_only_latest_temporaries_of_a_killed_save(tmp_path):
    from zeroplus import files
    from zeroplus.checkpoint import fsutil

    old = time.time() - 2 * fsutil.STALE_TEMP_FILE_S
    names = {".latest.tmp-0123456789abcdef": True, ".model.pt.tmp-0123456789abcdef": False,
             ".notes.txt.tmp-fedcba9876543210": False}
    for n in names:
        (tmp_path / n).write_bytes(b"x")
        os.utime(tmp_path / n, (old, old))
    fd = files.open_directory_at(None, str(tmp_path))
    try:
        fsutil.remove_stale_temp_dirs(fd, keep="")
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, removed in names.items() if not removed)


def test_a_new_staging_directory_is_locked_before_another_job_can_sweep_it(tmp_path, monkeypatch):
    """Another job's save into the same ROOT sweeps at the worst moment: right before this save
    locks its staging directory."""
    from zeroplus import files
    from zeroplus.checkpoint import fsutil, save

    real_lock = fsutil.lock

    def sweep_then_lock(fd, wait=True):
        other = files.open_directory_at(None, str(tmp_path))
        try:
            fsutil.remove_stale_temp_dirs(other, keep="")
        finally:
            os.close(other)
        return real_lock(fd, wait)
    monkeypatch.setattr(fsutil, "lock", sweep_then_lock)
    staging, lock_fd = save._prepare(str(tmp_path), "ck")
    try:
        assert os.path.isdir(tmp_path / staging), "the other job's sweep removed this save's staging directory"
        assert os.fstat(lock_fd).st_ino == os.stat(tmp_path / staging).st_ino
    finally:
        os.close(lock_fd)


# -- item 14: rank > 0 reads the committed manifest through zeroplus.files ---------------------------


def test_committed_manifest_check_never_follows_a_link_or_blocks_on_a_fifo(tmp_path):
    from zeroplus.checkpoint import commit

    (tmp_path / "elsewhere.json").write_text(json.dumps({"save_id": ".ck.tmp-0123456789abcdef"}))
    os.makedirs(tmp_path / "ck")
    os.symlink(tmp_path / "elsewhere.json", tmp_path / "ck" / fmt.MANIFEST)
    assert commit._save_id(str(tmp_path / "ck")) is None
    os.unlink(tmp_path / "ck" / fmt.MANIFEST)
    os.mkfifo(tmp_path / "ck" / fmt.MANIFEST)
    result = []
    t = threading.Thread(target=lambda: result.append(commit._save_id(str(tmp_path / "ck"))), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the reader (open of a FIFO waits for a writer)
        os.close(os.open(tmp_path / "ck" / fmt.MANIFEST, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("reading the manifest blocked on a FIFO")
    assert result == [None]


# -- item 18: ROOT's missing parents ----------------------------------------------------------------


def test_missing_parents_of_root_are_private_under_umask_000(tmp_path):
    from zeroplus.checkpoint import save

    old = os.umask(0)
    try:
        staging, lock_fd = save._prepare(str(tmp_path / "a" / "b" / "root"), "ck")
        os.close(lock_fd)
    finally:
        os.umask(old)
    modes = {p: oct(stat.S_IMODE(os.stat(tmp_path / p).st_mode)) for p in ("a", "a/b", "a/b/root")}
    assert modes == {p: "0o700" for p in modes}


# -- item 9: the user's own links are followed, another user's are not ------------------------------


def test_own_links_are_followed_and_another_users_refused(tmp_path):
    from zeroplus.checkpoint import save

    value = _write_checkpoint(tmp_path / "real" / "ck", 2)
    os.symlink(tmp_path / "real", tmp_path / "root_link")       # ROOT as a link
    os.symlink(tmp_path / "real" / "ck", tmp_path / "ck_link")  # the checkpoint as a link
    os.makedirs(tmp_path / "outdir")
    os.symlink(tmp_path / "outdir", tmp_path / "out_link")      # the output's directory as a link
    with CheckpointReader(tmp_path / "ck_link") as r:
        assert torch.equal(r.read_many([("w", "param", 0, 80)])[0], value)
    assert inspect(tmp_path / "root_link" / "ck")["ok"]
    consolidate(tmp_path / "ck_link", tmp_path / "out_link" / "model.pt")
    assert torch.equal(torch.load(tmp_path / "outdir" / "model.pt", weights_only=True)["w"], value)
    staging, lock_fd = save._prepare(str(tmp_path / "root_link"), "ck2")
    os.close(lock_fd)
    assert os.path.isdir(tmp_path / "real" / staging)
    assert save._split(str(tmp_path / "ck_link")) == (str(tmp_path / "real"), "ck")
    os.makedirs(tmp_path / "dcp_real")
    os.symlink(tmp_path / "dcp_real", tmp_path / "dcp_link")  # DCP's checkpoint directory as a link
    _dcp_save(tmp_path / "dcp_link", {"a": torch.arange(4.0)})
    sd = {"a": torch.zeros(4)}
    _dcp_load(tmp_path / "dcp_link", sd)
    assert torch.equal(sd["a"], torch.arange(4.0)) and (tmp_path / "dcp_real" / ".metadata").exists()

    os.lchown(tmp_path / "ck_link", 65534, 65534)  # now another user's link (the tests run as root)
    if os.lstat(tmp_path / "ck_link").st_uid != 65534:
        pytest.skip("cannot give a link to another user here")
    with pytest.raises(PermissionError, match="ck_link"):
        CheckpointReader(tmp_path / "ck_link")
    with pytest.raises(PermissionError, match="ck_link"):
        save._split(str(tmp_path / "ck_link"))


# -- item 5: AioStorageReader's trust model --------------------------------------------------------


class _Payload:
    """A pickle that runs code when loaded: it creates the file `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _dcp_save(path, sd):
    import warnings

    import torch.distributed.checkpoint as dcp
    from zeroplus.checkpoint import AioStorageWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=AioStorageWriter(str(path)))


def _dcp_load(path, sd):
    import warnings

    import torch.distributed.checkpoint as dcp
    from zeroplus.checkpoint import AioStorageReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=AioStorageReader(str(path)))


def test_dcp_reader_refuses_metadata_that_runs_code(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    _dcp_save(tmp_path / "ck", {"a": torch.arange(4.0)})
    marker = tmp_path / "pwned"
    meta = tmp_path / "ck" / ".metadata"
    os.chmod(meta, 0o600)
    meta.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointException, match="not allowed in DCP metadata") as e:  # DCP wraps ours
        _dcp_load(tmp_path / "ck", {"a": torch.zeros(4)})
    assert not marker.exists(), "unpickling the checkpoint's metadata ran its code"
    assert "ck/.metadata" in str(e.value)


def test_dcp_reader_refuses_a_data_path_outside_the_directory(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    _dcp_save(tmp_path / "ck", {"a": torch.arange(4.0)})
    _dcp_save(tmp_path / "outside", {"a": torch.full((4,), 7.0)})  # what the crafted path reaches
    meta = tmp_path / "ck" / ".metadata"
    md = pickle.loads(meta.read_bytes())
    for index, info in list(md.storage_data.items()):
        md.storage_data[index] = _StorageInfo(f"../outside/{info.relative_path}", info.offset, info.length,
                                              info.transform_descriptors)
    os.chmod(meta, 0o600)
    meta.write_bytes(pickle.dumps(md))
    sd = {"a": torch.zeros(4)}
    with pytest.raises(CheckpointException, match="not a plain file name"):
        _dcp_load(tmp_path / "ck", sd)
    assert torch.equal(sd["a"], torch.zeros(4))
    _dcp_save(tmp_path / "good", {"a": torch.arange(4.0)})
    _dcp_load(tmp_path / "good", sd)
    assert torch.equal(sd["a"], torch.arange(4.0))

