"""`write_all`: the one loop that writes a whole buffer to a file descriptor (a write may
take fewer bytes than it is given); `pwritev_all`, the same for buffers back to back;
`copy_all`, the same for a range of another file."""

from __future__ import annotations

import os

_CHUNK = 64 << 20  # bytes per call at the most
IOV_MAX = 1024  # buffers per pwritev (Linux's limit)


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


def pwritev_all(fd: int, parts: list[bytes | memoryview], offset: int) -> int:
    """Write `parts` back to back at `offset`, in one call where the kernel takes them all
    (a write of whole pages then reads none first); returns the bytes written."""
    total = sum(memoryview(p).nbytes for p in parts)
    if len(parts) > IOV_MAX:
        parts = [b"".join(parts)]
    n = os.pwritev(fd, parts, offset) if total else 0
    if n < total:  # a short write: the rest in one buffer
        write_all(fd, b"".join(parts)[n:], offset + n)
    return total


def copy_all(src: int, dst: int, count: int, offset: int, to: int | None = None) -> None:
    """Copy `count` bytes of `src` from `offset` into `dst` at its file position, or at `to`
    (the position stays). `copy_file_range`: where the filesystem clones and the ranges
    are aligned to its blocks, the blocks are shared, not copied."""
    while count:
        n = os.copy_file_range(src, dst, min(count, _CHUNK), offset, to)
        if n == 0:
            raise OSError(f"unexpected end of the source at byte {offset}")
        offset, count = offset + n, count - n
        if to is not None:
            to += n
