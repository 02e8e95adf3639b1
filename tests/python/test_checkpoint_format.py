"""The checkpoint manifest parser and value encoding (no process group, no files), and the shard
writer's file layout (one file in a temporary directory, no process group).

parse_manifest is the one place untrusted bytes enter a load, so it is fuzzed here: thousands of
seeded mutations of a valid manifest (fields deleted, retyped, set to extreme or escaping values,
bytes flipped or cut) must each either parse into something whose every range is in bounds, or
raise CheckpointError (an OSError) naming the manifest; never another exception.

Its validator is C++'s (manifest.cpp, op zeroplus::check_manifest); the dict is json.loads'. Where
the two JSON grammars differ (duplicate members, integers past int64, lone surrogates, malformed
UTF-8, a byte-order mark, UTF-16, deep nesting) the C++ parser refuses, so json.loads never reads
anything other than what was checked: one test per difference below.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import math
import random
import time

import pytest
import torch

from zeroplus.checkpoint.format import (VERSION, CheckpointCorruptError, CheckpointError, CheckpointVersionError,
                                        DTYPE_BYTES, check_json, decode_value, dumps, encode_manifest, encode_value,
                                        parse_manifest)

TRIALS = 3000


def _valid() -> dict:
    return {
        "format": "zeroplus-checkpoint", "version": 1, "block_bytes": 64,
        "source": {"stage": 2, "world_size": 2},
        "files": [{"name": "rank00000.bin", "bytes": 100, "block_crc32": [1, 2]},
                  {"name": "rank00001.bin", "bytes": 40, "block_crc32": [3]}],
        "tensors": {"w": {"shape": [3, 5], "dtype": "float32", "kind": "param", "trainable": True,
                          "state": {"exp_avg": "float32"}, "scalars": {"step": encode_value(torch.tensor(3.0))}},
                    "b": {"shape": [5], "dtype": "bfloat16", "kind": "buffer"}},
        "aliases": {"w2": "w"},
        "chunks": [["w", "param", 0, 15, "float32", 0, 0], ["w", "exp_avg", 0, 10, "float32", 1, 0],
                   ["b", "value", 0, 5, "bfloat16", 0, 60]],
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
        "optimizer": {}, "extra": {"step": 3},
    }


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


_WEIRD = [None, True, -1, 0, 1, 2 ** 63, -2 ** 63, 1.5, float("nan"), "", "../x", "rank00000.bin", "/etc/passwd",
          [], [1, 2], {}, {"a": 1}, ["w"], "float32", "w", "param"]


def _mutate(m: dict, rng: random.Random) -> dict:
    m = copy.deepcopy(m)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(m) if p]
        path = rng.choice(paths)
        parent = m
        for k in path[:-1]:
            parent = parent[k]
        op = rng.random()
        if op < 0.3 and isinstance(parent, dict):
            del parent[path[-1]]
        elif op < 0.4 and isinstance(parent, list):
            parent.pop(path[-1])
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(_WEIRD))
    return m


def _check_bounds(m: dict) -> None:
    sizes = [f["bytes"] for f in m["files"]]
    for name, key, lo, hi, dtype, fi, off in m["chunks"]:
        assert 0 <= lo < hi <= m["tensors"][name]["numel"]
        assert off + (hi - lo) * DTYPE_BYTES[dtype] <= sizes[fi]
    for f in m["files"]:
        assert "/" not in f["name"] and ".." not in f["name"]


def test_valid_manifest_parses():
    m = parse_manifest(dumps(_valid()), "manifest.json")
    _check_bounds(m)
    assert m["tensors"]["w"]["numel"] == 15


def test_newer_version_is_refused():
    with pytest.raises(CheckpointVersionError, match=f"version {VERSION + 1}, newer"):
        parse_manifest(dumps({**_valid(), "version": VERSION + 1}), "m.json")


def test_errors_map_to_their_types_with_errno_and_the_manifest_path():
    sealed = encode_manifest({**_valid(), "version": VERSION})
    assert parse_manifest(sealed, "ck/manifest.json")["tensors"]["w"]["numel"] == 15
    assert "manifest_sha256" not in parse_manifest(sealed, "ck/manifest.json")
    broken = sealed.replace(b'"param",0,15', b'"param",0,14')
    for data, error, words in [(broken, CheckpointCorruptError, "checksum mismatch in the manifest"),
                               (b"{", CheckpointCorruptError, "not valid JSON"),
                               (b"", CheckpointCorruptError, "not valid JSON"),
                               (dumps({**_valid(), "block_bytes": 0}), CheckpointError, "block_bytes 0 is outside")]:
        with pytest.raises(error, match=words) as e:
            parse_manifest(data, "ck/manifest.json")
        assert "ck/manifest.json" in str(e.value)
        assert (e.value.errno, e.value.filename) == ((errno.EIO, "ck/manifest.json") if error is CheckpointCorruptError
                                                     else (None, None))
        assert not isinstance(e.value, CheckpointCorruptError) or error is CheckpointCorruptError


# -- one validator, two JSON grammars ------------------------------------------------------------


def _v1(**extra) -> bytes:
    """A valid (unsealed, version 1) manifest whose "extra" member's text is spliced in raw."""
    body = dumps({**_valid(), "extra": None})
    assert body.count(b'"extra":null') == 1
    return body.replace(b'"extra":null', b'"extra":{' + b",".join(b'"%s":%s' % (k.encode(), v)
                                                                 for k, v in extra.items()) + b"}")


