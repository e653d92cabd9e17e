"""Per-shard sidecars: the block fingerprints of a shard and the weight version they describe.

`DIR/.hotweights/SHARD.blocks.json` records the shard's size, mtime, ctime and inode
beside the fingerprints (ctime: no one can set it back, `cp -p` or `touch -r` onto the
shard in place change it). A missing, corrupt or stale one (the shard changed behind its
back) is never trusted: `load` returns None and the caller compares with the file instead.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from hotweights.changes import blocks
from hotweights.checkpoint.fileid import FileId
from hotweights.checkpoint.shards import Shard
from hotweights.errors import CheckpointError, HotweightsError

logger = logging.getLogger(__name__)

FORMAT = 1
DIR = ".hotweights"
# path -> (the sidecar file's identity, its shard stat, its fingerprints), as this process
# last wrote it: while the file is still that one, `load` takes them without parsing it.
_written: dict[str, tuple[FileId, dict, blocks.Fingerprints]] = {}


def path_of(shard_path: str | os.PathLike) -> Path:
    p = Path(shard_path)
    return p.parent / DIR / f"{p.name}.blocks.json"


def _stat(shard: Shard) -> dict:
    f = shard.file
    return dict(size=f.size, mtime_ns=f.mtime_ns, ctime_ns=f.ctime_ns, inode=f.ino)


def state(shard: Shard) -> tuple[str, dict | None]:
    """("fresh" | "missing" | "stale" | "corrupt", the sidecar's document or None)."""
    path = path_of(shard.path)
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            return "corrupt", None
        return ("fresh" if doc["shard"] == _stat(shard) else "stale"), doc
    except FileNotFoundError:
        return "missing", None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return "corrupt", None  # e.g. a directory where it belongs: distrusted, as a bad one


def load(shard: Shard, block_size: int, kind: str) -> blocks.Fingerprints | None:
    """The shard's recorded fingerprints, or None if missing, corrupt, stale, or of
    another block size or hash kind (CUDA tensors are hashed with torch, CPU ones with
    xxh3: the two never compare)."""
    path = path_of(shard.path)
    mine = _written.get(str(path))
    try:
        if mine is not None and mine[0] != FileId.of(path):
            mine = None  # not the file this process wrote
    except OSError:
        mine = None  # gone (or not a file): `state` says so below
    if mine is not None:  # as this process wrote it
        if mine[1] != _stat(shard):
            logger.warning("%s: stale sidecar; comparing with the file", path)
            return None
        fp = mine[2]
    else:
        how, doc = state(shard)
        if how != "fresh":
            if how != "missing":
                logger.warning("%s: %s sidecar; comparing with the file", path, how)
            return None
        try:
            fp = blocks.Fingerprints.from_dict(doc["fingerprints"], source=str(path))
        except (KeyError, HotweightsError) as e:
            logger.warning("%s: unreadable sidecar (%s); comparing with the file", path, e)
            return None
    if (fp.block_size, fp.kind) != (block_size, kind):
        logger.info("%s: fingerprints of %s at %d-byte blocks, this sync takes %s at %d; "
                    "comparing with the file", path, fp.kind, fp.block_size, kind, block_size)
        return None
    return fp


def write(shard: Shard, fp: blocks.Fingerprints, version: str | None) -> None:
    """Record `fp` for `shard` as it is now (write, rename). Not fsync'd: a sidecar lost or
    torn by a crash reads as missing or corrupt, and is never trusted."""
    path = path_of(shard.path)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    doc = dict(format=FORMAT, version=version, fingerprints=fp.to_dict(), shard=_stat(shard))
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(doc))  # json.dump to a file: the pure-Python encoder
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no partial file left behind
        with suppress(OSError):  # (its own error would hide the first)
            tmp.unlink(missing_ok=True)
        raise
    _written[str(path)] = (FileId.of(path), doc["shard"], fp)


def as_placed(path: str | os.PathLike, placed: FileId | None) -> FileId | None:
    """The file at `path` now (ctime included), if it is still `placed`, the file a commit
    left there (`journal.apply`'s `then`); else None, logged: another program wrote it
    since, and a sidecar of the bytes this sync wrote would vouch for the other's."""
    now = FileId.of(path)
    if now != placed:
        logger.warning("%s: changed since this sync wrote it (another program?); no "
                       "sidecar: the next sync compares it with the live weights", path)
        return None
    return now


@contextmanager
def best_effort(shard_path: str | os.PathLike) -> Iterator[None]:
    """Writing the sidecar of the shard at `shard_path` in the block: an OSError or
    CheckpointError is logged, not raised (a sidecar not written only costs the next sync
    a compare with the file)."""
    try:
        yield
    except (OSError, CheckpointError) as e:
        logger.warning("%s: sidecar not written (%s); the next sync compares the shard with "
                       "the live weights", shard_path, e)
