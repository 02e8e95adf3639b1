"""Export of a checkpoint as a Hugging Face folder of sharded safetensors, in bounded memory.

export_hf(path, output_dir, max_shard_size="5GB", dtype="fp32", trainable_only=False, mode=0o644)
writes what `save_pretrained(..., safe_serialization=True)` writes for the weights:

    model-00001-of-00003.safetensors ...   each at most max_shard_size bytes (a tensor larger than
    model.safetensors.index.json            that gets a file of its own); one file is written as
                                            model.safetensors, without an index, as HF does

so that `from_pretrained(output_dir)` (after the user adds config.json) and
`safetensors.torch.load_file` read it as it is. Keys are the model's state_dict keys; a tied
parameter (an alias in the manifest) is written once, under its first name, as HF saves tied
weights (`from_pretrained` ties them again). Floating tensors are written in `dtype` (the fp32
master where the optimizer keeps one, converted); integer and bool tensors keep theirs.
trainable_only=True writes the parameters that were trainable when saved (PEFT adapters), no
frozen parameter and no buffer.

Memory: the shards are planned from the manifest (sizes and names, no tensor read), then written
one tensor at a time at its offset: the peak is the largest tensor (read, then converted), not a
shard, nor the model.

Files: the folder is built under a private temporary name beside output_dir (0700 while it is
incomplete) and renamed into place when every file is synced, with renameat2(RENAME_NOREPLACE):
output_dir appears complete or not at all, and an existing output_dir is never replaced
(FileExistsError). Files are created exclusively, never through a link, and get exactly `mode`
(0644 by default, whatever the umask); the folder gets `mode` plus search bits where it grants
read. On any error nothing is left behind.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct

import torch

from .. import files
from . import fsutil
from .consolidate import SAFETENSORS_DTYPE, read_tensor
from .format import DTYPE_BYTES
from .reader import CheckpointReader

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_FLOATING = ("float32", "float64", "float16", "bfloat16")
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16"}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_shard_size(value) -> int:
    """Bytes from an int or a string as HF's max_shard_size takes it ("5GB" = 5e9, "500MiB")."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"export_hf: max_shard_size must be an int or a string like '5GB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"export_hf: max_shard_size must look like '5GB', '500MiB' or a byte count, got {value!r}")
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if size <= 0:
        raise ValueError(f"export_hf: max_shard_size must be positive, got {value!r}")
    return size


def _plan(manifest: dict, dtype: str, trainable_only: bool, max_bytes: int):
    """[(file name, [(key, manifest name, out dtype, nbytes), ...]), ...] in manifest order."""
    items = []
    for name, t in manifest["tensors"].items():
        if trainable_only and not (t["kind"] == "param" and t.get("trainable", True)):
            continue
        if name == "__metadata__":
            # safetensors keeps its metadata under this key: a tensor of that name would make the
            # file unreadable.
            raise ValueError("export_hf: the checkpoint has a tensor named '__metadata__', which safetensors "
                             "reserves for its metadata; rename the parameter or buffer")
        out = dtype if t["dtype"] in _FLOATING else t["dtype"]
        items.append((name, name, out, t["numel"] * DTYPE_BYTES[out]))
    if not items:
        raise ValueError("export_hf: nothing to export (trainable_only=True and no trainable parameter was saved)"
                         if trainable_only else "export_hf: the checkpoint holds no tensor")
    shards, current, size = [], [], 0
    for item in items:  # HF's rule: a tensor starts a new file when it would overflow a non-empty one
        if current and size + item[3] > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item[3]
    shards.append(current)
    if len(shards) == 1:
        return [(SINGLE_NAME, shards[0])]
    n = len(shards)
    return [(f"model-{k + 1:05d}-of-{n:05d}.safetensors", s) for k, s in enumerate(shards)]


def _write_shard(reader: CheckpointReader, fd: int, items, source: dict) -> None:
    header, offset = {}, 0
    for key, _name, out, nbytes in items:
        header[key] = {"dtype": SAFETENSORS_DTYPE[out], "shape": reader.manifest["tensors"][_name]["shape"],
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "zeroplus_source": json.dumps(source)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fsutil.write_all(fd, struct.pack("<Q", len(raw)) + raw, 0)
    pos = 8 + len(raw)
    for _key, name, out, nbytes in items:
        if nbytes:
            value = read_tensor(reader, name, getattr(torch, out))
            fsutil.write_all(fd, value.contiguous().view(torch.uint8).reshape(-1).numpy(), pos)
            del value
        pos += nbytes


def _write_file(dir_fd: int, name: str, mode: int, write) -> int:
    fd = files.create_exclusive_at(dir_fd, name, 0o600)
    try:
        write(fd)
        os.fdatasync(fd)
        os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def export_hf(path, output_dir, max_shard_size="5GB", dtype: str = "fp32", trainable_only: bool = False,
              mode: int = 0o644) -> dict:
    """See the module doc. Returns {"files": [names], "tensors": n, "bytes": total file bytes}."""
    if not isinstance(output_dir, (str, os.PathLike)) or not os.fspath(output_dir):
        raise TypeError(f"export_hf: output_dir must be a non-empty path, got {output_dir!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"export_hf: dtype must be one of fp32, bf16, fp16, got {dtype!r}")
    if not isinstance(trainable_only, bool):
        raise TypeError(f"export_hf: trainable_only must be a bool, got {trainable_only!r}")
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
        raise ValueError(f"export_hf: mode must be a permission mode in [0, 0o777], got {mode!r}")
    max_bytes = parse_shard_size(max_shard_size)
    out = os.path.abspath(os.fspath(output_dir))
    parent, name = os.path.split(out)
    with CheckpointReader(path) as reader:
        plan = _plan(reader.manifest, _DTYPES[dtype], trainable_only, max_bytes)
        parent_fd = files.open_directory(parent)  # the user's or root's link is followed, another's refused
        stage_name = files.temporary_name(fsutil.temp_prefix(name))
        try:
            if os.path.lexists(out):
                raise FileExistsError(errno.EEXIST, "export_hf: output_dir exists; refusing to replace it", out)
            stage_fd = files.make_private_directory_at(parent_fd, stage_name)
            try:
                total = 0
                for file_name, items in plan:
                    total += _write_file(stage_fd, file_name, mode,
                                         lambda fd, items=items: _write_shard(reader, fd, items, reader.manifest["source"]))
                if len(plan) > 1:
                    index = {"metadata": {"total_size": sum(i[3] for _f, items in plan for i in items)},
                             "weight_map": {key: f for f, items in plan for key, *_ in items}}
                    data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
                    total += _write_file(stage_fd, INDEX_NAME, mode, lambda fd: fsutil.write_all(fd, data, 0))
                os.fsync(stage_fd)
                os.fchmod(stage_fd, mode | ((mode & 0o444) >> 2))
            finally:
                os.close(stage_fd)
            fsutil.rename_noreplace(parent_fd, stage_name, name)
            os.fsync(parent_fd)
        except BaseException:
            files.remove_tree_at(parent_fd, stage_name)
            raise
        finally:
            os.close(parent_fd)
    names = [f for f, _ in plan] + ([INDEX_NAME] if len(plan) > 1 else [])
    return {"files": names, "tensors": sum(len(items) for _f, items in plan), "bytes": total}
