"""A zeroplus checkpoint inside a framework's checkpoint directory (docs/integrations.md).

The integrations save and resume the way the frameworks drive DeepSpeed's engine: the framework
owns its checkpoint directory (HF's `checkpoint-N`, Lightning's `epoch=0-step=2.ckpt`,
accelerate's `save_state` folder) and its own small files in it (trainer state, scheduler, RNG,
loop state); the model weights and the optimizer state, sharded or not, go through
zeroplus.save_checkpoint into the subdirectory `zeroplus` of that directory, and come back
through zeroplus.load_checkpoint at any world size and stage.

    save(directory, model, opt)            collective: DIRECTORY/zeroplus (DIRECTORY/latest names it),
                                           with opt.lr_scheduler's state (a config scheduler) in its extra
    load(directory, model, opt, who)       collective; FileNotFoundError naming `who` without one
    require(directory, who)                the same check, before the engine exists
    write_state_file(directory, name, obj) this rank writes torch.save(obj) crash-consistently
    read_state_file(directory, name)       torch.load(weights_only=True) of such a file

Small framework files are written with the checkpoint package's rules (a temporary name created
O_EXCL|O_NOFOLLOW relative to a descriptor of the directory, fdatasync, rename), so a planted
symlink is replaced, never followed.
"""

from __future__ import annotations

import errno
import io
import os

import torch

from .. import files
from ..checkpoint import fsutil
from ..checkpoint.load import load_checkpoint
from ..checkpoint.save import save_checkpoint
from . import unwrap_optimizer

SUBDIR = "zeroplus"


def _checkpoint_path(directory, who: str) -> str:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"{who}: the checkpoint directory must be a str or os.PathLike, got "
                        f"{type(directory).__name__}")
    return os.path.join(os.fspath(directory), SUBDIR)


def save(directory, model, opt, who: str = "save") -> str:
    """Collective over the optimizer's group: model and optimizer state into DIRECTORY/zeroplus,
    with the state of a config scheduler (opt.lr_scheduler, stepped by opt.step()) in its extra."""
    path = _checkpoint_path(directory, who)
    engine = unwrap_optimizer(opt)
    scheduler = getattr(engine, "lr_scheduler", None)
    extra = None if scheduler is None else {"lr_scheduler": scheduler.state_dict()}
    save_checkpoint(path, model, engine, extra=extra)
    return path


def require(directory, who: str) -> str:
    """DIRECTORY/zeroplus, or FileNotFoundError saying what the directory is missing."""
    path = _checkpoint_path(directory, who)
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        raise FileNotFoundError(errno.ENOENT, f"{who}: no zeroplus checkpoint in this directory (expected "
                                              f"{SUBDIR}/manifest.json, written when a zeroplus integration saves a "
                                              f"checkpoint)", os.fspath(directory))
    return path


def load(directory, model, opt, who: str = "load") -> None:
    """Collective: model weights, optimizer state and the config scheduler's state from
    DIRECTORY/zeroplus. On any error (every rank raises) model and optimizer are untouched."""
    engine = unwrap_optimizer(opt)
    extra = load_checkpoint(require(directory, who), model, engine) or {}
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and extra.get("lr_scheduler") is not None:
        scheduler.load_state_dict(extra["lr_scheduler"])


def write_state_file(directory, name: str, obj) -> None:
    """torch.save(obj) as DIRECTORY/NAME on this rank: temporary file, fdatasync, rename."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    dir_fd = files.open_directory_at(None, os.fspath(directory), owned=True)
    try:
        fsutil.write_small_file(dir_fd, name, buf.getvalue(), replace=True)
    finally:
        os.close(dir_fd)


def read_state_file(directory, name: str, weights_only: bool | None = True):
    """torch.load of DIRECTORY/NAME (no symlink followed at the last component)."""
    dir_fd = files.open_directory_at(None, os.fspath(directory))
    try:
        fd = files.open_regular_at(dir_fd, name)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=weights_only)
