"""The writer lock of a checkpoint directory: one writer at a time, in this process or
another (`locked`), whether one holds it now (`held`), and work run under it once the
caller lets go (`later`)."""

from __future__ import annotations

import _thread
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hotweights.checkpoint import finisher
from hotweights.checkpoint.held import interrupts_held
from hotweights.errors import CheckpointError

__all__ = ["hand_over", "held", "later", "locked", "taken_over"]

logger = logging.getLogger(__name__)


@contextmanager
def locked(directory: str | os.PathLike, *, finish_first: bool = True) -> Iterator[None]:
    """Hold the directory's writer lock (an flock on the directory itself); a second
    writer, in this process or another, waits for the first. `finish_first`: wait for this
    process's finisher threads first (False: the caller is one of them)."""
    if finish_first:  # this process's last commit first (its thread takes this lock too;
        finisher.finish()  # a finisher thread never waits for the others: they chain)
    where = os.path.realpath(directory)
    with _registering:  # a fork waits: its child knows every fd it must close
        try:  # O_CLOEXEC (os.open's default too): an exec'd child does not keep the fd
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise CheckpointError(f"{directory}: cannot open the directory: {e.strerror}") from e
        mine = _Held(where, fd)
        _held.append(mine)  # before any wait: a child forked meanwhile closes its fd too
    try:
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # (a finisher thread waits for the sync that started it)
                logger.log(logging.WARNING if finish_first else logging.DEBUG,
                           "%s: another writer holds the directory; waiting for it", directory)
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # e.g. NFS, where flock is a POSIX lock a directory cannot take
            raise CheckpointError(
                f"{directory}: cannot take the directory's writer lock (flock: {e.strerror}); "
                "hotweights writes checkpoints on a local filesystem (ext4, XFS, btrfs, "
                "tmpfs): sync into one and copy the result") from e
        mine.locked = True
        if os.fstat(fd).st_nlink == 0:  # removed while this writer waited
            raise CheckpointError(f"{directory}: removed while this writer waited for its lock "
                                  "(a sync that had made it failed): nothing was written; "
                                  "run it again")
        yield
    finally:
        taken = mine.locked
        if mine in _held:
            _held.remove(mine)
        # An flock belongs to the open file description, which a forked child (e.g. a
        # DataLoader worker started during a sync) shares: closing only this fd would
        # leave the lock held until every such child exits. Unlocking frees it for all;
        # where it was handed over (`hand_over`), the receiver unlocks it.
        if mine.fd is not None:  # None: closed in a forked child (`_after_fork`)
            try:
                if taken and not mine.handed:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


class _Held:
    """A lock `locked` holds in this process: its directory (real path) and fd."""

    def __init__(self, directory: str, fd: int) -> None:
        self.directory, self.fd, self.handed, self.locked = directory, fd, False, False


_held: list[_Held] = []  # the locks `locked` holds or waits for now, innermost last
_handed: set[int] = set()  # the fds `hand_over` gave, until `taken_over` ends them
# Held from opening (or dup'ing) a lock's fd to listing it, and by a fork: re-entrant, for
# a signal handler that syncs (or forks) in a thread that holds it
_registering = threading.RLock()
_fork_held = False  # whether `_before_fork` holds it for the fork under way


def _before_fork() -> None:
    global _fork_held
    interrupted = False
    while True:  # an exception here is dropped, and the fork goes on: no Ctrl-C lost,
        try:  # nor a release of the lock another thread holds
            _registering.acquire()
            break
        except KeyboardInterrupt:
            interrupted = True
    _fork_held = True
    if interrupted:
        _thread.interrupt_main()  # the Ctrl-C, raised once the fork is done


def _after_fork_in_parent() -> None:
    global _fork_held
    if _fork_held:
        _fork_held = False
        _registering.release()


def _after_fork() -> None:
    """In a forked child: close (not unlock) every fd of this process's locks. The child
    shares their open file descriptions, so it would hold the locks for as long as it
    lives, after its parent died too (a DataLoader worker of a trainer SIGKILLed mid-sync
    kept every later sync, recover and serve waiting)."""
    global _registering, _fork_held
    _registering, _fork_held = threading.RLock(), False  # the parent's was held for the fork
    for h in _held:
        os.close(h.fd)
        h.fd = None
    _held.clear()
    for fd in _handed:
        os.close(fd)
    _handed.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork)


def hand_over(directory: str | os.PathLike) -> int | None:
    """The writer lock of `directory` that this process holds (`locked`), kept past the
    `with` block for the finisher thread the holder starts, which ends it (`taken_over`).
    None where this process holds none. A finisher thread must never wait for the lock
    itself: the threads run one after another, and the next writer's lock, handed to the
    thread after it, would wait for it in turn."""
    where = os.path.realpath(directory)
    for h in reversed(_held):
        if h.directory == where and h.locked and not h.handed:
            with _registering:
                fd = os.dup(h.fd)  # the same open file description: the same lock
                _handed.add(fd)
            h.handed = True
            return fd
    return None


@contextmanager
def taken_over(directory: str | os.PathLike, fd: int | None) -> Iterator[None]:
    """The block under the lock `hand_over` gave (`fd`), unlocked after it (for every fd
    of it); where none was given (None), under the lock taken anew, once free."""
    if fd is None:
        with locked(directory, finish_first=False):
            yield
        return
    try:
        yield
    finally:
        if fd in _handed:  # else closed in a forked child (`_after_fork`)
            _handed.discard(fd)
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
    that the caller holds, handed over (`hand_over`); `finisher.finish` waits for it."""

    def run() -> None:
        try:
            with taken_over(directory, kept):
                fn()
        except (OSError, CheckpointError) as e:  # e.g. the directory removed meanwhile
            logger.info("%s: %s not run (%s)", directory, getattr(fn, "__name__", fn), e)

    with interrupts_held():  # a Ctrl-C between the two would leave the lock handed to none
        kept = hand_over(directory)
        finisher.start(run)
