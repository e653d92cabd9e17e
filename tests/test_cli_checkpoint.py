"""`hotweights sync --from` and `hotweights diagnose`, and checkpoint.source (no vLLM)."""

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hotweights.changes import blocks
from hotweights.checkpoint import clone, diagnose, finisher, journal, lock, sidecar, sync
from hotweights.checkpoint.shards import read_dir
from hotweights.checkpoint.source import open_dir
from hotweights.cli.main import main
from hotweights.errors import CheckpointError
from hotweights.testing.tiny import make_config

CHANGED = ("model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A tiny sharded bf16 Llama (A), the same with two rows changed (B), B in float32 (F)."""
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("llama", 300), dtype=torch.bfloat16)
    model.save_pretrained(root / "A", max_shard_size="200KB")
    with torch.no_grad():
        for name in CHANGED:
            model.get_parameter(name)[3] += 1.0
    model.save_pretrained(root / "B", max_shard_size="200KB")
    model.float().save_pretrained(root / "F", max_shard_size="200KB")
    assert len(list((root / "A").glob("*.safetensors"))) > 2
    return {k: root / k for k in "ABF"}


@pytest.fixture
def dirs(saved, tmp_path) -> dict[str, Path]:
    """Fresh copies for one test: it may write them."""
    return {k: Path(shutil.copytree(v, tmp_path / k)) for k, v in saved.items()}


