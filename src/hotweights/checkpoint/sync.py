"""`sync`: write the live weights into a safetensors directory, only the blocks that changed.

Journal mode (this slice): every tensor is checked against the shard headers first (name,
dtype, shape: nothing is written if one disagrees); the changed blocks are found from the
shard's sidecar fingerprints (`.hotweights/SHARD.blocks.json`), or, when the sidecar is
missing, corrupt or stale (the shard changed behind its back), by comparing with the file;
they go through one redo journal for the whole directory (`checkpoint.journal`), are
applied in place, and fresh sidecars record the new state and the weight version.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hotweights import blocks
from hotweights.checkpoint import journal
from hotweights.checkpoint.shards import Shard, TensorInfo, read_dir, read_shard
from hotweights.errors import CheckpointError, HotweightsError

logger = logging.getLogger(__name__)

SIDECAR_FORMAT = 1
SIDECAR_DIR = ".hotweights"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16,
           "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


@dataclass(frozen=True)
class SyncResult:
    """What a sync did. `to_json()` for the CLI."""

    mode: str
    version: str | None
    tensors_synced: int
    tensors_changed: int
    shards_changed: tuple[str, ...]
    bytes_hashed: int  # live bytes fingerprinted
    bytes_compared: int  # live bytes compared with the file (no usable sidecar)
    bytes_written: int  # payload patched into the shards (the journal holds as much again)
    missing_on_disk: tuple[str, ...]  # live tensors the checkpoint does not hold
    missing_live: tuple[str, ...]  # checkpoint tensors with no live source
    seconds: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def sync(model_dir: str | os.PathLike, live: Mapping[str, torch.Tensor], *,
         mode: str = "journal", version: str | None = None,
         block_size: int = blocks.DEFAULT_BLOCK_SIZE) -> SyncResult:
    """Make the safetensors in `model_dir` hold the `live` tensors, writing what changed.

    Args:
        model_dir: a directory with `model.safetensors` or a sharded index.
        live: HF-named tensors (e.g. `bridge.model().state_dict()`), any device.
        mode: "journal" (the only mode of this slice).
        version: the weight version the live tensors are (recorded in the sidecars).
        block_size: bytes per fingerprinted block.
    Returns:
        A `SyncResult`.
    Raises:
        CheckpointError: no safetensors in `model_dir`, or a live tensor whose dtype or
            shape differs from the file's (named, with the shard; nothing is written).
    """
    if mode != "journal":
        raise CheckpointError(f"mode {mode!r}: this version writes mode 'journal' only")
    started = time.perf_counter()
    model_dir = Path(model_dir)
    journal.recover(model_dir)  # an interrupted sync is finished or discarded first
    disk = read_dir(model_dir)
    if disk is None:
        raise CheckpointError(f"{model_dir}: no safetensors to sync into (a first full save "
                              "is not in this version: use save_pretrained)")
    matched = {name: t for name, t in live.items() if name in disk}
    for name, t in matched.items():
        _check(name, t, *disk[name])
    by_shard: dict[str, dict[str, torch.Tensor]] = {}  # shard path -> its live tensors
    shards: dict[str, Shard] = {}  # its header, as read_dir read it
    for name, t in matched.items():
        shard = shards.setdefault(disk[name][0].path, disk[name][0])
        by_shard.setdefault(shard.path, {})[name] = t.detach().contiguous()
    hashed = compared = 0
    plans: list[tuple[Shard, list[tuple[str, int, int]], blocks.Fingerprints]] = []
    for path, tensors in by_shard.items():
        shard, nbytes = shards[path], sum(t.numel() * t.element_size() for t in tensors.values())
        fresh = blocks.fingerprint(tensors, block_size=block_size)
        hashed += nbytes
        old = _load_sidecar(shard, block_size)
        if old is not None and set(old.tensors) >= set(tensors):
            diff = blocks.changed(_subset(old, tensors), fresh)
            ranges = [(n, int(lo), int(hi)) for n, c in diff.tensors.items()
                      for lo, hi in c.ranges]
        else:
            ranges = _compare_file(shard, tensors, block_size)
            compared += nbytes
        plans.append((shard, ranges, fresh))
    changed = [(shard, ranges) for shard, ranges, _ in plans if ranges]
    written = sum(hi - lo for _, ranges in changed for _, lo, hi in ranges)
    if changed:
        journal.write_journal(model_dir, _patches(changed, by_shard),
                              meta={"version": version})
        journal.apply(model_dir)
    for shard, _, fresh in plans:  # after the data: a stale sidecar is only ever distrusted
        _write_sidecar(read_shard(shard.path), fresh, version)
    return SyncResult(
        mode=mode, version=version, tensors_synced=len(matched),
        tensors_changed=len({n for _, ranges in changed for n, _, _ in ranges}),
        shards_changed=tuple(Path(s.path).name for s, _ in changed), bytes_hashed=hashed,
        bytes_compared=compared, bytes_written=written,
        missing_on_disk=tuple(sorted(set(live) - set(disk))),
        missing_live=tuple(sorted(set(disk) - set(live))),
        seconds=time.perf_counter() - started)


def _check(name: str, t: torch.Tensor, shard: Shard, info: TensorInfo) -> None:
    where = f"{name} in {Path(shard.path).name}"
    if _DTYPES.get(info.dtype) != t.dtype:
        raise CheckpointError(f"{where}: the file holds {info.dtype}, the live tensor is "
                              f"{str(t.dtype).removeprefix('torch.')}; nothing was written")
    if tuple(t.shape) != info.shape:
        raise CheckpointError(f"{where}: the file holds shape {list(info.shape)}, the live "
                              f"tensor {list(t.shape)}; nothing was written")


def _subset(fp: blocks.Fingerprints, names) -> blocks.Fingerprints:
    return blocks.Fingerprints(fp.kind, fp.block_size, {n: fp.tensors[n] for n in names})


def _compare_file(shard: Shard, tensors: Mapping[str, torch.Tensor],
                  block_size: int) -> list[tuple[str, int, int]]:
    ranges = []
    with open(shard.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        try:
            for name, t in tensors.items():
                info = shard.tensors[name]
                change = blocks.compare_bytes(name, t, view[info.begin:info.end],
                                              block_size=block_size)
                ranges += [(name, int(lo), int(hi)) for lo, hi in change.ranges]
        finally:
            view.release()
    return ranges


def _patches(changed, by_shard) -> Iterator[tuple[str, int, memoryview]]:
    for shard, ranges in changed:
        for name, lo, hi in ranges:
            data = by_shard[shard.path][name].reshape(-1).view(torch.uint8)[lo:hi]
            yield Path(shard.path).name, shard.tensors[name].begin + lo, \
                memoryview(data.cpu().numpy())


def _sidecar_path(shard_path: str) -> Path:
    p = Path(shard_path)
    return p.parent / SIDECAR_DIR / f"{p.name}.blocks.json"


def _load_sidecar(shard: Shard, block_size: int) -> blocks.Fingerprints | None:
    """The shard's recorded fingerprints, or None if missing, corrupt or stale."""
    path = _sidecar_path(shard.path)
    try:
        doc = json.loads(path.read_text())
        stat = doc["shard"]
        if doc.get("format") != SIDECAR_FORMAT or stat != dict(
                size=shard.size, mtime_ns=shard.mtime_ns, inode=shard.inode):
            logger.info("%s: stale (the shard changed since); comparing with the file", path)
            return None
        fp = blocks.Fingerprints.from_dict(doc["fingerprints"], source=str(path))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, HotweightsError) as e:
        logger.warning("%s: unreadable sidecar (%s); comparing with the file", path, e)
        return None
    return fp if fp.block_size == block_size else None


def _write_sidecar(shard: Shard, fp: blocks.Fingerprints, version: str | None) -> None:
    path = _sidecar_path(shard.path)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    doc = dict(format=SIDECAR_FORMAT, version=version, fingerprints=fp.to_dict(),
               shard=dict(size=shard.size, mtime_ns=shard.mtime_ns, inode=shard.inode))
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
