"""This process's finisher thread: what a sync leaves behind its commit (the fsyncs, the
journal's removal, the sidecars) runs in background threads, one after another; `finish`
waits for them and for the trash sweeper."""

from __future__ import annotations

import threading
from collections.abc import Callable

from hotweights.checkpoint import trash

__all__ = ["finish", "start"]

_finisher: threading.Thread | None = None  # the last of this process's finisher threads
_finishers_lock = threading.Lock()


def start(run: Callable[[], None]) -> None:
    """Run `run` in a new finisher thread, after the one before it (a writer in another
    thread of this process may have started it): `finish` joins the last, so all."""
    global _finisher
    with _finishers_lock:  # writers of other directories may start theirs meanwhile
        before = _finisher

        def chained() -> None:
            if before is not None:
                before.join()
            run()

        t = threading.Thread(target=chained, name="hotweights-finish")
        t.start()
        _finisher = t  # started before `finish` can see it


def finish() -> None:
    """Wait until this process's last commit is on disk, its journal removed and the files
    it replaced freed (`sync` returns as soon as the commit is durable and the files hold
    it; a thread fsyncs the files, removes the journal, then another frees the trash).
    Writers and `journal.pending` wait for it by themselves; call it before removing a
    directory this process synced into."""
    t = _finisher
    if t is not None and t is not threading.current_thread():
        t.join()
    trash.wait()
