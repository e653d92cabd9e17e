"""checkpoint.sync write modes (reflink, journal, copy, auto), first saves and bad places."""

import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import remove_synced, without_reflinks
from hotweights.checkpoint import clone, diagnose, finisher, incremental, journal, sync
from hotweights.checkpoint.incremental import write_mode
from hotweights.errors import CheckpointError
from hotweights.testing.tiny import make_config
from test_checkpoint_sync import _disk, _shard_of, _stats


def _model(tie: bool = False):
    torch.manual_seed(0)
    config = make_config("llama", 300)
    config.tie_word_embeddings = tie
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _live(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.fixture
def place(request, tmp_path, tmp_path_factory):
    """An empty directory on ext4 (tmp_path) or, for reflink, on a loop-mounted XFS."""
    if request.param == "xfs":
        d = request.getfixturevalue("xfs_dir") / request.node.name
        d.mkdir()
        yield d
        remove_synced(d)
    else:
        without_reflinks(tmp_path)
        yield tmp_path / "model"


def _saved(d: Path):
    model = _model()
    model.save_pretrained(d, max_shard_size="200KB")
    return _live(model)


def _equal(d: Path, live) -> None:
    for n, t in _disk(d).items():
        assert torch.equal(t.view(torch.int16), live[n].view(torch.int16)), n


@pytest.mark.parametrize(("place", "mode", "how"), [
    ("ext4", "journal", "journal"), ("ext4", "copy", "whole"), ("xfs", "reflink", "reflink"),
    ("xfs", "auto", "reflink"), ("ext4", "auto", "whole")], indirect=["place"])
def test_each_mode_writes_the_changed_shard_only(place, mode, how):
    d = place
    live = _saved(d)
    sync(d, live, mode=mode, version="0@s")
    before = _stats(d)
    name = "model.layers.1.mlp.down_proj.weight"
    live[name][3] += 1.0  # one row
    result = sync(d, live, mode=mode, version="1@s")
    shard = _shard_of(d, name)
    assert result.shards_changed == (shard,) and result.writes == {shard: how}
    assert result.write_mode == {"auto": "copy" if how == "whole" else how}.get(mode, mode)
    row = live[name][3].numel() * 2
    if how == "whole":
        assert result.bytes_written == (d / shard).stat().st_size
    else:
        assert row <= result.bytes_written <= 64 << 10
    if how == "reflink":  # whole pages of the file: no page of the clone read first
        assert result.bytes_written % 4096 == 0
    _equal(d, live)
    after = _stats(d)
    for s, stat in before.items():  # untouched shards keep inode and mtime
        assert (after[s] == stat) == (s != shard), s
    if how != "journal":  # a new file took the old one's place
        assert after[shard][0] != before[shard][0]
    reloaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    assert torch.equal(reloaded.get_parameter(name), live[name])
    finisher.finish()  # the fsyncs and the journal's removal run in a thread after sync
    assert not (d / journal.STAGE_DIR).exists() and not (d / journal.JOURNAL_NAME).exists()
    assert sync(d, live, mode=mode).bytes_written == 0


def _paths_written(monkeypatch) -> list[tuple[str, str]]:
    """(call, file name) of every write and copy_file_range from here on (the target)."""
    calls, real = [], {c: getattr(os, c) for c in ("write", "pwrite", "pwritev",
                                                   "copy_file_range")}
    for call in real:
        def wrapped(*args, call=call):
            fd = args[1] if call == "copy_file_range" else args[0]
            calls.append((call, os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
            return real[call](*args)
        monkeypatch.setattr(os, call, wrapped)
    return calls


@pytest.mark.parametrize("place", ["xfs"], indirect=True)
def test_a_reflinked_shard_gets_its_pages_cloned_in_not_written_into_it(place, monkeypatch):
    """The changed pages go into a scratch file, then are cloned into the shard's clone
    (no copy-on-write of each page at its fsync); the shard's last page, which ends
    inside a page of the file, too; no scratch file is left."""
    d = place
    d.mkdir(exist_ok=True)
    live = {"a": torch.zeros(1 << 20, dtype=torch.bfloat16),  # 2 MiB
            "z": torch.zeros(1001, dtype=torch.bfloat16)}  # the file ends inside a page
    save_file(live, d / "model.safetensors")
    assert (d / "model.safetensors").stat().st_size % 4096
    sync(d, live)
    calls = _paths_written(monkeypatch)
    live["a"][::1 << 17] += 1.0  # 8 pages apart
    live["z"][-1] += 1.0
    result = sync(d, live)
    monkeypatch.undo()
    assert result.writes == {"model.safetensors": "reflink"}  # straddles, the last page
    assert ("write", ".model.safetensors.pages") in calls  # O_DIRECT, where it can
    assert all(f != "model.safetensors" for c, f in calls if c != "copy_file_range"), calls
    assert all(f == "model.safetensors" for c, f in calls if c == "copy_file_range"), calls
    assert len([c for c, _ in calls if c == "copy_file_range"]) == 9  # 8 runs, the end
    size = (d / "model.safetensors").stat().st_size  # a run: the file pages a tensor page
    assert result.bytes_written % 4096 == size % 4096 <= result.bytes_written <= 17 * 4096
    disk = load_file(d / "model.safetensors")
    assert all(torch.equal(disk[n], t) for n, t in live.items())
    finisher.finish()
    assert not (d / journal.STAGE_DIR).exists()


@pytest.mark.parametrize("place", ["xfs"], indirect=True)
def test_a_clone_the_disk_refuses_is_named_and_nothing_written(place, monkeypatch):
    import errno
    d = place
    live = _saved(d)
    sync(d, live)
    name = "model.layers.1.mlp.down_proj.weight"
    live[name][3] += 1.0
    shard = _shard_of(d, name)
    before = {p.name: p.read_bytes() for p in d.glob("*.safetensors")}

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "copy_file_range", full)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{d}: cannot stage the changed shards: {d / shard}: No space left on device; "
            "nothing was written")):
        sync(d, live, mode="reflink")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in d.glob("*.safetensors")} == before
    assert not (d / journal.STAGE_DIR).exists() and not (d / journal.JOURNAL_NAME).exists()
    assert sync(d, live, mode="reflink").writes == {shard: "reflink"}
    _equal(d, live)


