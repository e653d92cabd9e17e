"""`write_all`: the one loop that writes a whole buffer to a file descriptor (a write may
take fewer bytes than it is given)."""

from __future__ import annotations

import os

_CHUNK = 64 << 20  # bytes per call at the most


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
