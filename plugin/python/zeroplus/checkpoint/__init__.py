"""zeroplus checkpoints: sharded, crash-consistent, reshardable across world sizes and stages.

    handle = zeroplus.save_checkpoint("ckpt/step100", model, opt, extra={"step": 100})
    extra = zeroplus.load_checkpoint("ckpt", model, opt)      # follows ckpt/latest

Format (format.py), the write path (shard_io.py, commit.py, save.py), the read path (reader.py,
load.py), what each optimizer owns (adapters.py), torch.distributed.checkpoint storage classes
(dcp_storage.py) and the CLI (`python -m zeroplus.checkpoint`,
cli.py). Guarantees and the format: docs/checkpoints.md.
"""

from .dcp_storage import AioStorageReader, AioStorageWriter
from .format import CheckpointCorruptError, CheckpointError, CheckpointVersionError
from .load import load_checkpoint
from .reader import CheckpointReader
from .save import CheckpointHandle, CheckpointOptions, release_snapshot_memory, save_checkpoint

__all__ = ["AioStorageReader", "AioStorageWriter", "CheckpointCorruptError", "CheckpointError", "CheckpointHandle", "CheckpointOptions", "CheckpointReader",
           "CheckpointVersionError", "load_checkpoint", "release_snapshot_memory", "save_checkpoint"]
