"""The tensors of another safetensors directory, mapped rather than read: a `sync` source."""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch

from hotweights.checkpoint.dtypes import TORCH
from hotweights.checkpoint.fileid import FileId
from hotweights.checkpoint.result import not_a_directory
from hotweights.checkpoint.shards import INDEX_NAME, SINGLE_NAME, read_dir
from hotweights.errors import CheckpointError

__all__ = ["Tensors", "open_dir"]


class Tensors(dict):
    """name -> tensor, each a view of a private mapping of its shard.

    Each tensor keeps its shard's mapping alive by itself (`torch.frombuffer` holds a
    reference to the mmap object): a shard is unmapped once no tensor of it is left.
    """

    def __init__(self, tensors: dict[str, torch.Tensor],
                 files: dict[str, FileId] | None = None):
        super().__init__(tensors)
        self.files = files or {}  # shard path -> the file as its header was read

    def changed(self) -> str | None:
        """The first shard whose file changed or was replaced since it was mapped (a writer
        into its directory: the tensors read may mix its versions), or None. A private
        mapping still reads the file's pages it has not copied."""
        for path, was in self.files.items():
            try:
                st = os.stat(path)
            except OSError:
                return path
            if not was.unchanged(FileId.of_stat(st)):
                return path
        return None

    def close(self) -> None:
        """Drop the tensors: each shard is unmapped with the last of them. Not `mmap.close`:
        `torch.frombuffer` keeps no buffer export that would make it refuse, and it would
        unmap the shard under a tensor still held elsewhere (a traceback's, a caller's),
        whose next read crashes the process."""
        self.clear()


def open_dir(model_dir: str | os.PathLike, *, skip_unknown: bool = False,
             strict: bool = False) -> Tensors:
    """Map every tensor of the safetensors checkpoint in `model_dir`, without copying.

    Each shard is mapped copy-on-write (`mmap.ACCESS_COPY`): the tensors read the file's
    pages as they are touched, and writing into one changes this process's copy only,
    never the file. A writer into the directory meanwhile shows in `Tensors.changed()`.

    Args:
        model_dir: a directory with `model.safetensors` or a sharded index.
        skip_unknown: leave out the tensors of a dtype with no torch equivalent here (e.g.
            F4) instead of raising.
        strict: refuse a tensor that two shards hold (`shards.read_dir`): a sync's source,
            whose copy the loader of that checkpoint may not take.

    Returns:
        A `Tensors` mapping (a dict) of name -> CPU tensor, in the file's dtype and shape.

    Raises:
        CheckpointError: the directory holds no safetensors, a header is bad (as
            `shards.read_dir`, with `strict`), or a tensor's dtype has no torch equivalent
            here.
    """
    if not os.path.isdir(model_dir):
        raise not_a_directory(model_dir)
    disk = read_dir(model_dir, strict=strict)
    if disk is None:
        raise CheckpointError(f"{model_dir}: no safetensors checkpoint (neither "
                              f"{SINGLE_NAME} nor {INDEX_NAME})")
    mmaps: dict[str, mmap.mmap] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, (shard, info) in disk.items():
        dtype = TORCH.get(info.dtype)
        if dtype is None and skip_unknown:
            continue
        if dtype is None:
            raise CheckpointError(f"{Path(shard.path).name}: tensor {name} is {info.dtype}; "
                                  f"supported: {', '.join(TORCH)}")
        count = math.prod(info.shape)
        if count == 0:
            tensors[name] = torch.empty(info.shape, dtype=dtype)
            continue
        if shard.path not in mmaps:
            mmaps[shard.path] = _map(shard.path, shard.size)
        flat = torch.frombuffer(mmaps[shard.path], dtype=dtype, count=count,
                                offset=info.begin)
        tensors[name] = flat.view(info.shape)
    return Tensors(tensors, {shard.path: shard.file for shard, _ in disk.values()})


def _map(path: str, size: int) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise CheckpointError(f"{path}: changed size since its header was read")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot map: {e.strerror}") from e
