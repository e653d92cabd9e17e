"""Ctrl-C held off while a committed journal is applied: a KeyboardInterrupt raised
between two renames would leave shards of two versions for every reader until `recover`."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["interrupts_held"]


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Run the block with SIGINT noted, not acted on, then act on it as the handler before
    would have (a KeyboardInterrupt, by default). Only the main thread gets signals; in
    another, the block simply runs."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is None):  # (a handler from outside Python)
        yield
        return
    noted: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if noted:
            if callable(before):
                before(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt
            elif before == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)
