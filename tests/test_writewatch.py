"""WriteWatch: the pages of live tensors written since their hashes were recorded, from
the kernel (userfaultfd write-protect, PAGEMAP_SCAN)."""

import ctypes
import logging
import os
import platform

import numpy as np
import pytest
import torch

from hotweights.changes import writewatch
from hotweights.changes.uffd import WriteTracker
from hotweights.changes.writewatch import PAGE, WriteWatch

with WriteWatch() as _probe:
    WHY = _probe.why
needs_kernel = pytest.mark.skipif(bool(WHY), reason=f"no write watch here: {WHY}")
N = 256 << 10  # bytes per test tensor: above writewatch.MIN_BYTES


def _tensors(*sizes: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(n // 4) for i, n in enumerate(sizes)}


def _settle(watch: WriteWatch, tensors) -> dict:
    """One sync's worth: what was written, then every tensor recorded."""
    got = watch.written(tensors)
    watch.record({n: np.zeros(1, np.uint64) for n in tensors})
    return got


def _watched(watch: WriteWatch, tensors) -> None:
    """Two syncs' worth: the first protects the tensors' pages, the second finds them
    watched; a write after it is told."""
    _settle(watch, tensors)
    _settle(watch, tensors)


def _page_inside(t: torch.Tensor, k: int) -> tuple[int, int]:
    """The address of the `k`-th whole page inside `t` (from 0), and its offset in `t`."""
    page = -(-t.data_ptr() // PAGE) * PAGE + k * PAGE
    return page, page - t.data_ptr()


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _pages_of(t: torch.Tensor, lo: int, hi: int) -> tuple[int, int]:
    """Byte range [lo, hi) of `t` widened to whole pages, clipped to the tensor."""
    p = t.data_ptr()
    a, b = (p + lo) - (p + lo) % PAGE, -(-(p + hi) // PAGE) * PAGE
    return max(a, p) - p, min(b, p + t.nbytes) - p


@needs_kernel
def test_only_the_pages_written_since_the_record_are_told():
    ts = _tensors(N, N)
    with WriteWatch() as w:
        assert _settle(w, ts) == {}  # new: protected now, nothing to tell yet
        assert _settle(w, ts) == {"t0": [], "t1": []}
        ts["t0"][1000] = 1.0
        ts["t0"][-1] = 2.0
        assert w.written(ts) == {"t0": [_pages_of(ts["t0"], 4000, 4004),
                                        _pages_of(ts["t0"], N - 4, N)], "t1": []}
        w.record({n: np.zeros(1, np.uint64) for n in ts})
        assert _settle(w, ts) == {"t0": [], "t1": []}  # protected again by the scan


@needs_kernel
def test_a_failed_sync_loses_no_write():
    ts = _tensors(N)
    with WriteWatch() as w:
        _settle(w, ts)
        ts["t0"][5] = 1.0
        first = w.written(ts)
        w.record({})  # the sync failed: nothing recorded
        ts["t0"][N // 4 - 1] = 1.0
        got = w.written(ts)
        w.record({})
        assert got["t0"] == first["t0"] + [_pages_of(ts["t0"], N - 4, N)]
        assert w.written(ts)["t0"] == got["t0"]
        w.record({})


@needs_kernel
def test_pages_shared_with_other_memory_count_only_when_the_tensors_own_bytes_change():
    big = torch.zeros((3 * N + 3 * PAGE) // 4)
    off = PAGE // 2 + 8  # no boundary on a page
    ts = {"a": big[off // 4:(off + N) // 4], "b": big[(off + N) // 4:(off + 2 * N) // 4]}
    with WriteWatch() as w:
        _watched(w, ts)
        big[0] = 1.0  # in a's first page, not a's
        big[(off + 2 * N) // 4] = 1.0  # in b's last page, not b's
        assert _settle(w, ts) == {"a": [], "b": []}
        ts["b"][0] = 1.0  # b's first byte: in a page it shares with a
        got = _settle(w, ts)
        assert got == {"a": [], "b": [_pages_of(ts["b"], 0, 4)]}
        ts["a"][-1] = 3.0  # the same shared page, a's side
        assert _settle(w, ts) == {"a": [_pages_of(ts["a"], N - 4, N)], "b": []}


@needs_kernel
def test_zeroed_pages_read_as_written():
    ts = _tensors(N)
    with WriteWatch() as w:
        _watched(w, ts)
        ts["t0"].fill_(1.0)
        _settle(w, ts)
        page, at = _page_inside(ts["t0"], 1)
        assert LIBC.madvise(ctypes.c_void_p(page), ctypes.c_size_t(PAGE), 4) == 0  # DONTNEED
        assert ts["t0"].view(-1)[at // 4].item() == 0.0
        assert _settle(w, ts) == {"t0": [(at, at + PAGE)]}


@needs_kernel
def test_moved_small_and_shared_tensors_are_not_told():
    ts = _tensors(N, writewatch.MIN_BYTES // 2, N)
    ts["t2"].share_memory_()  # another process may write it
    with WriteWatch() as w:
        _settle(w, ts)
        assert _settle(w, ts) == {"t0": []}
        ts["t0"] = ts["t0"].clone()  # new bytes under the old name: start over
        assert _settle(w, ts) == {}
        assert _settle(w, ts) == {"t0": []}
        assert w.recorded("t1") is None and w.recorded("t2") is None


@needs_kernel
def test_a_file_mapped_tensor_is_hashed_and_said_so_once(tmp_path, caplog):
    """A tensor in a private mapping of a file (a model loaded from safetensors may map
    its files) is not watched, and one INFO line says why, not one per sync."""
    (tmp_path / "w.bin").write_bytes(bytes(N))
    ts = {"own": torch.zeros(N // 4),
          "mapped": torch.from_file(str(tmp_path / "w.bin"), shared=False, size=N // 4)}
    with caplog.at_level(logging.INFO, logger=writewatch.__name__), WriteWatch() as w:
        for _ in range(3):
            _settle(w, ts)
        assert w.recorded("own") is not None and w.recorded("mapped") is None
    said = [r.getMessage() for r in caplog.records if "cannot be watched" in r.getMessage()]
    assert said == [f"write watch: 1 tensor(s), {N} bytes, cannot be watched (pinned, not "
                    "contiguous, or in shared or file-backed memory: a model loaded from "
                    "safetensors may map the file): hashed at every sync; give them memory "
                    "of their own (a copy) to watch them"]


@needs_kernel
def test_syncs_sharing_a_watch_take_turns():
    import threading
    ts = _tensors(N)
    with WriteWatch() as w:
        w.written(ts)
        other = threading.Thread(target=_settle, args=(w, ts))
        other.start()
        other.join(0.2)
        assert other.is_alive()  # waits for this turn's record
        w.record({})
        other.join(60)
        assert not other.is_alive()


@needs_kernel
def test_a_forked_child_is_told_nothing():
    ts = _tensors(N)
    with WriteWatch() as w:
        _settle(w, ts)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if "another process" in w.why and w.written(ts) == {} else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert _settle(w, ts) == {"t0": []}


def test_a_closed_watch_tells_nothing():
    w = WriteWatch()
    w.close()
    assert w.why == "closed"
    assert w.written(_tensors(N)) == {}
    w.record({})


def test_where_the_kernel_cannot_watch_it_says_why(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    w = WriteWatch()
    assert "needs Linux on x86_64 or aarch64" in w.why
    assert w.written(_tensors(N)) == {}
    w.record({})


@needs_kernel
def test_pages_mapped_anew_read_as_written():
    ts = _tensors(N)
    with WriteWatch() as w:
        _watched(w, ts)
        page, at = _page_inside(ts["t0"], 2)
        fixed = 0x10 | 0x20 | 0x02  # MAP_FIXED | MAP_ANONYMOUS | MAP_PRIVATE: not registered
        assert LIBC.mmap(page, PAGE, 3, fixed, -1, 0) == page
        ts["t0"][0] = 1.0  # and a write elsewhere, in a page still registered
        assert _settle(w, ts) == {"t0": [_pages_of(ts["t0"], 0, 4), (at, at + PAGE)]}
        assert _settle(w, ts) == {"t0": [(at, at + PAGE)]}  # every time


@needs_kernel
def test_a_tensor_written_all_over_at_two_syncs_in_a_row_is_hashed_from_then_on():
    ts = _tensors(N, N)
    with WriteWatch() as w, WriteWatch() as other:
        _watched(w, ts)
        ts["t0"].add_(1)
        assert _settle(w, ts)["t0"] == [(0, N)]  # once: still watched
        ts["t0"][:N // 8].add_(1)  # half of it
        assert _settle(w, ts) == {"t1": []}  # twice in a row: hashed (the faults cost more)
        assert _settle(w, ts) == {"t1": []} and w.recorded("t0") is None
        _, at = _page_inside(ts["t0"], 1)  # its pages were let go (but one it may share
        mine = {"t": ts["t0"].view(torch.uint8)[at:at + 16 * PAGE]}  # with t1): another
        _settle(other, mine)  # watch may take them
        assert _settle(other, mine) == {"t": []}


@needs_kernel
def test_the_pages_of_a_freed_tensor_are_let_go():
    memory = np.zeros(N // 4, np.float32)  # outlives the tensors made on it
    with WriteWatch() as w, WriteWatch() as other:
        _settle(w, {"t": torch.from_numpy(memory)})  # then the tensor is freed
        again = {"u": torch.from_numpy(memory)}
        _settle(other, again)  # the first watch lets go of its pages when asked
        assert _settle(other, again) == {"u": []}
        assert w.recorded("t") is None


def test_the_default_watch_is_one_per_process_and_can_be_turned_off(monkeypatch):
    assert writewatch.default() is writewatch.default()
    monkeypatch.setenv(writewatch.ENV, "0")
    assert writewatch.default() is None


@needs_kernel
def test_a_kernel_that_fails_the_self_test_is_not_trusted(monkeypatch):
    monkeypatch.setattr(WriteTracker, "_scan", lambda self, *a: [])  # sees no write
    w = WriteWatch()
    assert "self-test: a written page does not read as written" in w.why
    assert w.written(_tensors(N)) == {}
    w.record({})


def test_spans_without_holes():
    assert writewatch._without([(0, 10), (20, 30)], [(2, 4), (8, 22), (25, 26)]) == \
        [(0, 2), (4, 8), (22, 25), (26, 30)]
    assert writewatch._without([(0, 10)], []) == [(0, 10)]
    assert writewatch._without([(0, 10)], [(0, 10)]) == []


@needs_kernel
def test_a_name_given_new_bytes_starts_over_while_its_old_tensor_lives_on():
    # the old storage is still alive (not freed): only its address tells it moved
    ts = _tensors(N)
    old = ts["t0"]
    with WriteWatch() as w:
        _watched(w, ts)
        ts["t0"] = old.clone() + 1  # other bytes under the same name
        assert _settle(w, ts) == {}  # hashed whole, not told "nothing written"
        assert _settle(w, ts) == {"t0": []}
    assert old.sum() == 0


@needs_kernel
def test_a_tensor_a_third_written_at_two_syncs_in_a_row_is_hashed_from_then_on():
    # more than a quarter counts as written all over
    ts = _tensors(N)
    with WriteWatch() as w:
        _watched(w, ts)
        third = N // 4 // 3
        ts["t0"][:third].add_(1)
        assert "t0" in _settle(w, ts)
        ts["t0"][:third].add_(1)
        assert _settle(w, ts) == {}
        assert w.recorded("t0") is None


@needs_kernel
def test_a_sync_with_few_writes_between_two_dense_ones_keeps_the_watch():
    # "at two syncs in a row": a quiet sync in between starts the count over
    ts = _tensors(N)
    with WriteWatch() as w:
        _watched(w, ts)
        ts["t0"].add_(1)
        assert _settle(w, ts)["t0"] == [(0, N)]
        ts["t0"][0] = 5.0
        assert len(_settle(w, ts)["t0"]) == 1
        ts["t0"].add_(1)
        assert _settle(w, ts)["t0"] == [(0, N)]  # once since the quiet sync: still watched
        assert w.recorded("t0") is not None


@needs_kernel
def test_a_name_unwatchable_once_is_watched_when_it_names_memory_of_its_own():
    shared = torch.zeros(N // 4).share_memory_()  # another process may write it
    with WriteWatch() as w:
        _settle(w, {"t": shared})
        assert _settle(w, {"t": shared}) == {}
        own = {"t": shared.clone()}  # now a private copy: watchable
        _settle(w, own)
        assert _settle(w, own) == {"t": []}


@needs_kernel
def test_hashes_recorded_for_a_tensor_the_sync_did_not_ask_about_lose_no_write():
    ts = _tensors(N, N)
    with WriteWatch() as w:
        _watched(w, ts)
        ts["t1"][0] = 1.0
        w.written({"t0": ts["t0"]})  # a sync of t0 alone
        w.record({n: np.zeros(1, np.uint64) for n in ts})  # names t1 too: not its own
        got = _settle(w, ts)["t1"]
        assert len(got) == 1 and got[0][0] == 0


@needs_kernel
def test_a_non_contiguous_tensor_is_not_watched():
    # its bytes lie beyond [data_ptr, data_ptr + nbytes): a watch of that span would miss
    # writes to its last rows
    rows = torch.zeros(256, 512)[:, :256]  # 256 KiB of elements over 512 KiB of memory
    assert not rows.is_contiguous()
    with WriteWatch() as w:
        assert _settle(w, {"nc": rows}) == {}
        assert _settle(w, {"nc": rows}) == {}
        assert w.recorded("nc") is None


@needs_kernel
def test_a_pinned_tensor_is_never_watched(monkeypatch):
    # a device writes pinned memory by DMA, which the page tables never see (pinning needs
    # an accelerator: torch's own check is stood in for)
    ts = _tensors(N)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    with WriteWatch() as w:
        assert _settle(w, ts) == {}
        assert _settle(w, ts) == {}
        assert w.recorded("t0") is None


@needs_kernel
def test_an_edge_written_before_the_first_record_is_recorded_as_it_was_hashed():
    # protected, then a sync failed: the bytes the next sync hashes (not those at
    # protection) are what a later write of the shared page is compared with
    big = torch.zeros((N + 3 * PAGE) // 4)
    off = PAGE // 2 + 8  # its first page is shared with the memory before it
    a = {"a": big[off // 4:(off + N) // 4]}
    with WriteWatch() as w:
        w.written(a)
        w.record({})  # the sync failed: nothing recorded
        a["a"][0] = 1.0
        assert _settle(w, a) == {}  # hashed whole, with a[0] == 1
        a["a"][0] = 0.0  # back to its bytes at protection: a change all the same
        assert _settle(w, a) == {"a": [_pages_of(a["a"], 0, 4)]}


def test_a_forked_child_gets_a_default_watch_of_its_own():
    from hotweights.changes import writewatch
    parent = writewatch.default()
    pid = os.fork()
    if pid == 0:
        child = writewatch.default()
        os._exit(0 if child is not parent and child._pid == os.getpid() else 1)
    assert os.waitpid(pid, 0)[1] == 0


@needs_kernel
def test_a_freed_tensor_is_forgotten_at_the_next_sync():
    with WriteWatch() as w:
        ts = _tensors(N)
        _settle(w, ts)
        assert w.recorded("t0") is not None
        del ts  # freed
        _settle(w, {"other": torch.zeros(4)})
        assert w.recorded("t0") is None


@needs_kernel
def test_a_tensor_whose_last_page_is_shared_memory_is_not_watched(tmp_path):
    # private anonymous memory up to its last page, a shared file mapping there: another
    # process may write that page
    pages = 20  # above MIN_BYTES
    base = LIBC.mmap(None, pages * PAGE, 3, 0x02 | 0x20, -1, 0)  # PRIVATE | ANONYMOUS
    (tmp_path / "shared").write_bytes(bytes(PAGE))
    fd = os.open(tmp_path / "shared", os.O_RDWR)
    try:
        last = base + (pages - 1) * PAGE
        assert LIBC.mmap(last, PAGE, 3, 0x01 | 0x10, fd, 0) == last  # SHARED | FIXED
        t = torch.frombuffer((ctypes.c_char * (pages * PAGE)).from_address(base),
                             dtype=torch.uint8)
        with WriteWatch() as w:
            assert _settle(w, {"t": t}) == {}
            assert _settle(w, {"t": t}) == {}
            assert w.recorded("t") is None
        del t
    finally:
        os.close(fd)
        LIBC.munmap(base, pages * PAGE)


@needs_kernel
@pytest.mark.timeout(30)  # a walk that does not resume from where it stopped never ends
def test_a_scan_of_more_written_regions_than_one_call_holds_resumes_where_it_stopped(
        monkeypatch):
    import mmap

    from hotweights.changes import uffd

    monkeypatch.setattr(uffd, "_REGIONS", 2)  # the walk stops after 2 regions a call
    tracker = WriteTracker()
    assert tracker.open() == ""
    mapping = mmap.mmap(-1, 10 * PAGE)
    page = (ctypes.c_char * (10 * PAGE)).from_buffer(mapping)
    lo = ctypes.addressof(page)
    try:
        tracker.register(lo, lo + 10 * PAGE)
        tracker.protect(lo, lo + 10 * PAGE)
        for k in (0, 2, 4, 6, 8):  # 5 regions, apart
            page[k * PAGE] = b"\x01"
        assert tracker.written(lo, lo + 10 * PAGE, protect=False) == [
            (lo + k * PAGE, lo + (k + 1) * PAGE) for k in (0, 2, 4, 6, 8)]
    finally:
        del page
        mapping.close()
        tracker.close()


@needs_kernel
@pytest.mark.parametrize("fault, why", [
    ("unregistered", "a registered page reads as not registered"),
    ("reprotect", "a page protected again reads as written"),
    ("blind", "a written page does not read as written"),
    ("no_scan", "PAGEMAP_SCAN needs Linux 6.7 or later"),
])
def test_a_kernel_that_fails_a_step_of_the_self_test_is_named_and_nothing_stays_open(
        monkeypatch, fault, why):
    import errno

    real = WriteTracker.written

    def written(self, lo, hi, *, protect):
        if fault == "no_scan":
            raise OSError(errno.ENOTTY, os.strerror(errno.ENOTTY))
        if fault == "blind":
            return []
        return real(self, lo, hi, protect=protect and fault != "reprotect")

    monkeypatch.setattr(WriteTracker, "written", written)
    if fault == "unregistered":
        monkeypatch.setattr(WriteTracker, "unregistered", lambda self, lo, hi: [(lo, hi)])
    tracker = WriteTracker()
    assert why in tracker.open()
    assert not tracker.is_open and tracker.uffd == tracker.pagemap == -1


def test_the_tracker_reads_registrations_and_writes_as_the_kernel_keeps_them(monkeypatch):
    # checked here without the self-test, which would otherwise skip every test above on a
    # tracker that misreads the kernel (`needs_kernel`)
    import mmap

    monkeypatch.setattr(WriteTracker, "_self_test", lambda self: "")
    tracker = WriteTracker()
    if why := tracker.open():
        pytest.skip(f"no write tracking here: {why}")
    mapping = mmap.mmap(-1, 2 * PAGE)
    pages = (ctypes.c_char * (2 * PAGE)).from_buffer(mapping)
    lo = ctypes.addressof(pages)
    mid, hi = lo + PAGE, lo + 2 * PAGE
    try:
        tracker.register(lo, mid)
        tracker.protect(lo, mid)
        assert tracker.unregistered(lo, hi) == [(mid, hi)]
        assert tracker.written(lo, mid, protect=False) == []
        pages[0] = b"\x01"
        for _ in range(2):  # a look without `protect` leaves the write to be read again
            assert tracker.written(lo, mid, protect=False) == [(lo, mid)]
        assert tracker.written(lo, mid, protect=True) == [(lo, mid)]
        assert tracker.written(lo, mid, protect=False) == []
    finally:
        del pages
        mapping.close()
        tracker.close()
