"""Which reader a checkpoint path needs: zeroplus's own format or a DeepSpeed ZeRO checkpoint.

    reader = open_reader(path, adapter)

A directory holding manifest.json (or a root whose `latest` names one) is zeroplus's format
(reader.CheckpointReader). A DeepSpeed checkpoint -- a tag directory of *_optim_states.pt files,
or a root whose `latest` names one (deepspeed_layout.resolve) -- gets deepspeed_reader's
DeepSpeedReader, fitted to the loading optimizer (`adapter`). Both expose the same manifest and
read_many, so load.py has one path for both. Anything else goes to CheckpointReader, whose
errors name what is missing.
"""

from __future__ import annotations

import os

from .reader import CheckpointReader


def open_reader(path, adapter=None):
    from .deepspeed_layout import resolve  # noqa: PLC0415 - the DeepSpeed modules load only for DeepSpeed paths

    if isinstance(path, (str, os.PathLike)) and os.fspath(path) and resolve(path) is not None:
        from .deepspeed_reader import DeepSpeedReader  # noqa: PLC0415

        return DeepSpeedReader(path, adapter)
    return CheckpointReader(path)