def _disk(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(d.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_sync_from_writes_only_the_changed_rows(dirs, capsys):
    a, b = dirs["A"], dirs["B"]
    assert not _equal(_disk(a), _disk(b))
    rc, out, _ = _run(capsys, "sync", "--model-dir", a, "--from", b, "--json",
                      "--mode", "journal")  # patched in place: only the rows' pages
    assert rc == 0
    result = json.loads(out)
    assert result["tensors_changed"] == 2 and len(result["shards_changed"]) == 2
    assert 0 < result["bytes_written"] <= 64 << 10  # rows, not shards
    assert _equal(_disk(a), _disk(b))
    rc, out, _ = _run(capsys, "sync", "--model-dir", a, "--from", b, "--json")
    again = json.loads(out)
    assert rc == 0 and again["bytes_written"] == 0 and again["tensors_changed"] == 0
    assert again["bytes_compared"] == 0  # the sidecars of the first run were trusted


def test_sync_from_records_the_version_in_the_sidecars(dirs, capsys):
    a, b = dirs["A"], dirs["B"]
    rc, out, _ = _run(capsys, "sync", "--model-dir", a, "--from", b, "--weight-version",
                      "7@run")
    assert rc == 0 and ", version 7@run" in out.splitlines()[0]
    sidecars = sorted((a / ".hotweights").glob("*.blocks.json"))
    assert len(sidecars) == len(list(a.glob("*.safetensors")))
    assert {json.loads(p.read_text())["version"] for p in sidecars} == {"7@run"}
    rc, out, _ = _run(capsys, "sync", "--model-dir", a, "--from", b, "--json")  # none given
    assert rc == 0 and json.loads(out)["version"] is None
    assert {json.loads(p.read_text())["version"] for p in sidecars} == {None}


def test_sync_prints_a_summary(dirs, capsys):
    rc, out, err = _run(capsys, "sync", "--model-dir", dirs["A"], "--from", dirs["B"])
    assert rc == 0 and err == ""
    lines = {line.split(maxsplit=1)[0]: line for line in out.splitlines()[1:]}
    assert "2 of 21" in lines["tensors"]
    assert lines["shards"].startswith("  shards changed  2 of ")
    shards = sum(p.stat().st_size for p in dirs["A"].glob("*.safetensors"))
    assert re.fullmatch(rf"  written +[\d.]+ KiB of the shards' {shards / 1024:.1f} KiB "
                        r"\(\d+\.\d\d %\)", lines["written"]), lines["written"]
    assert out.startswith("synced 21 tensors in ")
    assert re.match(r"  mode +(copy|reflink) \(asked auto\): ", lines["mode"])  # the one used


def test_sync_from_with_tensors_the_checkpoint_has_no_place_for_fails_naming_them(
        dirs, tmp_path, capsys, caplog):
    extra = tmp_path / "extra"
    extra.mkdir()
    save_file({**_disk(dirs["B"]), "model.extra.weight": torch.ones(4, dtype=torch.bfloat16)},
              extra / "model.safetensors", metadata={"format": "pt"})
    for json_out in (False, True):
        rc, out, err = _run(capsys, "sync", "--model-dir", dirs["A"], "--from", extra,
                            *(["--json"] if json_out else []))
        assert rc == 1, out
        assert err.startswith(f"error: {dirs['A']}: 1 of the 22 live tensors not written, "
                              "no shard holds them: model.extra.weight")
        if json_out:  # the result, and the error as every command's --json has it
            got = json.loads(out)
            assert got["missing_on_disk"] == ["model.extra.weight"]
            assert got["error"] == err.removeprefix("error: ").rstrip("\n")
        else:
            assert "not on disk" in out
    assert not caplog.records  # the library's warning: said once, by the command, not twice
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", dirs["A"], "--from", extra)
    assert rc == 1 and ("1 live tensor(s) have no place in the checkpoint: a sync does not "
                        "write them (e.g. model.extra.weight)") in out  # said before it
    without = _disk(extra)
    del without["model.extra.weight"]
    assert _equal(_disk(dirs["A"]), without)  # all else written


def _with_sidecars(dirs, tmp_path, capsys) -> Path:
    """A with fresh sidecars: synced once from a copy of itself."""
    same = shutil.copytree(dirs["A"], tmp_path / "A-copy")
    assert _run(capsys, "sync", "--model-dir", dirs["A"], "--from", same)[0] == 0
    return dirs["A"]


def test_sync_changed_hashes_only_the_named_tensors(dirs, tmp_path, capsys):
    a = _with_sidecars(dirs, tmp_path, capsys)
    rc, out, _ = _run(capsys, "sync", "--model-dir", a, "--from", dirs["B"], "--json",
                      "--changed", "model.layers.1.mlp.*", "model.embed_tokens.weight")
    result = json.loads(out)
    assert rc == 0 and result["tensors_changed"] == 2 and _equal(_disk(a), _disk(dirs["B"]))
    named = sum(t.nbytes for n, t in _disk(dirs["B"]).items()
                if n == CHANGED[1] or n.startswith("model.layers.1.mlp."))
    assert result["bytes_hashed"] == named and result["bytes_compared"] == 0
    assert result["bytes_trusted"] == sum(t.nbytes for t in _disk(a).values()) - named


def test_sync_changed_that_leaves_a_change_out_skips_it_until_a_full_sync(dirs, tmp_path,
                                                                          capsys):
    a = _with_sidecars(dirs, tmp_path, capsys)
    rc, out, _ = _run(capsys, "sync", "--model-dir", a, "--from", dirs["B"],
                      "--changed", "model.layers.0.*")
    assert rc == 0 and "  not hashed      " in out and "outside --changed" in out
    assert "tensors changed 0 of 21" in out and not _equal(_disk(a), _disk(dirs["B"]))
    rc, out, _ = _run(capsys, "sync", "--model-dir", a, "--from", dirs["B"], "--json")
    assert rc == 0 and json.loads(out)["tensors_changed"] == 2
    assert _equal(_disk(a), _disk(dirs["B"]))


def test_sync_changed_pattern_matching_nothing_is_an_error_naming_it(dirs, capsys):
    before = _disk(dirs["A"])
    rc, out, err = _run(capsys, "sync", "--model-dir", dirs["A"], "--from", dirs["B"],
                        "--changed", "model.layers.1.*", "lm_head.bias")
    assert rc == 1 and out == ""
    assert "--changed 'lm_head.bias' matches none of the 21 live tensor names" in err
    assert _equal(_disk(dirs["A"]), before)


def test_sync_into_an_empty_directory_is_a_first_save(dirs, tmp_path, capsys):
    new = tmp_path / "new"
    rc, out, _ = _run(capsys, "sync", "--model-dir", new, "--from", dirs["B"], "--json")
    assert rc == 0 and json.loads(out)["first_save"]
    assert _equal(_disk(new), _disk(dirs["B"]))
    assert json.loads((new / "config.json").read_text())["model_type"] == "llama"
    rc, out, _ = _run(capsys, "sync", new / "made", "--from", dirs["B"])
    assert rc == 0 and out.startswith(f"created {new / 'made'}\n")  # a typo is seen
    (new / "file").write_bytes(b"x")
    rc, _, err = _run(capsys, "sync", new / "file", "--from", dirs["B"])
    assert rc == 1 and err == f"error: {new / 'file'}: not a directory\n"


def test_a_first_save_says_what_it_replaced_and_left_beside_it(dirs, tmp_path, capsys):
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text('{"model_type": "llama", "mine": 1}')
    (old / "pytorch_model.bin").write_bytes(b"x")
    rc, out, _ = _run(capsys, "sync", old, "--from", dirs["B"])
    assert rc == 0 and "first full save" in out
    assert "  config.json     replaced by the saved model's\n" in out
    assert ("  left as is      pytorch_model.bin: weights in another format (transformers "
            "and vLLM load the safetensors)\n") in out
    rc, out, _ = _run(capsys, "sync", tmp_path / "new", "--from", dirs["B"])
    assert rc == 0 and "config.json" not in out and "left as is" not in out


def test_sync_refuses_reflink_where_there_are_none(dirs, capsys):
    if clone.supports_reflink(dirs["A"])[0]:
        pytest.skip("tmp_path supports reflinks here")
    before = _disk(dirs["A"])
    rc, out, err = _run(capsys, "sync", "--model-dir", dirs["A"], "--from", dirs["B"],
                        "--mode", "reflink")
    assert rc == 1 and out == ""
    assert err.startswith("error: ") and "does not support reflinks" in err
    assert _equal(_disk(dirs["A"]), before)
    # a first save writes whole files in any mode: diagnose says what the sync then does
    empty = dirs["A"].parent / "empty"
    empty.mkdir()
    rc, out, _ = _run(capsys, "diagnose", empty, "--mode", "reflink", "--json")
    d = json.loads(out)
    assert rc == 0 and d["problems"] == [] and d["write_mode"] == "copy"
    assert d["write_reason"] == "a first save writes whole files, in any mode"
    assert _run(capsys, "sync", empty, "--from", dirs["B"], "--mode", "reflink")[0] == 0


def test_sync_json_in_a_terminal_draws_its_progress_on_stderr(dirs, capsys, monkeypatch):
    from hotweights.cli import checkpoint as cli

    drawn, progress = [], cli._progress
    monkeypatch.setattr(cli, "_progress", lambda on: (drawn.append(on), progress(on))[1])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, out, _ = _run(capsys, "sync", "--model-dir", dirs["A"], "--from", dirs["B"], "--json")
    assert rc == 0 and drawn == [True]  # a long sync --json showed nothing before
    assert json.loads(out)["tensors_changed"] == 2  # stdout: the JSON alone


def test_sync_refuses_a_dtype_mismatch_and_writes_nothing(dirs, capsys):
    before = _disk(dirs["A"])
    rc, _, err = _run(capsys, "sync", "--model-dir", dirs["A"], "--from", dirs["F"])
    assert rc == 1 and re.match(  # which file, and whose are the live tensors
        rf"error: \S+ in {re.escape(str(dirs['A']))}/model-\S+\.safetensors: the file holds "
        rf"BF16, the live tensor is float32; .* \(the live tensors: --from "
        rf"{re.escape(str(dirs['F']))}\)$", err), err
    assert _equal(_disk(dirs["A"]), before)


def test_sync_from_names_the_source_of_a_cast_that_overflows(tmp_path, capsys):
    dst, src = tmp_path / "dst", tmp_path / "src"
    dst.mkdir(), src.mkdir()
    save_file({"w": torch.zeros(4, 8, dtype=torch.float16)}, dst / "model.safetensors")
    save_file({"w": torch.full((4, 8), 1e6)}, src / "model.safetensors")  # > fp16's max
    before = _disk(dst)
    rc, _, err = _run(capsys, "sync", "--model-dir", dst, "--from", src, "--convert-dtype")
    assert rc == 1 and "overflow to inf" in err, err
    assert err.rstrip().endswith(f"(the live tensors: --from {src})"), err
    assert _equal(_disk(dst), before)


def test_sync_from_a_directory_of_empty_safetensors_names_it(dirs, capsys, tmp_path):
    from safetensors.torch import save_file

    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({}, empty / "model.safetensors")
    before = _disk(dirs["A"])
    rc, _, err = _run(capsys, "sync", "--model-dir", dirs["A"], "--from", empty)
    assert (rc, err) == (1, f"error: --from {empty}: holds no tensors (its safetensors are "
                            f"empty); nothing was written to {dirs['A']}\n")
    assert _equal(_disk(dirs["A"]), before)


def test_sync_refuses_the_same_directory(dirs, capsys):
    rc, _, err = _run(capsys, "sync", "--model-dir", dirs["A"], "--from", dirs["A"] / ".")
    assert rc == 1 and "are the same one" in err


def test_a_source_that_does_not_exist_is_named_so(dirs, tmp_path, capsys):
    for command in ("sync", "diagnose"):
        rc, _, err = _run(capsys, command, "--model-dir", dirs["A"], "--from", tmp_path / "nope")
        assert (rc, err) == (1, f"error: {tmp_path / 'nope'}: no such directory\n")


@pytest.mark.parametrize("argv", [
    ["sync", "--model-dir", "x"],  # neither --server nor --from
    ["sync", "--model-dir", "x", "--from", "y", "--server", "http://h:1"],
    ["sync", "--from", "y"],
    ["sync", "--model-dir", "x", "--from", "y", "--mode", "fast"],
    ["sync", "--model-dir", "x", "--server", "http://h:1", "--version", "3"],
    ["sync", "--model-dir", "x", "--from", "y", "--version"],
    ["sync", "--model-dir", "x", "--from", "y", "--changed"],
    ["diagnose", "--model-dir", "x", "--from", "y", "--server", "http://h:1"],
    ["sync", "--model-dir", "", "--from", "y"],  # an unset "$DIR": not the current directory
    ["sync", "--model-dir", "x", "--from", " "],
    ["diagnose", "--model-dir", ""],
    ["recover", ""],
    ["recover"],
    ["recover", "x", "--model-dir", "x"],
    ["sync", "x", "--model-dir", "x", "--from", "y"],
    ["diagnose", "x", "--model-dir", "x"],
    ["diagnose"],
    ["recover", "x", "--bogus"],
    ["diagnose", "x", "--server", "http://127.0.0.1:1", "--cafile", "ca.pem"],
])
def test_usage_errors_exit_2(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"usage: hotweights {argv[0]}" in capsys.readouterr().err  # the command's usage
    assert not list(tmp_path.iterdir())  # nothing written here


def test_a_directory_taken_by_changed_is_named_with_what_to_do(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["sync", "--from", str(tmp_path), "--changed", "lm_head.*", "out"])
    assert ("the checkpoint directory is required: DIR or --model-dir DIR (every word after "
            "--changed is a pattern: put DIR before --changed, or end the patterns with --)"
            ) in capsys.readouterr().err


def test_a_server_url_that_is_no_url_is_one_clear_line(tmp_path, capsys):
    for argv in (["status", "localhost:abc"],
                 ["sync", "--model-dir", str(tmp_path), "--server", "http://h:99999"],
                 ["diagnose", "--model-dir", str(tmp_path), "--server", "ftp://h"]):
        assert main([*argv, "--token", "t"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: '") and "is not a server URL" in err, err
        assert len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_diagnose_a_clean_checkpoint(dirs, capsys):
    a = dirs["A"]
    assert _run(capsys, "sync", "--model-dir", a, "--from", dirs["B"])[0] == 0
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a, "--from", dirs["B"], "--json")
    d = json.loads(out)
    assert rc == 0 and d["problems"] == [] and d["error"] is None
    assert d["tensors"] == 21 and d["matched"] == 21 and d["mismatches"] == []
    assert len(d["shards"]) == len(list(a.glob("*.safetensors")))
    assert {s["sidecar"] for s in d["shards"]} == {"fresh"}
    assert d["write_mode"] in ("copy", "reflink") and d["fs_type"] != "unknown"
    assert d["journal"] is None and d["leftovers"] == [] and not d["writer_active"]
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a)
    assert rc == 0 and out.rstrip().endswith("no problems")
    assert "sidecar fresh" in out and "live" not in out.split() and "note" not in out


def test_diagnose_names_a_dtype_mismatch(dirs, capsys):
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", dirs["A"], "--from", dirs["F"])
    assert rc == 1
    assert ("model.embed_tokens.weight in model-00001-of-00006.safetensors: the file holds "
            "dtype BF16, the live tensor float32") in out
    assert "and 11 more (--json lists them all)" in out  # 21 mismatches, 10 listed
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", dirs["A"], "--from", dirs["F"],
                      "--json")
    d = json.loads(out)
    assert rc == 1 and len(d["mismatches"]) == 21 and len(d["problems"]) == 21
    assert {m["field"] for m in d["mismatches"]} == {"dtype"}
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", dirs["A"], "--from", dirs["F"],
                      "--convert-dtype")  # as the sync it checks for would: cast
    assert rc == 0 and "the file holds dtype" not in out
    assert _run(capsys, "sync", "--model-dir", dirs["A"], "--from", dirs["F"],
                "--convert-dtype")[0] == 0


def test_diagnose_names_live_tensors_that_mostly_match_nothing_as_sync_does(dirs):
    live = {n if i % 3 == 0 else "base." + n: t  # 14 of 21 under an unknown wrapper's prefix
            for i, (n, t) in enumerate(sorted(_disk(dirs["B"]).items()))}
    d = diagnose(dirs["A"], live)
    assert d.matched == 7 and d.only_live == 14
    assert len(d.problems) == 1 and d.problems[0].startswith(
        f"{dirs['A']}: 14 of 21 live tensors have no place in the checkpoint (e.g. base.")
    with pytest.raises(CheckpointError) as e:
        sync(dirs["A"], live)
    assert str(e.value) == f"{d.problems[0]} Nothing was written."


def test_diagnose_a_stale_sidecar_is_no_problem(dirs, capsys):
    a = dirs["A"]
    _run(capsys, "sync", "--model-dir", a, "--from", dirs["B"])
    shard = a / "model-00002-of-00006.safetensors"
    save_file(load_file(shard), shard, metadata={"format": "pt"})  # behind the sidecar's back
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a, "--json")
    states = {s["name"]: s["sidecar"] for s in json.loads(out)["shards"]}
    assert rc == 0 and states.pop(shard.name) == "stale"
    assert set(states.values()) == {"fresh"}
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a)
    assert rc == 0 and out.rstrip().endswith("no problems")
    assert "  note            1 sidecar not fresh: the next sync compares those shards" in out


