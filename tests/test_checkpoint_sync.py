"""checkpoint.sync on checkpoints written by transformers' save_pretrained."""

import collections
import json
import os
import re
import shutil
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import remove_synced
from hotweights.changes import blocks
from hotweights.checkpoint import changed, diagnose, finisher, incremental, journal, sync
from hotweights.errors import CheckpointError
from hotweights.testing import tiny
from hotweights.testing.tiny import make_config


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sharded bf16 tiny Llama as save_pretrained writes it, and its tensors (live)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("llama", 300), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    live = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return tmp_path, live


def _disk(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(d.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _stats(d: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in d.glob("*.safetensors")}


def _shard_of(d: Path, name: str) -> str:
    return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_only_the_changed_blocks_of_the_changed_shard_are_written(saved):
    d, live = saved
    first = sync(d, live, version="0@s")
    assert first.bytes_written == 0 and first.bytes_compared > 0  # no sidecar yet
    before = _stats(d)
    name = "model.layers.1.mlp.down_proj.weight"
    live[name][3] += 1.0  # one row
    result = sync(d, live, version="1@s", mode="journal")  # patched: only the pages
    assert result.tensors_changed == 1 and result.shards_changed == (_shard_of(d, name),)
    assert result.bytes_compared == 0  # the sidecars said what was on disk
    row = live[name][3].numel() * 2
    assert row <= result.bytes_written <= 64 << 10
    on_disk = _disk(d)
    for n, t in on_disk.items():
        assert torch.equal(t.view(torch.int16), live[n].view(torch.int16)), n
    after = _stats(d)
    for shard, stat in before.items():  # untouched shards keep inode and mtime
        assert (after[shard] == stat) == (shard != _shard_of(d, name)), shard
    reloaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    assert torch.equal(reloaded.get_parameter(name), live[name])
    finisher.finish()  # the sidecars are written once the commit is durable, in a thread
    sidecar = json.loads((d / ".hotweights" / f"{_shard_of(d, name)}.blocks.json").read_text())
    assert sidecar["version"] == "1@s"


def test_nothing_changed_writes_nothing(saved):
    d, live = saved
    sync(d, live)
    before = _stats(d)
    result = sync(d, live)
    assert result.bytes_written == 0 and result.shards_changed == () and _stats(d) == before


def test_a_shard_changed_behind_the_sidecar_is_compared_with_the_file(saved):
    d, live = saved
    sync(d, live)
    name = "model.embed_tokens.weight"
    shard = d / _shard_of(d, name)
    other = load_file(shard)
    other[name] = other[name] * 2  # another program rewrites the shard
    from safetensors.torch import save_file

    save_file(other, shard, metadata={"format": "pt"})
    result = sync(d, live)
    assert result.bytes_compared > 0 and result.bytes_written > 0
    assert torch.equal(_disk(d)[name], live[name])


def test_a_shard_copied_back_in_place_with_its_mtime_kept_is_compared_with_the_file(
        saved, tmp_path):
    """`cp -p backup/shard DIR/shard` (a backup put back: same inode, size and mtime): the
    sidecar describes other bytes; only the ctime tells, and the sync compares."""
    d, live = saved
    name = "model.norm.weight"
    shard = d / _shard_of(d, name)
    backup = tmp_path / "backup"
    backup.write_bytes(shard.read_bytes())
    live[name] += 1
    sync(d, live)
    finisher.finish()
    st = shard.stat()
    with open(shard, "r+b") as f:  # in place, as cp onto an existing file writes
        f.write(backup.read_bytes())
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # cp -p: the mtime kept
    assert (shard.stat().st_ino, shard.stat().st_size, shard.stat().st_mtime_ns) == (
        st.st_ino, st.st_size, st.st_mtime_ns)
    result = sync(d, live)
    assert result.bytes_compared > 0 and torch.equal(_disk(d)[name], live[name])


def test_a_sidecar_of_the_other_hash_kind_is_compared_with_the_file(saved, monkeypatch):
    """Fingerprints of CUDA tensors (the torch hash) and of CPU ones (xxh3) never meet: a
    trainer that syncs from the GPU after a CPU sync gets a compare, not an error."""
    from hotweights.changes import blocks
    d, live = saved
    monkeypatch.setattr(blocks, "kind_of", lambda t: blocks.TORCH)  # as on CUDA
    sync(d, live)
    monkeypatch.undo()
    name = "model.norm.weight"
    live[name] += 1
    result = sync(d, live)
    assert result.bytes_compared > 0 and torch.equal(_disk(d)[name], live[name])
    assert sync(d, live).bytes_compared == 0  # the fresh sidecars are xxh3's


def test_a_sidecar_this_process_wrote_is_not_parsed_again(saved, monkeypatch):
    from hotweights.changes import blocks
    d, live = saved
    sync(d, live)
    finisher.finish()
    parsed, from_dict = [], blocks.Fingerprints.from_dict
    monkeypatch.setattr(blocks.Fingerprints, "from_dict",
                        lambda doc, **kw: parsed.append(kw) or from_dict(doc, **kw))
    assert sync(d, live).bytes_compared == 0 and parsed == []
    finisher.finish()
    one = next((d / ".hotweights").glob("*.json"))
    copy = one.with_suffix(".copy")
    copy.write_bytes(one.read_bytes())
    copy.replace(one)  # the same content, another file: read as any other program's
    assert sync(d, live).bytes_compared == 0 and len(parsed) == 1


def test_only_the_tensors_named_changed_are_hashed(saved):
    d, live = saved
    total = sum(t.numel() * t.element_size() for t in live.values())
    first = sync(d, live, changed=[])  # no sidecar yet: everything is compared anyway
    assert first.bytes_compared == first.bytes_hashed == total and first.bytes_trusted == 0
    name, other = "model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"
    live[name][3] += 1.0
    result = sync(d, live, changed=(n for n in [name]))  # any iterable, read once
    size = live[name].numel() * 2
    assert result.bytes_hashed == size and result.bytes_trusted == total - size
    assert result.tensors_changed == 1 and torch.equal(_disk(d)[name], live[name])
    live[other][0] += 1.0  # not named: taken as unchanged, as the caller said
    assert sync(d, live, changed=[name]).bytes_written == 0
    assert not torch.equal(_disk(d)[other], live[other])
    found = sync(d, live)  # a sync without `changed` hashes everything and finds it
    assert found.tensors_changed == 1 and torch.equal(_disk(d)[other], live[other])


def _sidecars(d: Path) -> dict[str, dict]:
    finisher.finish()  # sidecars of a sync are written behind its commit
    return {n: e for p in (d / ".hotweights").glob("*.blocks.json")
            for n, e in json.loads(p.read_text())["fingerprints"]["tensors"].items()}


def test_coarse_hashes_spare_the_per_block_pass_and_never_outlive_their_bytes(saved,
                                                                              monkeypatch):
    d, live = saved  # the hashing path: no write watch
    bs, name = 1024, "model.embed_tokens.weight"  # coarse hashes of 16 KiB
    sync(d, live, block_size=bs, watch=False)  # compared with the file; coarse hashes kept
    assert all("coarse" in e for e in _sidecars(d).values())
    seen, real = [], blocks._xxh3
    monkeypatch.setattr(blocks, "_xxh3", lambda mv, size: seen.append((len(mv), size)) or
                        real(mv, size))
    live[name][5] += 1.0  # one row, inside one coarse region
    result = sync(d, live, block_size=bs, watch=False)
    assert result.tensors_changed == 1 and torch.equal(_disk(d)[name], live[name])
    assert sum(n for n, size in seen if size == bs) == bs * blocks.COARSE  # that region
    # Hashed per block only (named), a tensor's coarse hashes are dropped, not left stale;
    # the next sync without a hint finds what the hint left out, and records them again.
    other = "model.layers.0.mlp.up_proj.weight"
    live[name][6] += 1.0
    live[other][0] += 1.0
    assert sync(d, live, block_size=bs, changed=[name], watch=False).tensors_changed == 1
    entries = _sidecars(d)
    assert "coarse" not in entries[name] and "coarse" in entries[other]
    found = sync(d, live, block_size=bs, watch=False)
    assert found.tensors_changed == 1 and _disk(d)[other].equal(live[other])
    # `name`, found unchanged, has them again; `other` changed in one region of several.
    assert all("coarse" in e for e in _sidecars(d).values())


def test_sidecars_without_coarse_hashes_still_find_every_change(saved):
    d, live = saved
    sync(d, live)
    for p in (d / ".hotweights").glob("*.blocks.json"):  # as an earlier build wrote them
        doc = json.loads(p.read_text())
        for e in doc["fingerprints"]["tensors"].values():
            del e["coarse"]
        p.write_text(json.dumps(doc))
    name = "model.layers.1.self_attn.q_proj.weight"
    live[name][2] += 1.0
    result = sync(d, live)
    assert result.bytes_compared == 0 and result.tensors_changed == 1  # the sidecars used
    assert torch.equal(_disk(d)[name], live[name])
    assert {n for n, e in _sidecars(d).items() if "coarse" not in e} == {name}  # it changed


def test_a_tensor_sharing_bytes_with_a_changed_one_is_hashed(saved):
    """The bridge's tensors are views into vLLM's merged ones, and tied weights are one
    tensor under two names: a named tensor's bytes are hashed under every name."""
    d, live = saved
    flat = torch.cat([t.reshape(-1) for t in live.values()])
    at, views = 0, {}
    for n, t in live.items():
        views[n] = flat[at:at + t.numel()].view(t.shape)
        at += t.numel()
    views["lm_head.alias"] = views["model.norm.weight"]  # not on disk: a tied alias
    sync(d, views)
    views["model.norm.weight"] += 1.0
    result = sync(d, views, changed=["lm_head.alias"])
    assert result.bytes_hashed == views["model.norm.weight"].numel() * 2
    assert torch.equal(_disk(d)["model.norm.weight"], views["model.norm.weight"])


@pytest.mark.parametrize(("changed", "message"), [
    (["model.nope.weight"], "changed 'model.nope.weight' matches none of the 21 live tensor "
                            "names (e.g. ['model.embed_tokens.weight', "),
    (["model.norm.*", "model.layers.9.*"], "changed 'model.layers.9.*' matches none of "),
    (["model.norm.weight", 5], "changed: [5] are not names (str); nothing was written"),
    ("model.norm.weight", "not one string")])
def test_bad_changed_names_are_refused_and_nothing_is_written(saved, changed, message):
    d, live = saved
    before = _stats(d)
    live["model.norm.weight"] += 1
    with pytest.raises(CheckpointError, match=re.escape(message)):
        sync(d, live, changed=changed)
    assert _stats(d) == before and not (d / ".hotweights").exists()


def test_changed_takes_fnmatch_patterns_as_remote_group_s_trainable_does(saved):
    """`changed=` patterns: only the tensors they match are hashed; a name without pattern
    characters is looked up as it is; a wrapped model's patterns are matched too."""
    d, live = saved
    sync(d, live)
    mlp = [n for n in live if ".mlp." in n]
    for n in mlp:
        live[n] += 1
    live["model.norm.weight"] += 1  # left out by the patterns: not written
    result = sync(d, live, changed=["model.layers.*.mlp.*_proj.weight"])
    assert result.tensors_changed == len(mlp)
    assert result.bytes_hashed == sum(live[n].nbytes for n in mlp)
    assert not torch.equal(_disk(d)["model.norm.weight"], live["model.norm.weight"])
    result = sync(d, {"module." + n: t for n, t in live.items()},
                  changed=["module.model.norm.*"])
    assert result.tensors_changed == 1
    assert torch.equal(_disk(d)["model.norm.weight"], live["model.norm.weight"])


@pytest.mark.parametrize("mode", ["auto", "copy", "journal"])
def test_a_tensor_left_out_of_changed_keeps_the_file_s_bytes(saved, mode):
    """A change `changed=` leaves out is not written, also where its shard is rewritten
    whole for a named tensor beside it: the file keeps the bytes its sidecar describes.
    (Written from the live tensor, it would differ from its sidecar, and once the tensor
    went back to those old bytes, a sync without `changed=` would find it unchanged and
    leave the file stale.)"""
    from hotweights.checkpoint.shards import read_dir

    d, live = saved
    sync(d, live)
    disk = read_dir(d)
    x, y = next((a, b) for a in live for b in live
                if a != b and disk[a][0].path == disk[b][0].path)
    old_y = live[y].clone()
    live[x] += 1
    live[y] += 1
    result = sync(d, live, changed=[x], mode=mode)
    assert result.tensors_changed == 1
    assert torch.equal(_disk(d)[x], live[x]) and torch.equal(_disk(d)[y], old_y)
    live[y].copy_(old_y)  # back to the bytes its sidecar holds
    sync(d, live)
    for n, t in _disk(d).items():
        assert torch.equal(t.view(torch.int16), live[n].view(torch.int16)), n


@pytest.mark.parametrize("text", ["{not json", "[" * 10**5])  # past the recursion limit
def test_a_corrupt_sidecar_is_never_trusted(saved, text):
    d, live = saved
    sync(d, live)
    finisher.finish()  # the sidecars are written in a thread
    for sidecar in (d / ".hotweights").glob("*.json"):
        sidecar.write_text(text)
    name = "model.norm.weight"
    live[name] += 1
    result = sync(d, live)
    assert result.bytes_compared > 0 and torch.equal(_disk(d)[name], live[name])


@pytest.mark.parametrize("where", ["the sidecar", "its directory"])
def test_a_sidecar_that_is_not_a_file_is_distrusted_not_fatal(saved, where):
    d, live = saved
    sync(d, live)
    finisher.finish()
    if where == "the sidecar":
        for sidecar in (d / ".hotweights").glob("*.json"):
            sidecar.unlink()
            sidecar.mkdir()
    else:
        shutil.rmtree(d / ".hotweights")
        (d / ".hotweights").write_text("")
    (problem,) = diagnose(d).problems  # every sync pays a compare: said
    assert problem.startswith(f"{d}/.hotweights") and "byte by byte (remove it)" in problem
    name = "model.norm.weight"
    live[name] += 1
    result = sync(d, live)
    assert result.bytes_compared > 0 and torch.equal(_disk(d)[name], live[name])


def test_a_directory_where_the_uncommitted_journal_belongs_is_named(saved):
    d, live = saved
    (d / ".hotweights-journal.tmp").mkdir()
    with pytest.raises(CheckpointError, match=r"hotweights-journal.tmp: a directory where a "
                                              r"sync's uncommitted journal belongs: move it"):
        sync(d, live)


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.float(), r"model.norm.weight in .*/model-0000\d-of-0000\d.safetensors: the "
                          r"file holds BF16, the live tensor is float32; nothing was written"),
    (lambda t: t[:-1], r"model.norm.weight in .*: the file holds shape \[(\d+)\], the live "
                       r"tensor \[(?!\1\])\d+\]"),
])
def test_a_mismatch_is_named_and_nothing_is_written(saved, change, message):
    d, live = saved
    live["model.layers.0.mlp.up_proj.weight"] += 1  # a real change that must not land
    live["model.norm.weight"] = change(live["model.norm.weight"])
    before = {p: p.read_bytes() for p in d.iterdir() if p.is_file()}
    with pytest.raises(CheckpointError, match=message):
        sync(d, live)
    assert {p: p.read_bytes() for p in d.iterdir() if p.is_file()} == before
    assert not (d / ".hotweights").exists()