def _seal(body: bytes) -> bytes:
    """encode_manifest's seal over raw bytes (what a crafted, not a damaged, manifest carries)."""
    return body[:-1] + b',"manifest_sha256":"' + hashlib.sha256(body).hexdigest().encode() + b'"}'


@pytest.mark.parametrize("case, data", [
    # json.loads keeps the last of two same-named members; C++ checks one of them
    ("duplicate member", _v1(a=b"1").replace(b'"extra":', b'"extra":7,"extra":')),
    ("duplicate member spelled with an escape", _v1(a=b"1").replace(b'"extra":', b'"extra":7,"ext\\u0072a":')),
    ("duplicate tensor", dumps(_valid()).replace(b'"tensors":{', b'"tensors":{"w":{"shape":[0],"dtype":"float32",'
                                                                b'"kind":"buffer"},')),
    # Python's ints are unbounded, C++'s are int64: a value C++ cannot hold is not read differently
    ("integer past int64", _v1(a=b"9223372036854775808")),
    ("integer below int64", _v1(a=b"-9223372036854775809")),
    # json.loads keeps unpaired surrogates (escaped, or raw with its surrogatepass decoding)
    ("lone surrogate escape", _v1(a=b'"\\ud800"')),
    ("lone low surrogate escape", _v1(a=b'"\\udc00x"')),
    ("encoded surrogate", _v1(a=b'"\xed\xa0\x80"')),
    ("overlong UTF-8", _v1(a=b'"\xc0\xaf"')),
    ("truncated UTF-8", _v1(a=b'"\xe2\x82"')),
    ("past U+10FFFF", _v1(a=b'"\xf4\x90\x80\x80"')),
    ("Latin-1 byte", _v1(a=b'"\xe9"')),
    # json.loads(bytes) detects these encodings and reads them
    ("UTF-8 byte-order mark", b"\xef\xbb\xbf" + dumps(_valid())),
    ("sealed, with a byte-order mark", _seal(b"\xef\xbb\xbf" + dumps({**_valid(), "version": VERSION}))),
    ("UTF-16", dumps(_valid()).decode().encode("utf-16-le")),
    # nesting json.loads reads (to ~1000 levels) but C++ (64) does not
    ("nesting 70 deep", _v1(a=b"[" * 70 + b"]" * 70)),
    # whitespace Python's str.strip would take, JSON's grammar does not
    ("form feed", dumps(_valid()) + b"\x0c"),
    ("no-break space", b"\xc2\xa0" + dumps(_valid())),
])
def test_what_json_loads_would_read_differently_is_refused_as_corrupt(case, data):
    with pytest.raises(CheckpointCorruptError, match="not valid JSON") as e:
        parse_manifest(data, "manifest.json")
    assert e.value.errno == errno.EIO and e.value.filename == "manifest.json", case


