"""This process's finisher thread: what a sync leaves behind its commit (the fsyncs, the
journal's removal, the sidecars) runs in background threads, one after another; `finish`
waits for them and for the trash sweeper."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from hotweights.checkpoint import threads, trash

__all__ = ["finish", "start"]

_finisher: threading.Thread | None = None  # the last of this process's finisher threads
_finishers_lock = threading.Lock()


def start(run: Callable[[], None]) -> None:
    """Run `run` in a new finisher thread, after the one before it (a writer in another
    thread of this process may have started it): `finish` joins the last, so all. Where no
    thread can be started (a limit on threads, or the interpreter exiting), `run` runs
    here, now."""
    global _finisher
    with _finishers_lock:  # writers of other directories may start theirs meanwhile
        before = _finisher

        def chained() -> None:
            if before is not None:
                before.join()
            run()

        if (t := threads.started(chained, name="hotweights-finish")) is not None:
            _finisher = t  # started before `finish` can see it
            return
    chained()


def _after_fork() -> None:  # a child has none of its parent's threads, and this lock may
    global _finisher, _finishers_lock  # have been held by one of them
    _finisher, _finishers_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def finish() -> None:
    """Wait until this process's last commit is on disk, its journal removed and the files
    it replaced freed (`sync` returns as soon as the commit is durable and the files hold
    it; a thread fsyncs the files, removes the journal, then another frees the trash).
    Writers and `journal.pending` wait for it by themselves; call it before copying,
    uploading or removing a directory this process synced into (a copy made before would
    hold the journal and the staged files, and be refused as another directory's)."""
    t = _finisher
    if t is not None and t is not threading.current_thread():
        t.join()
    trash.wait()
