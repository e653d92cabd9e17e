"""checkpoint.first_save: its sidecars describe the bytes it wrote, whatever the live
tensors do meanwhile."""

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hotweights.changes import blocks
from hotweights.checkpoint import finisher, first_save, journal, lock, sidecar, sync
from hotweights.checkpoint.shards import read_shard
from hotweights.errors import CheckpointError
from test_checkpoint_sync import _staged_fsynced


def _live() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(64, 256, generator=g) for i in range(4)}


@pytest.mark.parametrize("when", ["while it writes", "after_read"])
def test_the_sidecars_hash_the_bytes_written_not_the_live_tensors_after(tmp_path, when,
                                                                           monkeypatch):
    live = _live()

    def train() -> None:  # another thread's optimizer step
        for t in live.values():
            t.add_(1.0)

    if when == "while it writes":  # once the first bytes are written and hashed
        fingerprint, calls = blocks.fingerprint, []

        def step_once(*args, **kwargs):
            if not calls:
                train()
            calls.append(1)
            return fingerprint(*args, **kwargs)
        monkeypatch.setattr(blocks, "fingerprint", step_once)
    first = sync(tmp_path, live, max_shard_size=100_000,
                 after_read=train if when == "after_read" else None)
    finisher.finish()  # the sidecars are written once the shards are durable
    monkeypatch.undo()
    assert first.first_save and len(first.shards_changed) > 1
    for shard in first.shards_changed:  # each sidecar holds the hashes of its file's bytes
        path = tmp_path / shard
        recorded = sidecar.load(read_shard(path), blocks.DEFAULT_BLOCK_SIZE, blocks.XXH3)
        on_disk = blocks.fingerprint({n: t.reshape(-1).view(torch.uint8)
                                      for n, t in load_file(path).items()})
        assert recorded is not None and recorded.tensors.keys() == on_disk.tensors.keys()
        for n, (nbytes, hashes) in on_disk.tensors.items():
            assert recorded.tensors[n][0] == nbytes, n
            assert np.array_equal(recorded.tensors[n][1], hashes), n
    stale = [n for n, t in load_file(tmp_path / first.shards_changed[0]).items()
             if not torch.equal(t, live[n])]
    assert stale  # the step came after these bytes were written
    again = sync(tmp_path, live)
    assert again.tensors_changed >= len(stale)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for n, t in live.items():
        assert torch.equal(load_file(tmp_path / index["weight_map"][n])[n], t), n


def test_a_first_save_whose_after_read_raises_still_writes_its_sidecars(tmp_path):
    """The shards are in place when the hook raises: their sidecars are written too, and
    the next sync hashes the live tensors against them instead of comparing every byte
    with the files."""
    live = _live()

    def hook():
        raise RuntimeError("the caller's hook failed")
    with pytest.raises(RuntimeError, match="the caller's hook failed"):
        sync(tmp_path, live, max_shard_size=100_000, after_read=hook)
    finisher.finish()  # the sidecars are written once the shards are durable
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    for path in shards:
        assert sidecar.load(read_shard(path), blocks.DEFAULT_BLOCK_SIZE, blocks.XXH3)
    again = sync(tmp_path, live)
    assert again.bytes_compared == 0 and again.bytes_written == 0


def test_a_first_save_writes_its_sidecars_under_the_writer_lock(tmp_path, monkeypatch):
    """Once the lock is free, a writer after this one may replace a shard: a sidecar
    written after that would vouch for its file with the first save's hashes."""
    write, held = sidecar.write, []
    finisher.finish()  # another test's sidecars first

    def write_late(shard, *args, **kwargs):  # as a sidecar written once the commit is durable
        deadline = time.monotonic() + 10
        while (tmp_path / journal.JOURNAL_NAME).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        held.append(lock.held(tmp_path))
        return write(shard, *args, **kwargs)
    monkeypatch.setattr(sidecar, "write", write_late)
    first = sync(tmp_path, _live(), max_shard_size=100_000)
    finisher.finish()
    assert len(held) == len(first.shards_changed) > 1 and all(held), held


