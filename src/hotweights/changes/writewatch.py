"""Which pages of live CPU tensors were written since they were last hashed, told by the
kernel instead of found by hashing every byte again.

Linux 6.7 and later: the tensors' pages are registered with a userfaultfd in write-protect
mode, asynchronous (`UFFD_FEATURE_WP_ASYNC`): the first write to a protected page lifts its
protection in the kernel, one minor fault and no signal. `PAGEMAP_SCAN` on
`/proc/self/pagemap` lists the pages whose protection was lifted and protects them again in
the same call. The pages of a tensor a scan does not report have not been written since
the scan before (a page outside any registration, zeroed by `madvise`, or mapped anew reads
as written).

What it cannot see, and so never watches: memory another process may write (shared or file
mappings: shared memory with a vLLM server), and pinned memory (a device writes it by DMA).
The cost is on the writer: after each scan, the first write to each 4 KiB page faults once
(~0.4 us; `benchmarks/checkpoint_sync.py` measures it), more than hashing the page costs:
a tensor written all over at two syncs in a row is let go (hashed from then on), and so
are the pages of a freed tensor. `checkpoint.sync` uses the process's watch, `default()`,
unless told otherwise.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import platform
import struct
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

logger = logging.getLogger(__name__)

__all__ = ["ENV", "WriteWatch", "default"]

PAGE = os.sysconf("SC_PAGE_SIZE")
MIN_BYTES = 64 << 10  # smaller tensors are hashed whole: fewer registrations (VMA splits)
_SYSCALL = {"x86_64": 323, "aarch64": 282}  # userfaultfd(2)
_USER_MODE_ONLY = 1  # what an unprivileged process may open (vm.unprivileged_userfaultfd=0)
_WP_ASYNC, _WP_UNPOPULATED = 1 << 15, 1 << 14
_REGISTER_WP, _WP = 1 << 1, 1
_WP_MATCHING = 1  # PAGEMAP_SCAN: protect the pages it reports. Not with PM_SCAN_CHECK_WPASYNC:
# that fails on a mapping not registered, after protecting pages it then does not report.
_WP_ALLOWED, _WRITTEN = 1, 1 << 1  # page categories
_REGIONS = 4096  # page regions per PAGEMAP_SCAN call (the walk resumes where it stopped)
# A fault per page written costs about what hashing 2-3 unwritten pages saves: a tensor more
# than a quarter written at this many syncs in a row is no longer watched.
_DENSE = 2
ENV = "HOTWEIGHTS_WRITE_WATCH"  # "0": syncs that are given no watch use none
_default: WriteWatch | None = None
_default_lock = threading.Lock()


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API, _UFFDIO_REGISTER = _iowr(0xAA, 0x3F, 24), _iowr(0xAA, 0x00, 32)
_UFFDIO_WRITEPROTECT, _PAGEMAP_SCAN = _iowr(0xAA, 0x06, 24), _iowr(ord("f"), 16, 96)
_UFFDIO_UNREGISTER = (2 << 30) | (16 << 16) | (0xAA << 8) | 0x01  # _IOR: reads 16 bytes
_watches: weakref.WeakSet[WriteWatch] = weakref.WeakSet()  # this process's open watches


@dataclass
class _Watched:
    span: tuple[int, int]  # the tensor's bytes, as addresses
    storage: StorageWeakRef  # expired: the tensor was freed, its pages are not its own
    hashes: np.ndarray | None = None  # its block hashes when last recorded
    written: list[tuple[int, int]] = field(default_factory=list)  # since then (addresses)
    # Its bytes in the pages it shares with other memory (allocator headers, neighbours,
    # written all the time): when last recorded, and now (recorded next).
    edges: dict[tuple[int, int], bytes] = field(default_factory=dict)
    edges_now: dict[tuple[int, int], bytes] = field(default_factory=dict)
    dense: int = 0  # syncs in a row that found more than a quarter of it written

    def changed(self) -> list[tuple[int, int]]:
        """`written`, less the shared pages where its own bytes are as recorded; notes its
        bytes there now, to be recorded next (`edges_now`)."""
        out, self.edges_now = [], dict(self.edges)
        for lo, hi in self.written:
            for (a, b), old in self.edges.items():
                if lo < b and hi > a:
                    now = self.edges_now[a, b] = ctypes.string_at(a, b - a)
                    if now == old:
                        lo, hi = (b, hi) if a == self.span[0] else (lo, a)
            if lo < hi:
                out.append((lo, hi))
        return out


class WriteWatch:
    """Tells `checkpoint.sync` which bytes of the live tensors were written since it last
    hashed them, so it hashes only those.

    One watch follows the tensors of one process; every sync of those weights must use the
    same one (syncs that share it take turns): the process's `default()` unless a sync is
    given its own (`sync(..., watch=WriteWatch())`). A tensor it cannot watch (not on the
    CPU, in shared or pinned memory, under 64 KiB, or a kernel without the feature: see
    `why`) is hashed as without it.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._uffd = self._pagemap = -1
        self._why: str | None = None  # why nothing can be watched; None: not tried yet
        self._watched: dict[str, _Watched] = {}
        self._unwatchable: dict[str, tuple[int, int]] = {}  # name -> span, checked once
        self._regions = np.zeros((_REGIONS, 3), np.uint64)
        self._turn = threading.Lock()  # held from `written` to `record`
        self._spans: list[tuple[int, int]] = []  # the watched pages, merged
        self._asked: set[str] = set()  # the names of the last `written` call

    @property
    def why(self) -> str:
        """Empty when this process can watch writes, else the reason it cannot."""
        if self._why is None:
            self._why = self._open()
        if os.getpid() != self._pid:
            return "the watch was made in another process (before a fork)"
        return self._why

    def written(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, list[tuple[int, int]]]:
        """The byte ranges of each tensor written since its hashes were last `record`ed.

        Tensors not watched yet are protected now, before this returns: hash them after
        it, and `record` those hashes. Tensors whose bytes moved start over the same way.
        Every call must be followed by one `record` (another caller waits until then).

        Args:
            tensors: name -> tensor, as the sync holds them.
        Returns:
            name -> sorted byte ranges [start, stop) within the tensor, for the tensors
            whose recorded hashes describe their bytes outside those ranges.
        """
        self._turn.acquire()
        try:
            return self._written(tensors)
        except BaseException:
            self._turn.release()
            raise

    def _written(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, list[tuple[int, int]]]:
        if self.why:
            return {}
        self._collect()
        self._forget([n for n, w in self._watched.items() if w.storage.expired()  # freed,
                      or n in tensors and w.span != _span(tensors[n])])  # or moved
        out, new, anonymous, self._asked = {}, [], None, set(tensors)
        for name, t in tensors.items():
            span = _span(t)
            w = self._watched.get(name)
            if w is not None and w.hashes is None:  # protected, never recorded
                w.edges_now = _edge_bytes(span)
            elif w is not None:
                changed = w.changed()
                w.dense = w.dense + 1 if 4 * sum(b - a for a, b in changed) > t.nbytes else 0
                if w.dense < _DENSE:
                    out[name] = [(lo - span[0], hi - span[0]) for lo, hi in changed]
                else:  # written all over, sync after sync: hashing costs less than the
                    logger.debug("%s: written all over at %d syncs in a row: hashed from "
                                 "now on", name, _DENSE)  # faults
                    self._forget([name])
                    self._unwatchable[name] = span
            elif self._unwatchable.get(name) == span:
                continue
            elif _plain(name, t) and _private(name, t, anonymous := anonymous or _anonymous()):
                new.append((name, t))
            else:
                self._unwatchable[name] = span
        self._protect(new)
        self._spans = _merge(_pages(*w.span) for w in self._watched.values())
        return out

    def _forget(self, names: list[str]) -> None:
        """Stop watching these tensors: their pages are unregistered (no more faults, and
        free for another watch), but for those they share with a tensor still watched;
        the scans cover the pages of those alone."""
        if not names:
            return
        gone = _merge(_pages(*self._watched.pop(n).span) for n in names)
        self._spans = _merge(_pages(*w.span) for w in self._watched.values())
        for lo, hi in _without(gone, self._spans):
            try:
                fcntl.ioctl(self._uffd, _UFFDIO_UNREGISTER, struct.pack("QQ", lo, hi - lo))
            except OSError as e:  # unmapped since: nothing registered there any more
                logger.debug("pages %#x-%#x: not unregistered (%s)", lo, hi, e.strerror)

    def _tidy(self) -> None:
        """Forget the tensors that were freed, if no sync is using this watch right now."""
        if self._uffd >= 0 and os.getpid() == self._pid and self._turn.acquire(blocking=False):
            try:
                self._forget([n for n, w in self._watched.items() if w.storage.expired()])
            finally:
                self._turn.release()

    def recorded(self, name: str) -> np.ndarray | None:
        """The block hashes last `record`ed for `name`, if it is watched."""
        w = self._watched.get(name)
        return None if w is None else w.hashes

    def record(self, hashes: Mapping[str, np.ndarray]) -> None:
        """Note the block hashes just computed for watched tensors, after `written` (none:
        nothing was hashed, e.g. the sync failed): their writes count from that call on."""
        try:
            for name, h in hashes.items():
                if name in self._asked and (w := self._watched.get(name)) is not None:
                    w.hashes, w.written, w.edges = h, [], w.edges_now
        finally:
            if self._turn.locked():
                self._turn.release()

    def close(self) -> None:
        """Stop watching (the protections go with the file descriptor)."""
        for fd in (self._uffd, self._pagemap):
            if fd >= 0 and os.getpid() == self._pid:
                os.close(fd)
        self._uffd = self._pagemap = -1
        self._why, self._watched, self._unwatchable, self._spans = "closed", {}, {}, []

    def __enter__(self) -> WriteWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self) -> str:
        nr = _SYSCALL.get(platform.machine())
        if platform.system() != "Linux" or nr is None:
            return f"needs Linux on x86_64 or aarch64, found {platform.system()} " \
                   f"{platform.machine()}"
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY)
        if fd < 0:
            return f"userfaultfd: {os.strerror(ctypes.get_errno())} (a seccomp profile, " \
                   "e.g. a container's, may forbid it)"
        try:
            fcntl.ioctl(fd, _UFFDIO_API, bytearray(struct.pack(
                "QQQ", 0xAA, _WP_ASYNC | _WP_UNPOPULATED, 0)))
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            os.close(fd)
            return f"asynchronous write-protect needs Linux 6.7 or later ({e.strerror})"
        self._uffd, self._pagemap = fd, pagemap
        try:  # PAGEMAP_SCAN (6.7) over nothing: ENOTTY where the kernel lacks it
            self._scan(0, 0, 0, 0, _WRITTEN)
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
        _watches.add(self)
        return ""

    def _self_test(self) -> str:
        """Watch a page of its own and write it: what went wrong, or ''. An emulated or
        broken kernel must not pass for one that tracks writes."""
        m = mmap.mmap(-1, PAGE)
        page = (ctypes.c_char * PAGE).from_buffer(m)
        lo = ctypes.addressof(page)
        hi = lo + PAGE
        try:
            self._register(lo, hi)
            self._protection(lo, hi, _WP)
            if self._scan(lo, hi, 0, _WP_ALLOWED, _WP_ALLOWED):
                return "a registered page reads as not registered"
            if self._scan(lo, hi, 0, 0, _WRITTEN):
                return "a protected page reads as written"
            page[0] = b"\x01"
            if self._scan(lo, hi, _WP_MATCHING, 0, _WRITTEN) != [(lo, hi)]:
                return "a written page does not read as written"
            if self._scan(lo, hi, 0, 0, _WRITTEN):
                return "a page protected again reads as written"
            return ""
        finally:
            del page
            m.close()  # its registration goes with the mapping

    def _collect(self) -> None:
        """Move what the kernel saw written since the last scan into every watched tensor,
        protecting those pages again (one call per distinct page span)."""
        hits: list[tuple[int, int]] = []
        for lo, hi in self._spans:  # pages mapped anew (not registered) read as written
            hits += self._scan(lo, hi, 0, _WP_ALLOWED, _WP_ALLOWED)
            hits += self._scan(lo, hi, _WP_MATCHING, 0, _WRITTEN)
        hits = _merge(hits)  # disjoint: the one starting last at or before a span covers it
        starts = [lo for lo, _ in hits]
        for w in self._watched.values():
            a, b = w.span
            i, seen = max(0, bisect.bisect_right(starts, a) - 1), len(w.written)
            while i < len(hits) and hits[i][0] < b:
                lo, hi = hits[i]
                if hi > a:
                    w.written.append((max(a, lo), min(b, hi)))
                i += 1
            if len(w.written) > seen:
                w.written = _merge(w.written)

    def _protect(self, new: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in new:
            span = _span(t)
            lo, hi = _pages(*span)
            try:
                try:
                    self._register(lo, hi)
                except OSError as e:  # EBUSY: another watch holds pages of a freed tensor?
                    if e.errno != errno.EBUSY:
                        raise
                    for other in list(_watches):
                        if other is not self:
                            other._tidy()
                    self._register(lo, hi)
                self._protection(lo, hi, _WP)
            except OSError as e:
                logger.debug("%s: cannot watch its pages (%s): hashed", name, e.strerror)
                self._unwatchable[name] = span  # not tried again at every sync
                continue
            self._watched[name] = _Watched(span, StorageWeakRef(t.untyped_storage()),
                                           edges_now=_edge_bytes(span))

    def _register(self, lo: int, hi: int) -> None:
        fcntl.ioctl(self._uffd, _UFFDIO_REGISTER, bytearray(struct.pack(
            "QQQQ", lo, hi - lo, _REGISTER_WP, 0)))

    def _protection(self, lo: int, hi: int, mode: int) -> None:
        fcntl.ioctl(self._uffd, _UFFDIO_WRITEPROTECT, bytearray(struct.pack(
            "QQQ", lo, hi - lo, mode)))

    def _scan(self, lo: int, hi: int, flags: int, inverted: int, mask: int
              ) -> list[tuple[int, int]]:
        """The page regions of [lo, hi) whose categories, `inverted` bits flipped, hold
        all of `mask`."""
        out, regions = [], self._regions
        while True:
            arg = bytearray(struct.pack("12Q", 96, flags, lo, hi, 0, regions.ctypes.data,
                                        _REGIONS, 0, inverted, mask, 0, mask))
            n = fcntl.ioctl(self._pagemap, _PAGEMAP_SCAN, arg)
            out += [(int(a), int(b)) for a, b, _ in regions[:n].tolist()]
            walk_end = struct.unpack_from("Q", arg, 32)[0]
            if walk_end >= hi:
                break
            lo = walk_end
        return out


def default() -> WriteWatch | None:
    """The watch `checkpoint.sync` uses when it is given none: one per process, made at its
    first use; None where the environment says HOTWEIGHTS_WRITE_WATCH=0."""
    global _default
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    with _default_lock:
        if _default is None or _default._pid != os.getpid():  # a forked child makes its own
            _default = WriteWatch()
        return _default


def _pages(lo: int, hi: int) -> tuple[int, int]:
    return lo - lo % PAGE, -(-hi // PAGE) * PAGE


def _edges(lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) in pages it shares with the memory around it."""
    head, tail = min(hi, -(-lo // PAGE) * PAGE), max(lo, hi - hi % PAGE)
    return [e for e in ((lo, head) if lo % PAGE else None,
                        (tail, hi) if hi % PAGE and tail >= head else None) if e]


def _edge_bytes(span: tuple[int, int]) -> dict[tuple[int, int], bytes]:
    return {(a, b): ctypes.string_at(a, b - a) for a, b in _edges(*span)}


def _merge(spans) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _without(spans: list[tuple[int, int]], holes: list[tuple[int, int]]
             ) -> list[tuple[int, int]]:
    """The parts of sorted, disjoint `spans` outside sorted, disjoint `holes`."""
    out = []
    for lo, hi in spans:
        for a, b in holes:
            if b <= lo or a >= hi:
                continue
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
        if lo < hi:
            out.append((lo, hi))
    return out


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.nbytes


def _plain(name: str, t: torch.Tensor) -> bool:
    if t.device.type != "cpu" or t.nbytes < MIN_BYTES or not t.is_contiguous():
        return False
    if t.is_pinned():
        logger.debug("%s: pinned memory (DMA writes bypass the page tables): hashed", name)
        return False
    return True


def _private(name: str, t: torch.Tensor, anonymous: tuple[list[int], list[int]]) -> bool:
    lo, hi = _pages(*_span(t))
    starts, ends = anonymous
    i = bisect.bisect_right(starts, lo) - 1
    if i < 0 or ends[i] < hi:
        logger.debug("%s: shared or file-backed memory: hashed", name)
        return False
    return True


def _anonymous() -> tuple[list[int], list[int]]:
    """This process's private anonymous memory, as merged address spans (starts, ends):
    no other process and no file writes it."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) > 5 else ""
            if fields[1][3] == "p" and fields[4] == "0" and (
                    not path or path == "[heap]" or path.startswith("[anon:")):
                a, b = fields[0].split("-")
                spans.append((int(a, 16), int(b, 16)))
    merged = _merge(spans)
    return [a for a, _ in merged], [b for _, b in merged]