@pytest.mark.parametrize("place", ["ext4"], indirect=True)
def test_auto_rewrites_a_mostly_changed_shard_whole(place):
    d = place
    live = _saved(d)
    sync(d, live)
    name = "model.layers.0.mlp.up_proj.weight"
    shard = _shard_of(d, name)
    for n in load_file(d / shard):  # every element of every tensor in that shard
        live[n] += 1.0
    result = sync(d, live)
    assert result.writes == {shard: "whole"}
    _equal(d, live)


@pytest.mark.parametrize("place", ["xfs"], indirect=True)
def test_a_shard_split_into_many_extents_is_rewritten_whole(place, monkeypatch):
    d = place
    d.mkdir(exist_ok=True)
    live = {"w": torch.zeros(1 << 21, dtype=torch.bfloat16)}  # 4 MiB: 64 blocks
    save_file(live, d / "model.safetensors")
    sync(d, live)
    live["w"][::1 << 17] += 1.0  # one page in every 4th block: each patch splits an extent
    assert sync(d, live).writes == {"model.safetensors": "reflink"}
    split = clone.extents(d / "model.safetensors")
    assert split > 16
    monkeypatch.setattr(incremental, "FRAGMENTS_MIN", 2)
    monkeypatch.setattr(incremental, "FRAGMENT_BYTES", 1 << 62)  # over 2 extents: too many
    live["w"][::1 << 17] += 1.0
    assert sync(d, live).writes == {"model.safetensors": "whole"}
    assert clone.extents(d / "model.safetensors") < split
    assert torch.equal(load_file(d / "model.safetensors")["w"], live["w"])


def test_reflink_refused_where_the_filesystem_cannot(tmp_path):
    without_reflinks(tmp_path)
    with pytest.raises(CheckpointError, match="mode 'reflink' asked for, but .*reflink"):
        write_mode(tmp_path, "reflink")
    assert write_mode(tmp_path, "auto")[0] == "copy"  # never in place by default
    with pytest.raises(CheckpointError, match="mode 'fast': choose one of auto, reflink"):
        sync(tmp_path, {}, mode="fast")


