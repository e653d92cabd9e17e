"""What tells a file from another of the same name, or from itself changed: `FileId`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import xxhash

__all__ = ["MAX_HEADER", "FileId"]

MAX_HEADER = 100_000_000  # the safetensors loader refuses longer headers (bytes)


@dataclass(frozen=True)
class FileId:
    """A file's device, inode, size and mtime: another file, or this one changed, differs."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    # A safetensors file's header (which no patch touches): where it ends and the xxh3_64
    # of it with its 8-byte length; 0 and None if not asked for or not a safetensors file.
    header_end: int = 0
    header: str | None = None
    # Changed by every write, rename or link, and settable by no one: what a sidecar also
    # records (a shard copied back in place with its mtime kept). Not compared here: a
    # link into the trash, say, leaves the file the same one.
    ctime_ns: int = field(default=0, compare=False)

    def unchanged(self, now: FileId) -> bool:
        """Whether `now` is this file as it was: the same, and not written since (its ctime
        too: a write in place that put the mtime back, a `cp -p` over it)."""
        return now == self and now.ctime_ns == self.ctime_ns

    @classmethod
    def of(cls, path: str | os.PathLike, *, header: bool = False) -> FileId:
        """The identity of the file at `path` (symlinks followed), with its safetensors
        header's digest if `header`. Raises OSError (FileNotFoundError if it is gone)."""
        if not header:
            return cls.of_stat(os.stat(path))
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if 0 < n <= min(st.st_size - 8, MAX_HEADER):
                return cls.of_stat(st, 8 + n, xxhash.xxh3_64_hexdigest(head + f.read(n)))
        return cls.of_stat(st)

    @classmethod
    def of_stat(cls, st: os.stat_result, header_end: int = 0,
                header: str | None = None) -> FileId:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, header_end, header,
                   st.st_ctime_ns)
