"""Staged shards: complete new files in `DIR/.hotweights-stage/`, moved into place at commit.

Two ways to stage a changed shard: `whole` writes it sequentially (the old header, then each
tensor's bytes from the live tensor or, for a tensor with no live source, from the old
file), the fast way when most of a shard changed; `patched` clones it (a reflink: no data
copied) and writes only the changed byte ranges into the clone. Either way the file is
fsync'd before the caller commits, keeps the old file's permission bits, and the old file
stays untouched (a reader sees it whole) until the journal's move record replaces it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
_BEHIND = 8 << 20  # a whole shard's writeback is started every this many bytes written
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writing the range's dirty pages, no wait


def _writeback_starter():
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        f = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    f.argtypes, f.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], \
        ctypes.c_int
    return f


_SYNC_FILE_RANGE = _writeback_starter()


class _Behind:
    """Starts the disk writing what a sequential writer wrote (SYNC_FILE_RANGE_WRITE: no
    wait), `_BEHIND` bytes at a time, so the writing and the disk overlap and the final
    fsync has little left to do. A full-shard rewrite then beats write-everything-then-
    fsync (what save_file + fsync does) by about the time of the in-memory copy."""

    def __init__(self, fd: int):
        self.fd, self.started, self.pos = fd, 0, 0

    def wrote(self, n: int) -> None:
        self.pos += n
        if _SYNC_FILE_RANGE is not None and self.pos - self.started >= _BEHIND:
            _SYNC_FILE_RANGE(self.fd, self.started, self.pos - self.started,
                             _SYNC_FILE_RANGE_WRITE)
            self.started = self.pos


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


def range_chunks(tensors: Mapping[str, torch.Tensor], ranges: Sequence[tuple[str, int, int]]
                 ) -> Iterator[tuple[str, int, memoryview]]:
    """(tensor, byte offset in it, host bytes) covering each (tensor, lo, hi) of `ranges`:
    a CPU tensor is viewed once for all its ranges (no copy), any other copied to the host
    a chunk at a time."""
    now = view = u8 = None
    for name, lo, hi in ranges:
        if name != now:
            now, u8 = name, raw(tensors[name])
            view = memoryview(u8.numpy()) if u8.device.type == "cpu" else None
        if view is not None:
            yield name, lo, view[lo:hi]
            continue
        for chunk in host_chunks(u8[lo:hi]):
            yield name, lo, chunk
            lo += chunk.nbytes


def _write(fd: int, data: memoryview, offset: int | None = None,
           behind: _Behind | None = None) -> None:
    step = _CHUNK if behind is None else _BEHIND
    while data.nbytes:
        n = os.write(fd, data[:step]) if offset is None else os.pwrite(fd, data[:step], offset)
        data = data[n:]
        offset = None if offset is None else offset + n
        if behind is not None:
            behind.wrote(n)


def _copy(src: int, dst: int, offset: int, count: int, behind: _Behind) -> None:
    while count:
        n = os.copy_file_range(src, dst, min(count, _BEHIND), offset)
        if n == 0:
            raise OSError(f"unexpected end of the source at byte {offset}")
        offset, count = offset + n, count - n
        behind.wrote(n)


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


def commit(model_dir: Path, after_read: Callable[[], None] | None,
           then: Callable[[], None] | None = None) -> None:
    """Tell the caller every live byte is read, then apply the committed journal (its
    fsyncs and removal, then `then`, finish in a thread: `journal.finish`)."""
    if after_read:
        after_read()
    journal.apply(model_dir, wait=False, then=then, mine=True)
    shutil.rmtree(model_dir / journal.STAGE_DIR, ignore_errors=True)  # empty by now


def whole(shard: Shard, tensors: Mapping[str, torch.Tensor], dst: Path,
          progress: Callable[[int], None]) -> int:
    """Write `shard` anew at `dst` with the `tensors` (contiguous, the header's dtypes and
    shapes) in place of their bytes; fsync. Returns the bytes written."""
    src, fd = os.open(shard.path, os.O_RDONLY), _create(dst, shard.path)
    behind = _Behind(fd)
    try:
        pos = 0
        for name, info in sorted(shard.tensors.items(), key=lambda kv: kv[1].begin):
            if info.begin > pos:  # the header, or a gap between tensors
                _copy(src, fd, pos, info.begin - pos, behind)
            if name in tensors:
                for chunk in host_chunks(raw(tensors[name])):
                    _write(fd, chunk, behind=behind)
            else:
                _copy(src, fd, info.begin, info.nbytes, behind)
            progress(info.nbytes)
            pos = max(pos, info.end)
        if shard.size > pos:
            _copy(src, fd, pos, shard.size - pos, behind)
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
        for name, lo, chunk in range_chunks(tensors, ranges):
            _write(fd, chunk, shard.tensors[name].begin + lo)
            written += chunk.nbytes
            progress(chunk.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return written
