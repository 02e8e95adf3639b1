"""zeroplus checkpoints: sharded, crash-consistent, reshardable across world sizes and stages.

    handle = zeroplus.save_checkpoint("ckpt/step100", model, opt, extra={"step": 100})
    extra = zeroplus.load_checkpoint("ckpt", model, opt)      # follows ckpt/latest

Format (format.py), the write path (shard_io.py, commit.py, save.py), the read path (reader.py,
load.py), what each optimizer owns (adapters.py), torch.distributed.checkpoint storage classes
(dcp_storage.py), zeroplus's state as DCP state dicts (get_state_dict / set_state_dict,
dcp_state.py), offline consolidation and inspection (consolidate.py), export as an HF folder of
sharded safetensors (hf_export.py) and their command line (`python -m zeroplus.checkpoint`,
`zeroplus-checkpoint`, __main__.py). Guarantees and the format: docs/checkpoints.md.
DeepSpeed ZeRO checkpoints (docs/from_deepspeed.md): which reader a path needs (sources.py),
DeepSpeed's pickles without running them (deepspeed_pickle.py), its files and flat partitions
(deepspeed_layout.py), the bridge into load.py (deepspeed_reader.py), `convert --from deepspeed`
(deepspeed_convert.py) and back, `convert --to deepspeed` (deepspeed_export.py: convert_to_deepspeed).
"""

# The functions shadow the module of the same name (zeroplus.checkpoint.consolidate is the function).
from .consolidate import consolidate, inspect, load_fp32_state_dict  # noqa: E402 - after the module doc
from .format import CheckpointCorruptError, CheckpointError, CheckpointVersionError
from .load import load_checkpoint
from .reader import CheckpointReader
from .save import CheckpointHandle, CheckpointOptions, release_snapshot_memory, save_checkpoint

__all__ = ["AioStorageReader", "AioStorageWriter", "CheckpointCorruptError", "CheckpointError", "CheckpointHandle",
           "CheckpointOptions", "CheckpointReader", "CheckpointVersionError", "consolidate", "export_hf",
           "get_state_dict", "inspect", "load_checkpoint", "load_fp32_state_dict", "release_snapshot_memory",
           "save_checkpoint", "set_state_dict"]


def __getattr__(name: str):
    # torch.distributed.checkpoint costs ~0.1 s to import: only for the users of these classes.
    if name in ("AioStorageReader", "AioStorageWriter"):
        from . import dcp_storage

        return getattr(dcp_storage, name)
    if name in ("get_state_dict", "set_state_dict"):
        from . import dcp_state

        return getattr(dcp_state, name)
    if name == "export_hf":
        from .hf_export import export_hf

        return export_hf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