@pytest.mark.parametrize("mode", ["auto", "copy", "journal", "auto on xfs"])
@pytest.mark.parametrize("how", ["replaced", "rewritten in place"])
def test_a_shard_another_program_writes_during_the_sync_is_left_to_it(saved, monkeypatch,
                                                                    request, mode, how):
    # the bytes would be staged (or patched) by the header read before: another layout
    d, live = saved
    if mode == "auto on xfs":  # sidecars, then a few rows changed: patched in a clone
        d = shutil.copytree(d, request.getfixturevalue("xfs_dir") / f"{how}-{os.getpid()}")
        sync(d, live)
        mode = "auto"  # elsewhere: no sidecars, the live bytes compared with the file
    name = "model.layers.0.mlp.up_proj.weight"
    shard = next(p for p in d.glob("*.safetensors") if name in load_file(p))
    theirs = {k: t * 2 for k, t in reversed(load_file(shard).items())}  # reordered, changed
    read = incremental.read_to_sync

    def and_another_writer(model_dir):
        disk = read(model_dir)
        if how == "replaced":
            save_file(theirs, d / "theirs.tmp")
            os.replace(d / "theirs.tmp", shard)
        else:
            save_file(theirs, shard)
        return disk

    monkeypatch.setattr(incremental, "read_to_sync", and_another_writer)
    live[name][:2] += 1
    with pytest.raises(CheckpointError, match=f"{re.escape(str(shard))}: changed while this "
                                              "sync ran .*nothing was written"):
        sync(d, live, mode=mode)
    assert load_file(shard).keys() == theirs.keys()
    assert all(torch.equal(t, theirs[k]) for k, t in load_file(shard).items())
    assert not list(d.glob(".hotweights/stage*/*")) and not (d / ".hotweights/journal").exists()