def test_the_validator_sees_every_byte():
    """The op takes the bytes as they are (a NUL does not end them): C++ words the refusal."""
    data = dumps(_valid())
    with pytest.raises(CheckpointCorruptError, match=f"trailing characters after the JSON value at byte {len(data)}"):
        parse_manifest(data + b"\x00" + data, "manifest.json")


def test_what_both_grammars_accept_reads_as_checked():
    data = _v1(big=b"9223372036854775807", small=b"-9223372036854775808", nan=b"NaN", inf=b"Infinity",
               ninf=b"-Infinity", f=b"1e400", z=b"-0", e=b'"\\u00e9\\ud83d\\ude00\\u0000\\/"',
               raw="\"é😀\U0010ffff\"".encode(), deep=b"[" * 60 + b"]" * 60)
    m = parse_manifest(b" \t\r\n" + data + b"\n", "manifest.json")
    x = m["extra"]
    assert (x["big"], x["small"], x["z"]) == (2 ** 63 - 1, -2 ** 63, 0)
    assert math.isnan(x["nan"]) and x["inf"] == x["f"] == math.inf and x["ninf"] == -math.inf
    assert x["e"] == "é😀\x00/" and x["raw"] == "é😀\U0010ffff"
    # a name spelled raw in one place and escaped in another is one name to both parsers
    named = _valid()
    named["tensors"] = {"wé": named["tensors"]["w"], "b": named["tensors"]["b"]}
    named["chunks"][0][0] = named["chunks"][1][0] = "wé"
    named["param_groups"][0]["params"] = ["wé"]
    named["aliases"] = {"w2": "wé"}
    raw = json.dumps(named, ensure_ascii=False).encode()
    escaped = raw.replace('"wé"'.encode(), b'"w\\u00e9"', 1)  # the key in "tensors"
    assert escaped != raw
    for data in (raw, escaped, json.dumps(named, indent="\t").encode()):
        assert parse_manifest(data, "manifest.json")["tensors"]["wé"]["numel"] == 15


def test_the_writer_refuses_extra_values_the_validator_would_not_read_back():
    def nested(n):
        return [] if n == 1 else [nested(n - 1)]

    fine = {"big": 2 ** 63 - 1, "small": -2 ** 63, "s": "é😀\x00", "deep": nested(31)}  # 32 levels with fine itself
    assert check_json(fine, "extra") is fine and check_json(nested(32), "extra") == nested(32)
    assert parse_manifest(encode_manifest({**_valid(), "version": VERSION, "extra": fine}), "m.json")["extra"] == fine
    for bad, words in [({"n": 2 ** 63}, r"extra\['n'\] is 9223372036854775808, outside the 64-bit"),
                       ([-2 ** 63 - 1], r"extra\[0\] is -9223372036854775809"),
                       ({"s": "a\ud800"}, "lone surrogate"), ({"\udc00": 1}, "lone surrogate"),
                       (nested(33), "more than 32 deep")]:
        with pytest.raises(TypeError, match=words):
            check_json(bad, "extra")


def test_shape_bound_is_the_product_below_2_to_the_62():
    m = _valid()
    m["tensors"]["huge"] = {"shape": [2 ** 62 - 1], "dtype": "float32", "kind": "buffer"}
    assert parse_manifest(dumps(m), "manifest.json")["tensors"]["huge"]["numel"] == 2 ** 62 - 1
    m["tensors"]["huge"]["shape"] = [3, 0, 1537228672809129301]  # 3 * max(0, 1) * ... = 2**62 - 1
    assert parse_manifest(dumps(m), "manifest.json")["tensors"]["huge"]["numel"] == 0
    for shape in ([2 ** 62], [3, 1537228672809129302], [2 ** 31, 2 ** 31]):
        m["tensors"]["huge"]["shape"] = shape
        with pytest.raises(CheckpointError, match="'huge' has an invalid shape"):
            parse_manifest(dumps(m), "manifest.json")


