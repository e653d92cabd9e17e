"""checkpoint.spare: the clone of each shard a sync wrote, taken behind its commit and
used by the next sync that patches the shard, only while the shard is that file."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import remove_synced
from hotweights.checkpoint import clone, finisher, spare, sync


@pytest.fixture(autouse=True)
def none_held():
    """No spare of an earlier test's syncs (held until a sync finds its shard changed)."""
    spare.release()


@pytest.fixture
def d(xfs_dir, request):
    d = xfs_dir / request.node.name
    d.mkdir()
    yield d
    remove_synced(d)


def _saved(d) -> dict[str, torch.Tensor]:
    live = {n: torch.zeros(1 << 18, dtype=torch.bfloat16) for n in ("a", "b")}  # 512 KiB
    save_file(live, d / "model.safetensors")
    sync(d, live)  # the sidecars
    return live


def _clones(monkeypatch) -> list[str]:
    """The shards cloned on a sync's own path from here on (not its spares)."""
    calls, real = [], clone.reflink
    monkeypatch.setattr(clone, "reflink", lambda src, dst: calls.append(src) or real(src, dst))
    return calls


def test_the_next_sync_links_the_spare_instead_of_cloning(d, monkeypatch):
    live = _saved(d)
    live["a"][::4096] += 1.0
    cloned = _clones(monkeypatch)
    assert sync(d, live).writes == {"model.safetensors": "reflink"}
    assert cloned == [str(d / "model.safetensors")]  # no spare yet: cloned
    finisher.finish()  # the spare is taken behind the commit
    assert list(spare._spares) == [str(d / "model.safetensors")]
    counted = clone.extents(d / "model.safetensors")  # what the next sync reads for it
    assert counted > 1 and spare.extents(str(d / "model.safetensors")) == counted
    before = set(os.listdir(d))
    live["b"][::8192] += 1.0
    assert sync(d, live).writes == {"model.safetensors": "reflink"}
    assert cloned == [str(d / "model.safetensors")]  # the spare, not a second clone
    assert torch.equal(load_file(d / "model.safetensors")["a"], live["a"])
    assert torch.equal(load_file(d / "model.safetensors")["b"], live["b"])
    finisher.finish()  # (its thread may have taken the next spare before this line)
    assert set(os.listdir(d)) == before  # a spare has no name in the directory
    assert list(spare._spares) == [str(d / "model.safetensors")]  # the new file's
    assert spare.extents(str(d / "model.safetensors")) == clone.extents(
        d / "model.safetensors")


@pytest.mark.parametrize("how", ["in place", "in place, its mtime put back", "replaced"])
def test_a_spare_of_a_shard_changed_since_is_not_used(d, monkeypatch, how):
    """The shard written by someone else after the spare was taken: the spare (a clone of
    the file before) would bring back what they overwrote; the sync clones the file."""
    live = _saved(d)
    live["a"][::4096] += 1.0
    sync(d, live)
    finisher.finish()
    live["a"][::2048] += 2.0  # someone else writes this (save_file: in place, or renamed)
    if how.startswith("in place"):
        st = os.stat(d / "model.safetensors")
        save_file(live, d / "other")
        with open(d / "model.safetensors", "r+b") as f:  # the same inode, the same size
            f.write((d / "other").read_bytes())
        if how.endswith("put back"):  # cp --preserve, touch -r: only the ctime tells
            os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        save_file(live, d / "other")
        os.replace(d / "other", d / "model.safetensors")
    assert spare.extents(str(d / "model.safetensors")) is None  # counted anew
    live["b"][::8192] += 1.0  # and the trainer's next step
    cloned = _clones(monkeypatch)
    assert sync(d, live).writes == {"model.safetensors": "reflink"}
    assert cloned == [str(d / "model.safetensors")]
    disk = load_file(d / "model.safetensors")
    assert torch.equal(disk["a"], live["a"]) and torch.equal(disk["b"], live["b"])


