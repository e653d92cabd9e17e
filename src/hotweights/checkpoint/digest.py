"""Which weights a checkpoint holds: a digest of its tensors' bytes, and the tensors mapped.

A `--remote` server reports the digest of the checkpoint it loaded while nothing has been
applied to it since; a trainer holding the same checkpoint (`RemoteGroup(checkpoint=...)`)
then sends it only what differs from it, instead of the whole model.
"""

from __future__ import annotations

import mmap
import os
import warnings

import numpy as np
import torch
import xxhash

from hotweights.checkpoint.shards import read_dir
from hotweights.checkpoint.sync import DTYPES

__all__ = ["digest", "mapped", "stats"]


def stats(model_dir: str | os.PathLike) -> dict[str, list[int]]:
    """Shard path -> [size, mtime_ns, inode]: any sync (in place or by rename) changes it."""
    found = read_dir(model_dir) or {}
    return {p: [st.st_size, st.st_mtime_ns, st.st_ino]
            for p in sorted({shard.path for shard, _ in found.values()})
            for st in [os.stat(p)]}


def digest(model_dir: str | os.PathLike) -> str | None:
    """xxh3-128 over every tensor in name order (name, dtype, shape, bytes), whatever the
    sharding; None for a directory without safetensors."""
    tensors = mapped(model_dir)
    if not tensors:
        return None
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def mapped(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """name -> the checkpoint's tensor, a read-only view of a memory map of its shard (no
    copy; the pages stay the page cache's; a map closes with the last tensor viewing it).
    Write nothing to them."""
    maps: dict[str, mmap.mmap] = {}
    out = {}
    with warnings.catch_warnings():  # torch warns of the read-only buffer
        warnings.simplefilter("ignore", UserWarning)
        for name, (shard, info) in (read_dir(model_dir) or {}).items():
            if shard.path not in maps:
                with open(shard.path, "rb") as f:
                    maps[shard.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            out[name] = torch.from_numpy(np.frombuffer(
                maps[shard.path], np.uint8, info.nbytes, info.begin)).view(
                DTYPES[info.dtype]).view(info.shape)
    return out
