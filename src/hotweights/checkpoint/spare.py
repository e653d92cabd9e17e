"""Spare clones: the next sync's clone of a shard, taken behind this one's commit.

A reflinked sync clones each changed shard before patching it, and a clone costs time per
extent of its source (~25 µs here), which every patched page splits: a shard patched sync
after sync lies in thousands of extents and its clone took 10-60 ms of each sync on a
loop-mounted XFS. So once a sync's commit is durable, its finisher thread clones each shard
it wrote into a spare, an unnamed file (`O_TMPFILE`) held open by this process; the next
sync that patches the shard links the spare into its stage area (~0.1 ms) instead of
cloning.

A spare is used only while the shard is still the file it was cloned from (device, inode,
size, mtime: `FileId`, and ctime: a rewrite in place that put the mtime back); else it is
closed and the shard cloned as before. Spares hold the
blocks of what they cloned and nothing else, live only in this process (the filesystem
frees them when it exits, after a crash too; a forked child gets none), are closed at the
next `keep` once their shard is gone or changed, and `MOST` at a time; `release` closes
them all (before a directory's filesystem is unmounted, say).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Iterable

from hotweights.checkpoint import clone
from hotweights.checkpoint.fileid import FileId

__all__ = ["drop", "extents", "keep", "release", "take"]

logger = logging.getLogger(__name__)

MOST = 256  # spares held at once (open files), the oldest closed first
_lock = threading.Lock()
_spares: dict[str, tuple[FileId, int, int | None]] = {}  # shard path -> (the file cloned,
# the spare's fd, its extents)


def keep(paths: Iterable[str]) -> None:
    """Clone each file of `paths` into a spare, in place of any spare held before; a file
    that cannot be cloned gets none. First, the spares of files gone or changed since are
    closed (they would only hold blocks the filesystem could free): every sync's record
    calls it, with no paths where it keeps no spares."""
    with _lock:
        held = dict(_spares)
    drop([p for p, (of, *_) in held.items() if not _current(p, of)])
    for path in paths:
        try:
            src = os.open(path, os.O_RDONLY)
        except OSError as e:
            logger.debug("%s: no spare clone: %s", path, e)
            continue
        try:
            fd = os.open(os.path.dirname(path), os.O_RDWR | os.O_TMPFILE, 0o600)
            try:  # the file before the clone and after: a write between the two (another
                of = FileId.of_stat(os.fstat(src))  # program's) would be in the clone or not
                clone.clone_into(fd, src)
                if not of.unchanged(FileId.of_stat(os.fstat(src))):
                    raise OSError(f"{path} was written while it was cloned")
            except BaseException:
                os.close(fd)
                raise
        except OSError as e:  # no O_TMPFILE, no reflinks, no room
            logger.debug("%s: no spare clone: %s", path, e)
            continue
        finally:
            os.close(src)
        n = clone.extents(fd)  # the file's: the clone maps the same extents
        with _lock:
            old = _spares.pop(path, None)
            _spares[path] = (of, fd, n)  # the newest last
            oldest = list(_spares)[:-MOST] if len(_spares) > MOST else []
        if old is not None:
            os.close(old[1])
        drop(oldest)


def take(path: str, dst: str | os.PathLike) -> bool:
    """Link the spare clone of the file at `path` as `dst` (a new name on its
    filesystem), if this process holds one and `path` is still the file it was cloned
    from; False otherwise (`dst` not made)."""
    with _lock:
        got = _spares.pop(path, None)
    if got is None:
        return False
    of, fd, _ = got
    try:
        if not _current(path, of):
            return False
        fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
        try:  # linkat(AT_SYMLINK_FOLLOW) of the fd: how an O_TMPFILE file gets a name
            os.link(str(fd), dst, src_dir_fd=fds, follow_symlinks=True)
        finally:
            os.close(fds)
        return True
    except OSError as e:
        logger.debug("%s: spare clone not used: %s", path, e)
        return False
    finally:
        os.close(fd)


def extents(path: str) -> int | None:
    """How many extents the file at `path` lies in, as counted when its spare was cloned,
    if this process holds one and `path` is still that file (`clone.extents` reads them
    again: a few ms for a shard in thousands)."""
    with _lock:
        got = _spares.get(path)
    return got[2] if got is not None and _current(path, got[0]) else None


def release() -> None:
    """Close every spare this process holds (their blocks are freed)."""
    with _lock:
        paths = list(_spares)
    drop(paths)


def _current(path: str, of: FileId) -> bool:
    """Whether the file at `path` is still `of`, the file a spare was cloned from
    (`FileId.unchanged`)."""
    try:
        return of.unchanged(FileId.of_stat(os.stat(path)))
    except OSError:
        return False


def drop(paths: Iterable[str]) -> bool:
    """Close the spares of `paths`; whether there was one."""
    dropped = False
    for p in paths:
        with _lock:
            got = _spares.pop(p, None)
        if got is not None:
            os.close(got[1])
            dropped = True
    return dropped


def _forget() -> None:
    """In a forked child: none of the parent's spares (a sync there must not patch one
    the parent may link later; the lock may have been held by a thread it has not)."""
    global _lock
    _lock = threading.Lock()
    fds = [fd for _, fd, _ in _spares.values()]
    _spares.clear()
    for fd in fds:
        os.close(fd)


atexit.register(release)
os.register_at_fork(after_in_child=_forget)
