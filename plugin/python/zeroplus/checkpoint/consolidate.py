"""Offline tools over a checkpoint directory (no process group): consolidate and inspect.

consolidate(path, out, fmt): one fp32 state dict of the model (the keys model.state_dict() has,
tied parameters under every name; floating values as float32, the master where there is one),
assembled one tensor at a time from the shards (each read verified against its checksums).
  * fmt="torch": a torch.save file that torch.load(out, weights_only=True) reads;
  * fmt="safetensors": written natively in the safetensors layout (8-byte header length, JSON
    header, raw bytes), streaming: only one tensor is in memory at a time. The `safetensors`
    package is not needed to write it; safetensors.torch.load_file reads it.
The output is created exclusively next to `out` under a temporary name, fdatasync'ed and renamed
into place; an existing `out` is never replaced (FileExistsError). Its directory may be a
symbolic link of this user or root (files.open_directory). A state_dict key safetensors cannot
hold (`__metadata__`, its header's reserved key) raises ValueError before anything is written.

inspect(path): the source (stage, world size, precision), tensors, bytes per file, and whether
every block of every file matches its checksum (the manifest's own checksum is checked when the
reader opens it: a corrupt manifest raises CheckpointCorruptError instead of a summary). A file
that cannot be opened for a reason other than its own damage (EMFILE, EACCES) raises; it is never
reported as corrupt.
"""

from __future__ import annotations

import errno
import json
import os
import struct

import torch

from .. import files
from . import fsutil
from .format import DTYPE_BYTES, MANIFEST, CheckpointCorruptError, CheckpointError
from .reader import CheckpointReader

SAFETENSORS_DTYPE = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def _out_dtype(saved: str) -> str:
    return "float32" if saved in ("float16", "bfloat16", "float32", "float64") else saved