@pytest.mark.parametrize(("place", "mode"), [("ext4", "auto"), ("xfs", "auto"),
                                             ("ext4", "copy")], indirect=["place"])
def test_a_reader_that_opened_a_shard_before_a_sync_keeps_its_bytes(place, mode):
    # safetensors maps the file: a write in place would change tensors already loaded
    from safetensors import safe_open

    d = place
    live = _saved(d)
    name = "model.layers.1.mlp.down_proj.weight"
    shard = d / _shard_of(d, name)
    with safe_open(shard, "pt") as f:
        before = f.get_tensor(name).clone()
        loaded = load_file(shard)[name]
        live[name][3] += 1.0
        sync(d, live, mode=mode)
        assert torch.equal(f.get_tensor(name), before)
    assert torch.equal(loaded, before)
    _equal(d, live)


def _hf_cache(root: Path) -> tuple[Path, Path, dict]:
    """Two snapshots of one repo whose shards are symlinks to the same blobs, as the
    Hugging Face cache lays them out."""
    model = _model()
    model.save_pretrained(root / "saved", max_shard_size="200KB")
    blobs = root / "blobs"
    blobs.mkdir()
    snaps = [root / "snapshots" / rev for rev in ("a1", "b2")]
    for snap in snaps:
        snap.mkdir(parents=True)
    for f in (root / "saved").iterdir():
        (f).rename(blobs / f.name)
        for snap in snaps:
            (snap / f.name).symlink_to(os.path.relpath(blobs / f.name, snap))
    return snaps[0], snaps[1], _live(model)


@pytest.mark.parametrize("mode", ["auto", "journal"])
def test_a_symlinked_shard_is_replaced_never_written_through(tmp_path, mode):
    mine, other, live = _hf_cache(tmp_path)
    blobs = {p.name: p.read_bytes() for p in (tmp_path / "blobs").iterdir()}
    name = "model.layers.1.mlp.down_proj.weight"
    live[name][3] += 1.0
    result = sync(mine, live, mode=mode)
    shard = _shard_of(mine, name)
    cloned = mode == "auto" and clone.supports_reflink(tmp_path)[0]  # /tmp on XFS, btrfs
    assert result.writes == {shard: "reflink" if cloned else "whole"}
    assert not (mine / shard).is_symlink()  # the snapshot synced has a file of its own
    _equal(mine, live)
    assert {p.name: p.read_bytes() for p in (tmp_path / "blobs").iterdir()} == blobs
    assert torch.equal(load_file(other / shard)[name], _live(_model())[name])


def test_a_journal_sync_after_reflinked_ones_does_not_run_out_of_space_in_its_apply(xfs_dir):
    """A reflinked sync keeps a spare clone of each shard it wrote, which shares its blocks:
    a journal-mode sync after it would write each page in place as a copy on write, room
    it does not count, and could fill the disk after its commit, leaving a torn shard. Its
    shards' spares are let go first."""
    d = xfs_dir / "journal-after-reflink"
    live = {"model.embed.weight": torch.zeros(8192, 1024, dtype=torch.bfloat16)}  # 16 MiB
    sync(d, live)
    live["model.embed.weight"][0] += 1
    assert sync(d, live).writes == {"model.safetensors": "reflink"}  # keeps a spare
    finisher.finish()
    live["model.embed.weight"][:3000] += 1  # ~6 MiB
    filler = xfs_dir / "filler"
    os.sync()
    subprocess.run(["fallocate", "-l", str(shutil.disk_usage(d).free - (9 << 20)), filler],
                   check=True)
    try:
        assert sync(d, live, mode="journal").writes == {"model.safetensors": "journal"}
        finisher.finish()
    finally:
        filler.unlink()
    assert torch.equal(load_file(d / "model.safetensors")["model.embed.weight"],
                       live["model.embed.weight"])
    remove_synced(d)


