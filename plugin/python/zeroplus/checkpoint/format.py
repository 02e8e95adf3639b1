"""The zeroplus checkpoint format (version 1): one JSON manifest plus one shard file per rank.

A checkpoint is a directory::

    manifest.json      written last; a directory without it is not a checkpoint
    rank00000.bin ...  raw little-endian tensor bytes, one file per saving rank

The manifest is world-size independent ("universal"): for every tensor it records the global
shape and dtype, and for every *chunk* (one contiguous flat element range [lo, hi) of one value
of one tensor, written by one rank) the file, byte offset and dtype. A value is "param" (the fp32
master where the optimizer keeps one, else the parameter itself), "value" (a buffer), or the name
of an elementwise optimizer state tensor ("exp_avg", "momentum_buffer", ...). Per-parameter
optimizer scalars (Adam's "step") and small non-elementwise state tensors are stored in the
manifest itself. A loader at any world size and stage reads, for each range it owns now, the
chunks overlapping it.

Integrity: every file's size and the CRC-32 of each `block_bytes` block are recorded, so a
reader that reads a byte range verifies exactly the blocks it touched (and `inspect` verifies all).
The manifest checks itself (version 2 on): its bytes end with the member
`,"manifest_sha256":"<64 hex>"}`, the SHA-256 of the file's bytes with that member taken out
(everything before it, then the closing `}`); encode_manifest writes it, parse_manifest checks it
before it trusts any other field, so one flipped bit anywhere in the file (a chunk offset that is
still valid JSON and in range) is refused instead of loading wrong values. Version 1 manifests
(zeroplus before the checksum) carry none and are read as before; a manifest of version >= 2 without
the member, or one that claims a checksum and mismatches, is CheckpointCorruptError.

Parsing (parse_manifest) checks every field it will later trust (names, offsets, ranges, dtypes)
and never evaluates code: JSON only. This module imports no torch.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import re

FORMAT = "zeroplus-checkpoint"
VERSION = 2            # 2: the manifest carries its own checksum (MANIFEST_CHECKSUM)
CHECKSUMMED_SINCE = 2  # the first version whose manifests must carry it
MANIFEST_CHECKSUM = "manifest_sha256"
MANIFEST = "manifest.json"
LATEST = "latest"
BLOCK_BYTES = 4 << 20
# The largest checksum block a manifest may declare: a reader allocates one block to read one
# element, so a crafted block_bytes (2**40 over a sparse shard) would cost the file's apparent
# size in memory. The writer refuses more too (CheckpointOptions).
MAX_BLOCK_BYTES = 64 << 20

# dtype name -> bytes per element. Only these may appear in a manifest.
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}

_MAX_ELEMENTS = 1 << 62  # what torch can index (sizes and strides are int64), with room for byte counts
_FILE_NAME = re.compile(r"^rank[0-9]{5}\.bin$")
# A checkpoint directory name as the `latest` pointer may name it: one path component.
# The last member of a checksummed manifest (encode_manifest), anchored at the end of the file.
_SEAL = re.compile(rb',"' + MANIFEST_CHECKSUM.encode() + rb'":"([0-9a-f]{64})"\}\Z')
_DIR_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,254}$")


class CheckpointError(OSError):
    """A checkpoint on disk is unusable: missing, torn, corrupt or of an unknown format. The
    message names the file (also in .filename)."""


class CheckpointCorruptError(CheckpointError):
    """Bytes on disk do not match the manifest (checksum, size, truncation)."""


class CheckpointVersionError(CheckpointError):
    """The manifest was written by a newer zeroplus (format version > VERSION)."""


def shard_file_name(rank: int) -> str:
    return f"rank{rank:05d}.bin"


def check_dir_name(name: str, what: str) -> str:
    """One path component, no '..', no separators: what a `latest` pointer may name."""
    if not isinstance(name, str) or not _DIR_NAME.match(name) or name in (".", "..") or ".." in name:
        raise CheckpointError(f"checkpoint: {what} names {name!r}, which is not a plain directory name inside the "
                              f"checkpoint root (refusing a path that could escape it)")
    return name


# -- JSON values -------------------------------------------------------------------------------


def check_json(value, where: str):
    """`value` if it survives a JSON round trip unchanged in meaning, else TypeError naming the
    key path `where` (extra= and hyperparameters go through this)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json(v, f"{where}[{i}]")
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"checkpoint: {where} has a key {k!r} of type {type(k).__name__}; JSON needs str keys")
            check_json(v, f"{where}[{k!r}]")
        return value
    raise TypeError(f"checkpoint: {where} is a {type(value).__name__}, which is not JSON-serializable "
                    f"(extra and hyperparameters must be None, bool, int, float, str, list, tuple or dict)")


