"""Whether this process may replace a file by a rename, or write into it (and whether a
write into it would reach another name too): asked before a commit (and before a replay's
first rename or write), so that a file it may not change is refused with nothing written,
never found half way through applying a journal."""

from __future__ import annotations

import array
import fcntl
import os
import stat

__all__ = ["shared_file", "why_not_replaceable", "why_not_writable"]

FS_IOC_GETFLAGS = 0x80086601  # _IOR('f', 1, long), linux/fs.h
_FIXED = {0x10: "immutable", 0x20: "append-only"}  # FS_IMMUTABLE_FL, FS_APPEND_FL
_CAP_FOWNER = 3  # linux/capability.h


def why_not_replaceable(path: str) -> str | None:
    """Why a rename of another file onto `path` would fail (None: it would not, as far as
    the directory's mode, its sticky bit and the file's flags tell)."""
    directory = os.path.dirname(path) or "."
    if not os.access(directory, os.W_OK | os.X_OK, effective_ids=True):
        return f"its directory {directory} is not writable by this process"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    where = os.stat(directory)
    if (where.st_mode & stat.S_ISVTX and os.geteuid() not in (where.st_uid, st.st_uid)
            and not _may_own_any()):
        return (f"its directory is sticky (mode {stat.filemode(where.st_mode)}) and the file "
                f"is user {st.st_uid}'s, not this process's")
    return _fixed(path) if stat.S_ISREG(st.st_mode) else None


def _may_own_any() -> bool:
    """Whether this process holds CAP_FOWNER (root's, unless a container dropped it), which
    lets it rename over any file in a sticky directory."""
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return os.geteuid() == 0
    return bool(int(caps.split()[1], 16) >> _CAP_FOWNER & 1)


def why_not_writable(path: str) -> str | None:
    """Why `path` cannot be opened for writing (None: it can)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
    except OSError as e:
        return e.strerror
    return None


def shared_file(path: str) -> str | None:
    """Why a write in place into `path` would reach another name too (a symlink, e.g. a
    Hugging Face cache snapshot onto its blob, or a file with other hard links)."""
    if os.path.islink(path):
        return f"a symlink to {os.path.realpath(path)}"
    if (links := os.stat(path).st_nlink) > 1:
        return f"{links - 1} other hard link(s)"
    return None


def _fixed(path: str) -> str | None:
    """'immutable' or 'append-only' where the file's flags say so (`chattr +i`, `+a`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # not readable: the rename may still be allowed
    try:
        flags = array.array("i", [0])  # the kernel writes an int
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags)
    except OSError:  # no such flags on this filesystem
        return None
    finally:
        os.close(fd)
    fixed = [what for bit, what in _FIXED.items() if flags[0] & bit]
    return f"the file is {' and '.join(fixed)} (chattr)" if fixed else None