def test_diagnose_names_a_sidecar_a_sync_from_cpu_tensors_would_not_use(dirs, capsys):
    a = dirs["A"]
    _run(capsys, "sync", "--model-dir", a, "--from", dirs["B"])
    shard = a / "model-00002-of-00006.safetensors"
    doc = json.loads(sidecar.path_of(shard).read_text())
    assert doc["fingerprints"]["kind"] == blocks.XXH3
    doc["fingerprints"]["kind"] = blocks.TORCH  # as a sync from CUDA tensors records it
    sidecar.path_of(shard).write_text(json.dumps(doc))
    unused = (f"{blocks.TORCH} fingerprints: a sync from CPU tensors compares this shard "
              "with the file")
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a, "--json")
    infos = {s["name"]: s for s in json.loads(out)["shards"]}
    assert rc == 0 and infos[shard.name]["sidecar"] == "fresh"
    assert infos[shard.name]["kind"] == blocks.TORCH
    assert infos[shard.name]["unused"] is None  # no live tensors: no telling
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a, "--from", dirs["B"], "--json")
    d = json.loads(out)
    infos = {s["name"]: s for s in d["shards"]}
    assert rc == 0 and d["problems"] == [] and infos.pop(shard.name)["unused"] == unused
    assert {(s["sidecar"], s["kind"], s["block_size"], s["unused"]) for s in infos.values()} \
        == {("fresh", blocks.XXH3, blocks.DEFAULT_BLOCK_SIZE, None)}
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a, "--from", dirs["B"])
    assert rc == 0 and f"sidecar fresh ({unused})" in out
    assert out.count(f"sidecar fresh ({blocks.XXH3})") == len(infos)
    tensors = open_dir(dirs["B"])
    try:
        other = diagnose(a, tensors, block_size=4096)
    finally:
        tensors.close()
    assert other.shards[0].unused == (f"{blocks.DEFAULT_BLOCK_SIZE}-byte blocks: a sync at "
                                      "4096 compares this shard with the file")
    rc, out, _ = _run(capsys, "sync", "--model-dir", a, "--from", dirs["B"], "--json")
    result = json.loads(out)  # the sync compares that shard with the file, and only that one
    assert rc == 0 and result["bytes_written"] == 0
    assert result["bytes_compared"] == sum(i.nbytes for s, i in read_dir(a).values()
                                           if s.path == str(shard))
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a, "--from", dirs["B"], "--json")
    assert {s["unused"] for s in json.loads(out)["shards"]} == {None}