def test_spares_of_shards_gone_or_changed_are_closed_and_all_released(xfs_dir, monkeypatch):
    dirs = [xfs_dir / "spare-one", xfs_dir / "spare-two", xfs_dir / "spare-three"]
    try:
        for x in dirs:
            x.mkdir()
            live = _saved(x)
            live["a"] += 1.0
            sync(x, live)
            finisher.finish()
        assert list(spare._spares) == [str(x / "model.safetensors") for x in dirs]
        remove_synced(dirs[0])  # closes them all
        assert not spare._spares
        for x in dirs[1:]:
            live = load_file(x / "model.safetensors")
            live["a"] += 1.0
            sync(x, live)
            finisher.finish()
        assert list(spare._spares) == [str(x / "model.safetensors") for x in dirs[1:]]
        save_file(live, dirs[1] / "model.safetensors")  # changed by someone else
        live["a"] += 1.0
        sync(dirs[2], live)
        finisher.finish()  # the changed one's spare closed
        assert list(spare._spares) == [str(dirs[2] / "model.safetensors")]
        monkeypatch.setattr(spare, "MOST", 1)
        sync(dirs[1], live)
        finisher.finish()  # the oldest closed
        assert list(spare._spares) == [str(dirs[1] / "model.safetensors")]
        spare.release()
        assert not spare._spares
    finally:
        for x in dirs[1:]:
            remove_synced(x)


def test_a_forked_child_holds_no_spares(d):
    """A child (a DataLoader worker, say) that syncs must not patch a spare the parent
    may link later: it gets none, and a lock it can take."""
    live = _saved(d)
    live["a"] += 1.0
    sync(d, live)
    finisher.finish()
    assert spare._spares
    pid = os.fork()
    if pid == 0:  # no torch here: its OpenMP threads are not in the child
        ok = not spare._spares and not spare.take(str(d / "model.safetensors"), d / "x")
        with spare._lock:
            os._exit(0 if ok and not (d / "x").exists() else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert list(spare._spares) == [str(d / "model.safetensors")]  # the parent's, kept


def test_a_shard_written_while_its_spare_is_cloned_gets_no_spare(d, monkeypatch):
    # another program's write between the clone and the look at the file: the spare may
    # hold the old bytes under the new file's identity, and a sync patching from it would
    # keep them where the new file already equals the live tensors
    live = _saved(d)
    shard = d / "model.safetensors"
    real = spare.clone.clone_into

    def written_meanwhile(dfd, sfd):
        real(dfd, sfd)
        with open(shard, "r+b") as f:
            f.seek(-2, os.SEEK_END)
            f.write(b"\x80\x3f")  # the last element: 1.0
    monkeypatch.setattr(spare.clone, "clone_into", written_meanwhile)
    spare.keep([str(shard)])
    monkeypatch.undo()
    assert not spare._spares
    live["b"][-1] = 1.0  # what the other program wrote: that block needs no patch
    live["a"][::4096] += 1.0  # a patched sync: from a clone of the file as it is now
    assert sync(d, live).writes == {"model.safetensors": "reflink"}
    disk = load_file(shard)
    assert all(torch.equal(disk[n], t) for n, t in live.items())


@pytest.mark.parametrize("then", ["a sync that changes nothing", "a copy-mode sync",
                                  "a first save elsewhere"])
def test_every_sync_closes_the_spares_of_shards_changed_since(d, then, tmp_path):
    # a spare holds the blocks of the file it cloned: the filesystem frees them only once
    # it is closed
    live = _saved(d)
    live["a"] += 1.0
    sync(d, live)
    finisher.finish()
    assert list(spare._spares) == [str(d / "model.safetensors")]
    save_file(live, d / "model.safetensors")  # replaced by another program
    if then == "a copy-mode sync":
        live["a"] += 1.0
    if then == "a first save elsewhere":
        assert sync(tmp_path, live).first_save
    else:
        result = sync(d, live, mode="copy" if then == "a copy-mode sync" else "auto")
        assert result.tensors_changed == (then == "a copy-mode sync")
    finisher.finish()
    assert not spare._spares