@pytest.mark.parametrize(("changed", "free_mib"), [("a row in each of 120 blocks", 3),
                                                     ("most of the shard", 12)])
def test_near_a_full_disk_a_reflinked_shard_needs_the_pages_that_differ(xfs_dir, changed,
                                                                         free_mib):
    """The free space a patch needs was counted by changed 64 KiB blocks (16x a row's
    pages), and a shard more than half changed was to be rewritten whole (its whole size):
    both refused a sync whose pages fit. Near a full disk, the need is the pages, patched."""
    d = xfs_dir / f"near-full-{free_mib}"
    live = {"model.embed.weight": torch.zeros(8192, 1024, dtype=torch.bfloat16)}  # 16 MiB
    sync(d, live)
    if changed == "most of the shard":
        live["model.embed.weight"][:5000] += 1
    else:
        live["model.embed.weight"][::64][:120] += 1  # 2 KiB rows, 128 KiB apart
    filler = xfs_dir / "filler"
    finisher.finish()
    os.sync()
    subprocess.run(["fallocate", "-l", str(shutil.disk_usage(d).free - (free_mib << 20)),
                    filler], check=True)
    try:
        result = sync(d, live)
        finisher.finish()
    finally:
        filler.unlink()
    assert result.writes == {"model.safetensors": "reflink"}
    assert torch.equal(load_file(d / "model.safetensors")["model.embed.weight"],
                       live["model.embed.weight"])
    remove_synced(d)


def test_a_shard_without_its_directory_s_nodatacow_flag_is_cloned(btrfs_dir):
    """btrfs clones no file with nodatacow (`chattr +C`) into one without, or back, and a
    new file takes its directory's flag: after `chattr +C` on the directory, the clone of
    each shard written before failed ("does not support reflinks"), every sync. The clone
    and the spare take their shard's flag."""
    d = btrfs_dir / "nocow"
    live = {"w": torch.randn(300_000).to(torch.bfloat16)}
    sync(d, live)
    subprocess.run(["chattr", "+C", str(d)], check=True)
    for at in (7, 70_000):  # the second from the spare the first one kept
        live["w"][at] += 1.0
        assert sync(d, live).writes == {"model.safetensors": "reflink"}, at
        finisher.finish()
        assert torch.equal(load_file(d / "model.safetensors")["w"].view(torch.int16),
                           live["w"].view(torch.int16)), at
    remove_synced(d)


