"""torch.distributed.checkpoint storage through zeroplus: AioStorageWriter / AioStorageReader.

    import torch.distributed.checkpoint as dcp
    dcp.save(state_dict, storage_writer=zeroplus.checkpoint.AioStorageWriter(path))
    dcp.load(state_dict, storage_reader=zeroplus.checkpoint.AioStorageReader(path))

They are torch's FileSystemWriter / FileSystemReader (same plans, same on-disk layout, so either
side reads the other's checkpoints, and DCP reshards as it always does) over a file system layer
that adds what DCP's lacks:
  * every file is created exclusively (O_CREAT|O_EXCL|O_NOFOLLOW, relative to a directory
    descriptor opened O_DIRECTORY|O_NOFOLLOW): a planted symlink or an existing data file of an
    earlier save makes the save fail instead of writing through it or over it;
  * data bytes are written through zeroplus.aio.AioHandle (io_uring, several requests in flight
    while DCP serialises the next item), then fdatasync'ed through our own descriptor, whose inode
    is checked to be the one the engine wrote;
  * every rename (DCP's `.metadata.tmp` -> `.metadata`, the commit point) is followed by an fsync
    of the directory, so a crash after dcp.save returned cannot lose the metadata;
  * reads open files with O_NOFOLLOW; the checkpoint directory itself may be a symbolic link of
    this user or root, never of another user (files.open_directory).
sync_files=True is forced (it is what makes a save durable).

Trust model of AioStorageReader (docs/security.md): DCP's `.metadata` is a pickle, and torch's
reader unpickles it whole, so a crafted checkpoint runs code as the user who loads it. This reader
unpickles it with an allow-list (_MetadataUnpickler: the classes torch writes into DCP metadata,
torch dtypes and torch.Size, nothing that runs code) and refuses anything else with
CheckpointError naming the file, before reading any data. Every `relative_path` the metadata
names must be a plain file name inside the checkpoint directory (DCP writes no others): `..`, a
separator or an absolute path is refused the same way, so no read leaves the directory. Data
items themselves are read by torch as torch's reader reads them (torch.load(weights_only=True)).
"""

from __future__ import annotations

import errno
import io
import os
import pickle
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter

from .. import files
from . import fsutil
from .format import CheckpointError


class _AioWriteStream(io.RawIOBase):
    """A write-only stream whose writes are queued on an AioHandle at increasing offsets (each
    write's bytes copied first: the caller may reuse its buffer); close() waits for them and
    fdatasyncs. tell() is the bytes written so far (DCP records item offsets with it)."""

    def __init__(self, fd: int, path: str):
        from ..aio import AioHandle

        super().__init__()
        self._fd, self._path, self._offset = fd, path, 0
        self._handle = AioHandle(block_size=1 << 20, queue_depth=16, threads=1, direct="off")
        self._keep: list[torch.Tensor] = []
        self._kept = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if n:
            t = torch.frombuffer(bytearray(view), dtype=torch.uint8)
            self._handle.async_pwrite(t, self._path, self._offset)
            self._keep.append(t)
            self._kept += n
            if self._kept >= 256 << 20:  # bound the copies in flight
                self._drain()
        self._offset += n
        return n

    def _drain(self) -> None:
        try:
            self._handle.wait()
        finally:
            self._keep.clear()
            self._kept = 0

    def tell(self) -> int:
        return self._offset

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._drain()
            os.fdatasync(self._fd)
            st = os.fstat(self._fd)
            here = os.stat(self._path, follow_symlinks=False)
            if (here.st_ino, here.st_dev) != (st.st_ino, st.st_dev) or st.st_size != self._offset:
                raise OSError(errno.EIO, "dcp storage: file changed under the writer", self._path)
        finally:
            os.close(self._fd)
            super().close()