def test_fuzzed_manifests_parse_or_raise_checkpoint_error():
    rng = random.Random(2026)
    base = _valid()
    accepted = 0
    for trial in range(TRIALS):
        if trial % 10 == 9:  # raw byte damage: flips and cuts
            data = bytearray(dumps(base))
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data[:rng.randint(0, len(data))]) if rng.random() < 0.3 else bytes(data)
        else:
            data = json.dumps(_mutate(base, rng), allow_nan=True).encode()
        try:
            m = parse_manifest(data, "manifest.json")
        except CheckpointError as e:
            assert "manifest.json" in str(e) or "checkpoint:" in str(e)
            continue
        _check_bounds(m)
        accepted += 1
    assert accepted < TRIALS  # the mutations do hit the checks


def test_values_round_trip():
    values = [(0.9, 0.999), [1, (2, 3)], {"a": (1,)}, float("inf"), float("nan"), None, "s", 3,
              torch.tensor(5.0), torch.tensor([1, 2], dtype=torch.int64), torch.tensor(1.5, dtype=torch.bfloat16)]
    for v in values:
        back = decode_value(json.loads(json.dumps(encode_value(v))))
        if isinstance(v, torch.Tensor):
            assert back.dtype == v.dtype and back.shape == v.shape and torch.equal(back, v)
        elif isinstance(v, float) and math.isnan(v):
            assert math.isnan(back)
        else:
            assert back == v and type(back) is type(v)


def test_fuzzed_values_decode_or_raise_checkpoint_error():
    rng = random.Random(7)
    tags = ["__tuple__", "__dict__", "__float__", "__tensor__", "data", "shape", "other"]
    for _ in range(TRIALS):
        def gen(depth=0):
            r = rng.random()
            if depth > 2 or r < 0.4:
                return copy.deepcopy(rng.choice(_WEIRD))
            if r < 0.6:
                return [gen(depth + 1) for _ in range(rng.randint(0, 3))]
            return {rng.choice(tags): gen(depth + 1) for _ in range(rng.randint(1, 3))}
        try:
            decode_value(gen())
        except CheckpointError:
            pass


def test_stale_staging_directories_are_removed_unless_locked(tmp_path):
    import os

    from zeroplus import files
    from zeroplus.checkpoint import fsutil

    root = files.open_directory_at(None, str(tmp_path), owned=True)
    try:
        names = {k: fsutil.temp_name(k) for k in ("killed", "in_flight", "mine")}
        fds = {k: files.make_private_directory_at(root, n) for k, n in names.items()}
        os.close(files.create_exclusive_at(fds["killed"], "rank00000.bin"))
        fsutil.lock(fds["in_flight"])  # a save in flight holds its lock
        os.mkdir(tmp_path / ".user.tmp-notours")  # not a name zeroplus generates
        (tmp_path / "ckpt").mkdir()
        old_latest, new_latest = fsutil.temp_name("latest"), fsutil.temp_name("latest")
        for n in (old_latest, new_latest):
            os.close(files.create_exclusive_at(root, n))
        hour_ago = time.time() - 3600
        os.utime(tmp_path / old_latest, (hour_ago, hour_ago))  # a killed save's; the other is being written
        removed = fsutil.remove_stale_temp_dirs(root, keep=names["mine"])
        assert sorted(removed) == sorted([names["killed"], old_latest])
        assert sorted(os.listdir(tmp_path)) == sorted([names["in_flight"], names["mine"], ".user.tmp-notours", "ckpt",
                                                       new_latest])
    finally:
        for fd in fds.values():
            os.close(fd)
        os.close(root)


@pytest.mark.parametrize("io,direct,held", [("aio", "auto", [0, 1, 2, 3, 4, 5]), ("aio", "off", [0] * 6),
                                           ("posix", "auto", [0] * 6)])
