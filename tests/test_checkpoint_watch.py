"""checkpoint.sync with a WriteWatch: only the blocks the kernel saw written are hashed,
and every change still reaches the files."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotweights.changes import writewatch
from hotweights.changes.writewatch import MIN_BYTES, PAGE, WriteWatch
from hotweights.checkpoint import finisher, sync
from hotweights.checkpoint import incremental as sync_mod
from hotweights.errors import CheckpointError

with WriteWatch() as _probe:
    WHY = _probe.why
pytestmark = pytest.mark.skipif(bool(WHY), reason=f"no write watch here: {WHY}")
BS = 16 << 10  # block size: several blocks per page run


def _live(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.w": torch.randn(192, 1024, generator=gen).to(torch.bfloat16)
            for i in range(4)} | {"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}


def _on_disk(d: Path) -> dict[str, torch.Tensor]:
    finisher.finish()
    return load_file(d / "model.safetensors")


def _same(d: Path, live) -> bool:
    disk = _on_disk(d)
    return disk.keys() == live.keys() and all(torch.equal(disk[n], t) for n, t in live.items())


@pytest.fixture
def watch():
    with WriteWatch() as w:
        yield w


def test_only_the_blocks_written_are_hashed_and_every_change_is_written(tmp_path, watch):
    live = _live()
    small = live["model.norm.weight"].nbytes
    assert small < MIN_BYTES < live["model.layers.0.w"].nbytes
    sync(tmp_path, live, watch=watch, block_size=BS)  # first save
    sync(tmp_path, live, watch=watch, block_size=BS)  # watched from here
    r = sync(tmp_path, live, watch=watch, block_size=BS)
    assert (r.bytes_hashed, r.bytes_written) == (small, 0)  # only the unwatched tensor
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        t = live[f"model.layers.{step % 4}.w"]
        rows = torch.randint(0, t.shape[0], (3,), generator=gen)
        t[rows] += 1  # in place, as an optimizer step
        r = sync(tmp_path, live, watch=watch, block_size=BS, version=str(step),
                 mode="journal")  # patches: only the pages written
        assert _same(tmp_path, live), step
        assert r.tensors_changed == 1
        assert small < r.bytes_hashed <= small + 3 * 2 * BS  # each row's blocks, at most
        assert 0 < r.bytes_written <= 3 * 2 * PAGE  # the pages that differ
        assert r.bytes_trusted == sum(t.nbytes for t in live.values()) - r.bytes_hashed


@pytest.mark.parametrize("mode", ["journal", "auto", "reflink"])
def test_a_write_the_watch_cannot_see_beside_one_it_saw_is_written(tmp_path, watch, mode,
                                                                   request):
    """DMA into a block the CPU also wrote: the block's new hash goes into the sidecar, so
    every page of it that differs from the file is written, the unseen one too (else no
    later sync, watched or not, would find it). Patched in place, rewritten whole, cloned."""
    if mode == "reflink":
        tmp_path = request.getfixturevalue("xfs_dir") / request.node.name
    live = _live()
    for _ in range(3):
        sync(tmp_path, live, watch=watch, block_size=BS)
    t = live["model.layers.1.w"]
    seen_at, unseen_at = 3 * BS, 3 * BS + 2 * PAGE + 100  # one block, pages apart
    flat = t.view(-1).view(torch.uint8)
    flat[seen_at] ^= 1
    flat[unseen_at] ^= 1  # as a device would: the watch is told only of the first page
    told = watch.written

    def blind(tensors):
        out = told(tensors)
        page = unseen_at - unseen_at % PAGE  # cut out of the ranges it was seen in
        out["model.layers.1.w"] = [(a, b) for lo, hi in out["model.layers.1.w"] for a, b in
                                   ((lo, min(hi, page)), (max(lo, page + PAGE), hi)) if a < b]
        return out
    watch.written = blind
    r = sync(tmp_path, live, watch=watch, block_size=BS, mode=mode)
    assert r.bytes_hashed < sum(t.nbytes for t in live.values())  # watched, not all hashed
    assert _same(tmp_path, live)


def test_a_directory_another_writer_changed_is_hashed_again(tmp_path, watch):
    live, other = _live(0), _live(1)
    for _ in range(2):
        sync(tmp_path, live, watch=watch)
    sync(tmp_path, other)  # another writer (a process without this watch)
    r = sync(tmp_path, live, watch=watch)  # nothing written to `live` since its last sync
    assert r.bytes_hashed == sum(t.nbytes for t in live.values())
    assert _same(tmp_path, live)


def test_one_watch_for_two_directories(tmp_path, watch):
    live, a, b = _live(), tmp_path / "a", tmp_path / "b"
    for d in (a, b, a, b):
        sync(d, live, watch=watch)
    for step in range(4):
        live["model.layers.1.w"][step] += 1
        sync(a if step % 2 else b, live, watch=watch)
        assert _same(a if step % 2 else b, live)
    sync(a, live, watch=watch)
    sync(b, live, watch=watch)
    assert _same(a, live) and _same(b, live)


def test_a_failed_watched_sync_loses_no_write(tmp_path, watch, monkeypatch):
    live = _live()
    for _ in range(3):
        sync(tmp_path, live, watch=watch)
    live["model.layers.2.w"][7] += 1

    def full(*args):
        raise CheckpointError("disk full (test)")
    with monkeypatch.context() as m:
        m.setattr(sync_mod._Stager, "_room", full)
        with pytest.raises(CheckpointError, match="disk full"):
            sync(tmp_path, live, watch=watch)
    r = sync(tmp_path, live, watch=watch)
    assert r.tensors_changed == 1 and _same(tmp_path, live)


def test_cast_copies_are_not_watched(tmp_path, watch):
    live = _live()
    sync(tmp_path, live)
    as_f32 = {n: t.float() for n, t in live.items()}
    for _ in range(2):
        r = sync(tmp_path, as_f32, watch=watch, convert_dtype=True)  # cast anew each time
    assert r.bytes_hashed == sum(t.nbytes for t in live.values())
    assert all(watch.recorded(n) is None for n in live)


def test_the_watch_is_opt_in(tmp_path, monkeypatch):
    # DMA, RDMA and io_uring writes bypass the page tables: a plain sync hashes every byte
    live = _live()
    small, total = live["model.norm.weight"].nbytes, sum(t.nbytes for t in live.values())
    for _ in range(3):
        assert sync(tmp_path, live, block_size=BS).bytes_hashed in (0, total)  # 0: saved
    for _ in range(2):  # watched from the first of these; what it saw, from the second
        r = sync(tmp_path, live, block_size=BS, watch=True)
    assert r.bytes_hashed == small
    live["model.layers.2.w"][7] += 1
    r = sync(tmp_path, live, block_size=BS, watch=True)
    assert small < r.bytes_hashed <= small + 2 * BS and _same(tmp_path, live)
    assert sync(tmp_path, live, block_size=BS).bytes_hashed == total
    monkeypatch.setenv(writewatch.ENV, "0")  # turns even watch=True off
    assert sync(tmp_path, live, block_size=BS, watch=True).bytes_hashed == total


def test_memory_pinned_after_its_first_sync_is_no_longer_watched(tmp_path, watch,
                                                                  monkeypatch):
    # pinned (e.g. cudaHostRegister after the first sync), a device may write it by DMA,
    # which the page tables never see: checked at every scan, then hashed
    live = _live()
    for _ in range(3):
        sync(tmp_path, live, watch=watch, block_size=BS)
    name = "model.layers.1.w"
    assert watch.recorded(name) is not None
    pinned = live[name].data_ptr()
    monkeypatch.setattr(writewatch, "_pinned", lambda n, t: t.data_ptr() == pinned)
    with torch.no_grad():  # as a DMA write would land: not through these page tables
        live[name].view(torch.int16)[5] ^= 1  # (here it does fault; the watch must not ask)
    r = sync(tmp_path, live, watch=watch, block_size=BS)
    assert r.bytes_hashed >= live[name].nbytes and _same(tmp_path, live)
    assert watch.recorded(name) is None


def test_tensors_off_the_cpu_never_open_the_watch(monkeypatch):
    opened = []
    monkeypatch.setattr(writewatch.WriteTracker, "open", lambda self: opened.append(1) or "")
    w = WriteWatch()
    assert w.written({"w": torch.empty(4, device="meta")}) == {}
    w.record({})
    assert opened == []