def test_diagnose_a_pending_journal_then_sync_finishes_it(dirs, capsys):
    a = dirs["A"]
    shard, info = read_dir(a)["model.norm.weight"]
    journal.write_journal(a, [(Path(shard.path).name, info.begin, b"x")], meta={"version": "7"})
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a)
    assert rc == 1
    assert ("a committed journal (version 7) is not applied yet, a shard may be half "
            f"written: run hotweights recover {a} before reading the shards (a sync or "
            "serve finishes it too)") in out
    assert (f"  reader          run hotweights recover {a} before loading the shards: a "
            "sync was interrupted, a shard may be half written\n") in out
    with lock.locked(a):  # its writer committing now, not cut short: its journal
        rc, out, _ = _run(capsys, "diagnose", "--model-dir", a, "--json")
    d = json.loads(out)
    assert rc == 0 and d["writer_active"] and d["problems"] == [] and not d["interrupted"]
    with lock.locked(a):
        out = _run(capsys, "diagnose", "--model-dir", a)[1]
    assert "  journal         not looked at: a sync holds the directory now" in out
    assert "reader" not in out
    rc, _, _ = _run(capsys, "sync", "--model-dir", a, "--from", dirs["B"])
    assert rc == 0 and not (a / journal.JOURNAL_NAME).exists()
    assert _equal(_disk(a), _disk(dirs["B"]))  # the patched byte compared and put back


@pytest.mark.parametrize("command", ["sync", "diagnose"])
def test_from_a_source_cut_short_after_its_commit_is_refused(dirs, capsys, command):
    """Its shards may be half written: read as they are, they would be copied as a clean
    checkpoint (diagnose would foretell that copy)."""
    a, b = dirs["A"], dirs["B"]
    shard, info = read_dir(b)["model.norm.weight"]
    journal.write_journal(b, [(Path(shard.path).name, info.begin, b"x")])
    before = _disk(a)
    rc, out, err = _run(capsys, command, "--model-dir", a, "--from", b)
    assert (rc, out) == (1, "")
    assert err == (f"error: {b}: a sync into it was cut short after its commit (its journal "
                   "is there): some shards may be half written; run hotweights recover "
                   f"{b} first\n")
    if command == "diagnose":
        return
    assert _equal(_disk(a), before)
    with lock.locked(b):  # its writer committing now, not cut short
        rc, out, err = _run(capsys, "sync", "--model-dir", a, "--from", b)
    assert (rc, out, err) == (1, "", f"error: {b}: a sync into it is committing now: read it "
                              "once that sync is done\n")
    assert _run(capsys, "recover", b)[0] == 0
    assert _run(capsys, "sync", "--model-dir", a, "--from", b)[0] == 0
    assert _equal(_disk(a), _disk(b))


def test_sync_from_a_source_written_while_it_is_read_says_so(dirs, capsys, monkeypatch):
    """Another sync into the source meanwhile (here: one shard rewritten in place, as the
    journal mode does): the copy may mix its versions, and the command says so."""
    import hotweights.checkpoint as checkpoint

    a, b = dirs["A"], dirs["B"]
    shard = read_dir(b)["model.norm.weight"][0].path
    real = checkpoint.sync

    def written_meanwhile(*args, after_read=None, **kwargs):
        def read():
            with open(shard, "r+b") as f:  # the same bytes: only the file's times change
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(last)
            after_read()
        return real(*args, after_read=read, **kwargs)
    monkeypatch.setattr(checkpoint, "sync", written_meanwhile)
    rc, out, err = _run(capsys, "sync", "--model-dir", a, "--from", b)
    assert (rc, out) == (1, "")
    assert err == (f"error: {shard}: changed while this sync read it (another sync into "
                   f"{b}?): {a} may hold a mix of its versions; sync again once {b} is "
                   "still\n")


def test_diagnose_a_pending_journal_of_no_version_says_none_of_it(dirs, capsys):
    a = dirs["A"]
    shard, info = read_dir(a)["model.norm.weight"]
    journal.write_journal(a, [(Path(shard.path).name, info.begin, b"x")])
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a)
    assert rc == 1 and "None" not in out
    assert "  journal         committed, not applied\n" in out
    assert "a committed journal is not applied yet" in out