def test_shard_writer_holds_a_piece_only_while_the_writer_reads_it(tmp_path, monkeypatch, io, direct, held):
    """write_shard hands the writer a contiguous CPU copy of a piece that is not one (a CUDA
    tensor's host copy, a transposed view). It keeps that copy only while the writer may still read
    it (a large piece queued O_DIRECT-capable: until the next drain); through the page cache or
    pwrite it is dropped when place() returns, so a save holds one copy at a time, not the shard."""
    import os
    import weakref

    from zeroplus import files
    from zeroplus.checkpoint import shard_io

    real = torch.classes.zeroplus.ShardFileWriter

    class Spy:
        def __init__(self, *args):
            self.writer, self.refs, self.alive = real(*args), [], []

        def place(self, data):
            self.alive.append(sum(r() is not None for r in self.refs))  # earlier copies still held
            self.refs.append(weakref.ref(data))
            return self.writer.place(data)

        def __getattr__(self, name):
            return getattr(self.writer, name)
    spies = []
    monkeypatch.setattr(torch.classes.zeroplus, "ShardFileWriter", lambda *a: spies.append(Spy(*a)) or spies[-1])
    torch.manual_seed(0)
    pieces = [(f"w{i}", "param", 0, 512 * 1024, torch.randn(1024, 512).t()) for i in range(6)]  # 2 MiB, copied
    dir_fd = files.open_directory_at(None, str(tmp_path), owned=True)
    try:
        record, chunks = shard_io.write_shard(dir_fd, str(tmp_path), 0, pieces, io, direct=direct)
    finally:
        os.close(dir_fd)
    assert spies[0].alive == held, spies[0].alive
    data = (tmp_path / record["name"]).read_bytes()
    for (name, _k, _lo, _hi, t), (*_, offset) in zip(pieces, chunks):
        assert data[offset:offset + t.numel() * 4] == t.contiguous().numpy().tobytes(), name


@pytest.mark.parametrize("io,direct", [("aio", "auto"), ("aio", "off"), ("posix", "auto")])
def test_shard_writer_segments_and_calls_back_after_the_live_pieces(tmp_path, monkeypatch, io, direct):
    """Through the page cache a large piece goes out in segments (here 256 KiB + 12 bytes, so they
    split pieces at odd places): the file and its checksums are right. The `live` callback runs
    once, after the pieces up to its index are in the file (an async save's live tensors,
    snapshot.py), before the later ones are. (Which ranges get their write-back started is the C++
    writer's: shard_file_writer_test LayoutChecksumsAndWriteback.)"""
    import os
    import zlib

    from zeroplus import files
    from zeroplus.checkpoint import shard_io

    monkeypatch.setattr(shard_io, "_SEGMENT_BYTES", (256 << 10) + 12)
    torch.manual_seed(0)
    base = torch.randn(3 << 18)  # 3 MiB of float32
    big = (1 << 20) // 4 + 3
    pieces = [(f"big{i}", "param", 0, big, base[i * (big + 7) + i:i * (big + 7) + i + big]) for i in range(2)]
    pieces.insert(1, ("small", "exp_avg", 0, 5, torch.arange(5.0)))
    seen = []

    def written():
        (name,) = [n for n in os.listdir(tmp_path)]
        seen.append((tmp_path / name).read_bytes())
    dir_fd = files.open_directory_at(None, str(tmp_path), owned=True)
    try:
        record, chunks = shard_io.write_shard(dir_fd, str(tmp_path), 0, pieces, io, block_bytes=1 << 16,
                                              direct=direct, live=(1, written))
    finally:
        os.close(dir_fd)
    data = (tmp_path / record["name"]).read_bytes()
    assert record["block_crc32"] == [zlib.crc32(data[i:i + (1 << 16)]) for i in range(0, len(data), 1 << 16)]
    for (name, _k, _lo, _hi, t), (*_, offset) in zip(pieces, chunks):
        assert data[offset:offset + t.numel() * 4] == t.numpy().tobytes(), name
    assert len(seen) == 1
    for (name, _k, _lo, _hi, t), (*_, offset) in list(zip(pieces, chunks))[:2]:
        assert seen[0][offset:offset + t.numel() * 4] == t.numpy().tobytes(), f"{name} not in the file at the callback"


