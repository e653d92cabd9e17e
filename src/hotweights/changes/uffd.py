"""The kernel's write tracking (Linux 6.7 and later): a userfaultfd in asynchronous
write-protect mode, and `PAGEMAP_SCAN` on `/proc/self/pagemap` to list the pages written.

Addresses only: which tensors own which pages is `writewatch`'s business.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import struct

import numpy as np

__all__ = ["PAGE", "WriteTracker"]

PAGE = os.sysconf("SC_PAGE_SIZE")
_SYSCALL = {"x86_64": 323, "aarch64": 282}  # userfaultfd(2)
_USER_MODE_ONLY = 1  # what an unprivileged process may open (vm.unprivileged_userfaultfd=0)
_WP_ASYNC, _WP_UNPOPULATED = 1 << 15, 1 << 14
_REGISTER_WP, _WP = 1 << 1, 1
_WP_MATCHING = 1  # PAGEMAP_SCAN: protect the pages it reports. Not with PM_SCAN_CHECK_WPASYNC:
# that fails on a mapping not registered, after protecting pages it then does not report.
_WP_ALLOWED, _WRITTEN = 1, 1 << 1  # page categories
_REGIONS = 4096  # page regions per PAGEMAP_SCAN call (the walk resumes where it stopped)


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API, _UFFDIO_REGISTER = _iowr(0xAA, 0x3F, 24), _iowr(0xAA, 0x00, 32)
_UFFDIO_WRITEPROTECT, _PAGEMAP_SCAN = _iowr(0xAA, 0x06, 24), _iowr(ord("f"), 16, 96)
_UFFDIO_UNREGISTER = (2 << 30) | (16 << 16) | (0xAA << 8) | 0x01  # _IOR: reads 16 bytes


class WriteTracker:
    """One userfaultfd and this process's pagemap: register and write-protect page ranges,
    then list the pages written since. Every method but `open` raises OSError."""

    def __init__(self) -> None:
        self.uffd = self.pagemap = -1
        self._regions = np.zeros((_REGIONS, 3), np.uint64)

    @property
    def is_open(self) -> bool:
        return self.uffd >= 0

    def open(self) -> str:
        """Open the file descriptors and test the kernel on a page of its own: empty when
        writes can be tracked, else the reason they cannot (and nothing stays open)."""
        nr = _SYSCALL.get(platform.machine())
        if platform.system() != "Linux" or nr is None:
            return f"needs Linux on x86_64 or aarch64, found {platform.system()} " \
                   f"{platform.machine()}"
        libc = ctypes.CDLL(None, use_errno=True)
        uffd = libc.syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY)
        if uffd < 0:
            return f"userfaultfd: {os.strerror(ctypes.get_errno())} (a seccomp profile, " \
                   "e.g. a container's, may forbid it)"
        try:
            fcntl.ioctl(uffd, _UFFDIO_API, bytearray(struct.pack(
                "QQQ", 0xAA, _WP_ASYNC | _WP_UNPOPULATED, 0)))
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            os.close(uffd)
            return f"asynchronous write-protect needs Linux 6.7 or later ({e.strerror})"
        self.uffd, self.pagemap = uffd, pagemap
        try:  # PAGEMAP_SCAN (6.7) over nothing: ENOTTY where the kernel lacks it
            self.written(0, 0, protect=False)
        except OSError as e:
            self.close()
            return f"PAGEMAP_SCAN needs Linux 6.7 or later ({e.strerror})"
        try:
            failed = self._self_test()
        except OSError as e:
            failed = e.strerror
        if failed:
            self.close()
            return f"the kernel's write tracking failed a self-test: {failed}"
        return ""

    def close(self) -> None:
        """Close the file descriptors; the registrations and protections go with them."""
        for fd in (self.uffd, self.pagemap):
            if fd >= 0:
                os.close(fd)
        self.uffd = self.pagemap = -1

    def _self_test(self) -> str:
        """Watch a page of its own and write it: what went wrong, or ''. An emulated or
        broken kernel must not pass for one that tracks writes."""
        mapping = mmap.mmap(-1, PAGE)
        page = (ctypes.c_char * PAGE).from_buffer(mapping)
        lo = ctypes.addressof(page)
        hi = lo + PAGE
        try:
            self.register(lo, hi)
            self.protect(lo, hi)
            if self.unregistered(lo, hi):
                return "a registered page reads as not registered"
            if self.written(lo, hi, protect=False):
                return "a protected page reads as written"
            page[0] = b"\x01"
            if self.written(lo, hi, protect=True) != [(lo, hi)]:
                return "a written page does not read as written"
            if self.written(lo, hi, protect=False):
                return "a page protected again reads as written"
            return ""
        finally:
            del page
            mapping.close()  # its registration goes with the mapping

    def register(self, lo: int, hi: int) -> None:
        """Register the pages [lo, hi) for write-protection (EBUSY: another userfaultfd
        holds some of them)."""
        fcntl.ioctl(self.uffd, _UFFDIO_REGISTER, bytearray(struct.pack(
            "QQQQ", lo, hi - lo, _REGISTER_WP, 0)))

    def unregister(self, lo: int, hi: int) -> None:
        fcntl.ioctl(self.uffd, _UFFDIO_UNREGISTER, struct.pack("QQ", lo, hi - lo))

    def protect(self, lo: int, hi: int) -> None:
        """Write-protect the registered pages [lo, hi): a write lifts it, one minor fault."""
        fcntl.ioctl(self.uffd, _UFFDIO_WRITEPROTECT, bytearray(struct.pack(
            "QQQ", lo, hi - lo, _WP)))

    def unregistered(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The page regions of [lo, hi) not registered (e.g. mapped anew)."""
        return self._scan(lo, hi, 0, _WP_ALLOWED, _WP_ALLOWED)

    def written(self, lo: int, hi: int, *, protect: bool) -> list[tuple[int, int]]:
        """The page regions of [lo, hi) written since they were protected; with `protect`,
        protected again in the same call."""
        return self._scan(lo, hi, _WP_MATCHING if protect else 0, 0, _WRITTEN)

    def _scan(self, lo: int, hi: int, flags: int, inverted: int, mask: int
              ) -> list[tuple[int, int]]:
        """The page regions of [lo, hi) whose categories, `inverted` bits flipped, hold
        all of `mask`."""
        found, regions = [], self._regions
        while True:
            arg = bytearray(struct.pack("12Q", 96, flags, lo, hi, 0, regions.ctypes.data,
                                        _REGIONS, 0, inverted, mask, 0, mask))
            count = fcntl.ioctl(self.pagemap, _PAGEMAP_SCAN, arg)
            found += [(int(start), int(stop)) for start, stop, _ in regions[:count].tolist()]
            walk_end = struct.unpack_from("Q", arg, 32)[0]
            if walk_end >= hi:
                break
            lo = walk_end
        return found