def test_a_sidecar_that_cannot_be_written_is_a_warning_not_a_failed_save(tmp_path, monkeypatch,
                                                                          caplog):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(sidecar, "write", full)
    first = sync(tmp_path, _live(), max_shard_size=100_000)
    finisher.finish()  # the sidecars are written once the shards are durable
    assert first.first_save and "sidecar not written" in caplog.text
    monkeypatch.undo()
    assert sync(tmp_path, _live()).bytes_written == 0


def test_a_first_save_that_cannot_fit_says_so_before_writing(tmp_path, monkeypatch):
    real = shutil.disk_usage

    def almost_full(path):
        return real(path)._replace(free=1000)
    monkeypatch.setattr(first_save.shutil, "disk_usage", almost_full)
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: not enough free space: a first "
                       r"save writes [\d.]+ MiB \(\d+ bytes\) of tensors, 0.0 MiB are free: "
                       r"free [\d.]+ MiB more; nothing was written"):
        sync(tmp_path, _live(), max_shard_size=100_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="not enough free space"):  # what it made: gone
        sync(tmp_path / "new" / "model", _live(), max_shard_size=100_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_first_save_whose_write_fails_names_the_shard_and_writes_nothing(tmp_path,
                                                                           monkeypatch):
    write, calls = first_save._write_shard, []

    def full_at_the_second(path, *args):
        calls.append(path)
        if len(calls) == 2:  # as a file object's write fails: no file name
            raise OSError(28, "No space left on device")
        return write(path, *args)
    monkeypatch.setattr(first_save, "_write_shard", full_at_the_second)
    with pytest.raises(CheckpointError) as e:
        sync(tmp_path, _live(), max_shard_size=100_000)
    assert str(e.value) == (f"{tmp_path}: cannot write the first save: {calls[1]}: No space "
                            "left on device; nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_sidecar_cut_short_by_a_full_disk_leaves_no_partial_file(tmp_path, monkeypatch,
                                                                   caplog):
    replace = os.replace

    def full(src, dst):
        if str(src).endswith(".blocks.tmp"):  # a sidecar
            raise OSError(28, "No space left on device")
        return replace(src, dst)
    monkeypatch.setattr(os, "replace", full)
    sync(tmp_path, _live(), max_shard_size=100_000)
    finisher.finish()  # the sidecars are written once the shards are durable
    monkeypatch.undo()
    assert "sidecar not written" in caplog.text
    assert not list((tmp_path / ".hotweights").glob("*.tmp"))


def test_a_first_save_into_new_directories_makes_each_one_s_entry_durable(tmp_path,
                                                                          monkeypatch):
    from hotweights.checkpoint import journal

    synced, real = [], journal.fsync_dir
    monkeypatch.setattr(journal, "fsync_dir", lambda p: (synced.append(str(p)), real(p)))
    target = tmp_path / "runs" / "step-1"
    sync(target, _live())
    assert synced[:2] == [str(tmp_path), str(tmp_path / "runs")]
    synced.clear()
    sync(target, _live())  # there already: no parent synced again
    assert str(tmp_path) not in synced and str(tmp_path / "runs") not in synced


def test_views_of_one_storage_are_sharded_by_size_not_kept_together(tmp_path):
    """A bridge's tensors are views of one shared-memory file: not one tied tensor, whose
    names huggingface_hub's splitter keeps in one shard (the whole model in one file). A
    view that is not contiguous (transposed) is written as its values."""
    flat = torch.randn(4 * 64 * 256, generator=torch.Generator().manual_seed(0))
    live = {f"layers.{i}.weight": flat[i * 64 * 256:(i + 1) * 64 * 256].view(64, 256)
            for i in range(4)}
    live["layers.3.weight"] = live["layers.3.weight"].view(256, 64).t()
    r = sync(tmp_path / "new", live, max_shard_size=70_000)  # one 64 KiB tensor a shard
    assert len(r.shards_changed) == 4
    disk = {}
    for shard in (tmp_path / "new").glob("*.safetensors"):
        disk.update(load_file(shard))
    assert disk.keys() == live.keys() and all(torch.equal(disk[n], t) for n, t in live.items())


def test_a_first_save_reports_its_progress_chunk_by_chunk_and_a_sync_from_the_start(
        tmp_path, monkeypatch):
    # one shard (every model under max_shard_size) once showed nothing until it was written
    monkeypatch.setattr(first_save, "_CHUNK", 1 << 20)
    live = {"w": torch.zeros(4 << 20, dtype=torch.bfloat16)}  # 8 MiB: eight chunks or more
    seen = []
    sync(tmp_path, live, progress=lambda *p: seen.append(p))
    total = 8 << 20
    assert seen[0] == ("write", 0, total) and seen[-1] == ("write", total, total)
    assert len(seen) > 3 and [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)
    finisher.finish()
    seen.clear()
    live["w"][0] = 1
    sync(tmp_path, live, progress=lambda *p: seen.append(p))
    assert seen[0] == ("hash", 0, total)


def test_a_first_save_s_config_does_not_say_where_the_weights_were_read(tmp_path):
    # from_pretrained records the file it read (`transformers_weights`); save_pretrained
    # drops it, else a load of the new checkpoint looks for that file
    from transformers import AutoModelForCausalLM

    from hotweights.checkpoint import sync
    from hotweights.testing.tiny import make_config

    model = AutoModelForCausalLM.from_config(make_config("llama", 300))
    model.config.transformers_weights = "weights.safetensors"
    sync(tmp_path, model, config=model.config)
    assert "transformers_weights" not in (tmp_path / "config.json").read_text()
    assert model.config.transformers_weights == "weights.safetensors"  # the caller's as is
    AutoModelForCausalLM.from_pretrained(tmp_path)


class _Crash(Exception):
    pass


@pytest.mark.parametrize("max_shard_size, at", [("50GB", 0), (100_000, 1)],
                         ids=["one file", "sharded"])
def test_a_first_save_cut_short_between_moves_leaves_no_weights_beside_an_old_config(
        tmp_path, monkeypatch, max_shard_size, at):
    (tmp_path / "config.json").write_text('{"model_type": "old"}')
    real = journal._crash_point

    def crash(step, n=0):
        if step == "move" and n == at:
            raise _Crash
        real(step, n)
    monkeypatch.setattr(journal, "_crash_point", crash)
    with pytest.raises(_Crash):
        sync(tmp_path, _live(), config={"model_type": "new"}, max_shard_size=max_shard_size)
    monkeypatch.undo()
    # the new config is in place, and no loadable weights (no index while sharded): a
    # loader fails, not loads a mismatch
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "new"}
    assert not (tmp_path / "model.safetensors").exists()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) == at
    assert journal.recover(tmp_path) == "replayed"
    finisher.finish()
    again = sync(tmp_path, _live())  # recovered: the directory holds every tensor
    assert again.writes == {} and again.missing_on_disk == () and again.missing_live == ()


def test_a_first_save_fsyncs_every_staged_file_before_the_journal_that_moves_it(tmp_path,
                                                                                 monkeypatch):
    # shards, config.json and the index: one not yet durable at the commit could be moved
    # into place empty or torn after a power loss
    staged = _staged_fsynced(monkeypatch)
    first = sync(tmp_path, _live(), max_shard_size=100_000, config={"model_type": "llama"})
    assert first.first_save and len(first.shards_changed) > 1
    assert sorted(staged) == sorted(
        (n, True) for n in [*first.shards_changed, "config.json", "model.safetensors.index.json"])