@pytest.mark.parametrize("io,direct", [("aio", "auto"), ("aio", "off"), ("posix", "auto")])
def test_shard_writer_places_unaligned_tensors_and_checksums_every_byte(tmp_path, io, direct):
    """write_shard of large pieces at every kind of address (page-aligned, 4 and 64 bytes in, the
    last 4 bytes of a page), small coalesced ones between them and a piece of 0 elements: each
    chunk's bytes read back from the file equal the tensor's, the block checksums match the file,
    and with io="aio" a large piece starts in the file at its address's place in a page (the
    zero-copy O_DIRECT layout; with posix nothing needs it)."""
    import os
    import zlib

    from zeroplus import files
    from zeroplus.checkpoint.shard_io import aligned_empty, write_shard

    base = aligned_empty(8 << 20).view(torch.float32)
    torch.manual_seed(0)
    base.copy_(torch.randn(base.numel()))
    big = (1 << 20) // 4 + 3  # a little over 1 MiB of float32: the zero-copy path
    pieces = []
    for i, skew in enumerate([0, 4, 64, 4092, 1000 * 4]):
        at = i * (big + 1024) + skew // 4
        pieces.append((f"big{i}", "param", 0, big, base[at:at + big]))
        pieces.append((f"small{i}", "exp_avg", 0, 5 + i, torch.arange(5.0 + i, dtype=torch.bfloat16)))
    pieces.append(("empty", "param", 0, 0, torch.empty(0)))
    dir_fd = files.open_directory_at(None, str(tmp_path), owned=True)
    try:
        record, chunks = write_shard(dir_fd, str(tmp_path), 0, pieces, io, block_bytes=1 << 16, direct=direct)
    finally:
        os.close(dir_fd)
    data = (tmp_path / record["name"]).read_bytes()
    assert len(data) == record["bytes"]
    blocks = [data[i:i + (1 << 16)] for i in range(0, len(data), 1 << 16)]
    assert record["block_crc32"] == [zlib.crc32(b) for b in blocks]
    for (name, key, lo, hi, t), (cname, ckey, clo, chi, dtype, _fi, offset) in zip(pieces, chunks):
        assert (cname, ckey, clo, chi, dtype) == (name, key, lo, hi, str(t.dtype).replace("torch.", ""))
        nbytes = t.numel() * t.element_size()
        assert data[offset:offset + nbytes] == t.contiguous().view(torch.uint8).numpy().tobytes(), name
        if name.startswith("big"):
            assert offset % 4096 == (t.data_ptr() % 4096 if io == "aio" else 0), (name, offset)


def test_checkpoint_options_reject_bad_values():
    from zeroplus.checkpoint import CheckpointOptions

    with pytest.raises(TypeError, match="overlap_snapshot"):
        CheckpointOptions(overlap_snapshot=1)
    with pytest.raises(ValueError, match="io"):
        CheckpointOptions(io="mmap")
    with pytest.raises(ValueError, match="direct"):
        CheckpointOptions(direct="on")


def test_manifest_for_save_refuses_what_no_reader_reads():
    """The writer runs the readers' validator: a value JSON writes but no reader accepts is a
    ValueError at save time, not a checkpoint every load refuses as corrupt."""
    from zeroplus.checkpoint.format import manifest_for_save

    assert parse_manifest(manifest_for_save(_valid()), "m.json")["tensors"]["w"]["numel"] == 15
    for where, bad in ((("param_groups", 0, "seed"), 2**64 - 1), (("extra", "note"), "\ud800"),
                       (("tensors", "w", "scalars", "step"), -(2**63) - 1)):
        m = _valid()
        node = m
        for key in where[:-1]:
            node = node[key]
        node[where[-1]] = bad
        with pytest.raises(ValueError, match="is not one a reader accepts"):
            manifest_for_save(m)
        encode_manifest(m)  # the raw encoder checks nothing (hostile manifests are made with it)


def test_trainable_must_be_a_bool():
    m = _valid()
    m["tensors"]["w"]["trainable"] = "false"  # truthy: an exporter would have taken it as trainable
    with pytest.raises(CheckpointError, match="trainable"):
        parse_manifest(dumps(m), "m.json")
