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

This module is the writer (dumps, encode_manifest, encode_value) and the dict front-end of the
reader. The validator is C++'s, one for both front-ends: parse_manifest hands the bytes to
optimizers/core/checkpoint/manifest.cpp parseManifest (op zeroplus::check_manifest), which checks
the version, the seal and every field a reader will trust (names, offsets, ranges, dtypes), then
reads them with json.loads (JSON only: nothing is evaluated). Importing this module imports no
torch; parse_manifest and decode_value of a tensor use it (and the library `import zeroplus` loads).
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

# A checkpoint directory name as the `latest` pointer may name it: one path component.
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


# What the manifest's validator reads (optimizers/core/checkpoint/json.hpp): int64 integers, UTF-8
# strings, nesting at most 64 deep in the whole manifest. extra sits one level below its root: 32
# levels of its own stay well inside that.
_INT64 = (-(1 << 63), (1 << 63) - 1)
_MAX_JSON_DEPTH = 32


def check_json(value, where: str, _depth: int = 0):
    """`value` if it survives a JSON round trip unchanged in meaning and the manifest's validator
    reads it back (ints in int64, strings encodable as UTF-8, at most 32 levels of lists and
    dicts), else TypeError naming the key path `where` (extra= goes through this)."""
    if value is None or isinstance(value, (bool, float)):
        return value
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise TypeError(f"checkpoint: {where} is {value}, outside the 64-bit integers a checkpoint reader "
                            f"reads (store it as a str)")
        return value
    if isinstance(value, str):
        _check_utf8(value, where)
        return value
    if _depth >= _MAX_JSON_DEPTH and isinstance(value, (list, tuple, dict)):
        raise TypeError(f"checkpoint: {where} nests lists and dicts more than {_MAX_JSON_DEPTH} deep, more than a "
                        f"checkpoint reader reads")
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json(v, f"{where}[{i}]", _depth + 1)
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"checkpoint: {where} has a key {k!r} of type {type(k).__name__}; JSON needs str keys")
            _check_utf8(k, f"{where} key {k!r}")
            check_json(v, f"{where}[{k!r}]", _depth + 1)
        return value
    raise TypeError(f"checkpoint: {where} is a {type(value).__name__}, which is not JSON-serializable "
                    f"(extra and hyperparameters must be None, bool, int, float, str, list, tuple or dict)")


def _check_utf8(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: json.dumps would write a \ud800 no reader accepts
        raise TypeError(f"checkpoint: {where} holds a lone surrogate ({s!r}), which is not UTF-8") from None


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
    it (module doc). Any MANIFEST_CHECKSUM already in `manifest` is replaced. Nothing is checked
    (tests craft hostile manifests with it); what a save writes goes through manifest_for_save."""
    body = dumps({k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM})
    digest = hashlib.sha256(body).hexdigest().encode()
    return body[:-1] + b',"' + MANIFEST_CHECKSUM.encode() + b'":"' + digest + b'"}'


def manifest_for_save(manifest: dict) -> bytes:
    """encode_manifest's bytes, after the readers' validator accepted them: a value no reader would
    accept (an int beyond int64 or a lone surrogate in a hyperparameter, a tensor name or an
    optimizer scalar) raises ValueError naming it here, at save time (the save then publishes
    nothing), instead of writing a checkpoint that every later load refuses as corrupt."""
    import torch  # the op's library is loaded by `import zeroplus`

    data = encode_manifest(manifest)
    rc, what = torch.ops.zeroplus.check_manifest(data)
    if rc != 0:
        raise ValueError(f"checkpoint: the manifest this save would write is not one a reader accepts ({what}); "
                         f"nothing was published (hyperparameters, optimizer scalars and names must be JSON "
                         f"values with integers in int64 and strings in UTF-8)")
    return data


def _str_in(v, container) -> bool:
    """v is a str key of container (a dict from JSON may hold any type where a name belongs)."""
    return isinstance(v, str) and v in container


def parse_manifest(data: bytes, where: str) -> dict:
    """The manifest at `where` (its bytes), validated: every name, range, offset and dtype the reader
    will use. Raises CheckpointVersionError for a newer version, CheckpointCorruptError (errno EIO,
    filename `where`) for bytes that are not JSON or fail the manifest's checksum, CheckpointError
    for anything else malformed.

    The checks are C++'s (optimizers/core/checkpoint/manifest.cpp parseManifest, through the op
    zeroplus::check_manifest): one validator for the Python and the LibTorch reader. Only what it
    accepted reaches json.loads here, and its JSON grammar is the stricter of the two (json.hpp), so
    the dict holds exactly the values it checked."""
    import torch  # the op's library is loaded by `import zeroplus`, which importing this module ran

    data = bytes(data)  # immutable: the bytes checked are the bytes parsed (a str is a TypeError)
    rc, what = torch.ops.zeroplus.check_manifest(data)
    if rc == -errno.EIO:
        raise CheckpointCorruptError(errno.EIO, f"checkpoint: {where}: {what}", where)
    if rc == -errno.ENOTSUP:
        raise CheckpointVersionError(f"checkpoint: {where}: {what}")
    if rc != 0:
        raise CheckpointError(f"checkpoint: {where}: {what}")
    try:
        m = json.loads(data)
    except (ValueError, RecursionError) as e:  # unreachable while C++'s grammar is the stricter (json.hpp)
        raise CheckpointCorruptError(errno.EIO, f"checkpoint: {where}: not valid JSON ({e}); the manifest is "
                                                f"corrupt", where) from None
    m.pop(MANIFEST_CHECKSUM, None)
    for t in m["tensors"].values():
        t["numel"] = math.prod(t["shape"])
    return m
