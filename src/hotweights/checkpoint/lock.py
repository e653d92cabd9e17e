"""The writer lock of a checkpoint directory: one writer at a time, in this process or
another (`locked`), whether one holds it now (`held`), and work run under it once the
caller lets go (`later`)."""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hotweights.checkpoint import finisher
from hotweights.errors import CheckpointError

__all__ = ["held", "later", "locked"]

logger = logging.getLogger(__name__)


@contextmanager
def locked(directory: str | os.PathLike, *, finish_first: bool = True) -> Iterator[None]:
    """Hold the directory's writer lock (an flock on the directory itself); a second
    writer, in this process or another, waits for the first. `finish_first`: wait for this
    process's finisher threads first (False: the caller is one of them)."""
    if finish_first:  # this process's last commit first (its thread takes this lock too;
        finisher.finish()  # a finisher thread never waits for the others: they chain)
    try:  # O_CLOEXEC (os.open's default too): an exec'd child does not keep the fd
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"{directory}: cannot open the directory: {e.strerror}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # (a finisher thread waits for the sync that started it)
            logger.log(logging.WARNING if finish_first else logging.DEBUG,
                       "%s: another writer holds the directory; waiting for it", directory)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        # An flock belongs to the open file description, which a forked child (e.g. a
        # DataLoader worker started during a sync) shares: closing only this fd would
        # leave the lock held until every such child exits. Unlocking frees it for all.
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def held(directory: str | os.PathLike) -> bool:
    """Whether a writer holds the directory's lock now (tried without waiting; if free,
    taken and let go at once)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)  # not only by closing: see `locked`
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def later(directory: str | os.PathLike, fn: Callable[[], None]) -> None:
    """Run `fn` in this process's finisher thread, under the writer lock of `directory`
    (taken once the caller, which holds it, lets go); `finisher.finish` waits for it."""
    def run() -> None:
        try:
            with locked(directory, finish_first=False):
                fn()
        except (OSError, CheckpointError) as e:  # e.g. the directory removed meanwhile
            logger.info("%s: %s not run (%s)", directory, getattr(fn, "__name__", fn), e)

    finisher.start(run)