def test_a_reflinked_patch_writes_the_file_pages_that_differ(xfs_dir):
    """Changes are narrowed to the file's pages, not the tensor's: a tensor's data seldom
    starts on a page boundary, and a page of the tensor's own straddles two of the file's
    (both were written, twice the clones and extents)."""
    d = xfs_dir / "file-pages"
    live = {"w": torch.randn(3_000_000).to(torch.bfloat16)}
    sync(d, live)
    begin = 8 + int.from_bytes((d / "model.safetensors").read_bytes()[:8], "little")
    assert begin % 4096  # the data starts inside a page
    elements = [*range(1000, 1000 + 20 * 4096, 4096), 2_999_999]  # 8 KiB apart
    live["w"][elements] += 1.0
    result = sync(d, live)
    finisher.finish()
    assert result.writes == {"model.safetensors": "reflink"}
    pages, size = {(begin + 2 * i) // 4096 for i in elements}, begin + 2 * 3_000_000
    assert len(pages) == len(elements)  # (the last one partial: the file ends inside it)
    assert result.bytes_written == sum(min(4096, size - 4096 * p) for p in pages)
    assert torch.equal(load_file(d / "model.safetensors")["w"].view(torch.int16),
                       live["w"].view(torch.int16))
    remove_synced(d)


def test_reflink_patches_on_blocks_larger_than_a_page(xfs64k_dir):
    """On a 64 KiB-block XFS a page run is copied, not cloned, from the scratch file of
    pages: a change in the file's last, partial page is written (it was an EINVAL: the
    scratch file stayed O_DIRECT for the copy's unaligned read)."""
    d = xfs64k_dir / "last-page"
    live = {"w": torch.randn(1_000_001).to(torch.bfloat16)}
    sync(d, live)
    for at in (-1, 0, 500_000):
        live["w"][at] += 1.0
        result = sync(d, live)
        assert result.writes == {"model.safetensors": "reflink"}, at
        finisher.finish()
        assert torch.equal(load_file(d / "model.safetensors")["w"].view(torch.int16),
                           live["w"].view(torch.int16)), at
    remove_synced(d)


def test_a_shard_linked_onto_another_filesystem_is_rewritten_not_cloned(tmp_path, xfs_dir):
    mine, _, live = _hf_cache(tmp_path)  # its blobs here, the snapshot on the XFS
    d = xfs_dir / "linked-snapshot"
    d.mkdir()
    for f in mine.iterdir():
        (d / f.name).symlink_to(f.resolve())
    name = "model.layers.1.mlp.down_proj.weight"
    live[name][3] += 1.0  # a few rows: cloned and patched, were the file on the XFS
    result = sync(d, live)
    shard = _shard_of(d, name)
    assert result.write_mode == "reflink" and result.writes == {shard: "whole"}
    assert not (d / shard).is_symlink()
    _equal(d, live)


def test_a_hard_linked_shard_is_not_patched_in_place(tmp_path):
    d = tmp_path / "model"
    live = _saved(d)
    name = "model.layers.1.mlp.down_proj.weight"
    shard = d / _shard_of(d, name)
    os.link(shard, tmp_path / "backup.safetensors")
    backup = (tmp_path / "backup.safetensors").read_bytes()
    live[name][3] += 1.0
    assert sync(d, live, mode="journal").writes == {shard.name: "whole"}
    _equal(d, live)
    assert (tmp_path / "backup.safetensors").read_bytes() == backup


@pytest.mark.parametrize("tie", [False, True])
def test_a_first_save_is_what_save_pretrained_would_write(tmp_path, tie):
    model = _model(tie)
    live, d = model.state_dict(), tmp_path / "new"
    calls = []
    result = sync(d, live, config=model.config, max_shard_size="200KB", version="5@s",
                  after_read=lambda: calls.append(list(d.glob("*.safetensors"))))
    assert result.first_save and calls == [[]]  # after_read: before anything is in place
    assert len(result.shards_changed) > 2 and (d / "model.safetensors.index.json").exists()
    assert result.tied == (("lm_head.weight",) if tie else ())
    reloaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    for n, t in reloaded.state_dict().items():
        assert torch.equal(t, live[n]), n
    finisher.finish()  # the journal goes in the finisher thread
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [".hotweights", "config.json", "model.safetensors.index.json",
         *result.shards_changed])
    again = sync(d, live)
    assert again.bytes_written == 0 and again.bytes_compared == 0  # the sidecars serve
    assert again.tied == result.tied and again.missing_on_disk == ()


def test_a_first_save_of_a_model_writes_the_config_save_pretrained_writes(tmp_path):
    model = AutoModelForCausalLM.from_config(make_config("llama", 300)).to(torch.bfloat16)
    sync(tmp_path / "ours", model, max_shard_size="200KB")  # (its config says no dtype)
    model.save_pretrained(tmp_path / "theirs", max_shard_size="200KB")
    ours, theirs = (json.loads((tmp_path / d / "config.json").read_text())
                    for d in ("ours", "theirs"))
    assert ours == theirs and ours["dtype"] == "bfloat16"


def test_a_single_file_first_save(tmp_path):
    live = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    result = sync(tmp_path, live)
    assert result.shards_changed == ("model.safetensors",)
    assert (result.first_save, result.write_mode) == (True, "copy")
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], live["w"])


def test_a_read_only_directory_is_named_and_nothing_written(tmp_path):
    d = tmp_path / "m"
    live = _saved(d)
    sync(d, live)
    live["model.norm.weight"] += 1
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(d), str(ro)],
                      capture_output=True).returncode != 0:
        pytest.skip("a read-only bind mount needs root")
    try:
        before = {p.name: p.read_bytes() for p in ro.glob("*.safetensors")}
        with pytest.raises(CheckpointError, match=f"{ro}: cannot .*Read-only file system"):
            sync(ro, live)
        assert {p.name: p.read_bytes() for p in ro.glob("*.safetensors")} == before
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.fixture
def small(tmp_path):
    """An empty 1800 KiB tmpfs (a mount: root only, else a skip)."""
    d = tmp_path / "small"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1800k", "tmpfs", str(d)],
                      capture_output=True).returncode != 0:
        pytest.skip("a small tmpfs mount needs root")
    yield d
    subprocess.run(["umount", str(d)], check=True)