def test_a_shard_written_after_it_was_staged_is_refused_before_the_commit(saved, monkeypatch):
    # the staged copy holds the old file's other tensors: replacing theirs would lose them
    from hotweights.checkpoint import stage

    d, live = saved
    sync(d, live)  # sidecars: nothing compared with the file, nothing read after staging
    name = "model.layers.0.mlp.up_proj.weight"
    shard = next(p for p in d.glob("*.safetensors") if name in load_file(p))
    theirs = {k: t * 2 for k, t in load_file(shard).items()}
    whole = stage.whole

    def then_another_writer(*args, **kwargs):
        written = whole(*args, **kwargs)
        save_file(theirs, shard)
        return written

    monkeypatch.setattr(stage, "whole", then_another_writer)
    live[name] += 1
    with pytest.raises(CheckpointError, match=f"{re.escape(str(shard))}: changed while this "
                                              "sync ran"):
        sync(d, live, mode="copy")
    assert all(torch.equal(t, theirs[k]) for k, t in load_file(shard).items())
    assert not (d / ".hotweights/journal").exists()


def test_names_missing_on_either_side_are_reported(saved, caplog):
    d, live = saved
    live["extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)
    del live["model.norm.weight"]
    result = sync(d, live)
    assert result.missing_on_disk == ("extra.weight",)
    assert ("1 live tensor(s) have no place in the checkpoint and are not written "
            "(result.missing_on_disk): extra.weight") in caplog.text
    assert result.missing_live == ("model.norm.weight",)
    assert json.loads(result.to_json())["tensors_synced"] == len(live) - 1


@pytest.mark.parametrize("wrap", [
    lambda n: "module." + n,                                       # DDP, DataParallel
    lambda n: "_orig_mod." + n,                                    # torch.compile
    lambda n: "module._orig_mod." + n,                             # both
    lambda n: n.replace("layers.0.", "layers.0._fsdp_wrapped_module._checkpoint_"
                        "wrapped_module.").replace("model.", "_fsdp_wrapped_module.model.", 1),
])
def test_a_wrapped_model_s_names_are_unwrapped(saved, wrap):
    d, live = saved
    sync(d, live)
    name = "model.layers.0.mlp.up_proj.weight"
    live[name][0] += 1
    result = sync(d, {wrap(n): t for n, t in live.items()})
    assert result.tensors_changed == 1 and result.missing_on_disk == ()
    assert torch.equal(_disk(d)[name].view(torch.int16), live[name].view(torch.int16))
    live[name][1] += 1  # `changed=` names as the wrapped model's
    result = sync(d, {wrap(n): t for n, t in live.items()}, changed=[wrap(name)])
    assert result.tensors_changed == 1 and result.bytes_hashed < live[name].nbytes * 2
    assert torch.equal(_disk(d)[name].view(torch.int16), live[name].view(torch.int16))


def test_a_wrapped_module_is_unwrapped(saved):
    d, live = saved
    model = AutoModelForCausalLM.from_config(make_config("llama", 300), dtype=torch.bfloat16)
    model.load_state_dict(live)
    with torch.no_grad():
        model.model.norm.weight += 1
    compiled = torch.compile(model)  # an OptimizedModule: `_orig_mod.` before every name
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    result = sync(d, compiled)
    assert result.tensors_changed == 1 and result.missing_on_disk == ()
    assert torch.equal(_disk(d)["model.norm.weight"], model.model.norm.weight.detach())


def test_a_checkpoint_that_stores_the_wrapped_names_keeps_them(tmp_path):
    live = {"module.a.weight": torch.zeros(4, 4), "module.b.weight": torch.ones(4)}
    save_file(live, tmp_path / "model.safetensors")  # a DDP state dict saved as it is
    live["module.a.weight"][1] += 1
    result = sync(tmp_path, live)
    assert result.tensors_changed == 1 and result.missing_on_disk == ()
    assert torch.equal(_disk(tmp_path)["module.a.weight"], live["module.a.weight"])


def test_live_tensors_that_mostly_match_nothing_are_refused(saved):
    d, live = saved
    before = {p: p.read_bytes() for p in d.iterdir() if p.is_file()}
    renamed = {"base." + n: t for n, t in live.items()}  # an unknown wrapper's prefix
    renamed["model.norm.weight"] = live["model.norm.weight"] + 1  # one that matches
    with pytest.raises(CheckpointError, match=r"of \d+ live tensors have no place in the "
                       r"checkpoint \(e.g. base\.lm_head\.weight"):
        sync(d, renamed)
    assert {p: p.read_bytes() for p in d.iterdir() if p.is_file()} == before


def test_two_names_that_unwrap_to_one_are_refused(saved):
    d, live = saved
    twice = {**live, "_orig_mod.model.norm.weight": live["model.norm.weight"]}
    with pytest.raises(CheckpointError, match="both name model.norm.weight"):
        sync(d, twice)


def test_a_writer_that_waited_while_another_made_the_directory_patches_it(saved,
                                                                          monkeypatch):
    """Two writers into a directory not made yet: the one that gets the lock second finds
    the first one's save, and patches it in the mode it finds there."""
    _, live = saved
    d = saved[0] / "new"
    other = {n: t.clone() for n, t in live.items()}
    other["model.norm.weight"][0] += 1
    locked, first = incremental.lock.locked, []

    def after_another_writer(directory, **kwargs):
        if not first:  # the other writer got the lock first and saved everything
            first.append(1)
            sync(d, other)
        return locked(directory, **kwargs)
    monkeypatch.setattr(incremental.lock, "locked", after_another_writer)
    r = sync(d, live)
    finisher.finish()
    mode = incremental.write_mode(d)[0]  # the filesystem's: copy here, reflink on XFS or btrfs
    assert first and not r.first_save and r.write_mode == mode
    assert r.writes == {"model.safetensors": "whole" if mode == "copy" else "reflink"}
    disk = _disk(d)
    assert all(torch.equal(disk[n], t) for n, t in live.items())


def _hold_the_finisher(monkeypatch, fail: bool = False):
    """Make the finisher thread's fsyncs wait for the returned event (and then fail with
    EIO if `fail`); every other fsync runs as usual."""
    import errno
    import os
    import threading
    release, real = threading.Event(), os.fsync

    def fsync(fd):
        if threading.current_thread().name == "hotweights-finish":
            release.wait(30)
            if fail:
                raise OSError(errno.EIO, "Input/output error")
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return release


def test_sync_returns_once_the_files_hold_the_commit_and_a_thread_makes_it_durable(
        saved, monkeypatch):
    d, live = saved
    sync(d, live)
    name = "model.layers.1.mlp.down_proj.weight"
    live[name][3] += 1.0
    release = _hold_the_finisher(monkeypatch)
    try:
        sync(d, live)
        # a reader sees the new weights while the committed journal still guards them
        assert torch.equal(_disk(d)[name].view(torch.int16), live[name].view(torch.int16))
        assert (d / journal.JOURNAL_NAME).exists()
    finally:
        release.set()
    assert journal.pending(d) is None  # waits for this process's finisher
    assert not (d / journal.JOURNAL_NAME).exists()
    assert sync(d, live).bytes_written == 0


def test_a_record_that_fails_behind_a_durable_commit_is_not_taken_for_the_commit_s(
        saved, monkeypatch, caplog):
    from hotweights.checkpoint import sidecar

    d, live = saved
    sync(d, live)
    finisher.finish()
    live["model.norm.weight"] += 1

    def broken(*args):
        raise RuntimeError("a bug in the sidecars")
    monkeypatch.setattr(sidecar, "write", broken)
    sync(d, live)
    finisher.finish()
    monkeypatch.undo()
    assert "the commit is durable, but recording it failed (a bug in the sidecars)" \
        in caplog.text and "the journal is kept" not in caplog.text
    assert journal.not_durable(d) is None and journal.pending(d) is None
    assert torch.equal(_disk(d)["model.norm.weight"], live["model.norm.weight"])


def test_a_commit_whose_fsync_fails_keeps_its_journal_for_the_next_sync(
        saved, monkeypatch, caplog):
    d, live = saved
    sync(d, live)
    name = "model.layers.1.mlp.down_proj.weight"
    live[name][3] += 1.0
    release = _hold_the_finisher(monkeypatch, fail=True)
    sync(d, live, version="v1")
    release.set()
    finisher.finish()
    assert "could not make the commit durable" in caplog.text
    assert journal.pending(d) == {"version": "v1"}  # kept, whole, for a replay
    monkeypatch.undo()
    assert sync(d, live).bytes_written == 0  # replayed first; nothing else to write
    assert journal.pending(d) is None and not (d / journal.JOURNAL_NAME).exists()
    assert torch.equal(_disk(d)[name].view(torch.int16), live[name].view(torch.int16))


def test_ctrl_c_during_the_file_compare_is_raised_as_itself(saved, monkeypatch):
    """The compare reads the shards through a map; an interrupt that leaves slices of it in
    its traceback is still the error raised, not a BufferError from unmapping."""
    d, live = saved
    compare = blocks.compare_bytes

    def interrupted(name, tensor, disk, **kw):
        on_disk = memoryview(disk)[8:]  # a slice of the map, alive in this frame
        raise KeyboardInterrupt(f"{name}: {on_disk.nbytes}")

    monkeypatch.setattr(blocks, "compare_bytes", interrupted)
    before = {p.name: p.read_bytes() for p in d.glob("*.safetensors")}
    live["model.embed_tokens.weight"][0] += 1.0
    with pytest.raises(KeyboardInterrupt):
        sync(d, live)  # no sidecar yet: every tensor is compared with the file
    assert {p.name: p.read_bytes() for p in d.glob("*.safetensors")} == before
    monkeypatch.setattr(blocks, "compare_bytes", compare)
    assert sync(d, live).tensors_changed == 1


def _staged_names(monkeypatch) -> list[str]:
    """The names of the shards handed to the stager, in the order they come (filled as
    the syncs run)."""
    staged, add = [], incremental._Stager.add

    def add_in_order(self, c):
        staged.append(Path(c.shard.path).name)
        return add(self, c)

    monkeypatch.setattr(incremental._Stager, "add", add_in_order)
    return staged


def test_shards_are_hashed_at_once_and_staged_in_order(saved, monkeypatch):
    """Every shard is hashed on a thread of a pool (one per CPU, up to 4), so a shard
    slow to hash does not hold the others; their changes still reach the stager in the
    shards' order, and every change is found."""
    d, live = saved
    sync(d, live, version="0@s")
    first = sorted(p.name for p in d.glob("*.safetensors"))[0]
    threads, staged = set(), _staged_names(monkeypatch)
    shard_changes, other = changed._shard_changes, threading.Event()

    def slow_first(s, *args):
        threads.add(threading.current_thread().name)
        if Path(s.shard.path).name == first:
            assert other.wait(30)  # another shard is hashed meanwhile, on the other thread
        else:
            other.set()
        return shard_changes(s, *args)

    monkeypatch.setattr(changed, "_threads", lambda: 2)
    monkeypatch.setattr(changed, "_shard_changes", slow_first)
    for t in live.values():
        t.view(torch.int16).view(-1)[0] ^= 1
    result = sync(d, live, version="1@s")
    assert len(threads) == 2 and all(t.startswith("hotweights-hash") for t in threads)
    assert staged == sorted(staged) == sorted(p.name for p in d.glob("*.safetensors"))
    assert len(result.shards_changed) == len(staged)
    for n, t in _disk(d).items():
        assert torch.equal(t.view(torch.int16), live[n].view(torch.int16)), n


def test_the_shards_changed_last_time_are_hashed_and_staged_first(saved, monkeypatch):
    """A trainer changes the same tensors step after step: the shards the last sync found
    changed are hashed first (staged while the others are hashed); the result still
    lists the shards in their order."""
    d, live = saved
    sync(d, live, version="0@s")
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    last = next(n for n in live if weight_map.get(n) == shards[-1])
    live[last].view(torch.int16).view(-1)[0] ^= 1
    assert sync(d, live, version="1@s").shards_changed == (shards[-1],)
    staged = _staged_names(monkeypatch)
    for t in live.values():
        t.view(torch.int16).view(-1)[0] ^= 1
    result = sync(d, live, version="2@s")
    assert staged == [shards[-1], *shards[:-1]]
    assert result.shards_changed == tuple(shards)
    for n, t in _disk(d).items():
        assert torch.equal(t.view(torch.int16), live[n].view(torch.int16)), n


SYNC_AT_EXIT = """
import atexit, sys, torch
from safetensors.torch import load_file
from hotweights.checkpoint import sync
d, mode = sys.argv[1], sys.argv[2]
live = load_file(f"{d}/model.safetensors")
for t in live.values():
    t[:3] += 1
atexit.register(lambda: print(sync(d, live, mode=mode).tensors_changed))
"""


@pytest.mark.parametrize("mode", ["auto", "journal"])
def test_a_sync_from_an_atexit_handler_completes(tmp_path, mode):
    """"Save on exit": once the main thread has ended, thread pools take no work and a
    thread started then is not waited for; the sync runs its work in its own thread."""
    import subprocess
    import sys
    torch.manual_seed(0)
    before = {"a": torch.randn(64, 256), "b": torch.randn(64, 256)}
    save_file(before, tmp_path / "model.safetensors")
    done = subprocess.run([sys.executable, "-c", SYNC_AT_EXIT, str(tmp_path), mode],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "2", done.stderr
    after = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(after[n][:3], before[n][:3] + 1) for n in before)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hotweights", "model.safetensors"]


@pytest.mark.parametrize("arch", tiny.MLA_ARCHS)
def test_latent_attention_models_round_trip_their_buffers_too(tmp_path, arch):
    # DeepSeek-V3's router bias is a persistent buffer, kept in float32 by transformers
    d = tiny.build(arch, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(d)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if ".layers.1." in name:
                t[..., :3] += 1
    result = sync(d, model)
    assert result.missing_on_disk == () and result.missing_live == ()
    reloaded = AutoModelForCausalLM.from_pretrained(d).state_dict()
    assert all(torch.equal(t, reloaded[n]) for n, t in model.state_dict().items())


@pytest.mark.parametrize("mode", ["auto", "journal", "copy"])
def test_transposed_expert_views_sync_the_rows_that_changed(tmp_path, mode):
    """GPT-OSS's experts, trained as views of vLLM's [E, out, in] tensors, are transposed
    (not contiguous) in the live model: a few changed rows of them reach the checkpoint."""
    d = tiny.build("gpt_oss", tmp_path / "gpt_oss", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(d)
    experts = model.model.layers[1].mlp.experts
    for leaf in ("gate_up_proj", "down_proj"):  # as `build_hf_model` makes them
        vllm = getattr(experts, leaf).detach().transpose(1, 2).contiguous()
        experts._parameters[leaf] = torch.nn.Parameter(vllm.transpose(1, 2))
        assert not getattr(experts, leaf).is_contiguous()
    with torch.no_grad():
        experts.gate_up_proj[1, 3:5] += 1
        experts.down_proj[2, :, 7] -= 1
    result = sync(d, model, mode=mode)
    assert result.tensors_changed == 2
    reloaded = AutoModelForCausalLM.from_pretrained(d).state_dict()
    assert all(torch.equal(t, reloaded[n]) for n, t in model.state_dict().items())


@pytest.mark.parametrize("form", ["cast", "transposed"])
def test_a_sync_copies_what_it_must_convert_shard_by_shard(saved, monkeypatch, form):
    """A live tensor in another dtype (`convert_dtype`) or not contiguous (a transposed
    view, as GPT-OSS's experts are) is copied as its shard is hashed and let go once the
    shard is staged: a sync holds a few shards' copies at once, not the whole model's."""
    d, live = saved
    live["model.norm.weight"][3] += 1
    want = {n: t.clone() for n, t in live.items()}
    if form == "cast":
        live = {n: t.float() for n, t in live.items()}
    else:  # the same values, column-major
        live = {n: t.t().contiguous().t() if t.dim() == 2 else t for n, t in live.items()}
    copies = []

    def counting(real):
        def counted(t, *args, **kwargs):
            out = real(t, *args, **kwargs)
            if out.data_ptr() != t.data_ptr():
                copies.append(weakref.ref(out))
            return out
        return counted
    for method in ("to", "contiguous"):
        monkeypatch.setattr(torch.Tensor, method, counting(getattr(torch.Tensor, method)))
    held = []
    monkeypatch.setattr(changed, "HASH_THREADS", 1)
    r = sync(d, live, convert_dtype=form == "cast", progress=lambda phase, done, total: (
        held.append(sum(c() is not None for c in copies)) if phase == "hash" else None))
    monkeypatch.undo()
    copied = [n for n, t in live.items() if t.dtype != torch.bfloat16 or not t.is_contiguous()]
    per_shard = sorted(collections.Counter(_shard_of(d, n) for n in copied).values())
    assert len(copies) == len(copied) > sum(per_shard[-4:])  # each copied once
    assert 0 < max(held) <= sum(per_shard[-4:])  # the shard handed on, two more hashed or
    # hashing, one staging: not all of them
    assert r.shards_changed == (_shard_of(d, "model.norm.weight"),)
    assert all(torch.equal(_disk(d)[n], want[n]) for n in want)


@pytest.mark.parametrize("mode", ["copy", "journal"])
def test_a_shard_another_program_writes_behind_the_commit_gets_no_sidecar(saved, monkeypatch,
                                                                          mode, caplog):
    # between the commit and its record (the finisher's fsyncs): a sidecar of the live
    # bytes would vouch for theirs, and the next sync would leave them
    d, live = saved
    sync(d, live, mode=mode)
    name = "model.layers.0.mlp.up_proj.weight"
    shard = d / _shard_of(d, name)
    fsync_all = journal._fsync_all

    def then_another_writer(fds):
        fsync_all(fds)
        _write_with_a_new_mtime(shard, b"\x80\x7f")  # +inf in its last element, in place
    monkeypatch.setattr(journal, "_fsync_all", then_another_writer)
    live[name][:2] += 1
    assert sync(d, live, mode=mode).shards_changed == (shard.name,)
    finisher.finish()
    monkeypatch.undo()
    assert f"{shard}: changed since this sync wrote it" in caplog.text
    assert sync(d, live, mode=mode).shards_changed == (shard.name,)  # compared, found
    finisher.finish()
    disk = _disk(d)
    assert all(torch.equal(disk[k], t) for k, t in live.items())


def _write_with_a_new_mtime(path: Path, tail: bytes) -> None:
    """`tail` over the file's last bytes, in place, until its mtime is not the one it had
    (the filesystem's clock ticks coarsely: a write in the same tick keeps it)."""
    before = path.stat().st_mtime_ns
    while path.stat().st_mtime_ns == before:
        time.sleep(0.005)
        with open(path, "r+b") as f:
            f.seek(-len(tail), os.SEEK_END)
            f.write(tail)


def test_a_first_saved_shard_another_program_writes_behind_the_commit_gets_no_sidecar(
        tmp_path, monkeypatch):
    live = {"a": torch.zeros(64, dtype=torch.bfloat16), "b": torch.ones(64, dtype=torch.bfloat16)}
    d, fsync_all = tmp_path / "new", journal._fsync_all

    def then_another_writer(fds):
        fsync_all(fds)
        _write_with_a_new_mtime(d / "model.safetensors", b"\x80\x7f")
    monkeypatch.setattr(journal, "_fsync_all", then_another_writer)
    assert sync(d, live).first_save
    finisher.finish()
    monkeypatch.undo()
    assert sync(d, live).shards_changed == ("model.safetensors",)
    assert all(torch.equal(load_file(d / "model.safetensors")[k], t) for k, t in live.items())


def test_a_shard_replaced_while_the_journal_is_written_is_refused_at_the_commit(
        saved, monkeypatch):
    # its identity record would be the new file's: the replay would patch it at the old
    # header's offsets
    d, live = saved
    sync(d, live, mode="journal")
    names = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert _shard_of(d, names[0]) != _shard_of(d, names[1])
    patches = incremental._patches
    replaced = []

    def then_another_writer(writes, step):
        for k, patch in enumerate(patches(writes, step)):
            if k == 1:  # the first file's patches are on their way
                shard = writes[-1].shard.path
                theirs = {n: t * 2 for n, t in reversed(load_file(shard).items())}
                save_file(theirs, shard)
                replaced.append((shard, theirs))
            yield patch
    monkeypatch.setattr(incremental, "_patches", then_another_writer)
    for name in names:
        live[name][:2] += 1
    with pytest.raises(CheckpointError, match="changed while this sync ran"):
        sync(d, live, mode="journal")
    ((shard, theirs),) = replaced
    assert all(torch.equal(t, theirs[k]) for k, t in load_file(shard).items())
    assert journal.recover(d) == "none"


@pytest.mark.parametrize("threads_to_be_had", [0, 1])
@pytest.mark.parametrize("mode", ["auto", "journal"])
def test_a_sync_with_few_threads_to_be_had_runs_with_those(saved, monkeypatch, mode,
                                                           threads_to_be_had):
    # a limit on threads (a container's pids.max): the hashing, staging and fsyncs run in
    # the threads that could start, else in the sync's own
    d, live = saved
    sync(d, live, version="0@s")
    for name in list(live)[::3]:
        live[name][0] += 1.0
    start, left = threading.Thread.start, [threads_to_be_had]

    def limited(self):
        if not left[0]:
            raise RuntimeError("can't start new thread")
        left[0] -= 1
        start(self)
    monkeypatch.setattr(threading.Thread, "start", limited)
    result = sync(d, live, version="1@s", mode=mode)
    finisher.finish()  # the commit made durable: raises where it could not be
    monkeypatch.undo()
    assert result.tensors_changed == len(list(live)[::3])
    assert not (d / journal.JOURNAL_NAME).exists()
    assert all(torch.equal(t, live[n]) for n, t in _disk(d).items())


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("mode", ["copy", "reflink"])
def test_a_replaced_shard_keeps_its_owner_and_mode(saved, mode, request):
    # a checkpoint of another user's, synced by root: the owner keeps writing into it
    d, live = saved
    if mode == "reflink":  # a clone with the changed pages cloned in
        d = Path(shutil.copytree(d, request.getfixturevalue("xfs_dir") / request.node.name))
        request.addfinalizer(lambda: remove_synced(d))
    name = "model.layers.1.mlp.down_proj.weight"
    shard = d / _shard_of(d, name)
    os.chown(shard, 65534, 65534)
    os.chmod(shard, 0o664)
    live[name][3] += 1.0
    result = sync(d, live, version="1@s", mode=mode)
    assert result.shards_changed == (shard.name,) and result.write_mode != "journal"
    st = shard.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (65534, 65534, 0o664)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_an_owner_that_cannot_be_given_does_not_stop_the_sync(saved, monkeypatch):
    # an id a user namespace does not map (rootless containers: EINVAL), a filesystem
    # without owners: the shard is replaced all the same, as this user's
    import errno

    d, live = saved
    name = "model.layers.1.mlp.down_proj.weight"
    os.chown(d / _shard_of(d, name), 65534, 65534)

    def unmapped(fd, uid, gid):
        raise OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(os, "fchown", unmapped)
    live[name][3] += 1.0
    assert sync(d, live, version="1@s", mode="copy").tensors_changed == 1
    assert all(torch.equal(t, live[n]) for n, t in _disk(d).items())


def _staged_fsynced(monkeypatch) -> list[tuple[str, bool]]:
    """From now on, each file in the stage directory as a journal is written: (its name,
    whether it was fsync'd before)."""
    synced, staged = set(), []
    real_fsync, real_write = os.fsync, journal.write_journal

    def fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    def write_journal(directory, *args, **kwargs):
        staged.extend((p.name, p.stat().st_ino in synced)
                      for p in (Path(directory) / journal.STAGE_DIR).iterdir())
        return real_write(directory, *args, **kwargs)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(journal, "write_journal", write_journal)
    return staged


@pytest.mark.parametrize("mode", ["copy", "reflink"])
def test_every_staged_shard_is_fsynced_before_the_journal_that_moves_it(saved, mode,
                                                                         monkeypatch, request):
    # the journal's move trusts the staged file whole: one not yet durable at the commit
    # could be moved into place empty or torn after a power loss
    d, live = saved
    if mode == "reflink":  # a clone with the changed pages cloned in
        d = Path(shutil.copytree(d, request.getfixturevalue("xfs_dir") / request.node.name))
        request.addfinalizer(lambda: remove_synced(d))
    sync(d, live)
    staged = _staged_fsynced(monkeypatch)
    name = "model.layers.1.mlp.down_proj.weight"
    live[name][3] += 1.0
    result = sync(d, live, mode=mode)
    assert result.writes == {_shard_of(d, name): "whole" if mode == "copy" else "reflink"}
    assert staged == [(_shard_of(d, name), True)]


def test_changed_trusts_only_the_tensors_that_share_no_byte_with_a_named_one():
    # views of one buffer (a bridge's): one overlapping a named tensor's first elements,
    # one its last element only, one right after it, one holding it whole
    base = torch.arange(40, dtype=torch.float32)
    live = {"named": base[10:20], "head": base[5:11], "last": base[19:25],
            "after": base[20:30], "around": base[0:40], "before": base[0:10]}
    assert incremental._unchanged(live, ["named"], live) == {"after", "before"}


def test_after_read_runs_once_the_changes_are_read_before_the_files_hold_them(saved):
    # the trainer's cue to step again: what it changes from then on is the next sync's
    d, live = saved
    sync(d, live)
    name = "model.layers.1.mlp.down_proj.weight"
    live[name][3] += 1.0
    synced, calls = live[name].clone(), []

    def hook():
        calls.append(torch.equal(_disk(d)[name], synced))
        live[name][3] += 1.0  # the next step
    result = sync(d, live, after_read=hook)
    assert result.tensors_changed == 1 and calls == [False]
    assert torch.equal(_disk(d)[name], synced)


def test_a_tensor_the_last_sync_left_out_is_compared_with_its_file_when_it_is_back(saved):
    # its shard's sidecar holds no hashes of it: the file is what to compare it with
    d, live = saved
    name = "model.layers.1.mlp.down_proj.weight"
    sync(d, {n: t for n, t in live.items() if n != name})
    live[name][3] += 1.0
    result = sync(d, live)
    assert result.tensors_changed == 1 and torch.equal(_disk(d)[name], live[name])


def test_a_shard_replaced_by_another_file_of_the_same_size_and_times_is_compared(saved):
    # only the inode tells the two apart (two files written within one clock tick)
    from hotweights.checkpoint import sidecar
    from hotweights.checkpoint.shards import read_dir

    d, live = saved
    sync(d, live)
    finisher.finish()
    name = "model.layers.1.mlp.down_proj.weight"
    path = d / _shard_of(d, name)
    other = {n: t.clone() for n, t in load_file(path).items()}
    other[name][3] += 1.0
    save_file(other, d / "other", metadata={"format": "pt"})
    os.replace(d / "other", path)
    side = sidecar.path_of(path)
    doc, st = json.loads(side.read_text()), os.stat(path)
    doc["shard"].update(size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns)
    side.write_text(json.dumps(doc))
    assert sidecar.state(read_dir(d)[name][0])[0] == "stale"
    result = sync(d, live)
    assert result.tensors_changed == 1 and torch.equal(_disk(d)[name], live[name])


def test_a_sidecar_of_another_format_is_not_trusted(saved):
    # (a later hotweights' sidecar: what its fields mean may differ)
    from hotweights.checkpoint import sidecar
    from hotweights.checkpoint.shards import read_dir

    d, live = saved
    sync(d, live)
    finisher.finish()
    name = "model.layers.1.mlp.down_proj.weight"
    side = sidecar.path_of(d / _shard_of(d, name))
    doc = json.loads(side.read_text())
    side.write_text(json.dumps(dict(doc, format=doc["format"] + 1)))
    assert sidecar.state(read_dir(d)[name][0]) == ("corrupt", None)
