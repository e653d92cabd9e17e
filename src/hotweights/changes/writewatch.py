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
mappings: shared memory with a vLLM server), and pinned memory (a device writes it by DMA),
checked at every scan (memory pinned after its first sync is let go and hashed). Nor can
it see other writes that bypass the page tables: RDMA into registered memory, io_uring
fixed buffers, a driver's DMA into memory it did not pin through torch. That is why it is
opt-in: pass `watch=True` to `checkpoint.sync` only for weights this process's CPU code
alone writes.
The cost is on the writer: after each scan, the first write to each 4 KiB page faults once
(~0.4 us; `benchmarks/checkpoint_sync.py` measures it), more than hashing the page costs:
a tensor written all over at two syncs in a row is let go (hashed from then on), and so
are the pages of a freed tensor. `checkpoint.sync(..., watch=True)` uses the process's
watch, `default()`.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hotweights.changes.spans import merge_spans
from hotweights.changes.uffd import PAGE, WriteTracker

logger = logging.getLogger(__name__)

__all__ = ["ENV", "WriteWatch", "default"]

MIN_BYTES = 64 << 10  # smaller tensors are hashed whole: fewer registrations (VMA splits)
# A fault per page written costs about what hashing 2-3 unwritten pages saves: a tensor more
# than a quarter written at this many syncs in a row is no longer watched.
_DENSE = 2
ENV = "HOTWEIGHTS_WRITE_WATCH"  # "0": no watch even for sync(watch=True)
_default: WriteWatch | None = None
_default_lock = threading.Lock()
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
        changed, self.edges_now = [], dict(self.edges)
        for lo, hi in self.written:
            for (edge_lo, edge_hi), recorded in self.edges.items():
                if lo < edge_hi and hi > edge_lo:
                    now = self.edges_now[edge_lo, edge_hi] = ctypes.string_at(
                        edge_lo, edge_hi - edge_lo)
                    if now == recorded:  # drop the edge: the head's or the tail's
                        lo, hi = (edge_hi, hi) if edge_lo == self.span[0] else (lo, edge_lo)
            if lo < hi:
                changed.append((lo, hi))
        return changed


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
        self._tracker = WriteTracker()
        self._why: str | None = None  # why nothing can be watched; None: not tried yet
        self._watched: dict[str, _Watched] = {}
        self._unwatchable: dict[str, tuple[int, int]] = {}  # name -> span, checked once
        self._turn = threading.Lock()  # held from `written` to `record`
        self._spans: list[tuple[int, int]] = []  # the watched pages, merged
        self._asked: set[str] = set()  # the names of the last `written` call

    @property
    def why(self) -> str:
        """Empty when this process can watch writes, else the reason it cannot."""
        if self._why is None:
            self._why = self._tracker.open()
            if not self._why:
                _watches.add(self)
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
        if not any(t.device.type == "cpu" for t in tensors.values()) or self.why:
            return {}  # nothing to watch: no userfaultfd probed
        self._collect()
        self._forget([name for name, watched in self._watched.items()
                      if watched.storage.expired()  # freed,
                      or name in tensors and watched.span != _span(tensors[name])])  # or moved
        ranges, new, anonymous, self._asked = {}, [], None, set(tensors)
        refused = []  # CPU tensors large enough to watch, newly found unwatchable
        for name, tensor in tensors.items():
            span = _span(tensor)
            watched = self._watched.get(name)
            if watched is not None and _pinned(name, tensor):  # since: a device may write it
                self._forget([name])
                self._unwatchable[name] = span
            elif watched is not None and watched.hashes is None:  # protected, never recorded
                watched.edges_now = _edge_bytes(span)
            elif watched is not None:
                changed = watched.changed()
                written_all_over = 4 * sum(hi - lo for lo, hi in changed) > tensor.nbytes
                watched.dense = watched.dense + 1 if written_all_over else 0
                if watched.dense < _DENSE:
                    ranges[name] = [(lo - span[0], hi - span[0]) for lo, hi in changed]
                else:  # written all over, sync after sync: hashing costs less than the
                    logger.debug("%s: written all over at %d syncs in a row: hashed from "
                                 "now on", name, _DENSE)  # faults
                    self._forget([name])
                    self._unwatchable[name] = span
            elif self._unwatchable.get(name) == span:
                continue
            elif _plain(name, tensor) and _private(
                    name, tensor, anonymous := anonymous or _anonymous()):
                new.append((name, tensor))
            else:
                self._unwatchable[name] = span
                if tensor.device.type == "cpu" and tensor.nbytes >= MIN_BYTES:
                    refused.append(tensor.nbytes)
        if refused:
            logger.info("write watch: %d tensor(s), %d bytes, cannot be watched (pinned, not "
                        "contiguous, or in shared or file-backed memory: a model loaded from "
                        "safetensors may map the file): hashed at every sync; give them "
                        "memory of their own (a copy) to watch them", len(refused),
                        sum(refused))
        self._protect(new)
        self._spans = merge_spans(_pages(*watched.span) for watched in self._watched.values())
        return ranges

    def _forget(self, names: list[str]) -> None:
        """Stop watching these tensors: their pages are unregistered (no more faults, and
        free for another watch), but for those they share with a tensor still watched;
        the scans cover the pages of those alone."""
        if not names:
            return
        gone = merge_spans(_pages(*self._watched.pop(name).span) for name in names)
        self._spans = merge_spans(_pages(*watched.span) for watched in self._watched.values())
        for lo, hi in _without(gone, self._spans):
            try:
                self._tracker.unregister(lo, hi)
            except OSError as e:  # unmapped since: nothing registered there any more
                logger.debug("pages %#x-%#x: not unregistered (%s)", lo, hi, e.strerror)

    def _tidy(self) -> None:
        """Forget the tensors that were freed, if no sync is using this watch right now."""
        if (self._tracker.is_open and os.getpid() == self._pid
                and self._turn.acquire(blocking=False)):
            try:
                self._forget([name for name, watched in self._watched.items()
                              if watched.storage.expired()])
            finally:
                self._turn.release()

    def recorded(self, name: str) -> np.ndarray | None:
        """The block hashes last `record`ed for `name`, if it is watched."""
        watched = self._watched.get(name)
        return None if watched is None else watched.hashes

    def record(self, hashes: Mapping[str, np.ndarray]) -> None:
        """Note the block hashes just computed for watched tensors, after `written` (none:
        nothing was hashed, e.g. the sync failed): their writes count from that call on."""
        try:
            for name, block_hashes in hashes.items():
                if name in self._asked and (watched := self._watched.get(name)) is not None:
                    watched.hashes, watched.written = block_hashes, []
                    watched.edges = watched.edges_now
        finally:
            if self._turn.locked():
                self._turn.release()

    def close(self) -> None:
        """Stop watching (the protections go with the file descriptors)."""
        if os.getpid() == self._pid:  # a forked child leaves its parent's to the parent
            self._tracker.close()
        self._why, self._watched, self._unwatchable, self._spans = "closed", {}, {}, []

    def __enter__(self) -> WriteWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _collect(self) -> None:
        """Move what the kernel saw written since the last scan into every watched tensor,
        protecting those pages again (one call per distinct page span)."""
        hits: list[tuple[int, int]] = []
        for lo, hi in self._spans:  # pages mapped anew (not registered) read as written
            hits += self._tracker.unregistered(lo, hi)
            hits += self._tracker.written(lo, hi, protect=True)
        hits = merge_spans(hits)  # disjoint: the one starting last at or before a span covers it
        starts = [lo for lo, _ in hits]
        for watched in self._watched.values():
            start, stop = watched.span
            hit, known = max(0, bisect.bisect_right(starts, start) - 1), len(watched.written)
            while hit < len(hits) and hits[hit][0] < stop:
                lo, hi = hits[hit]
                if hi > start:
                    watched.written.append((max(start, lo), min(stop, hi)))
                hit += 1
            if len(watched.written) > known:
                watched.written = merge_spans(watched.written)

    def _protect(self, new: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in new:
            span = _span(tensor)
            lo, hi = _pages(*span)
            try:
                try:
                    self._tracker.register(lo, hi)
                except OSError as e:  # EBUSY: another watch holds pages of a freed tensor?
                    if e.errno != errno.EBUSY:
                        raise
                    for other in list(_watches):
                        if other is not self:
                            other._tidy()
                    self._tracker.register(lo, hi)
                self._tracker.protect(lo, hi)
            except OSError as e:
                logger.debug("%s: cannot watch its pages (%s): hashed", name, e.strerror)
                self._unwatchable[name] = span  # not tried again at every sync
                continue
            self._watched[name] = _Watched(span, StorageWeakRef(tensor.untyped_storage()),
                                           edges_now=_edge_bytes(span))


def default() -> WriteWatch | None:
    """The watch `checkpoint.sync(watch=True)` uses: one per process, made at its first use;
    None where the environment says HOTWEIGHTS_WRITE_WATCH=0."""
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
    return not _pinned(name, t)


def _pinned(name: str, t: torch.Tensor) -> bool:
    if t.is_pinned():
        logger.debug("%s: pinned memory (DMA writes bypass the page tables): hashed", name)
        return True
    return False


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
    merged = merge_spans(spans)
    return [a for a, _ in merged], [b for _, b in merged]
