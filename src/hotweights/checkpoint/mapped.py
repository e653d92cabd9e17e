"""A file mapped read-only for the length of a `with` block."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def mapped(path: str, check: Callable[[os.stat_result], None] = lambda st: None
           ) -> Iterator[memoryview]:
    """The bytes of `path`, mapped read-only, unmapped at the end of the block; `check`
    sees the file opened first (and may raise).

    When the block raises (Ctrl-C in the middle of a compare, say), its traceback still
    holds slices of the map, and unmapping would raise a `BufferError` in place of the
    error itself: the map is then left to be freed with those slices.
    """
    with open(path, "rb") as f:
        check(os.fstat(f.fileno()))
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(m)
    yield view  # an exception leaves the map to the garbage collector, with its slices
    view.release()
    m.close()