def encode_value(value):
    """Hyperparameters and optimizer scalars: JSON, tuples and tensors tagged so they come back
    as they were (betas stays a tuple, Adam's step a 0-dim float32 tensor)."""
    import numbers

    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        return {"__dict__": {k: encode_value(v) for k, v in value.items()}}
    if hasattr(value, "tolist") and hasattr(value, "dtype") and hasattr(value, "shape"):  # a tensor
        dtype = str(value.dtype).replace("torch.", "")
        if dtype not in DTYPE_BYTES:
            raise TypeError(f"checkpoint: tensor of dtype {value.dtype} is not supported")
        return {"__tensor__": dtype, "shape": list(value.shape), "data": value.detach().cpu().reshape(-1).tolist()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Number):
        return float(value)
    raise TypeError(f"checkpoint: value of type {type(value).__name__} cannot be stored")


def decode_value(value):
    """encode_value's inverse; malformed input raises CheckpointError (it comes from a file)."""
    try:
        return _decode(value)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, OverflowError) as e:
        raise CheckpointError(f"checkpoint: manifest has a malformed value ({type(e).__name__}: {e})") from None


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {k: _decode(v) for k, v in value["__dict__"].items()}
        if "__float__" in value:
            return float(value["__float__"])
        if "__tensor__" in value:
            import torch

            dtype = value["__tensor__"]
            if not _str_in(dtype, DTYPE_BYTES):
                raise CheckpointError(f"checkpoint: manifest has a tensor of unknown dtype {dtype!r}")
            try:
                return torch.tensor(value["data"], dtype=getattr(torch, dtype)).reshape(value["shape"])
            except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as e:
                raise CheckpointError(f"checkpoint: manifest has a malformed tensor value ({e})") from None
        raise CheckpointError(f"checkpoint: manifest has an untagged object {sorted(value)[:3]}")
    return value


# -- manifest ------------------------------------------------------------------------------------


def dumps(manifest: dict) -> bytes:
    return json.dumps(manifest, separators=(",", ":"), allow_nan=True).encode()


def encode_manifest(manifest: dict) -> bytes:
    """manifest.json's bytes: compact JSON whose last member is the SHA-256 of the bytes without
    it (module doc). Any MANIFEST_CHECKSUM already in `manifest` is replaced."""
    body = dumps({k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM})
    digest = hashlib.sha256(body).hexdigest().encode()
    return body[:-1] + b',"' + MANIFEST_CHECKSUM.encode() + b'":"' + digest + b'"}'


def _check_seal(data: bytes, where: str) -> None:
    """The manifest's own checksum (encode_manifest) matches its bytes, or CheckpointCorruptError."""
    seal = _SEAL.search(data)
    if seal is None:
        raise CheckpointCorruptError(errno.EIO, f"checkpoint: the manifest's checksum ({MANIFEST_CHECKSUM}, the last "
                                                f"member of a manifest of version >= {CHECKSUMMED_SINCE}) is missing "
                                                f"or damaged; the manifest is corrupt", where)
    actual = hashlib.sha256(data[:seal.start()] + b"}").hexdigest()
    if actual != seal.group(1).decode():
        raise CheckpointCorruptError(errno.EIO, f"checkpoint: checksum mismatch in the manifest (sha256 of its bytes "
                                                f"{actual[:16]}..., recorded {seal.group(1).decode()[:16]}...); the "
                                                f"manifest is corrupt", where)


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CheckpointError(f"checkpoint: {where}: {what}")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_in(v, container) -> bool:
    """v is a str key of container (a dict from JSON may hold any type where a name belongs)."""
    return isinstance(v, str) and v in container