def read_tensor(reader: CheckpointReader, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Tensor `name` in its full shape as `dtype` (the master for a parameter that has one)."""
    t = reader.manifest["tensors"][name]
    key = "param" if t["kind"] == "param" else "value"
    numel = t["numel"]
    if numel and not reader.has(name, key):  # before allocating anything of the size the manifest claims
        raise CheckpointCorruptError(errno.EIO, f"checkpoint: no shard holds {name!r} (the manifest is torn)",
                                     os.path.join(reader.path, MANIFEST))
    if numel == 0:
        return torch.zeros(t["shape"], dtype=dtype)
    return reader.read_many([(name, key, 0, numel)])[0].to(dtype).reshape(t["shape"])


def iter_tensors(reader: CheckpointReader):
    """(name, full-shape tensor) of every tensor, params first, one at a time."""
    for name, t in reader.manifest["tensors"].items():
        yield name, read_tensor(reader, name, getattr(torch, _out_dtype(t["dtype"])))


def load_fp32_state_dict(path) -> dict[str, torch.Tensor]:
    """The model's full state dict from a checkpoint, in memory, without a process group: the
    keys model.state_dict() has (tied parameters under every name, one tensor), floating values
    as float32 (the master where there is one). What consolidate(fmt="torch") writes."""
    with CheckpointReader(path) as reader:
        keys = _keys(reader.manifest)
        return {k: value for name, value in iter_tensors(reader) for k in keys[name]}


def _keys(m: dict) -> dict[str, list[str]]:
    """tensor name -> every state_dict key it appears under (itself, then its aliases)."""
    out = {name: [name] for name in m["tensors"]}
    for alias, target in m["aliases"].items():
        out[target].append(alias)
    return out


def _create_output(out: str):
    out = os.path.abspath(out)
    parent, name = os.path.split(out)
    dir_fd = files.open_directory(parent or ".")
    if os.path.lexists(out):
        os.close(dir_fd)
        raise FileExistsError(errno.EEXIST, "consolidate: output exists; refusing to replace it", out)
    try:
        fd, tmp = files.create_temporary_at(dir_fd, fsutil.temp_prefix(name))
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd, tmp, name, fd


def consolidate(path, out=None, fmt: str = "torch", *, output_dir=None, **hf_options) -> dict:
    """See the module doc. Returns {"tensors": n, "bytes": output size}. With output_dir instead
    of out: an HF folder of sharded safetensors (hf_export.export_hf; hf_options: max_shard_size,
    dtype, trainable_only, mode), and the result also lists its "files"."""
    if output_dir is not None:
        if out is not None:
            raise ValueError("consolidate: give out (one file) or output_dir (an HF folder), not both")
        from .hf_export import export_hf  # noqa: PLC0415

        return export_hf(path, output_dir, **hf_options)
    if hf_options:
        raise TypeError(f"consolidate: {sorted(hf_options)} apply to output_dir= only")
    if fmt not in ("torch", "safetensors"):
        raise ValueError(f"consolidate: format must be 'torch' or 'safetensors', got {fmt!r}")
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out):
        raise TypeError(f"consolidate: out must be a non-empty path, got {out!r}")
    with CheckpointReader(path) as reader:
        if fmt == "safetensors":
            reserved = [k for keys in _keys(reader.manifest).values() for k in keys if k == "__metadata__"]
            if reserved:
                raise ValueError(f"consolidate: the checkpoint has a tensor named '__metadata__', the key safetensors "
                                 f"reserves for its header; use --format torch")
        dir_fd, tmp, name, fd = _create_output(os.fspath(out))
        try:
            try:
                count = (_write_torch if fmt == "torch" else _write_safetensors)(reader, fd)
                os.fdatasync(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            fsutil.publish(dir_fd, tmp, name)
        except BaseException:
            fsutil.remove_quietly(dir_fd, tmp)
            raise
        finally:
            os.close(dir_fd)
    return {"tensors": count, "bytes": size}


def _write_torch(reader: CheckpointReader, fd: int) -> int:
    keys = _keys(reader.manifest)
    state = {}
    for name, value in iter_tensors(reader):
        for k in keys[name]:
            state[k] = value  # tied parameters: one tensor under every name (torch.save keeps the sharing)
    with os.fdopen(os.dup(fd), "wb") as f:
        torch.save(state, f)
    return len(state)


def _write_safetensors(reader: CheckpointReader, fd: int) -> int:
    m = reader.manifest
    keys = _keys(m)
    header, offset, order = {}, 0, []
    for name, t in m["tensors"].items():
        dtype = _out_dtype(t["dtype"])
        nbytes = t["numel"] * DTYPE_BYTES[dtype]
        for k in keys[name]:
            header[k] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": t["shape"], "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            order.append(name)
    header["__metadata__"] = {"format": "pt", "zeroplus_source": json.dumps(m["source"])}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fsutil.write_all(fd, struct.pack("<Q", len(raw)) + raw, 0)
    pos = 8 + len(raw)
    values = iter_tensors(reader)
    for name, value in values:
        data = value.contiguous().view(torch.uint8).reshape(-1).numpy() if value.numel() else b""
        for _ in keys[name]:
            fsutil.write_all(fd, data, pos)
            pos += len(data)
    return len(header) - 1


def inspect(path) -> dict:
    """Summary of a checkpoint, with every file's checksums verified (ok: True/False + error)."""
    with CheckpointReader(path) as reader:
        m = reader.manifest
        files = []
        for fi, f in enumerate(m["files"]):
            try:
                reader.verify_file(fi)
                status = "ok"
            except (CheckpointError, FileNotFoundError) as e:  # this file's damage; anything else raises
                status = f"{type(e).__name__}: {e}"
            files.append({"name": f["name"], "bytes": f["bytes"], "checksums": status})
        return {"path": reader.path, "version": m["version"], "source": m["source"],
                "tensors": {n: {"shape": t["shape"], "dtype": t["dtype"], "kind": t["kind"],
                                "optimizer_state": sorted(t.get("state", {}))} for n, t in m["tensors"].items()},
                "files": files, "bytes": sum(f["bytes"] for f in m["files"]),
                "ok": all(f["checksums"] == "ok" for f in files), "extra": m.get("extra")}
