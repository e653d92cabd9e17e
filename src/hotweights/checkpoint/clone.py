"""Copy-on-write clones (Linux `FICLONE`), and whether a directory's filesystem has them.

A reflink shares the source's blocks until one side writes, so cloning a shard, patching
the clone and renaming it over the original writes only the changed blocks, and a reader
sees one whole version at any moment. XFS (`mkfs.xfs -m reflink=1`) and btrfs have them;
ext4 and tmpfs do not: there a changed shard is written anew, every byte (`stage.whole`).
Each patch splits the clone's extents around the blocks it writes, and a clone costs time
per extent of its source, so `extents` tells `sync` when a shard is better written anew.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import logging
import os
import re
import struct
import tempfile

from hotweights.checkpoint.writes import write_all
from hotweights.errors import CheckpointError

__all__ = ["extents", "fs_type", "reflink", "supports_reflink"]

logger = logging.getLogger(__name__)

FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
# FICLONE's answers for "no reflinks here"; ENOTTY where the filesystem has no such ioctl.
_NO_REFLINK = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY}
PROBE = ".hotweights-probe-"  # then the pid of the process probing, and a random part
_probed: dict[tuple[int, int], tuple[bool, str]] = {}  # (st_dev, f_fsid) -> the answer
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS = 0x80086601, 0x40086602  # linux/fs.h (on 64-bit)
FS_NOCOW_FL = 0x00800000  # btrfs's nodatacow (`chattr +C`): no clone between a file with it
# and one without (EINVAL); a new file takes its directory's
FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap), linux/fs.h
# struct fiemap without its extent array: fm_start, fm_length, fm_flags,
# fm_mapped_extents, fm_extent_count (0: only count them), fm_reserved
_FIEMAP = struct.Struct("=QQIIII")


def _clone(src: str, dst: str) -> None:
    # Raises OSError; a dst this call created is removed again (an existing one is kept).
    sfd = os.open(src, os.O_RDONLY)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            clone_into(dfd, sfd)
        except BaseException:
            os.close(dfd)
            os.unlink(dst)
            raise
        os.close(dfd)
    finally:
        os.close(sfd)


def clone_into(dfd: int, sfd: int) -> None:
    """FICLONE the file `sfd` into the empty file `dfd`, which first takes `sfd`'s
    nodatacow flag (btrfs: a shard written before `chattr +C` on its directory, or moved in
    from another). Raises OSError."""
    flags = array.array("i", [0])  # an int, as the filesystems read and write it
    try:
        fcntl.ioctl(sfd, FS_IOC_GETFLAGS, flags, True)
        nocow = flags[0] & FS_NOCOW_FL
        fcntl.ioctl(dfd, FS_IOC_GETFLAGS, flags, True)
        if flags[0] & FS_NOCOW_FL != nocow:
            flags[0] ^= FS_NOCOW_FL
            fcntl.ioctl(dfd, FS_IOC_SETFLAGS, flags)
    except OSError:  # no such flags here (tmpfs), or none to set (XFS): clone as they are
        pass
    fcntl.ioctl(dfd, FICLONE, sfd)


def reflink(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Create `dst` as a copy-on-write clone of `src` (same bytes, shared blocks).

    Args:
        src: the file to clone.
        dst: the new file (mode 0o644 less the umask); it must not exist.

    Raises:
        CheckpointError: `dst` exists, `src` cannot be read, the two are on different
            filesystems, or the filesystem does not support reflinks; a `dst` this call
            created is removed again.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    try:
        _clone(src, dst)
    except OSError as e:
        if e.filename is not None:  # from os.open
            raise CheckpointError(f"{e.filename}: cannot clone {src} to {dst}: "
                                  f"{e.strerror}") from e
        where = os.path.dirname(os.path.abspath(dst))
        why = ""
        if e.errno == errno.EXDEV:
            why = "they are on different filesystems (a reflink stays within one) "
        elif e.errno in _NO_REFLINK:
            why = f"the filesystem of {where} does not support reflinks "
        raise CheckpointError(f"{dst}: cannot clone {src}: {why}(FICLONE: {e.strerror})"
                              ) from e


def extents(path: str | os.PathLike | int) -> int | None:
    """How many extents the data of the file at `path` (or open as that descriptor) lies
    in (FIEMAP, counted, not listed); None where the filesystem does not say (tmpfs) or
    the file cannot be read."""
    opened = not isinstance(path, int)
    try:
        fd = os.open(path, os.O_RDONLY) if opened else path
    except OSError:
        return None
    try:
        buf = bytearray(_FIEMAP.pack(0, 2**64 - 1, 0, 0, 0, 0))
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
        return _FIEMAP.unpack(buf)[3]
    except OSError:
        return None
    finally:
        if opened:
            os.close(fd)


def supports_reflink(directory: str | os.PathLike) -> tuple[bool, str]:
    """Whether files in `directory` can be cloned, found by cloning a small probe file
    (`.hotweights-probe-PID-*`, removed again; one a killed process left, by `sweep_probes`).

    Args:
        directory: an existing directory.

    Returns:
        (ok, reason), e.g. (True, "xfs at /mnt/x supports reflinks") or (False, "ext4 at /
        does not support reflinks (FICLONE: Operation not supported)"). The answer is
        cached per filesystem (st_dev and f_fsid: a device number is reused by the next
        mount, of another filesystem maybe); a read-only directory is checked every time.
    """
    directory = os.path.realpath(os.fspath(directory))
    try:
        dev = os.stat(directory).st_dev, os.statvfs(directory).f_fsid
        if not os.access(directory, os.W_OK):
            ro_mount = os.statvfs(directory).f_flag & os.ST_RDONLY
            how = "a read-only mount" if ro_mount else "no write permission"
            return False, f"{directory} is read-only ({how})"
    except OSError as e:
        return False, f"{directory}: {e.strerror}"
    if dev in _probed:
        return _probed[dev]
    kind, mount = fs_type(directory)
    src, full = None, False
    try:  # a name of this call's own: another thread may probe the directory meanwhile
        fd, src = tempfile.mkstemp(prefix=f"{PROBE}{os.getpid()}-", dir=directory)
        try:
            write_all(fd, bytes(4096))
        except OSError as e:  # a full disk: an empty file's clone takes no block (and
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):  # answers the same where
                raise  # the filesystem has no reflinks)
            os.ftruncate(fd, 0)
            full = True
        finally:
            os.close(fd)
        _clone(src, src + ".clone")
        os.unlink(src + ".clone")
        answer = True, f"{kind} at {mount} supports reflinks"
    except OSError as e:
        if e.errno not in _NO_REFLINK or e.filename is not None:  # not FICLONE's answer
            return False, f"{directory}: cannot probe for reflinks: {e.strerror}"
        answer = False, f"{kind} at {mount} does not support reflinks (FICLONE: {e.strerror})"
    finally:
        if src is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(src)
    if not full:  # (probed on an empty file: asked again once there is room)
        _probed[dev] = answer
    logger.debug("%s: %s", directory, answer[1])
    return answer


def sweep_probes(directory: str | os.PathLike) -> list[str]:
    """Remove the probe files (and their clones) that processes no longer running left in
    `directory` (killed while `supports_reflink` probed); their names."""
    gone = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            pid = name[len(PROBE):].split("-", 1)[0]
            if not (name.startswith(PROBE) and pid.isdigit()) or _alive(int(pid)):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                gone.append(name)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's
        return True
    return True


def fs_type(path: str | os.PathLike) -> tuple[str, str]:
    """(filesystem type, mount point) of `path`, from /proc/self/mounts; ("unknown", "")
    if that cannot be read. The innermost, latest mount over the real path wins."""
    real = os.path.realpath(os.fspath(path))
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return "unknown", ""
    best = "unknown", ""
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[1]):
            best = fields[2], mount
    return best