@pytest.mark.parametrize("mode", ["journal", "copy"])
def test_a_full_disk_is_named_and_nothing_written(small, mode):
    d = small
    live = _saved(d)
    sync(d, live, mode=mode)
    for n in live:  # a change far larger than the space left
        live[n] += 1.0
    before = {p.name: p.read_bytes() for p in d.glob("*.safetensors")}
    free = shutil.disk_usage(d).free
    need = sum(p.stat().st_size for p in d.glob("*.safetensors")) if mode == "copy" \
        else None  # every shard rewritten whole: each one's size, all told at once
    with pytest.raises(CheckpointError, match=rf"{d}: not enough free space: this sync "
                       r"needs [\d,.]+ MiB \((\d+) bytes\) for .*, [\d,.]+ MiB are free: "
                       r"free [\d,.]+ MiB more; nothing was written") as e:
        sync(d, live, mode=mode)
    asked = int(re.search(r"\((\d+) bytes\)", str(e.value))[1])
    assert asked > free and (need is None or asked == need)
    assert {p.name: p.read_bytes() for p in d.glob("*.safetensors")} == before
    assert not (d / journal.STAGE_DIR).exists() and not (d / journal.JOURNAL_NAME).exists()


def test_diagnose_names_the_shard_copy_mode_has_no_room_to_rewrite(small):
    """A sync in write mode copy stages a changed shard whole beside the old one:
    `diagnose` says so where the largest shard cannot be, before a sync fails on it."""
    d = small
    live = _saved(d)
    sync(d, live, mode="copy")
    finisher.finish()
    assert diagnose(d, mode="copy").space is None
    largest = max(d.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(d / "filler", "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(d).free - largest.stat().st_size // 2))
    found = diagnose(d, mode="copy")
    assert re.fullmatch(rf"{re.escape(str(largest))}: not enough free space to rewrite "
                        r"it: a sync in write mode copy stages a changed shard whole "
                        r"\([\d,.]+ MiB\), [\d,.]+ MiB are free; a sync that changes it "
                        r"fails, writing nothing", found.space)
    assert found.space in found.problems
    assert diagnose(d, mode="journal").space is None  # patched in place: no staging
    name = next(iter(load_file(largest)))
    live[name] += 1.0
    with pytest.raises(CheckpointError, match="not enough free space"):
        sync(d, live, mode="copy")


def test_a_whole_shard_write_the_disk_refuses_names_the_shard_and_writes_nothing(
        tmp_path, monkeypatch):
    """An O_DIRECT write that fails mid-shard (ENOSPC where the free space measured first
    said it fits) is the CheckpointError raised, naming the shard: not a BufferError from
    closing the buffer that the error's traceback still holds slices of."""
    import errno

    from hotweights.checkpoint import stage
    d = tmp_path / "m"
    live = _saved(d)
    sync(d, live)
    name = "model.layers.1.mlp.down_proj.weight"
    live[name] += 1.0
    shard = _shard_of(d, name)
    before = {p.name: p.read_bytes() for p in d.glob("*.safetensors")}
    monkeypatch.setattr(stage, "_DIRECT_BUFFER", 1 << 16)  # several writes a shard
    monkeypatch.setattr(stage, "_direct", lambda fd, on: True)  # _Direct on any filesystem

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(stage.os, "write", full)
    with pytest.raises(CheckpointError, match=f"{d}: cannot stage the changed shards: "
                                              f"{d / shard}: No space left on device; "
                                              "nothing was written"):
        sync(d, live, mode="copy")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in d.glob("*.safetensors")} == before
    assert not (d / journal.STAGE_DIR).exists() and not (d / journal.JOURNAL_NAME).exists()
    assert sync(d, live, mode="copy").shards_changed == (shard,)


def test_a_staged_file_that_cannot_be_created_leaks_no_descriptor(tmp_path, monkeypatch):
    """Out of inodes or quota in the stage area: the sync fails naming the shard, and the
    shard it had opened to copy from is closed (a trainer syncing every step would run out
    of descriptors)."""
    import errno

    from hotweights.checkpoint import stage
    d = tmp_path / "m"
    live = _saved(d)
    sync(d, live)
    live["model.layers.1.mlp.down_proj.weight"] += 1.0
    real_open = stage.os.open

    def no_inodes(path, flags, *mode):
        if flags & os.O_CREAT and journal.STAGE_DIR in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, flags, *mode)
    monkeypatch.setattr(stage.os, "open", no_inodes)
    with pytest.raises(CheckpointError, match="No space left on device; nothing was written"):
        sync(d, live, mode="copy")

    def opened() -> list[str]:
        fds = (os.path.join("/proc/self/fd", fd) for fd in os.listdir("/proc/self/fd"))
        return [path for path in map(_target, fds) if path.startswith(f"{d}{os.sep}")]
    assert opened() == []