def test_diagnose_leftovers_and_an_empty_directory(dirs, tmp_path, capsys):
    a = dirs["A"]
    (a / journal.STAGE_DIR).mkdir()
    (a / (journal.JOURNAL_NAME + ".tmp")).write_bytes(b"torn")
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a, "--json")
    d = json.loads(out)
    assert rc == 0 and len(d["leftovers"]) == 2 and d["journal"] is None and d["interrupted"]
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a)
    assert rc == 0 and ("  reader          the shards are whole, as before a sync that was "
                        f"interrupted before its commit; hotweights recover {a} (or the next "
                        "sync) removes what it left\n") in out
    assert "  leftover        .hotweights-stage/: files staged for a journal\n" in out
    assert _run(capsys, "recover", a)[0] == 0
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a, "--json")
    d = json.loads(out)
    assert rc == 0 and d["leftovers"] == [] and not d["interrupted"]
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", empty)
    assert rc == 0 and "no safetensors yet: a sync makes a first full save" in out
    rc, _, err = _run(capsys, "diagnose", "--model-dir", tmp_path / "absent")
    assert rc == 1 and err == (f"error: {tmp_path / 'absent'}: no such directory (a sync "
                               "would create it and save the model whole)\n")
    (tmp_path / "afile").write_text("")
    rc, _, err = _run(capsys, "diagnose", tmp_path / "afile" / "sub")
    assert rc == 1 and err == (f"error: {tmp_path / 'afile' / 'sub'}: no such directory, and a "
                               f"sync cannot create it: {tmp_path / 'afile'} is not a "
                               "directory\n")
    assert "cannot create the directory" in _run(capsys, "sync", tmp_path / "afile" / "sub",
                                                 "--from", a)[2]


def test_diagnose_a_first_save_that_would_not_fit(dirs, tmp_path, capsys, monkeypatch):
    from hotweights.checkpoint import first_save

    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run(capsys, "diagnose", empty, "--from", dirs["B"])[0] == 0
    real = first_save.shutil.disk_usage
    monkeypatch.setattr(first_save.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=1000))
    rc, out, _ = _run(capsys, "diagnose", empty, "--from", dirs["B"])
    assert rc == 1 and (f"{empty}: not enough free space: a first save writes ") in out
    assert "are free" in out
    tied = torch.zeros(1 << 18)  # 1 MiB, under two names: written once
    for free, fits in ((3 << 19, True), (1 << 19, False)):
        monkeypatch.setattr(first_save.shutil, "disk_usage",
                            lambda path, free=free: real(path)._replace(free=free))
        d = diagnose(empty, {"embed.weight": tied, "lm_head.weight": tied})
        assert (d.space is None) == fits, d.space


def _interrupt(a: Path, b: Path, *, commit: bool) -> list[str]:
    """Leave in A what a sync from B cut short leaves: its changed shards, one staged
    whole and the others patched by a journal, committed (not applied) or not."""
    changed = sorted(p.name for p in a.glob("*.safetensors")
                     if p.read_bytes() != (b / p.name).read_bytes())
    assert len(changed) == 2
    (a / journal.STAGE_DIR).mkdir()
    shutil.copy(b / changed[0], a / journal.STAGE_DIR / changed[0])
    patches = [_diff(a / name, b / name) for name in changed[1:]]
    journal.write_journal(a, patches, moves=changed[:1], meta={"version": "9"})
    if not commit:  # as if killed before the rename, the commit point
        (a / journal.JOURNAL_NAME).rename(a / (journal.JOURNAL_NAME + ".tmp"))
    return changed


def _diff(old: Path, new: Path) -> tuple[str, int, bytes]:
    """The patch from `old` to `new` (same size): the span from their first differing
    byte to their last."""
    x, y = old.read_bytes(), new.read_bytes()
    diff = [i for i in range(len(x)) if x[i] != y[i]]
    return old.name, diff[0], y[diff[0]:diff[-1] + 1]


def _journal_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(".hotweights-"))


def test_recover_replays_a_committed_sync(dirs, capsys, caplog):
    a, b = dirs["A"], dirs["B"]
    before = _disk(a)
    _interrupt(a, b, commit=True)
    assert _equal(_disk(a), before)  # committed, not a byte applied yet
    rc, out, _ = _run(capsys, "recover", a)
    assert rc == 0 and not caplog.records  # the library's warning: the line below says it
    assert out == f"{a}: replayed an interrupted sync (version 9): the files hold what it wrote\n"
    assert _equal(_disk(a), _disk(b)) and _journal_files(a) == []
    rc, out, _ = _run(capsys, "recover", a)
    assert rc == 0 and out == f"{a}: nothing to recover\n"


@pytest.mark.parametrize("commit", [True, False])
def test_recover_json_says_what_it_did(dirs, capsys, commit):
    a, b = dirs["A"], dirs["B"]
    _interrupt(a, b, commit=commit)
    rc, out, _ = _run(capsys, "recover", a, "--json")
    assert rc == 0 and json.loads(out) == ({"outcome": "replayed", "version": "9"} if commit
                                           else {"outcome": "discarded", "version": None})
    assert json.loads(_run(capsys, "recover", a, "--json")[1]) == {"outcome": "none",
                                                                    "version": None}


def test_recover_discards_an_uncommitted_sync(dirs, capsys):
    a, b = dirs["A"], dirs["B"]
    before = _disk(a)
    _interrupt(a, b, commit=False)
    rc, out, _ = _run(capsys, "recover", a)
    assert rc == 0
    assert out == f"{a}: discarded an uncommitted sync: the files are as before it\n"
    assert _equal(_disk(a), before) and _journal_files(a) == []


def test_recover_says_what_a_read_only_directory_keeps(dirs, capsys, monkeypatch):
    a, b = dirs["A"], dirs["B"]
    before = _disk(a)
    _interrupt(a, b, commit=False)

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    monkeypatch.setattr(os, "unlink", read_only)
    monkeypatch.setattr(shutil, "rmtree", read_only)
    rc, out, _ = _run(capsys, "recover", a)
    json_out = _run(capsys, "recover", a, "--json")[1]
    monkeypatch.undo()
    assert (rc, out) == (0, f"{a}: an uncommitted sync's leftovers are there, which this "
                            "process cannot remove (a read-only directory?): the files are as "
                            "before it; run hotweights recover where it can write to remove "
                            "them\n")
    assert json.loads(json_out) == {"outcome": "kept", "version": None}
    assert _equal(_disk(a), before)
    assert _run(capsys, "recover", a)[1] == f"{a}: discarded an uncommitted sync: the files " \
                                            "are as before it\n"


def test_diagnose_a_checkpoint_without_tensors(tmp_path, capsys):
    from safetensors.torch import save_file

    save_file({}, tmp_path / "model.safetensors")
    rc, out, _ = _run(capsys, "diagnose", tmp_path, "--json")
    assert rc == 0 and json.loads(out)["tensors"] == 0


def test_sync_and_diagnose_take_the_directory_as_recover_does(dirs, capsys):
    """DIR as an argument, or --model-dir DIR: the same run."""
    a, b = dirs["A"], dirs["B"]
    assert _run(capsys, "diagnose", a) == _run(capsys, "diagnose", "--model-dir", a)
    rc, out, _ = _run(capsys, "sync", a, "--from", b, "--json")
    assert rc == 0 and json.loads(out)["tensors_changed"] == 2
    assert _equal(_disk(a), _disk(b))


