"""`write_all`: the one loop that writes a whole buffer to a file descriptor (a write may
take fewer bytes than it is given); `copy_all`, the same for a range of another file;
`syncfs`, a filesystem's writes and deferred frees done."""

from __future__ import annotations

import ctypes
import errno
import logging
import os

logger = logging.getLogger(__name__)

_CHUNK = 64 << 20  # bytes per call at the most
PAGE = 4096  # what a write cut short or a power loss leaves whole (old or new), the unit
# of O_DIRECT's alignment and of a changed block's narrowing


def write_all(fd: int, data: bytes | memoryview, offset: int | None = None) -> None:
    """Write every byte of `data` to `fd`: at its file position, or at `offset` (pwrite:
    the position stays)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = (os.write(fd, view[:_CHUNK]) if offset is None
             else os.pwrite(fd, view[:_CHUNK], offset))
        view = view[n:]
        if offset is not None:
            offset += n


def copy_all(src: int, dst: int, count: int, offset: int, to: int | None = None) -> None:
    """Copy `count` bytes of `src` from `offset` into `dst` at its file position, or at `to`
    (the position stays). `copy_file_range`: where the filesystem clones and the ranges
    are aligned to its blocks, the blocks are shared, not copied; where it cannot copy
    between these files (another filesystem: EXDEV), read and written."""
    while count:
        try:
            n = os.copy_file_range(src, dst, min(count, _CHUNK), offset, to)
        except OSError as e:
            if e.errno not in _NO_COPY_RANGE:
                raise
            n = len(data := os.pread(src, min(count, _CHUNK), offset))
            if n:
                write_all(dst, data, to)
        if n == 0:
            raise OSError(f"unexpected end of the source at byte {offset}")
        offset, count = offset + n, count - n
        if to is not None:
            to += n


# copy_file_range's errors for a pair of files it cannot copy between (another
# filesystem, one that does not support it), where a read and a write can
_NO_COPY_RANGE = {errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def syncfs(directory: str | os.PathLike) -> None:
    """syncfs(2) on the filesystem of `directory`: its writes and its deferred frees done
    (XFS frees a deleted file's blocks in the background: free space measured before
    counts them as used)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd):
            logger.debug("%s: syncfs failed: %s", directory, os.strerror(ctypes.get_errno()))
    finally:
        os.close(fd)