def parse_manifest(data: bytes, where: str) -> dict:
    """The manifest at `where`, validated: every name, range, offset and dtype the reader will use.
    Raises CheckpointVersionError for a newer version, CheckpointError for anything malformed."""
    try:
        m = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the interpreter's limit
        raise CheckpointCorruptError(f"checkpoint: {where} is not valid JSON ({e}); the manifest is corrupt") from None
    _need(isinstance(m, dict) and m.get("format") == FORMAT, where, f"not a zeroplus checkpoint manifest "
          f"(format {m.get('format') if isinstance(m, dict) else None!r})")
    version = m.get("version")
    _need(_int(version) and version >= 1, where, f"version {version!r} is not a positive integer")
    if version > VERSION:  # before the checksum: a newer format may seal its manifest otherwise
        raise CheckpointVersionError(f"checkpoint: {where} has format version {version}, newer than this zeroplus "
                                     f"reads ({VERSION}); upgrade zeroplus")
    if version >= CHECKSUMMED_SINCE or MANIFEST_CHECKSUM in m:
        _check_seal(bytes(data), where)
        m.pop(MANIFEST_CHECKSUM, None)
    for key, kind in (("source", dict), ("files", list), ("tensors", dict), ("aliases", dict), ("chunks", list),
                      ("param_groups", list), ("optimizer", dict), ("block_bytes", int)):
        _need(isinstance(m.get(key), kind), where, f"field {key!r} missing or not a {kind.__name__}")
    _need(0 < m["block_bytes"] <= MAX_BLOCK_BYTES, where,
          f"block_bytes {m['block_bytes']} is outside [1, {MAX_BLOCK_BYTES}]")
    sizes = []
    for i, f in enumerate(m["files"]):
        name = f.get("name") if isinstance(f, dict) else f
        _need(isinstance(f, dict) and isinstance(name, str) and _FILE_NAME.match(name) is not None, where,
              f"files[{i}] has name {name!r}, expected rankNNNNN.bin (refusing a name that could escape the "
              f"checkpoint directory)")
        _need(_int(f.get("bytes")) and f["bytes"] >= 0, where, f"files[{i}].bytes is invalid")
        crcs = f.get("block_crc32")
        nblocks = -(-f["bytes"] // m["block_bytes"])
        _need(isinstance(crcs, list) and len(crcs) == nblocks and all(_int(c) and 0 <= c < 1 << 32 for c in crcs),
              where, f"files[{i}].block_crc32 must list {nblocks} checksums, each a 32-bit unsigned integer")
        sizes.append(f["bytes"])
    tensors = m["tensors"]
    for name, t in tensors.items():
        ok = (isinstance(t, dict) and isinstance(t.get("shape"), list) and all(_int(d) and d >= 0 for d in t["shape"])
              and math.prod(max(d, 1) for d in t["shape"]) < _MAX_ELEMENTS)
        _need(ok, where, f"tensor {name!r} has an invalid shape")
        _need(_str_in(t.get("dtype"), DTYPE_BYTES), where, f"tensor {name!r} has unknown dtype {t.get('dtype')!r}")
        _need(_str_in(t.get("kind"), ("param", "buffer")), where, f"tensor {name!r} has unknown kind {t.get('kind')!r}")
        state, scalars = t.get("state", {}), t.get("scalars", {})
        _need(isinstance(state, dict) and all(_str_in(v, DTYPE_BYTES) for v in state.values())
              and isinstance(scalars, dict), where, f"tensor {name!r} has invalid optimizer state fields")
        t["numel"] = math.prod(t["shape"])
    for alias, target in m["aliases"].items():
        _need(_str_in(target, tensors), where, f"alias {alias!r} names unknown tensor {target!r}")
        _need(alias not in tensors, where, f"alias {alias!r} is also the name of a stored tensor (one state_dict key, "
                                           f"two values)")
    for i, c in enumerate(m["chunks"]):
        ok = isinstance(c, list) and len(c) == 7
        if ok:
            name, key, lo, hi, dtype, fi, off = c
            ok = (_str_in(name, tensors) and isinstance(key, str) and _int(lo) and _int(hi) and 0 <= lo < hi
                  and hi <= tensors[name]["numel"] and _str_in(dtype, DTYPE_BYTES) and _int(fi)
                  and 0 <= fi < len(sizes) and _int(off) and off >= 0
                  and off + (hi - lo) * DTYPE_BYTES[dtype] <= sizes[fi])
        _need(ok, where, f"chunks[{i}] = {c!r} is out of range (tensor, element range, file or byte offset)")
    spans: dict = {}
    for name, key, lo, hi, *_rest in m["chunks"]:
        spans.setdefault((name, key), []).append((lo, hi))
    for (name, key), ranges in spans.items():  # a reader counts covered elements: each must be stored once
        ranges.sort()
        for (_lo, prev_hi), (lo, _hi) in zip(ranges, ranges[1:]):
            _need(lo >= prev_hi, where, f"chunks of {name!r} ({key}) overlap at elements [{lo}, {prev_hi})")
    for i, g in enumerate(m["param_groups"]):
        _need(isinstance(g, dict) and isinstance(g.get("params"), list)
              and all(_str_in(p, tensors) for p in g["params"]), where, f"param_groups[{i}] is invalid")
    return m