def test_recover_a_clean_directory_and_a_missing_one(dirs, tmp_path, capsys):
    a = dirs["A"]
    files = {p.name: p.read_bytes() for p in a.iterdir()}
    assert _run(capsys, "recover", a) == (0, f"{a}: nothing to recover\n", "")
    assert {p.name: p.read_bytes() for p in a.iterdir()} == files
    absent = tmp_path / "absent"
    assert _run(capsys, "recover", absent) == (1, "", f"error: {absent}: no such directory\n")
    assert not absent.exists()
    assert _run(capsys, "recover", "--model-dir", a, "-v") == (  # as sync and diagnose take it
        0, f"{a}: nothing to recover\n", "")


def test_recover_refuses_a_journal_that_no_longer_fits_its_files(dirs, capsys):
    a, b = dirs["A"], dirs["B"]
    patched = _interrupt(a, b, commit=True)[1]
    os.truncate(a / patched, 1000)  # e.g. another copy of the checkpoint put back
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a)  # says so, before recover
    assert rc == 1 and f"{a / patched}: not the file journal " in out
    assert "committed, and recover refuses it" in out and "run hotweights recover" not in out
    rc, out, err = _run(capsys, "recover", a)
    assert rc == 1 and out == ""
    assert err.startswith(f"error: {a}: cannot finish the interrupted sync, its journal is "
                          f"kept: {a / patched}: ")
    assert (a / journal.JOURNAL_NAME).exists()  # kept for a person to look at


def test_a_damaged_journal_is_a_problem_recover_and_sync_refuse(dirs, capsys):
    a, b = dirs["A"], dirs["B"]
    _interrupt(a, b, commit=True)
    path = a / journal.JOURNAL_NAME
    path.write_bytes(path.read_bytes()[:-3])  # the disk's doing, after the commit
    rc, out, _ = _run(capsys, "diagnose", "--model-dir", a)
    assert rc == 1 and "  journal         committed, and recover refuses it (see below)\n" in out
    assert f"{path}: a damaged journal (" in out and "run hotweights recover" not in out
    for argv in (["recover", a], ["sync", "--model-dir", a, "--from", b]):
        rc, out, err = _run(capsys, *argv)
        assert rc == 1 and "a damaged journal" in err and "Delete it, then sync" in err
    assert path.exists()
    path.unlink()
    assert _run(capsys, "sync", "--model-dir", a, "--from", b)[0] == 0
    assert _equal(_disk(a), _disk(b))


def test_ctrl_c_in_a_sync_is_one_line_and_exit_130_with_no_shard_of_two_versions(
        dirs, capsys, monkeypatch):
    a, b = dirs["A"], dirs["B"]
    replace = os.replace

    def ctrl_c_on_the_first_move(src, dst):
        if journal.STAGE_DIR in str(src):
            os.kill(os.getpid(), signal.SIGINT)
        replace(src, dst)
    monkeypatch.setattr(os, "replace", ctrl_c_on_the_first_move)
    rc, out, err = _run(capsys, "sync", "--model-dir", a, "--from", b)
    assert (rc, out, err) == (130, "", f"interrupted: {a} holds this sync, whole\n")
    monkeypatch.undo()
    finisher.finish()
    assert _equal(_disk(a), _disk(b))  # every shard the new version: the commit whole


@pytest.mark.parametrize("when", ["before the commit", "between commit and apply"])
def test_ctrl_c_in_a_sync_says_what_it_left(dirs, capsys, monkeypatch, when):
    a, b = dirs["A"], dirs["B"]
    before = _disk(a)
    if when == "before the commit":
        def ctrl_c(*args, **kwargs):
            raise KeyboardInterrupt
        monkeypatch.setattr(journal, "write_journal", ctrl_c)
        said = f"{a} is as it was: nothing was written"
    else:
        crash_point = journal._crash_point

        def ctrl_c(step, n=0):
            if step == "after-rename":
                raise KeyboardInterrupt
            crash_point(step, n)
        monkeypatch.setattr(journal, "_crash_point", ctrl_c)
        said = (f"{a}: the sync is committed but not applied or not durable: run hotweights "
                f"recover {a} (or sync again) before reading it")
    rc, out, err = _run(capsys, "sync", "--model-dir", a, "--from", b)
    assert (rc, out, err) == (130, "", f"interrupted: {said}\n")
    if when == "before the commit":  # a script reading stdout gets JSON all the same
        rc, out, err = _run(capsys, "sync", "--model-dir", a, "--from", b, "--json")
        assert (rc, json.loads(out), err) == (
            130, {"error": f"interrupted: {said}", "interrupted": True},
            f"interrupted: {said}\n")
    monkeypatch.undo()
    assert _equal(_disk(a), before)
    if when != "before the commit":
        assert _run(capsys, "recover", a)[0] == 0
        assert _equal(_disk(a), _disk(b))


def test_a_sync_whose_commit_cannot_be_made_durable_exits_1(dirs, capsys, monkeypatch):
    a, b = dirs["A"], dirs["B"]
    real = os.fsync

    def fsync(fd):
        if threading.current_thread().name == "hotweights-finish":
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    rc, out, err = _run(capsys, "sync", "--model-dir", a, "--from", b)
    monkeypatch.undo()
    assert rc == 1 and out == "" and err.endswith(
        f"error: {a}: the files hold this sync, but it could not be made durable ([Errno "
        f"5] Input/output error): its journal is kept; run hotweights recover {a} once the "
        "cause is fixed\n")
    assert _run(capsys, "recover", a)[0] == 0 and _equal(_disk(a), _disk(b))


def test_recover_is_a_light_command_and_a_library_function():
    code = ("import sys\nfrom hotweights.cli.main import main\n"
            "for argv in (['--help'], ['recover', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.endswith("False\n")
    assert "recover" in out and "finish or drop an interrupted sync" in out
    assert "Finish what a sync into DIR cut short" in out
    from hotweights.checkpoint import recover

    assert recover is journal.recover


def test_sync_recover_and_diagnose_are_functions_of_the_package():
    import hotweights
    import hotweights.checkpoint.incremental  # a submodule import must not shadow them
    from hotweights import checkpoint
    from hotweights.checkpoint import diagnose, recover, sync

    assert sync is checkpoint.incremental.sync is hotweights.sync and callable(sync)
    assert recover is journal.recover is hotweights.recover
    assert diagnose is checkpoint.diagnosis.diagnose is hotweights.diagnose


def test_open_dir_maps_without_copying_and_never_writes_back(dirs):
    b = dirs["B"]
    files = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in b.glob("*.safetensors")}
    tensors = open_dir(b)
    assert _equal(dict(tensors), _disk(b))
    disk = read_dir(b)
    at: dict[str, set[int]] = {}  # where each shard is mapped (from offset 0)
    with open("/proc/self/maps") as f:
        for line in f:
            if line.count(" ") >= 5 and ".safetensors" in line:
                at.setdefault(line.split(maxsplit=5)[5].strip(), set()).add(
                    int(line.split("-")[0], 16))
    for name, t in tensors.items():  # each tensor lies in its shard's mapping
        shard, info = disk[name]
        assert t.data_ptr() - info.begin in at[shard.path], name
    for t in tensors.values():
        t.fill_(1.0)
    assert tensors["model.norm.weight"].eq(1.0).all()
    del t
    tensors.close()
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files} == files


