"""Staged shards: complete new files in `DIR/.hotweights-stage/`, moved into place at commit.

Two ways to stage a changed shard: `whole` writes it sequentially (the old header, then each
tensor's bytes from the live tensor or, for a tensor with no live source, from the old
file; through O_DIRECT where the filesystem takes it), the fast way when most of a shard
changed; `patched` clones it (a reflink: no data
copied; the spare clone taken behind the last sync where there is one) and clones the
changed pages into it from a scratch file. Either way the file is
fsync'd before the caller commits, keeps the old file's owner (where this process may
give it) and permission bits, and the old file
stays untouched (a reader sees it whole) until the journal's move record replaces it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import torch

from hotweights.checkpoint import clone, journal, spare
from hotweights.checkpoint.fileid import FileId
from hotweights.checkpoint.mapped import mapped
from hotweights.checkpoint.shards import Shard
from hotweights.checkpoint.writes import PAGE, copy_all, write_all
from hotweights.errors import CheckpointError

logger = logging.getLogger(__name__)

_CHUNK = 64 << 20  # bytes per device-to-host copy
_DIRECT_BUFFER = 8 << 20  # bytes per O_DIRECT write (2 shards at a time: 2 in flight)
DIRECT = True  # whole shards through O_DIRECT where the filesystem takes it


class _Direct:
    """Sequential writes through O_DIRECT from one page-aligned buffer: the disk's own rate,
    steady (buffered writes then fsync swing between 0.3 and 1.5 s per GB on the VMs we
    measured, O_DIRECT stays at ~0.5 s), and no page cache filled and flushed. `end`
    pads the last write to the alignment and truncates the file to what was written."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, mmap.mmap(-1, _DIRECT_BUFFER)  # anonymous: page-aligned
        self.view, self.fill, self.size = memoryview(self.buf), 0, 0

    def write(self, data: memoryview) -> None:
        while data.nbytes:
            n = min(data.nbytes, len(self.view) - self.fill)
            self.view[self.fill:self.fill + n] = data[:n]
            data = data[n:]
            self._filled(n)

    def copy(self, src: int, offset: int, count: int) -> None:
        while count:
            room = self.view[self.fill:self.fill + min(count, len(self.view) - self.fill)]
            n = os.preadv(src, [room], offset)
            if n == 0:
                raise OSError(f"unexpected end of the source at byte {offset}")
            offset, count = offset + n, count - n
            self._filled(n)

    def _filled(self, n: int) -> None:
        self.fill, self.size = self.fill + n, self.size + n
        if self.fill == len(self.view):
            self._flush(self.fill)

    def _flush(self, n: int) -> None:
        start = os.lseek(self.fd, 0, os.SEEK_CUR)
        try:
            write_all(self.fd, self.view[:n])
        except OSError as e:  # EINVAL: the device wants a larger alignment
            if e.errno != errno.EINVAL or not _direct(self.fd, False):
                raise
            logger.debug("O_DIRECT write refused (%s): buffered from here on", e)
            write_all(self.fd, self.view[os.lseek(self.fd, 0, os.SEEK_CUR) - start:n])
        self.fill = 0

    def end(self) -> None:
        if self.fill:
            self._flush(-(-self.fill // PAGE) * PAGE)
            os.ftruncate(self.fd, self.size)

    def close(self) -> None:
        self.view.release()
        self.buf.close()


class _Buffered:
    """Sequential buffered writes, where the filesystem refuses O_DIRECT (tmpfs)."""

    def __init__(self, fd: int):
        self.fd = fd

    def write(self, data: memoryview) -> None:
        write_all(self.fd, data)

    def copy(self, src: int, offset: int, count: int) -> None:
        copy_all(src, self.fd, count, offset)

    def end(self) -> None:
        pass

    def close(self) -> None:
        pass


def _direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; False if it was already so."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    want = flags | os.O_DIRECT if on else flags & ~os.O_DIRECT
    if want == flags:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, want)
    return True


def _sink(fd: int) -> _Direct | _Buffered:
    """An O_DIRECT writer on `fd` if the filesystem takes it (and `DIRECT`), else buffered."""
    if DIRECT:
        try:
            _direct(fd, True)
            return _Direct(fd)
        except OSError as e:  # EINVAL: no direct I/O on this filesystem
            logger.debug("no O_DIRECT (%s): buffered writes", e)
    return _Buffered(fd)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor on its device."""
    return t.detach().reshape(-1).view(torch.uint8)


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


def _create(dst: Path, like: int) -> int:
    """A new file at `dst` with the owner and mode of the open file `like`."""
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _keep(fd, os.fstat(like))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _keep(fd: int, old: os.stat_result) -> None:
    """The old file's owner, where this process may give it (root, or its own group), and
    its mode bits (after the owner: a chown clears set-id bits). Extended attributes and
    ACLs are not carried over."""
    new = os.fstat(fd)
    if (new.st_uid, new.st_gid) != (old.st_uid, old.st_gid):
        try:
            os.fchown(fd, old.st_uid, old.st_gid)
        except OSError:  # another user's file (EPERM), an id this user namespace does not
            with suppress(OSError):  # map (EINVAL), a filesystem without owners
                if new.st_gid != old.st_gid:
                    os.fchown(fd, -1, old.st_gid)
    os.fchmod(fd, old.st_mode & 0o7777)


@contextmanager
def staging(model_dir: Path, what: str) -> Iterator[Path]:
    """The stage area of `model_dir` for the body to fill and journal; if the body fails
    before the commit, what it staged is removed and an OSError becomes a CheckpointError
    saying it could not `what`. After the commit (an error once the journal is in place)
    the staged files are the journal's to move: kept, for `recover`."""
    area = model_dir / journal.STAGE_DIR
    try:
        yield area
    except BaseException as e:
        if (model_dir / journal.JOURNAL_NAME).exists():  # this sync's (under its lock)
            if isinstance(e, OSError):
                raise CheckpointError(f"{model_dir}: the sync is committed, then: {e}; its "
                                      f"journal is kept: run hotweights recover {model_dir}"
                                      ) from e
            raise
        shutil.rmtree(area, ignore_errors=True)
        if isinstance(e, OSError):
            where = f"{e.filename}: " if e.filename else ""
            raise CheckpointError(f"{model_dir}: cannot {what}: {where}{e.strerror or e}; "
                                  "nothing was written") from e
        raise


@contextmanager
def naming(path: str) -> Iterator[None]:
    """An OSError of the block that names no file (a failed write, say) names `path`."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror or str(e), path) from e


def commit(model_dir: Path, after_read: Callable[[], None] | None,
           then: Callable[[dict[str, FileId]], None] | None = None) -> None:
    """Tell the caller every live byte is read, then apply the committed journal (its
    fsyncs and removal, the stage directory's, then `then`, finish in a thread, under the
    writer lock it is handed: `finisher.finish`; `then` as for `journal.apply`). The
    journal is committed: it is applied even if `after_read` raises (what it raised goes
    on up)."""
    def finish(placed: dict[str, FileId]) -> None:
        with suppress(OSError):  # empty once applied (none where nothing was staged)
            os.rmdir(model_dir / journal.STAGE_DIR)
        if then:
            then(placed)

    try:
        if after_read:
            after_read()
    finally:  # not applied: the stage directory's files are the journal's, for recover
        journal.apply(model_dir, wait=False, then=finish, mine=True)


def whole(shard: Shard, tensors: Mapping[str, torch.Tensor], dst: Path,
          progress: Callable[[int], None]) -> int:
    """Write `shard` anew at `dst` with the `tensors` (contiguous, the header's dtypes and
    shapes) in place of their bytes; fsync. Returns the bytes written."""
    with naming(shard.path):
        src = os.open(shard.path, os.O_RDONLY)
        try:
            fd = _create(dst, src)
            try:
                shard.check(os.fstat(src))
                sink, pos = _sink(fd), 0
                for name, info in sorted(shard.tensors.items(), key=lambda kv: kv[1].begin):
                    if info.begin > pos:  # the header, or a gap between tensors
                        sink.copy(src, pos, info.begin - pos)
                    if name in tensors:
                        for chunk in host_chunks(raw(tensors[name])):
                            sink.write(chunk)
                    else:
                        sink.copy(src, info.begin, info.nbytes)
                    progress(info.nbytes)
                    pos = max(pos, info.end)
                if shard.size > pos:
                    sink.copy(src, pos, shard.size - pos)
                sink.end()
                # not after an error: its traceback still holds slices of the buffer, and
                # closing it would raise a BufferError in place of the error; freed with them
                sink.close()
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            os.close(src)
    return shard.size


def patched(shard: Shard, tensors: Mapping[str, torch.Tensor],
            ranges: Sequence[tuple[str, int, int]], dst: Path,
            progress: Callable[[int], None]) -> int:
    """Clone `shard` at `dst` (reflink) and put the changed `ranges` (tensor name, byte
    range within it) of the live `tensors` in it, as whole pages of the file; fsync.
    Returns the bytes written.

    The pages are built a batch at a time (`_fill`: numpy gathers, no Python per page) and
    written back to back into a scratch file beside `dst`, through O_DIRECT where the
    filesystem takes it (`_sink`), then each run of pages is cloned into place
    (`copy_file_range`: the blocks shared; copied where a run is not aligned to the
    filesystem's blocks). Written into the clone instead, each page is copied on write at
    the fsync, one allocation and remap apiece (on a loop-mounted XFS, 330 scattered pages:
    ~35 ms written into the clone and fsync'd, ~13 ms this way). The scratch file is not
    fsync'd: `dst`'s fsync makes the bytes cloned into it durable, wherever they came from."""
    if not spare.take(shard.path, dst):  # the clone taken behind the last sync's commit
        clone.reflink(shard.path, dst)
    offsets = _page_offsets(shard, ranges)
    runs = _runs(offsets, shard.size)
    live = [(shard.tensors[n].begin, shard.tensors[n].end, raw(tensors[n]))
            for n in dict.fromkeys(n for n, _, _ in ranges)]
    scratch = dst.with_name(f".{dst.name}.pages")
    with naming(shard.path):
        fd = os.open(dst, os.O_WRONLY)
        try:
            _keep(fd, os.stat(shard.path))
            pages = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with mapped(shard.path, shard.check) as old_view:  # what was cloned
                    _write_pages(pages, offsets, np.frombuffer(old_view, np.uint8), live)
                _direct(pages, False)  # read back buffered: a run that cannot be cloned
                # (not aligned to the filesystem's blocks) is copied, by any length
                for pos, at, n in runs:
                    copy_all(pages, fd, n, pos, at)
                    progress(n)
            finally:
                os.close(pages)
                os.unlink(scratch)
            os.fsync(fd)
        finally:
            os.close(fd)
    return sum(n for _, _, n in runs)


def _page_offsets(shard: Shard, ranges: Sequence[tuple[str, int, int]]) -> np.ndarray:
    """The file offsets of the pages that `ranges` touch, sorted, each once."""
    spans = np.array([(shard.tensors[n].begin + lo, shard.tensors[n].begin + hi)
                      for n, lo, hi in ranges if hi > lo], np.int64).reshape(-1, 2)
    first, count = spans[:, 0] // PAGE, (spans[:, 1] - 1) // PAGE - spans[:, 0] // PAGE + 1
    starts = np.cumsum(count) - count  # each span's first page's place in the expansion
    pages = np.repeat(first - starts, count) + np.arange(int(count.sum()))
    return np.unique(pages) * PAGE


def _runs(offsets: np.ndarray, size: int) -> list[tuple[int, int, int]]:
    """(scratch offset, file offset, bytes) of each run of consecutive pages, the pages
    lying back to back in the scratch file; the last page of the file may be partial."""
    cut = np.flatnonzero(np.diff(offsets) != PAGE) + 1
    first, stop = np.concatenate(([0], cut)), np.concatenate((cut, [len(offsets)]))
    return [(i * PAGE, int(offsets[i]), min(size - int(offsets[i]), (j - i) * PAGE))
            for i, j in zip(first.tolist(), stop.tolist(), strict=True) if j > i]


def _write_pages(fd: int, offsets: np.ndarray, old: np.ndarray,
                 live: Sequence[tuple[int, int, torch.Tensor]]) -> None:
    """Write the new file's pages at `offsets` (of the `old` file's bytes, with the `live`
    (begin, end, bytes) tensors over them) back to back into `fd`, a batch at a time;
    the last page of the file only as far as the file goes."""
    batch = _DIRECT_BUFFER // PAGE
    out, sink = np.empty((min(batch, len(offsets)), PAGE), np.uint8), _sink(fd)
    for k in range(0, len(offsets), batch):
        at = offsets[k:k + batch]
        _fill(out[:len(at)], at, old, live)
        n = len(at) * PAGE - max(0, int(at[-1]) + PAGE - old.size)
        sink.write(memoryview(out[:len(at)].reshape(-1)[:n]))
    sink.end()
    sink.close()  # not after an error (see `whole`)


def _fill(out: np.ndarray, at: np.ndarray, old: np.ndarray,
          live: Sequence[tuple[int, int, torch.Tensor]]) -> None:
    """`out[i]` := the page at file offset `at[i]` (sorted) as the new file holds it: the
    `old` file's bytes (zeros past its end), each `live` (begin, end, bytes) tensor's bytes
    over its span. Gathers, no Python per page but the (at most two) pages a tensor
    starts or ends inside. The old bytes are read only for the pages no live tensor
    covers whole (each read faults a page of the mapped file in)."""
    spans = []
    covered = np.zeros(len(at), bool)  # pages wholly inside a live tensor
    for begin, end, u8 in live:
        lo = int(np.searchsorted(at, begin - PAGE, "right"))  # first page over the tensor
        hi = int(np.searchsorted(at, end, "left"))
        inner_lo = int(np.searchsorted(at, begin, "left"))  # pages wholly inside it
        inner_hi = max(inner_lo, int(np.searchsorted(at, end - PAGE, "right")))
        covered[inner_lo:inner_hi] = True
        spans.append((begin, end, u8, lo, hi, inner_lo, inner_hi))
    whole = int(np.searchsorted(at, old.size - PAGE, "right"))  # pages inside the file
    if (need := np.flatnonzero(~covered[:whole])).size:
        out[need] = np.take(old[:old.size // PAGE * PAGE].reshape(-1, PAGE),
                            at[need] // PAGE, axis=0)
    for i in range(whole, len(at)):  # the file's partial last page
        tail = old[int(at[i]):]
        out[i, :tail.size], out[i, tail.size:] = tail, 0
    for begin, end, u8, lo, hi, inner_lo, inner_hi in spans:
        if inner_hi > inner_lo:
            shift = -begin % PAGE
            rows = (u8[shift:shift + (u8.numel() - shift) // PAGE * PAGE]
                    .view(-1, PAGE))
            index = torch.from_numpy((at[inner_lo:inner_hi] - begin - shift) // PAGE)
            out[inner_lo:inner_hi] = rows.index_select(0, index.to(u8.device)).cpu().numpy()
        for i in [*range(lo, inner_lo), *range(inner_hi, hi)]:  # a tensor's edge pages
            page = int(at[i])
            a, b = max(page, begin), min(page + PAGE, end)
            out[i, a - page:b - page] = u8[a - begin:b - begin].cpu().numpy()