class _DurableFileSystem(FileSystem):
    """DCP's FileSystem with exclusive, symlink-refusing creation, aio writes and durable renames."""

    @contextmanager
    def create_stream(self, path, mode: str):
        path = Path(path)
        dir_fd = files.open_directory(str(path.parent))
        try:
            if mode == "wb":
                fd = files.create_exclusive_at(dir_fd, path.name)
                stream = _AioWriteStream(fd, str(path))
                try:
                    yield stream
                except BaseException:
                    try:
                        stream.close()
                    finally:
                        fsutil.remove_quietly(dir_fd, path.name)
                    raise
                stream.close()  # waits for the data and fdatasyncs it
                os.fsync(dir_fd)  # the new directory entry
            elif mode == "rb":
                with os.fdopen(files.open_regular_at(dir_fd, path.name), "rb") as f:
                    yield f
            else:
                raise ValueError(f"dcp storage: unsupported stream mode {mode!r}")
        finally:
            os.close(dir_fd)

    def rename(self, path, new_path) -> None:
        path, new_path = Path(path), Path(new_path)
        if path.parent != new_path.parent:
            raise ValueError(f"dcp storage: rename across directories ({path} -> {new_path})")
        dir_fd = files.open_directory(str(path.parent))
        try:
            fsutil.publish(dir_fd, path.name, new_path.name, replace=True)
        finally:
            os.close(dir_fd)

    def mkdir(self, path) -> None:
        os.makedirs(path, 0o700, exist_ok=True)


class AioStorageWriter(FileSystemWriter):
    """torch.distributed.checkpoint.FileSystemWriter over zeroplus's durable file layer (module
    doc). Same arguments as FileSystemWriter; sync_files is always True."""

    def __init__(self, path, *args, **kwargs):
        kwargs["sync_files"] = True
        super().__init__(path, *args, **kwargs)
        self.fs = _DurableFileSystem()
        self.path = self.fs.init_path(path)


_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "ChunkStorageMetadata",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name, from torch's own table
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, resolving only the globals in _METADATA_CLASSES and torch dtypes:
    a pickle naming anything else (os.system, builtins.eval, ...) raises UnpicklingError before
    the object it names exists."""

    def find_class(self, module, name):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")


def _check_relative_path(relative_path, where: str) -> None:
    if (not isinstance(relative_path, str) or not relative_path or "/" in relative_path or "\0" in relative_path
            or relative_path in (".", "..")):
        raise CheckpointError(errno.EINVAL, f"dcp storage: the metadata names the data file {relative_path!r}, which is "
                                            f"not a plain file name inside the checkpoint directory (refusing a path "
                                            f"that could leave it)", where)


def check_storage_data(storage_data, where: str) -> None:
    """Every entry a DCP read will follow: a plain file name, a non-negative offset and length."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(storage_data, dict):
        raise CheckpointError(errno.EINVAL, f"dcp storage: storage_data is a {type(storage_data).__name__}, "
                                            f"expected a dict", where)
    for index, info in storage_data.items():
        if not isinstance(info, _StorageInfo):
            raise CheckpointError(errno.EINVAL, f"dcp storage: storage_data[{index!r}] is a {type(info).__name__}",
                                  where)
        _check_relative_path(info.relative_path, where)
        for field in ("offset", "length"):
            value = getattr(info, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(errno.EINVAL, f"dcp storage: storage_data[{index!r}].{field} is {value!r}, "
                                                    f"expected an int >= 0", where)


class AioStorageReader(FileSystemReader):
    """torch.distributed.checkpoint.FileSystemReader opening files with O_NOFOLLOW, unpickling
    the metadata with an allow-list and confining every data file to the directory (module doc)."""

    def __init__(self, path, *args, **kwargs):
        super().__init__(path, *args, **kwargs)
        self.fs = _DurableFileSystem()
        self.path = self.fs.init_path(path)

    def _metadata_path(self, rank):
        # torch >= 2.13 names per-rank metadata (__<rank>.metadata, no rank coordination); older
        # readers have only the one file.
        if hasattr(self, "_get_metadata_path"):
            return self._get_metadata_path(rank)
        return self.fs.concat_path(self.path, ".metadata")

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        path = self._metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, KeyError, TypeError,
                    ValueError) as e:
                raise CheckpointError(errno.EINVAL, f"dcp storage: refusing the checkpoint's metadata "
                                                    f"({type(e).__name__}: {e}); AioStorageReader unpickles only "
                                                    f"DCP's own metadata classes", str(path)) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(errno.EINVAL, f"dcp storage: the metadata is a {type(metadata).__name__}, not a DCP "
                                                f"Metadata", str(path))
        check_storage_data(metadata.storage_data, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        # Every rank, whatever read the metadata (rank 0 may have sent it over): what read_data follows.
        check_storage_data(metadata.storage_data, str(self._metadata_path(None)))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