def _target(link: str) -> str:
    try:
        return os.readlink(link)
    except OSError:  # closed since it was listed
        return ""


def test_two_writers_take_turns(tmp_path):
    d = tmp_path / "m"
    live = _saved(d)
    sync(d, live)
    other = {n: t + 1 for n, t in live.items()}
    errors = []

    def run(tensors):
        try:
            for _ in range(3):
                sync(d, tensors, mode="copy")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in (live, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    disk = _disk(d)
    winner = live if torch.equal(disk["model.norm.weight"], live["model.norm.weight"]) else other
    _equal(d, winner)
    finisher.finish()  # the last sync's stage directory goes in its finisher thread
    assert os.listdir(d).count(journal.STAGE_DIR) == 0


def _takes_o_direct(d) -> bool:
    try:
        os.close(os.open(d / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        (d / "probe").unlink(missing_ok=True)


@pytest.mark.parametrize("direct", [True, False])
def test_a_whole_rewrite_is_the_same_bytes_direct_or_buffered(tmp_path, monkeypatch, direct):
    """stage.whole writes through O_DIRECT where the filesystem takes it (here: several
    buffers, the last one padded and the file truncated back), else buffered; a tensor with
    no live source is copied from the old file."""
    from hotweights.checkpoint import stage
    from hotweights.checkpoint.shards import read_shard
    monkeypatch.setattr(stage, "_DIRECT_BUFFER", 1 << 16)
    monkeypatch.setattr(stage, "DIRECT", direct)
    sinks, real = [], stage._sink
    monkeypatch.setattr(stage, "_sink", lambda fd: sinks.append(real(fd)) or sinks[-1])
    live = {"a": torch.arange(3 << 15, dtype=torch.float32), "b": torch.ones(5, 7),
            "c": torch.arange(1001, dtype=torch.int16)}
    d = tmp_path / "m"
    sync(d, {n: torch.zeros_like(t) for n, t in live.items()})
    shard = read_shard(d / "model.safetensors")
    assert shard.size % 4096
    new = tmp_path / "new"
    written = stage.whole(shard, {n: live[n] for n in ("a", "c")}, new, lambda n: None)
    got = load_file(new)
    assert written == shard.size == new.stat().st_size
    assert torch.equal(got["a"], live["a"]) and torch.equal(got["c"], live["c"])
    assert torch.equal(got["b"], torch.zeros(5, 7))  # from the old file
    assert new.read_bytes()[:shard.data_start] == (d / "model.safetensors").read_bytes()[
        :shard.data_start]
    want = "_Direct" if direct and _takes_o_direct(tmp_path) else "_Buffered"
    assert [type(s).__name__ for s in sinks] == [want]


def test_a_direct_write_the_device_refuses_goes_on_buffered(tmp_path, monkeypatch):
    """A device that wants a larger O_DIRECT alignment than 4 KiB refuses the write
    (EINVAL): the rest of the shard is written buffered, the same bytes."""
    import errno

    from hotweights.checkpoint import stage
    from hotweights.checkpoint.shards import read_shard
    if not _takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}: this filesystem refuses O_DIRECT")
    live = {"a": torch.arange(3 << 15, dtype=torch.float32), "b": torch.ones(5, 7)}
    d = tmp_path / "m"
    sync(d, {n: torch.zeros_like(t) for n, t in live.items()})
    shard = read_shard(d / "model.safetensors")
    monkeypatch.setattr(stage, "_DIRECT_BUFFER", 1 << 16)
    write, refused = os.write, []

    def refuse_once(fd, data):
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return write(fd, data)
    monkeypatch.setattr(stage.os, "write", refuse_once)
    new = tmp_path / "new"
    stage.whole(shard, live, new, lambda n: None)
    monkeypatch.undo()
    got = load_file(new)
    assert refused and all(torch.equal(got[n], t) for n, t in live.items())
    assert new.stat().st_size == shard.size


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_an_error_right_after_the_commit_keeps_what_the_journal_moves(tmp_path, monkeypatch,
                                                                      error):
    """A Ctrl-C or an I/O error once the journal is in place, before it is applied: the
    staged shards are the journal's now, kept for `recover`, never removed as a failed
    sync's leftovers (the journal could then never be finished)."""
    d = tmp_path / "m"
    live = _saved(d)
    sync(d, live)
    old = _disk(d)
    for n in live:
        live[n] += 1.0
    real = journal._crash_point

    def fail(step, n=0):
        if step == "after-rename":
            raise error(5, "Input/output error") if error is OSError else error()
        real(step, n)
    monkeypatch.setattr(journal, "_crash_point", fail)
    with pytest.raises(KeyboardInterrupt if error is KeyboardInterrupt else CheckpointError,
                       match=None if error is KeyboardInterrupt else
                       rf"{d}: the sync is committed, then: .*Input/output error.*; its "
                       rf"journal is kept: run hotweights recover {d}"):
        sync(d, live)
    monkeypatch.undo()
    assert all(torch.equal(t, old[n]) for n, t in _disk(d).items())  # not applied yet
    assert journal.recover(d) == "replayed"
    _equal(d, live)


@pytest.mark.parametrize(("place", "mode"), [("ext4", "journal"), ("xfs", "auto")],
                         indirect=["place"])
def test_a_relative_directory_syncs_and_its_finisher_runs_after_a_chdir(place, mode,
                                                                        monkeypatch):
    # the commit's fsyncs and the journal's removal run in a thread after sync returns:
    # by then the caller may be in another directory
    d = place
    live = _saved(d)
    monkeypatch.chdir(d)
    sync(".", live, mode=mode)
    name = "model.layers.1.mlp.down_proj.weight"
    live[name][3] += 1.0
    result = sync(".", live, mode=mode)
    monkeypatch.chdir(d.parent)
    finisher.finish()
    assert result.writes == {_shard_of(d, name): "journal" if mode == "journal" else "reflink"}
    assert not (d / journal.JOURNAL_NAME).exists() and not (d / journal.STAGE_DIR).exists()
    _equal(d, live)
    assert sync(d, live, mode=mode).bytes_written == 0  # its sidecar written too


def test_a_journal_sync_rewrites_a_hard_linked_shard_whole_beside_the_shards_it_patches(
        tmp_path):
    # one shard staged whole, another journaled: the stage area holds the staged one
    # until the commit moves it
    d = tmp_path / "model"
    live = _saved(d)
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    a = "model.layers.1.mlp.down_proj.weight"
    b = next(n for n, f in wm.items() if f != wm[a] and n.endswith("proj.weight"))
    os.link(d / wm[a], tmp_path / "kept.safetensors")  # another name of the same file
    kept = (tmp_path / "kept.safetensors").read_bytes()
    live[a][3] += 1.0
    live[b][0] += 1.0
    result = sync(d, live, mode="journal")
    assert result.writes == {wm[a]: "whole", wm[b]: "journal"}
    _equal(d, live)
    assert (tmp_path / "kept.safetensors").read_bytes() == kept  # not written through
