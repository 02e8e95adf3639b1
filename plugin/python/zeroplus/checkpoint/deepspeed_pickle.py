"""Reading DeepSpeed's pickled checkpoint files without running pickle code.

DeepSpeed writes its checkpoints with torch.save, i.e. pickles. A pickle can name any importable
callable and have the unpickler call it, so a checkpoint from elsewhere is code. safe_load(fd,
where) reads one file with torch.load(weights_only=True) (torch's restricted unpickler: tensors,
containers, primitive types, OrderedDict, torch.Size, ...) plus an explicit allow-list of the
four classes DeepSpeed 0.19.8 puts in its ZeRO checkpoints, each mapped to a stand-in class
defined here under DeepSpeed's fully qualified name: nothing of DeepSpeed is imported or run,
and DeepSpeed need not be installed. Before unpickling, every global the file names is listed
(torch.serialization.get_unsafe_globals_in_checkpoint, which reads the opcodes and executes
nothing); any outside the allow-list refuses the file with UnsafeCheckpointError naming them.

The allow-list (what 0.19.8 writes; deepspeed/runtime/zero/stage_1_and_2.py and stage3.py
state_dict, runtime/fp16/loss_scaler.py, utils/tensor_fragment.py):
  deepspeed.runtime.fp16.loss_scaler.LossScaler          the static loss scaler (fp32, bf16)
  deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler   the fp16 dynamic loss scaler
  deepspeed.runtime.zero.config.ZeroStageEnum            the saved ZeRO stage
  deepspeed.utils.tensor_fragment.fragment_address       param_slice_mappings' entries
The stand-ins only hold the attributes the pickle sets (BUILD updates __dict__); they define no
__setstate__, __reduce__ or methods that run on load.

Files are opened by the caller through zeroplus.files (O_NOFOLLOW, regular files only) and read
here through /proc/self/fd/N with mmap=True: the tensors' storages are mapped, not read, so a
loader touching one partition of a large file pages in only that partition.

Writing (convert --to deepspeed, deepspeed_export.py): save(obj, fd) is torch.save with pickle's
Python pickler, which writes each stand-in class under DeepSpeed's name (the GLOBAL opcode
DeepSpeed's own pickles carry), so DeepSpeed's torch.load(weights_only=False) rebuilds its real
LossScaler / ZeroStageEnum / fragment_address, and zeroplus's allow-list reads the file back.
Nothing of DeepSpeed is imported for that either.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import os
import pickle
import types
import zipfile

import torch

from .format import CheckpointError


class UnsafeCheckpointError(CheckpointError):
    """A DeepSpeed checkpoint file names a class or function outside the allow-list (a pickle that
    would run code on load): refused, nothing in it was executed. .filename names the file."""


class LossScaler:
    """Stand-in for deepspeed.runtime.fp16.loss_scaler.LossScaler (attributes: cur_scale, dynamic)."""


class DynamicLossScaler:
    """Stand-in for deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler (cur_scale, cur_iter,
    last_overflow_iter, scale_factor, scale_window, min_scale, delayed_shift, cur_hysteresis, ...)."""


class ZeroStageEnum(enum.IntEnum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclasses.dataclass
class FragmentAddress:
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address."""

    numel: int = 0
    start: int = 0


ALLOWED = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}
_SAFE_GLOBALS = [(cls, name) for name, cls in ALLOWED.items()]


def _refuse(names, where: str):
    return UnsafeCheckpointError(errno.EPERM, f"deepspeed checkpoint: the file names {', '.join(sorted(names))}, "
                                              f"which zeroplus does not unpickle (only torch's weights_only types "
                                              f"and the classes DeepSpeed writes: {', '.join(sorted(ALLOWED))}); "
                                              f"refusing it, nothing in it was run", where)


def safe_load(fd: int, where: str):
    """The object torch.save wrote into the open file `fd` (named `where` in errors), unpickled
    with weights_only=True and the allow-list; CPU tensors, storages memory-mapped."""
    path = f"/proc/self/fd/{fd}"
    try:
        named = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except (zipfile.BadZipFile, RuntimeError, pickle.UnpicklingError, EOFError, ValueError, KeyError) as e:
        raise CheckpointError(errno.EINVAL, f"deepspeed checkpoint: not a torch.save zip file ({type(e).__name__}: "
                                            f"{e})", where) from None
    unknown = named - set(ALLOWED)
    if unknown:
        raise _refuse(unknown, where)
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:  # a global the scan above did not see (reported with its name)
        raise UnsafeCheckpointError(errno.EPERM, f"deepspeed checkpoint: refused by the restricted unpickler, "
                                                 f"nothing was run: {str(e).splitlines()[0]}", where) from None
    except (RuntimeError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(errno.EIO, f"deepspeed checkpoint: unreadable ({type(e).__name__}: {e})", where) from None


_WRITE_AS = {cls: name for name, cls in ALLOWED.items()}


class _DeepSpeedPickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    def save_global(self, obj, name=None):
        full = _WRITE_AS.get(obj) if isinstance(obj, type) else None
        if full is None:
            return super().save_global(obj, name)
        module, _, qualname = full.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())  # protocol 2, as torch.save writes
        self.memoize(obj)
        return None


_PICKLE_MODULE = types.ModuleType("zeroplus_deepspeed_pickle")
_PICKLE_MODULE.Pickler = _DeepSpeedPickler


def save(obj, fd: int) -> None:
    """torch.save(obj) into the open file `fd` (written from its current offset, fdatasync'ed; the
    caller closes it), the stand-ins pickled under DeepSpeed's class names."""
    with os.fdopen(os.dup(fd), "wb") as f:
        torch.save(obj, f, pickle_module=_PICKLE_MODULE, pickle_protocol=2)
        f.flush()
        os.fdatasync(f.fileno())
