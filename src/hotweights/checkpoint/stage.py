"""Staged shards: complete new files in `DIR/.hotweights-stage/`, moved into place at commit.

Two ways to stage a changed shard: `whole` writes it sequentially (the old header, then each
tensor's bytes from the live tensor or, for a tensor with no live source, from the old
file), the fast way when most of a shard changed; `patched` clones it (a reflink: no data
copied) and writes only the changed byte ranges into the clone. Either way the file is
fsync'd before the caller commits, keeps the old file's permission bits, and the old file
stays untouched (a reader sees it whole) until the journal's move record replaces it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from hotweights.checkpoint import clone, journal
from hotweights.checkpoint.shards import Shard
from hotweights.errors import CheckpointError

_CHUNK = 64 << 20  # bytes per write, and per device-to-host copy


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor on its device."""
    return t.reshape(-1).view(torch.uint8)


def host_chunks(u8: torch.Tensor) -> Iterator[memoryview]:
    """Yield memoryviews of the bytes, copied to the host a chunk at a time when needed."""
    if u8.device.type == "cpu":
        yield memoryview(u8.numpy())
        return
    for lo in range(0, u8.numel(), _CHUNK):
        yield memoryview(u8[lo:lo + _CHUNK].cpu().numpy())


def _write(fd: int, data: memoryview, offset: int | None = None) -> None:
    while data.nbytes:
        n = os.write(fd, data[:_CHUNK]) if offset is None else os.pwrite(fd, data[:_CHUNK],
                                                                          offset)
        data = data[n:]
        offset = None if offset is None else offset + n


def _copy(src: int, dst: int, offset: int, count: int) -> None:
    while count:
        n = os.copy_file_range(src, dst, count, offset)
        if n == 0:
            raise OSError(f"unexpected end of the source at byte {offset}")
        offset, count = offset + n, count - n


def _create(dst: Path, like: str) -> int:
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.fchmod(fd, os.stat(like).st_mode & 0o7777)
    return fd


@contextmanager
def staging(model_dir: Path, what: str) -> Iterator[Path]:
    """The stage area of `model_dir` for the body to fill and journal; if the body fails
    (before the commit), what it staged is removed and an OSError becomes a
    CheckpointError saying it could not `what`."""
    area = model_dir / journal.STAGE_DIR
    try:
        yield area
    except BaseException as e:
        shutil.rmtree(area, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"{model_dir}: cannot {what}: {e.strerror or e}; nothing "
                                  "was written") from e
        raise


def commit(model_dir: Path, after_read: Callable[[], None] | None) -> None:
    """Tell the caller every live byte is read, then apply the committed journal."""
    if after_read:
        after_read()
    journal.apply(model_dir)
    shutil.rmtree(model_dir / journal.STAGE_DIR, ignore_errors=True)  # empty by now


def whole(shard: Shard, tensors: Mapping[str, torch.Tensor], dst: Path,
          progress: Callable[[int], None]) -> int:
    """Write `shard` anew at `dst` with the `tensors` (contiguous, the header's dtypes and
    shapes) in place of their bytes; fsync. Returns the bytes written."""
    src, fd = os.open(shard.path, os.O_RDONLY), _create(dst, shard.path)
    try:
        pos = 0
        for name, info in sorted(shard.tensors.items(), key=lambda kv: kv[1].begin):
            if info.begin > pos:  # the header, or a gap between tensors
                _copy(src, fd, pos, info.begin - pos)
            if name in tensors:
                for chunk in host_chunks(raw(tensors[name])):
                    _write(fd, chunk)
            else:
                _copy(src, fd, info.begin, info.nbytes)
            progress(info.nbytes)
            pos = max(pos, info.end)
        if shard.size > pos:
            _copy(src, fd, pos, shard.size - pos)
        os.fsync(fd)
    finally:
        os.close(src)
        os.close(fd)
    return shard.size


def patched(shard: Shard, tensors: Mapping[str, torch.Tensor],
            ranges: Sequence[tuple[str, int, int]], dst: Path,
            progress: Callable[[int], None]) -> int:
    """Clone `shard` at `dst` (reflink) and write the changed `ranges` (tensor name, byte
    range within it) from the live `tensors`; fsync. Returns the bytes written."""
    clone.reflink(shard.path, dst)
    fd, written = os.open(dst, os.O_WRONLY), 0
    try:
        os.fchmod(fd, os.stat(shard.path).st_mode & 0o7777)
        for name, lo, hi in ranges:
            offset = shard.tensors[name].begin + lo
            for chunk in host_chunks(raw(tensors[name])[lo:hi]):
                _write(fd, chunk, offset)
                offset += chunk.nbytes
            written += hi - lo
            progress(hi - lo)
        os.fsync(fd)
    finally:
        os.close(fd)
    return written
