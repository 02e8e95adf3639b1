"""`python -m zeroplus.checkpoint convert --from deepspeed DS_DIR OUT`: a DeepSpeed ZeRO checkpoint
rewritten as a native zeroplus checkpoint (format.py), streaming.

    convert_from_deepspeed("runs/ds", "ckpt/step300")  -> {"tensors", "bytes", "files", "stage", "world_size"}

DS_DIR is what load_checkpoint accepts (a root whose `latest` names a global_stepN directory, or
that directory). OUT is a new checkpoint directory (its name one plain path component, so a
`latest` file can name it); an existing OUT raises FileExistsError and is left alone.

Streaming: DeepSpeed rank r's optim file becomes rank r's shard file rankNNNNN.bin, one at a time:
the file is memory-mapped, its partition's fp32 masters and elementwise optimizer state are
written piece by piece through the checkpoints' own shard writer (shard_io.ShardFile: one
parameter's piece in memory at a time), the file is fdatasync'ed and published, and
the mapping dropped before the next rank's file is opened. So the peak is one DeepSpeed rank's
partition (its pages, mapped) plus one parameter piece; the model is never assembled. Rank 0's
shard also holds the buffers and (stages 1-2) the frozen parameters; at stage 3 each rank's shard
holds its fragments of the frozen parameters.

Crash consistency is the format's: OUT is created 0700 first, the shard files are written and
synced, and manifest.json (without which a directory is not a checkpoint) is written last
(temporary name, fdatasync, rename, fsync). On any error OUT is removed. The manifest carries
DeepSpeed's param groups (its own keys bias_correction, adam_w_mode, ... dropped), loss scaler,
step counts, and, as `extra`, the scheduler state and step counters (deepspeed_reader.py); an
extra value JSON cannot hold (a client_state object) raises TypeError naming it, before anything
is written.
"""

from __future__ import annotations

import os


from . import fsutil
from .deepspeed_reader import DeepSpeedReader
from .format import BLOCK_BYTES, FORMAT, MANIFEST, VERSION, check_dir_name, check_json, manifest_for_save
from .shard_io import ShardFile


def _write_rank(reader: DeepSpeedReader, writer: ShardFile, rank: int, index: int, chunks: list) -> None:
    lay, m = reader.layout, reader.manifest
    for name, pieces in lay.pieces.items():
        keys = ["param"] + sorted(m["tensors"][name].get("state", {}))
        for lo, hi, r, _g, _off in pieces:
            if r != rank:
                continue
            for key, value in zip(keys, reader.read_many([(name, k, lo, hi) for k in keys])):
                chunks.append([name, key, lo, hi, str(value.dtype).replace("torch.", ""), index, writer.place(value)])
    for name, t in m["tensors"].items():
        if t["kind"] == "param" and t["trainable"] or not t["numel"]:
            continue
        if t["kind"] == "buffer" or lay.stage < 3:
            if rank != 0:
                continue
            lo, hi = 0, t["numel"]
        else:  # stage 3 frozen parameter: this rank's fragment
            part = -(-t["numel"] // lay.world)
            lo, hi = min(rank * part, t["numel"]), min((rank + 1) * part, t["numel"])
            if lo >= hi:
                continue
        key = "value" if t["kind"] == "buffer" else "param"
        value = reader.read_many([(name, key, lo, hi)])[0]
        chunks.append([name, key, lo, hi, str(value.dtype).replace("torch.", ""), index, writer.place(value)])


def convert_from_deepspeed(src, out) -> dict:
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"convert: out must be a str or os.PathLike, got {type(out).__name__}")
    out = os.path.abspath(os.fspath(out))
    parent, name = os.path.split(out)
    check_dir_name(name, f"convert: out {out!r}")
    with DeepSpeedReader(src) as reader:
        m = reader.manifest
        extra = check_json(m["extra"], "extra")  # before anything is written
        tensors = {n: {k: v for k, v in t.items() if k != "numel"} for n, t in m["tensors"].items()}
        with fsutil.new_output_directory(parent, name) as dir_fd:  # removed again on any error
            file_recs, chunks = _write_all(reader, dir_fd, out)
            manifest = {"format": FORMAT, "version": VERSION, "source": m["source"], "block_bytes": BLOCK_BYTES,
                        "files": file_recs, "tensors": tensors, "aliases": m["aliases"], "chunks": chunks,
                        "param_groups": m["param_groups"], "optimizer": m["optimizer"], "extra": extra,
                        "save_id": f"convert-from-deepspeed:{name}"}
            fsutil.write_small_file(dir_fd, MANIFEST, manifest_for_save(manifest))  # last, with its own checksum
        return {"tensors": len(tensors), "bytes": sum(f["bytes"] for f in file_recs), "files": len(file_recs),
                "stage": reader.layout.stage, "world_size": reader.layout.world}


def _write_all(reader: DeepSpeedReader, dir_fd: int, dir_path: str) -> tuple[list, list]:
    file_recs, chunks = [], []
    for rank in range(reader.layout.world):
        # The checkpoints' own writer (shard_io.ShardFile: temporary name, fdatasync, no-replace
        # publish), through the page cache as a save's default.
        writer = ShardFile(dir_fd, dir_path, rank, io="aio", direct="off")
        try:
            _write_rank(reader, writer, rank, rank, chunks)
            file_recs.append(writer.finish())
        finally:
            writer.abandon()
        reader.drop_rank(rank)  # the mapping of this rank's file goes before the next is opened
    return file_recs, chunks
