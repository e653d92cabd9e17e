"""Which weights a checkpoint holds: a digest of its tensors' bytes.

A `--remote` server reports the digest of the checkpoint it loaded while nothing has been
applied to it since; a trainer holding the same checkpoint (`RemoteGroup(checkpoint=...)`)
then sends it only what differs from it (read through `source.open_dir`'s memory maps),
instead of the whole model.
"""

from __future__ import annotations

import os

import torch
import xxhash

from hotweights.checkpoint.fileid import FileId
from hotweights.checkpoint.shards import read_dir
from hotweights.checkpoint.source import open_dir

__all__ = ["digest", "stats"]


def stats(model_dir: str | os.PathLike) -> dict[str, list[int]]:
    """Shard path -> [size, mtime_ns, inode]: any sync (in place or by rename) changes it."""
    found = read_dir(model_dir) or {}
    return {p: [f.size, f.mtime_ns, f.ino]
            for p in sorted({shard.path for shard, _ in found.values()})
            for f in [FileId.of(p)]}


def digest(model_dir: str | os.PathLike) -> str | None:
    """xxh3-128 over every tensor in name order (name, dtype, shape, bytes), whatever the
    sharding, read through memory maps; None for a directory without safetensors."""
    if read_dir(model_dir) is None:
        return None
    tensors = open_dir(model_dir)
    try:
        h = xxhash.xxh3_128()
        for name in sorted(tensors):
            t = tensors[name]
            h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        return h.hexdigest()
    finally:
        tensors.close()
