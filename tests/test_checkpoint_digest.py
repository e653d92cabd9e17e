"""checkpoint.digest: which weights a checkpoint holds, whatever its sharding; the shards'
stats; and the check a `--remote` server makes of what it loaded."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotweights.checkpoint.digest import digest, stats
from hotweights.checkpoint.source import open_dir
from hotweights.server.env import CHECKPOINT_STATS
from hotweights.vllm_plugin.routes import _loaded


def _tensors(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16),
            "b.bias": torch.randn(16, generator=g),
            "c.steps": torch.arange(5, dtype=torch.int64)}


def _save(d, tensors, shards=1):
    d.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        return d
    index, parts = {}, [names[i::shards] for i in range(shards)]
    for i, part in enumerate(parts):
        f = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, d / f, metadata={"format": "pt"})
        index.update(dict.fromkeys(part, f))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return d


def test_digest_is_the_tensors_not_the_files(tmp_path):
    one = digest(_save(tmp_path / "one", _tensors()))
    assert one == digest(_save(tmp_path / "two", _tensors(), shards=2))
    assert one != digest(_save(tmp_path / "other", _tensors(seed=1)))
    renamed = _tensors()
    renamed["a.weight2"] = renamed.pop("a.weight")
    assert one != digest(_save(tmp_path / "renamed", renamed))
    as_f32 = _tensors()
    as_f32["a.weight"] = as_f32["a.weight"].float()
    assert one != digest(_save(tmp_path / "f32", as_f32))
    assert digest(tmp_path / "empty") is None and stats(tmp_path / "empty") == {}


def test_mapped_tensors_are_the_files_and_stats_follow_every_write(tmp_path):
    d = _save(tmp_path / "m", _tensors(), shards=2)
    got = open_dir(d)
    assert got.keys() == _tensors().keys()
    for k, t in _tensors().items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t)
    before = stats(d)
    (shard, *_) = sorted(d.glob("*.safetensors"))
    tensors = load_file(shard)
    save_file(tensors, shard, metadata={"format": "pt"})  # same bytes, written again
    assert stats(d) != before


def test_a_server_reports_what_it_loaded_only_if_no_shard_changed_since(tmp_path, monkeypatch):
    d = _save(tmp_path / "s", _tensors())
    monkeypatch.delenv(CHECKPOINT_STATS, raising=False)
    assert _loaded(str(d)) is None  # not started by `hotweights serve --remote`
    monkeypatch.setenv(CHECKPOINT_STATS, json.dumps(stats(d)))
    assert _loaded(str(d)) == digest(d)
    assert _loaded("org/some-hub-id") is None
    _save(d, _tensors(seed=2))  # a sync after the load: what was loaded is unknown
    assert _loaded(str(d)) is None


def _hub_snapshot(hub, repo: str, ref: str, commit: str, tensors):
    """A model as the Hugging Face cache holds it after a download (no network here)."""
    folder = hub / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return _save(folder / "snapshots" / commit, tensors)


def test_a_server_started_from_a_hub_id_reports_the_snapshot_it_loaded(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from hotweights.checkpoint.hub import local_dir

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    main = _hub_snapshot(tmp_path / "hub", "org/tiny", "main", "a" * 40, _tensors())
    v2 = _hub_snapshot(tmp_path / "hub", "org/tiny", "v2", "b" * 40, _tensors(seed=3))
    assert local_dir("org/tiny") == str(main) and local_dir("org/tiny", "v2") == str(v2)
    assert local_dir("org/tiny", "b" * 40) == str(v2)  # a commit hash
    assert local_dir("org/other") is None and local_dir("org/tiny", "v3") is None
    assert local_dir(str(main)) == str(main)  # a directory: itself
    monkeypatch.setenv(CHECKPOINT_STATS, json.dumps(stats(v2)))
    assert _loaded("org/tiny", "v2") == digest(v2) != digest(main)
    assert _loaded("org/tiny") is None  # main's shards are not the ones seen before the load
    # vLLM's --download-dir: a cache of its own
    elsewhere = _hub_snapshot(tmp_path / "dl", "org/tiny", "main", "c" * 40, _tensors(seed=4))
    assert local_dir("org/tiny", None, str(tmp_path / "dl")) == str(elsewhere)
    monkeypatch.setenv(CHECKPOINT_STATS, json.dumps(stats(elsewhere)))
    assert _loaded("org/tiny", None, str(tmp_path / "dl")) == digest(elsewhere)


def test_a_server_started_from_a_hub_id_recovers_its_snapshot_first(tmp_path, monkeypatch,
                                                                    capsys):
    # a sync into a Hugging Face cache snapshot, cut short after its commit: `serve`
    # finishes it before vLLM reads the shards, as it does for a directory
    import huggingface_hub.constants

    from hotweights.checkpoint import journal
    from hotweights.server.serve import recovered

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = _hub_snapshot(tmp_path / "hub", "org/tiny", "main", "a" * 40, _tensors())
    _save(tmp_path / "new", _tensors(seed=1))
    (snap / journal.STAGE_DIR).mkdir()
    (tmp_path / "new" / "model.safetensors").rename(
        snap / journal.STAGE_DIR / "model.safetensors")
    journal.write_journal(snap, [], moves=["model.safetensors"])
    assert recovered("org/tiny", None) == str(snap)
    assert f"{snap}: replayed an interrupted checkpoint sync" in capsys.readouterr().out
    assert journal.pending(snap) is None
    assert all(torch.equal(t, _tensors(seed=1)[k])
               for k, t in load_file(snap / "model.safetensors").items())
    assert recovered("org/other", None) is None


@pytest.mark.parametrize("shards", [1, 3])
def test_digest_reads_big_tensors_without_copies(tmp_path, shards):
    big = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(3)}
    d = _save(tmp_path / "big", big, shards=shards)
    assert digest(d) == digest(_save(tmp_path / "again", big, shards=4 - shards))


def test_digest_tells_apart_the_same_bytes_in_another_shape_or_dtype(tmp_path):
    # a server holding them would load other weights than the trainer's
    one = digest(_save(tmp_path / "one", _tensors()))
    reshaped = _tensors()
    reshaped["a.weight"] = reshaped["a.weight"].reshape(16, 8)
    assert one != digest(_save(tmp_path / "reshaped", reshaped))
    as_int = _tensors()
    as_int["b.bias"] = as_int["b.bias"].view(torch.int32)
    assert one != digest(_save(tmp_path / "as_int", as_int))


def test_stats_tell_a_shard_replaced_by_a_copy_with_the_same_size_and_mtime(tmp_path):
    # (`cp -p` of another checkpoint's shard: a server's digest of what it loaded is stale)
    import os
    import shutil

    d = _save(tmp_path / "d", _tensors())
    before, was = stats(d), os.stat(d / "model.safetensors")
    other = _save(tmp_path / "other", _tensors(seed=1))
    shutil.copy2(other / "model.safetensors", d / "new")
    os.utime(d / "new", ns=(was.st_atime_ns, was.st_mtime_ns))
    os.replace(d / "new", d / "model.safetensors")
    assert os.stat(d / "model.safetensors").st_size == was.st_size
    assert stats(d) != before