def test_open_dir_without_safetensors(tmp_path):
    with pytest.raises(CheckpointError, match=r"no safetensors checkpoint \(neither"):
        open_dir(tmp_path)


def test_warnings_the_command_restates_are_left_out_unless_verbose(caplog):
    import argparse
    import logging

    from hotweights.cli.checkpoint import _said_below

    log = logging.getLogger("hotweights.checkpoint.journal")
    log.warning("before")  # the logger's level cache filled: still obeyed below
    for verbose, seen in ((False, []), (True, ["said", "told"])):
        caplog.clear()
        with caplog.at_level(logging.INFO), _said_below(argparse.Namespace(verbose=verbose),
                                                        log.name):
            log.warning("said")
            log.info("told")
        assert [r.message for r in caplog.records] == seen


@pytest.mark.parametrize("command", ["sync", "diagnose"])
def test_from_a_source_holding_a_tensor_twice_is_refused(dirs, capsys, command):
    # its index names one copy, a loader of it takes the later file's: which is the source?
    a, b = dirs["A"], dirs["B"]
    index = json.loads((b / "model.safetensors.index.json").read_text())["weight_map"]
    first = index["model.norm.weight"]
    other = next(fn for fn in sorted(set(index.values())) if fn != first)
    stale = load_file(b / other) | {"model.norm.weight": torch.zeros_like(
        load_file(b / first)["model.norm.weight"])}
    save_file(stale, b / other, metadata={"format": "pt"})
    before = _disk(a)
    rc, out, err = _run(capsys, command, "--model-dir", a, "--from", b)
    assert (rc, out) == (1, "")
    assert err == (f"error: {b}: tensor model.norm.weight is in {first} (the index's) and in "
                   f"{other}: transformers and vLLM load both, the later file's last; remove "
                   "the stale copy\n")
    assert _equal(_disk(a), before)


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`hotweights diagnose DIR | head -1`: stdout's reader gone, the command ends as a
    shell's SIGPIPE-killed one would, with no traceback."""
    sync(tmp_path / "ck", {"w": torch.zeros(4)})
    r, w = os.pipe()
    os.close(r)  # the reader left before the command printed
    try:
        done = subprocess.run([sys.executable, "-m", "hotweights", "diagnose",
                               str(tmp_path / "ck")], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(w)
    assert done.returncode == 128 + signal.SIGPIPE and done.stderr == ""


def test_a_journal_that_cannot_be_read_is_named_by_diagnose_and_refused_by_sync(dirs, capsys):
    # not "no journal": a sync cut short may have left its shards half written
    a, b = dirs["A"], dirs["B"]
    for d in (a, b):
        os.symlink(journal.JOURNAL_NAME, d / journal.JOURNAL_NAME)  # ELOOP on open
    rc, out, _ = _run(capsys, "diagnose", b)
    assert rc == 1 and f"{b / journal.JOURNAL_NAME}: cannot read this sync journal" in out
    for argv in (("sync", "--model-dir", a, "--from", dirs["B"]),
                 ("diagnose", a, "--from", b)):
        rc, _, err = _run(capsys, *argv)
        assert rc == 1 and "cannot read this sync journal" in err and "Traceback" not in err


def test_sync_summary_counts_shards_not_tensors_and_gives_the_share_written(dirs, capsys):
    a = dirs["A"]
    rc, out, _ = _run(capsys, "sync", "--model-dir", a, "--from", dirs["B"])
    assert rc == 0
    shards = list(a.glob("*.safetensors"))
    assert f"  shards changed  2 of {len(shards)}: " in out  # 6 shards, not 21 tensors
    written, total, share = re.search(r"  written +([\d.]+) KiB of the shards' ([\d.]+) KiB "
                                      r"\(([\d.]+) %\)", out).groups()
    # the share of the bytes written, to the rounding of the two sizes printed
    low = 100 * (float(written) - 0.05) / (float(total) + 0.05)
    high = 100 * (float(written) + 0.05) / (float(total) - 0.05)
    assert low <= float(share) <= high, out


def test_sync_names_the_checkpoint_tensors_no_live_tensor_fills(dirs, tmp_path, capsys):
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    tensors = _disk(dirs["B"])
    del tensors["model.norm.weight"]
    save_file(tensors, fewer / "model.safetensors", metadata={"format": "pt"})
    before = _disk(dirs["A"])["model.norm.weight"]
    rc, out, _ = _run(capsys, "sync", "--model-dir", dirs["A"], "--from", fewer)
    assert rc == 0  # not an error: the file keeps what it held
    assert ("  no live source  1 checkpoint tensor kept as before: model.norm.weight\n"
            in out), out
    assert torch.equal(_disk(dirs["A"])["model.norm.weight"], before)


def test_sync_rows_name_the_live_aliases_stored_once(tmp_path):
    from hotweights.cli.checkpoint import sync_rows

    tied = torch.zeros(4, 4)
    live = {"embed.weight": tied, "lm_head.weight": tied}
    sync(tmp_path / "ck", live)  # a first save: one tensor stored
    result = sync(tmp_path / "ck", live)
    rows = dict(sync_rows(result, read_dir(tmp_path / "ck")))
    assert rows["tied"] == "1 live alias stored once: lm_head.weight"


def test_a_first_save_names_every_other_format_s_weights_left_beside_it(dirs, tmp_path,
                                                                       capsys):
    old = tmp_path / "old"
    old.mkdir()
    names = ["a.bin", "b.pt", "c.pth", "d.ckpt", "e.gguf"]
    for name in names:
        (old / name).write_bytes(b"x")
    rc, out, _ = _run(capsys, "sync", old, "--from", dirs["B"])
    assert rc == 0 and f"  left as is      {', '.join(names)}: weights in another " in out


def test_sync_lists_five_names_without_an_and_more(tmp_path, capsys):
    dst, src = tmp_path / "dst", tmp_path / "src"
    dst.mkdir(), src.mkdir()
    kept = {f"w{i}": torch.zeros(2) for i in range(5)}
    save_file(kept, dst / "model.safetensors")
    extra = {f"x{i}": torch.ones(2) for i in range(5)}  # no place in dst
    save_file({**kept, **extra}, src / "model.safetensors")
    rc, _, err = _run(capsys, "sync", dst, "--from", src)
    assert rc == 1 and err == (f"error: {dst}: 5 of the 10 live tensors not written, no shard "
                               "holds them: x0, x1, x2, x3, x4 (the wrong directory, or "
                               "another model's?)\n")


def test_diagnose_lists_ten_problems_without_an_and_more(tmp_path, capsys):
    dst, src = tmp_path / "dst", tmp_path / "src"
    dst.mkdir(), src.mkdir()
    save_file({f"w{i}": torch.zeros(2, dtype=torch.bfloat16) for i in range(10)},
              dst / "model.safetensors")
    save_file({f"w{i}": torch.zeros(2) for i in range(10)}, src / "model.safetensors")
    rc, out, _ = _run(capsys, "diagnose", dst, "--from", src)
    assert rc == 1 and out.count("  - ") == 10 and "more" not in out, out


def test_diagnose_names_the_filesystem_the_write_mode_and_the_sizes(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    save_file({"w": torch.zeros(256)}, ck / "model.safetensors")  # 1 KiB of tensor bytes
    d = json.loads(_run(capsys, "diagnose", ck, "--json")[1])
    rc, out, _ = _run(capsys, "diagnose", ck)
    assert rc == 0 and f"  filesystem      {d['fs_type']} at {d['mount']}\n" in out
    assert "  checkpoint      1 shard, 1 tensor, 1.0 KiB\n" in out
    save_file({}, ck / "model.safetensors")
    assert "  checkpoint      0 shards, 0 tensors, 0 B\n" in _run(capsys, "diagnose", ck)[1]


def test_diagnose_says_none_where_the_asked_write_mode_cannot_be_had(dirs, capsys):
    if clone.supports_reflink(dirs["A"])[0]:
        pytest.skip("tmp_path supports reflinks here")
    rc, out, _ = _run(capsys, "diagnose", dirs["A"], "--mode", "reflink")
    assert rc == 1 and re.search(r"^  write mode      none: .*does not support reflinks",
                                 out, re.M), out


def test_diagnose_shows_the_version_a_shard_s_sidecar_records(dirs, capsys):
    a = dirs["A"]
    assert _run(capsys, "sync", a, "--from", dirs["B"], "--weight-version", "7@run")[0] == 0
    out = _run(capsys, "diagnose", a)[1]
    assert out.count(f"sidecar fresh ({blocks.XXH3}; version 7@run)") == len(
        list(a.glob("*.safetensors")))


def test_diagnose_of_an_unreadable_shard_names_it(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 100)  # no safetensors header
    rc, out, _ = _run(capsys, "diagnose", tmp_path)
    assert rc == 1
    assert f"  checkpoint      unreadable: {tmp_path / 'model.safetensors'}: " in out


def test_diagnose_counts_live_names_placed_and_samples_those_left_over(dirs, tmp_path,
                                                                      capsys):
    # most live names under an unknown wrapper's prefix: a problem, and still counted
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    save_file({n if i % 3 == 0 else "base." + n: t
               for i, (n, t) in enumerate(sorted(_disk(dirs["B"]).items()))},
              wrapped / "model.safetensors", metadata={"format": "pt"})
    rc, out, _ = _run(capsys, "diagnose", dirs["A"], "--from", wrapped)
    assert rc == 1
    assert "  live            7 matched, 14 only live, 14 only on disk, 0 tied\n" in out
    assert re.search(r"^    only live: base\.\S+, .* and 9 more$", out, re.M), out
    assert re.search(r"^    only on disk: model\.\S+, .* and 9 more$", out, re.M), out


def test_recover_of_a_damaged_journal_says_once_that_it_is_kept(dirs, capsys):
    a = dirs["A"]
    _interrupt(a, dirs["B"], commit=True)
    path = a / journal.JOURNAL_NAME
    path.write_bytes(path.read_bytes()[:-3])
    rc, _, err = _run(capsys, "recover", a)
    assert rc == 1 and "a damaged journal" in err
    assert len(re.findall(r"\b(journal|it) is kept\b", err)) == 1, err


def test_recover_of_a_journal_it_cannot_read_is_one_line_naming_the_directory(tmp_path,
                                                                            capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    os.symlink(journal.JOURNAL_NAME, ck / journal.JOURNAL_NAME)  # a loop: ELOOP on open
    rc, out, err = _run(capsys, "recover", ck)
    assert (rc, out) == (1, "")
    assert err.startswith(f"error: {ck}: cannot finish the interrupted sync, its journal is "
                          f"kept: {ck / journal.JOURNAL_NAME}: cannot read this sync journal "
                          f"({os.strerror(errno.ELOOP)}); ")
    assert len(err.splitlines()) == 1


def test_recover_of_a_file_says_it_is_not_a_directory(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert _run(capsys, "recover", tmp_path / "afile") == (
        1, "", f"error: {tmp_path / 'afile'}: not a directory\n")
    assert (tmp_path / "afile").read_text() == "x"


def test_verbose_before_the_command_shows_the_library_s_warnings(dirs, capsys, caplog):
    a = dirs["A"]
    _interrupt(a, dirs["B"], commit=True)
    rc, out, _ = _run(capsys, "-v", "recover", a)  # as `recover DIR -v` would
    assert rc == 0 and out.startswith(f"{a}: replayed an interrupted sync")
    assert "replayed an interrupted journal" in caplog.text


def test_a_source_that_is_a_file_is_named_so(dirs, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    for command in ("sync", "diagnose"):
        rc, _, err = _run(capsys, command, "--model-dir", dirs["A"], "--from", tmp_path / "afile")
        assert (rc, err) == (1, f"error: {tmp_path / 'afile'}: not a directory\n")


def test_a_first_save_from_a_source_whose_config_json_is_no_object_leaves_it_out(dirs,
                                                                               tmp_path,
                                                                               capsys):
    src = shutil.copytree(dirs["B"], tmp_path / "src")
    (src / "config.json").write_text("[1]")  # not a model config
    rc, _, err = _run(capsys, "sync", tmp_path / "new", "--from", src)
    assert (rc, err) == (0, "")
    assert _equal(_disk(tmp_path / "new"), _disk(src))
    assert not (tmp_path / "new" / "config.json").exists()
