"""checkpoint.journal: SIGKILL at every step leaves every file all old or all new, together."""

import errno
import fcntl
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import xxhash

from hotweights.checkpoint import finisher, journal, lock, trash
from hotweights.errors import CheckpointError

SRC = str(Path(journal.__file__).resolve().parents[1])
NAMES = ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
         "model-00003-of-00003.safetensors")
SIZE, BLOCK, CHANGED = 64 << 10, 4096, 4  # per file: 16 blocks, 4 of them change

# The child skips hotweights/__init__ (torch) so each crash run starts in tens of ms.
CHILD = f"""
import json, sys, types
pkg = types.ModuleType("hotweights"); pkg.__path__ = [{SRC!r}]; sys.modules["hotweights"] = pkg
from hotweights.checkpoint import journal
d, new, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if len(sys.argv) > 4:
    print("ready", flush=True); sys.stdin.readline()
def patches():
    for name, off, n in spec:
        with open(f"{{new}}/{{name}}", "rb") as f:
            f.seek(off); yield name, off, f.read(n)
journal.write_journal(d, patches(), meta={{"version": 2}})
journal.apply(d)
"""


@pytest.fixture
def shards(tmp_path):
    """DIR with three old shards, NEW with the new versions, and the changed ranges."""
    rng = random.Random(12)
    d, new = tmp_path / "dir", tmp_path / "new"
    d.mkdir()
    new.mkdir()
    old, spec = {}, []
    for name in NAMES:
        data = bytearray(rng.randbytes(SIZE))
        old[name] = bytes(data)
        for b in sorted(rng.sample(range(SIZE // BLOCK), CHANGED)):
            block = slice(b * BLOCK, (b + 1) * BLOCK)
            data[block] = bytes(x ^ 0xFF for x in data[block])
            spec.append((name, b * BLOCK, BLOCK))
        (d / name).write_bytes(old[name])
        (new / name).write_bytes(data)
    return d, new, old, {n: (new / n).read_bytes() for n in NAMES}, spec


def _state(d, old, new) -> str:
    """'old' or 'new' when every file is that version; fails on a torn file or a mix."""
    states = set()
    for name in NAMES:
        data = (d / name).read_bytes()
        assert data in (old[name], new[name]), f"{name} is torn"
        states.add("old" if data == old[name] else "new")
    assert len(states) == 1, f"files mix versions: {states}"
    return states.pop()


def _run(d, new, spec, crash: str | None = None) -> int:
    env = dict(os.environ, HOTWEIGHTS_JOURNAL_CRASH_AT=crash or "")
    return subprocess.run([sys.executable, "-c", CHILD, str(d), str(new), json.dumps(spec)],
                          env=env, timeout=60).returncode


def _check_after_crash(d, old, new, spec) -> None:
    journal.recover(d)
    _state(d, old, new)
    assert not (d / journal.JOURNAL_NAME).exists()
    assert sorted(os.listdir(d)) == sorted(NAMES)
    # A following write + apply completes: write the old bytes back over every range.
    journal.write_journal(d, [(n, o, old[n][o:o + k]) for n, o, k in spec])
    assert journal.apply(d)
    assert _state(d, old, new) == "old"


N_REC = len(NAMES) * CHANGED
CRASHES = ([(f"record:{n}", "discarded", "old") for n in (0, 1, CHANGED, N_REC - 1)]
           + [("before-rename:0", "discarded", "old"), ("after-rename:0", "replayed", "new")]
           + [(f"apply:{k}", "replayed", "new") for k in (0, CHANGED - 1, CHANGED, N_REC - 1)]
           + [("before-unlink:0", "replayed", "new")])


@pytest.mark.parametrize(("crash", "outcome", "state"), CRASHES)
def test_sigkill_at_each_step(shards, crash, outcome, state):
    d, new_dir, old, new, spec = shards
    assert _run(d, new_dir, spec, crash) == -signal.SIGKILL
    if state == "new":
        assert journal.pending(d) == {"version": 2}
    got = journal.recover(d)
    assert got == outcome
    assert _state(d, old, new) == state
    assert journal.recover(d) == "none"
    _check_after_crash(d, old, new, spec)


@pytest.mark.parametrize("written", ["a prefix", "every other page"])
def test_a_patch_cut_inside_is_replayed(shards, written):
    """A write cut short (a kill or a full disk inside the apply's one pwrite of a patch:
    the kernel stops at a page boundary) or a power loss during the apply (pages reach the
    disk in any order) leaves a patch part new, part old, page by page: `recover` checks
    each page as the old bytes or the new ones, and finishes the patch."""
    d, new_dir, old, new, _ = shards
    name, lo, hi = NAMES[0], 100, SIZE - 100  # one patch over most of the file, unaligned
    assert _run(d, new_dir, [(name, lo, hi - lo)], "after-rename:0") == -signal.SIGKILL
    torn = bytearray(old[name])
    cuts = list(range(lo, hi, journal.PAGE)) if lo % journal.PAGE == 0 else [lo, *range(
        lo - lo % journal.PAGE + journal.PAGE, hi, journal.PAGE)]
    pieces = list(zip(cuts, [*cuts[1:], hi], strict=True))
    assert len(pieces) > 4 and all(b % journal.PAGE == 0 for _, b in pieces[:-1])
    for i, (a, b) in enumerate(pieces):
        if (i < len(pieces) // 2) if written == "a prefix" else i % 2 == 0:
            torn[a:b] = new[name][a:b]
    (d / name).write_bytes(torn)
    assert journal.recover(d) == "replayed"
    assert (d / name).read_bytes() == old[name][:lo] + new[name][lo:hi] + old[name][hi:]
    (d / name).write_bytes(old[name])  # a copy of the old file put back: still refused
    assert _run(d, new_dir, [(name, lo, hi - lo)], "after-rename:0") == -signal.SIGKILL
    torn = bytearray(old[name])
    torn[lo + journal.PAGE:lo + journal.PAGE + 8] = b"\0" * 8  # neither old nor new there
    (d / name).write_bytes(torn)
    with pytest.raises(CheckpointError, match=rf"{name}: not the file journal .* was "
                       rf"committed for \(its bytes at offset {journal.PAGE}"):
        journal.recover(d)


def test_uncrashed_run_writes_new(shards):
    d, new_dir, old, new, spec = shards
    assert _run(d, new_dir, spec) == 0
    assert _state(d, old, new) == "new"
    assert journal.recover(d) == "none"


def test_sigkill_at_random_times(shards):
    d, new_dir, old, new, spec = shards
    rng = random.Random(7)
    cmd = [sys.executable, "-c", CHILD, str(d), str(new_dir), json.dumps(spec), "wait"]
    seen = set()
    for _ in range(8):
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "ready\n"
        p.stdin.write("go\n")
        p.stdin.flush()
        time.sleep(rng.uniform(0, 0.03))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        journal.recover(d)
        seen.add(_state(d, old, new))
        _check_after_crash(d, old, new, spec)
    assert seen  # which states the kills hit depends on the disk's speed


def _committed(d, old, spec, new):
    journal.write_journal(d, [(n, o, new[n][o:o + k]) for n, o, k in spec], meta={"v": 3})
    return d / journal.JOURNAL_NAME


def _corrupt_truncate(p):
    p.write_bytes(p.read_bytes()[:-5])


def _corrupt_flip(p):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 1
    p.write_bytes(data)


def _corrupt_magic(p):
    p.write_bytes(b"XXJRNL\r\n" + p.read_bytes()[8:])


def _corrupt_empty(p):
    p.write_bytes(b"")


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_magic,
                                     _corrupt_empty])
def test_a_damaged_journal_is_kept_and_refused(shards, corrupt):
    # whole when committed (written and fsync'd, then renamed): damaged since, by the disk
    # or a person, after an apply may have begun; dropping it could leave a torn shard
    d, _, old, new, spec = shards
    path = _committed(d, old, spec, new)
    corrupt(path)
    damaged = path.read_bytes()
    assert "a damaged journal" in journal.inspect(d)[1]
    for refused in (journal.apply, journal.recover, journal.pending):  # not None: "none"
        with pytest.raises(CheckpointError, match=r"a damaged journal .*it is kept and "
                           "nothing was done. Delete it, then sync the directory again"):
            refused(d)
    assert _state(d, old, new) == "old" and path.read_bytes() == damaged
    path.unlink()
    assert journal.recover(d) == "none" and journal.inspect(d) == (None, None)


def test_a_journal_of_an_unknown_format_is_kept(shards):
    # a later version's journal, after a downgrade: discarding it could leave torn shards
    d, _, old, new, spec = shards
    _staged(d, new, NAMES[0])
    journal.write_journal(d, [(n, o, new[n][o:o + k]) for n, o, k in spec if n != NAMES[0]],
                          moves=[NAMES[0]])
    path = d / journal.JOURNAL_NAME
    data = bytearray(path.read_bytes())
    data[8:12] = (99).to_bytes(4, "little")
    path.write_bytes(data)
    match = (f"{path}: a journal of format 99; this version of hotweights knows formats "
             "1, 2, 3. Finish it with the hotweights version that wrote it")
    for call in (journal.pending, journal.apply, journal.recover):
        with pytest.raises(CheckpointError, match=match):
            call(d)
    assert path.read_bytes() == data and (d / journal.STAGE_DIR / NAMES[0]).exists()
    assert _state(d, old, new) == "old"


def test_leftover_temporary_is_discarded(shards):
    d, _, old, new, spec = shards
    (d / (journal.JOURNAL_NAME + ".tmp")).write_bytes(b"HWJRNL\r\npartial")
    assert journal.recover(d) == "discarded"
    assert sorted(os.listdir(d)) == sorted(NAMES)


def test_replaced_file_is_freed_after_the_commit(shards, monkeypatch):
    d, _, old, new, spec = shards
    stage = d / journal.STAGE_DIR
    stage.mkdir()
    (stage / NAMES[0]).write_bytes(new[NAMES[0]])
    ino = (d / NAMES[0]).stat().st_ino
    freed = []
    monkeypatch.setattr(trash, "wait", lambda: None)  # sweep by hand, below
    monkeypatch.setattr(trash, "sweep", lambda d, background: freed.append(background))
    journal.write_journal(d, [], moves=[NAMES[0]])
    assert journal.apply(d) and freed == [True]
    kept = d / trash.TRASH_DIR / NAMES[0]
    assert (d / NAMES[0]).read_bytes() == new[NAMES[0]]
    assert kept.stat().st_ino == ino and kept.read_bytes() == old[NAMES[0]]
    monkeypatch.undo()
    stage.rmdir()  # empty: what `stage.commit` removes
    assert journal.recover(d) == "none" and not kept.parent.exists()  # a leftover trash
    trash.sweep(str(d), background=True)  # nothing to sweep: no thread
    (d / trash.TRASH_DIR).mkdir()
    (d / trash.TRASH_DIR / "x").write_bytes(b"x")
    trash.sweep(str(d), background=True)
    finisher.finish()  # waits for the sweeper too
    assert sorted(os.listdir(d)) == sorted(NAMES)


def test_replay_twice_is_harmless_and_meta_kept(shards, tmp_path):
    d, _, old, new, spec = shards
    path = _committed(d, old, spec, new)
    assert journal.pending(d) == {"v": 3}
    shutil.copy(path, tmp_path / "copy")
    assert journal.apply(d)
    shutil.copy(tmp_path / "copy", path)
    assert journal.apply(d)
    assert _state(d, old, new) == "new"
    assert not journal.apply(d)


def test_pending_journal_refuses_a_new_one(shards):
    d, _, old, new, spec = shards
    _committed(d, old, spec, new)
    with pytest.raises(CheckpointError, match="committed journal is pending"):
        _committed(d, old, spec, new)


def test_stale_journal_is_refused(shards):
    d, _, old, new, spec = shards
    _committed(d, old, spec, new)
    os.truncate(d / NAMES[2], 100)
    with pytest.raises(CheckpointError, match=f"{NAMES[2]}: not the file journal .* was "
                       "committed for \\(size differ: 65536 then, 100 now\\)"):
        journal.apply(d)


def _safetensors_like(d: Path, name: str, header: bytes) -> None:
    """Give `name` a safetensors-shaped header (length, JSON), keeping its size."""
    data = bytearray((d / name).read_bytes())
    data[:8 + len(header)] = len(header).to_bytes(8, "little") + header
    (d / name).write_bytes(data)


def test_a_write_that_fails_half_way_through_an_apply_names_the_file_and_recover(
        shards, monkeypatch):
    """A full disk (a shard's blocks shared with a reflinked copy) half way through: the
    error names the file, says the journal is kept, and `recover` finishes the sync."""
    d, _, old, new, spec = shards
    real, calls = journal.write_all, []

    def full_at_the_third(fd, view, offset=None):
        calls.append(offset is not None)  # a patch of a shard, not the journal's own write
        if sum(calls) == 3 and calls[-1]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, view, offset)
    monkeypatch.setattr(journal, "write_all", full_at_the_third)
    with lock.locked(d):
        journal.write_journal(d, [(n, o, new[n][o:o + k]) for n, o, k in spec])
        third = spec[2][0]
        with pytest.raises(CheckpointError, match=re.escape(
                f"{d / third}: No space left on device while applying the committed journal "
                f"{d / journal.JOURNAL_NAME}: the files may hold part of the sync (this one "
                "perhaps half written); the journal is kept: once the cause is fixed, run "
                f"hotweights recover {d}")):
            journal.apply(d)
    monkeypatch.undo()
    assert journal.recover(d) == "replayed"
    assert _state(d, old, new) == "new"


@pytest.mark.parametrize("how", ["copied back", "other header"])
def test_a_committed_journal_is_not_replayed_onto_another_file(shards, tmp_path, how):
    # a checkpoint copied back after a crash (same bytes, another inode), or another
    # checkpoint of the same size in its place: replaying would mix them, silently
    d, _, old, new, spec = shards
    for name in NAMES:
        _safetensors_like(d, name, b'{"a": 1}')
    old = {n: (d / n).read_bytes() for n in NAMES}
    _committed(d, old, [(n, o, k) for n, o, k in spec if o >= BLOCK], new)
    if how == "copied back":
        shutil.copy(d / NAMES[1], tmp_path / "copy")
        os.replace(tmp_path / "copy", d / NAMES[1])
        match = "ino differ"
    else:
        _safetensors_like(d, NAMES[1], b'{"b": 2}')
        match = "header differ"
    before = {n: (d / n).read_bytes() for n in NAMES}
    with pytest.raises(CheckpointError, match=f"{NAMES[1]}: not the file journal .*{match}"):
        journal.recover(d)
    assert {n: (d / n).read_bytes() for n in NAMES} == before  # nothing written, anywhere
    assert (d / journal.JOURNAL_NAME).exists()  # kept for a person to look at


def _staged(d: Path, new: dict, *names: str) -> None:
    """Stage the new versions of `names`, as a sync does before its journal moves them."""
    (d / journal.STAGE_DIR).mkdir(exist_ok=True)
    for name in names:
        (d / journal.STAGE_DIR / name).write_bytes(new.get(name, b"new"))


@pytest.mark.parametrize("how", ["copied back", "other header", "a new file"])
def test_a_committed_move_is_not_replayed_onto_another_file(shards, tmp_path, how):
    # the default modes commit by moves alone: a checkpoint put back after a crash, before
    # the moves, must not be replaced by them either
    d, _, old, new, spec = shards
    _safetensors_like(d, NAMES[1], b'{"a": 1}')
    name = "extra.safetensors" if how == "a new file" else NAMES[1]
    _staged(d, new, NAMES[0], name)
    journal.write_journal(d, [], moves=[NAMES[0], name])
    if how == "copied back":
        shutil.copy(d / name, tmp_path / "copy")
        os.replace(tmp_path / "copy", d / name)
        match = "ino differ"
    elif how == "other header":
        _safetensors_like(d, name, b'{"b": 2}')
        match = "header differ"
    else:
        (d / name).write_bytes(b"put there since")
        match = "there was no file then"
    before = {n: (d / n).read_bytes() for n in {*NAMES, name}}
    with pytest.raises(CheckpointError, match=f"{name}: not the file journal .*{match}"):
        journal.recover(d)
    assert {n: (d / n).read_bytes() for n in before} == before  # the first move not done
    assert (d / journal.JOURNAL_NAME).exists()
    assert sorted(os.listdir(d / journal.STAGE_DIR)) == sorted([NAMES[0], name])


def test_a_move_of_a_new_file_replays(shards):
    d, _, old, new, spec = shards
    _staged(d, new, "extra.safetensors")
    journal.write_journal(d, [], moves=["extra.safetensors"])
    assert journal.recover(d) == "replayed"
    assert (d / "extra.safetensors").read_bytes() == b"new"


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_journal_of_an_older_format_still_replays(shards, fmt):
    # format 1: moves without the staged file's identity; 2: without the target's
    d, _, old, new, spec = shards
    _staged(d, new, NAMES[0])
    st = (d / journal.STAGE_DIR / NAMES[0]).stat()
    raw = NAMES[0].encode()
    body = (journal._HEAD.pack(journal._MAGIC, fmt, 2) + b"{}"
            + journal._REC.pack(b"M", len(raw), *((st.st_ino, st.st_size) if fmt == 2
                                                   else (0, 0))) + raw)
    (d / journal.JOURNAL_NAME).write_bytes(
        body + journal._COMMIT.pack(b"C", 1, xxhash.xxh3_64_intdigest(body)))
    assert journal.pending(d) == {}
    assert journal.recover(d) == "replayed"
    assert (d / NAMES[0]).read_bytes() == new[NAMES[0]]


def test_a_patch_into_a_safetensors_header_is_refused(shards):
    d, _, old, new, spec = shards
    _safetensors_like(d, NAMES[0], b'{"a": 1}' + b" " * 100)
    with pytest.raises(CheckpointError, match="falls in the safetensors header"):
        journal.write_journal(d, [(NAMES[0], 8, b"x")])
    assert not (d / journal.JOURNAL_NAME).exists()


def test_a_lost_staged_file_is_never_taken_as_moved(shards):
    # a power loss after the commit can lose a staged entry whose directory was never
    # fsync'd: the old file in place must not pass for the moved one
    d, _, old, new, spec = shards
    stage = d / journal.STAGE_DIR
    stage.mkdir()
    (stage / NAMES[0]).write_bytes(new[NAMES[0]])
    journal.write_journal(d, [], moves=[NAMES[0]])
    (stage / NAMES[0]).unlink()
    with pytest.raises(CheckpointError, match=f"{NAMES[0]}: the staged file is lost"):
        journal.recover(d)
    assert (d / NAMES[0]).read_bytes() == old[NAMES[0]]
    assert (d / journal.JOURNAL_NAME).exists()


def test_every_move_is_checked_before_the_first(shards):
    # a lost staged file found only when its turn comes would leave the moves before it
    # done: shards of two versions
    d, _, old, new, spec = shards
    _staged(d, new, *NAMES)
    journal.write_journal(d, [], moves=list(NAMES))
    (d / journal.STAGE_DIR / NAMES[2]).unlink()
    with pytest.raises(CheckpointError, match=f"{NAMES[2]}: the staged file is lost"):
        journal.recover(d)
    assert _state(d, old, new) == "old"
    assert sorted(os.listdir(d / journal.STAGE_DIR)) == sorted(NAMES[:2])


@pytest.mark.parametrize("wait", [True, False])
def test_ctrl_c_during_the_apply_is_raised_once_every_file_holds_the_commit(
        shards, monkeypatch, wait):
    # a KeyboardInterrupt between two renames would leave shards of two versions
    d, _, old, new, spec = shards
    _staged(d, new, *NAMES)
    journal.write_journal(d, [], moves=list(NAMES))
    replace, handler = os.replace, signal.getsignal(signal.SIGINT)

    def ctrl_c_on_the_first(src, dst):
        if os.path.basename(dst) == NAMES[0]:
            os.kill(os.getpid(), signal.SIGINT)
        replace(src, dst)
    monkeypatch.setattr(os, "replace", ctrl_c_on_the_first)
    with pytest.raises(KeyboardInterrupt):
        journal.apply(d, wait=wait)
    monkeypatch.undo()
    finisher.finish()  # the commit made durable all the same, its journal removed
    assert _state(d, old, new) == "new" and not (d / journal.JOURNAL_NAME).exists()
    assert journal.recover(d) == "none"
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_move_already_done_is_recognised_by_its_identity(shards):
    d, _, old, new, spec = shards
    stage = d / journal.STAGE_DIR
    stage.mkdir()
    (stage / NAMES[0]).write_bytes(new[NAMES[0]])
    journal.write_journal(d, [], moves=[NAMES[0]])
    os.replace(stage / NAMES[0], d / NAMES[0])  # a replay cut short after this rename
    assert journal.recover(d) == "replayed"
    assert (d / NAMES[0]).read_bytes() == new[NAMES[0]]


def test_the_stage_directory_is_fsynced_before_the_commit(shards, monkeypatch):
    d, _, old, new, spec = shards
    stage = d / journal.STAGE_DIR
    stage.mkdir()
    (stage / NAMES[0]).write_bytes(new[NAMES[0]])
    synced = []
    real = journal.fsync_dir
    monkeypatch.setattr(journal, "fsync_dir", lambda p: (synced.append(
        (p, (d / journal.JOURNAL_NAME).exists())), real(p)))
    journal.write_journal(d, [], moves=[NAMES[0]])
    assert synced[0] == (str(stage), False)  # before the journal's rename


@pytest.mark.parametrize(("patch", "match"), [
    (("missing.safetensors", 0, b"x"), r"missing.safetensors: patch target does not exist"),
    ((NAMES[0], SIZE - 1, b"xy"), rf"{NAMES[0]}: patch at offset {SIZE - 1} of 2 bytes"),
    ((NAMES[0], -1, b"x"), rf"{NAMES[0]}: patch at offset -1"),
    (("../x", 0, b"x"), r"'\.\./x': a patch target must be a plain file name"),
    (("/etc/passwd", 0, b"x"), r"'/etc/passwd': a patch target"),
    (("sub/x", 0, b"x"), r"'sub/x': a patch target"),
    (("..", 0, b"x"), r"'\.\.': a patch target"),
    ((journal.JOURNAL_NAME, 0, b"x"), r"a patch target must be a plain file name"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_patch_writes_nothing(shards, patch, match, stream):
    d, _, old, new, spec = shards
    good = [(n, o, new[n][o:o + k]) for n, o, k in spec[:3]]
    patches = good + [patch] + good
    with pytest.raises(CheckpointError, match=match):
        journal.write_journal(d, iter(patches) if stream else patches)
    assert sorted(os.listdir(d)) == sorted(NAMES)
    assert _state(d, old, new) == "old"


def test_free_space_checked_before_writing(shards, monkeypatch):
    d, _, old, new, spec = shards
    monkeypatch.setattr(journal.shutil, "disk_usage",
                        lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    with pytest.raises(CheckpointError, match=rf"{d}: the journal needs \d+ bytes, only 1000 "
                       r"are free; nothing was written: free \d+ bytes more$"):
        journal.write_journal(d, [(n, o, new[n][o:o + k]) for n, o, k in spec])
    assert sorted(os.listdir(d)) == sorted(NAMES)


def _mount(args: list[str], target) -> bool:
    return subprocess.run(["mount", *args, str(target)], capture_output=True).returncode == 0


def test_disk_full_while_streaming(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    if not _mount(["-t", "tmpfs", "-o", "size=256k", "tmpfs"], d):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        (d / "a").write_bytes(bytes(64 << 10))
        patches = ((("a", 0, bytes(64 << 10))) for _ in range(8))  # 512 KiB > 192 free
        with pytest.raises(CheckpointError, match=rf"{d}: out of space writing the journal "
                           r"after \d+ bytes of patches; nothing was written"):
            journal.write_journal(d, patches)
        assert os.listdir(d) == ["a"]
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_read_only_directory_named(shards):
    d, _, old, new, spec = shards
    if not (_mount(["--bind", str(d)], d) and _mount(["-o", "remount,ro,bind"], d)):
        subprocess.run(["umount", str(d)], capture_output=True)
        pytest.skip("cannot make a read-only bind mount here (needs root / CAP_SYS_ADMIN)")
    try:
        with pytest.raises(CheckpointError, match=rf"{d}: cannot write the journal: Read-only "
                           "file system; nothing was written"):
            journal.write_journal(d, [(n, o, new[n][o:o + k]) for n, o, k in spec])
    finally:
        subprocess.run(["umount", str(d)], check=True)
    assert _state(d, old, new) == "old"


def test_a_writer_applies_its_own_journal_without_reading_it_back(shards, monkeypatch):
    d, _, old, new, spec = shards
    _committed(d, old, spec, new)
    read = []
    monkeypatch.setattr(journal, "_scan", lambda p: read.append(p) or 1 / 0)
    assert journal.apply(d, mine=True) and read == []
    assert _state(d, old, new) == "new"


def test_a_journal_replaced_since_it_was_written_is_read_back(shards):
    d, _, old, new, spec = shards
    path = _committed(d, old, spec, new)
    other = path.with_name("other")  # a new file at the path: never trusted
    other.write_bytes(path.read_bytes())
    _corrupt_flip(other)
    os.replace(other, path)
    with pytest.raises(CheckpointError, match="a damaged journal"):
        journal.apply(d, mine=True)
    assert _state(d, old, new) == "old"


def test_held_says_whether_a_writer_holds_the_lock(tmp_path):
    assert not lock.held(tmp_path)
    with lock.locked(tmp_path):
        assert lock.held(tmp_path)  # another open file description: a conflict
    assert not lock.held(tmp_path)
    assert not lock.held(tmp_path / "nowhere")


def test_a_child_forked_under_the_lock_does_not_keep_it(tmp_path):
    """A child forked during a sync (a DataLoader worker) shares the lock's open file
    description: leaving `locked` frees the lock all the same while the child lives on."""
    with lock.locked(tmp_path):
        pid = os.fork()
        if pid == 0:  # the child: keeps the parent's fds until killed, never returns
            try:
                time.sleep(30)
            finally:
                os._exit(0)
    try:
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # still alive
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:  # not blocking: a lock the child kept fails here at once, never hangs
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_writer_waiting_for_another_says_so_and_one_alone_says_nothing(shards, caplog):
    d, _, old, new, spec = shards
    for _ in range(3):  # as syncs do: each one's finisher thread takes its lock over
        with lock.locked(d):
            journal.write_journal(d, [(NAMES[0], 0, b"x")])
            journal.apply(d, wait=False)
    finisher.finish()
    assert "another writer" not in caplog.text
    held, go = threading.Event(), threading.Event()

    def other_writer():
        with lock.locked(d, finish_first=False):
            held.set()
            go.wait(60)  # set once this writer waits for it
    t = threading.Thread(target=other_writer)
    t.start()
    assert held.wait(60)

    class Waiting(logging.Handler):  # the other writer lets go once this one waits for it
        def emit(self, record):
            if "waiting for it" in record.getMessage():
                go.set()
    handler = Waiting()
    logging.getLogger("hotweights.checkpoint.lock").addHandler(handler)
    try:
        assert journal.recover(d) == "none"  # waited for it
    finally:
        logging.getLogger("hotweights.checkpoint.lock").removeHandler(handler)
        go.set()
    t.join()
    assert caplog.text.count(f"{d}: another writer holds the directory; waiting for it") == 1


WRITER = """
import logging, os, sys, threading, time
import torch
from hotweights.checkpoint import finisher, sync
logging.basicConfig(level=logging.INFO)
real, waiting = os.fsync, sys.argv[1] + ".waiting"
def slow(fd):  # the commit's fsyncs in the finisher thread last until the test's writer
    if threading.current_thread().name == "hotweights-finish":  # waits for them
        deadline = time.monotonic() + 60
        while not os.path.exists(waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
    return real(fd)
os.fsync = slow
live = {"w": torch.full((256, 256), 2.0)}
sync(sys.argv[1], live, mode="journal")  # patched in place: the files' fsyncs to wait for
print("committed", flush=True)
finisher.finish()
"""


def test_a_second_writer_waits_for_the_first_one_s_commit_to_be_durable(tmp_path, caplog):
    """The commit's fsyncs, the journal's removal and the sidecars run behind the sync, in
    its process's finisher thread, under the lock the sync held: another process's
    writer waits for them, never replays a journal whose writer lives (as if it had
    crashed) and never keeps that writer from recording its sidecars."""
    import torch

    from hotweights.checkpoint import sync

    d = tmp_path / "ckpt"
    sync(d, {"w": torch.full((256, 256), 1.0)})
    finisher.finish()

    class Waiting(logging.Handler):  # lets the writer's fsyncs end once this one waits
        def emit(self, record):
            if "waiting for it" in record.getMessage():
                Path(f"{d}.waiting").touch()

    handler = Waiting()
    logging.getLogger("hotweights.checkpoint.lock").addHandler(handler)
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(d)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "committed\n"
        sync(d, {"w": torch.full((256, 256), 3.0)})  # while the writer's fsyncs go on
        finisher.finish()
    finally:
        logging.getLogger("hotweights.checkpoint.lock").removeHandler(handler)
        out, err = child.communicate(timeout=90)
    assert child.returncode == 0, err
    assert "replayed an interrupted journal" not in caplog.text
    assert "removed before this process could" not in err and "sidecar" not in err
    assert "another writer holds the directory; waiting for it" in caplog.text


# Forks a child that lives on, off the parent's pipes (the test reads them to their end).
# The child prints its pid: once the test reads it, the child's at-fork hooks have run.
FORK = """
if os.fork() == 0:
    print(os.getpid(), flush=True)
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)
    os.dup2(1, 2)
    time.sleep(60)
    os._exit(0)
"""
# A writer that holds the lock (and has handed it to its finisher), forks a child that lives
# on, then dies by SIGKILL (the OOM killer); light imports, as CHILD.
KILLED_WRITER = f"""
import os, signal, sys, time, types
pkg = types.ModuleType("hotweights"); pkg.__path__ = [{SRC!r}]; sys.modules["hotweights"] = pkg
from hotweights.checkpoint import lock
with lock.locked(sys.argv[1]):
    kept = lock.hand_over(sys.argv[1])
{textwrap.indent(FORK, "    ")}
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_child_forked_by_a_writer_that_dies_does_not_keep_the_lock(tmp_path):
    """The child closes its copies of the lock's fds (`lock._after_fork`): once the writer
    is dead, the lock is free although the child lives on."""
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    child = int(done.stdout)
    try:
        os.kill(child, 0)  # alive
        assert not lock.held(tmp_path)
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_writer_whose_directory_is_removed_while_it_waits_says_so(tmp_path):
    """A failed first save removes the directory it made, under its lock: a writer that
    waited for that lock is told, not left to fail on a missing path."""
    d = tmp_path / "new"
    d.mkdir()
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    failed = []

    def wait():
        try:
            with lock.locked(d, finish_first=False):
                pass
        except CheckpointError as e:
            failed.append(str(e))
    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 30  # until the waiter has its fd (it then waits, or is
    while not any(h.directory == os.path.realpath(d) for h in lock._held):  # about to)
        assert time.monotonic() < deadline and waiter.is_alive()
        time.sleep(0.01)
    d.rmdir()
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    waiter.join(60)
    assert failed == [f"{d}: removed while this writer waited for its lock (a sync that had "
                      "made it failed): nothing was written; run it again"]


WAITING_WRITER = f"""
import os, signal, sys, threading, time, types
pkg = types.ModuleType("hotweights"); pkg.__path__ = [{SRC!r}]; sys.modules["hotweights"] = pkg
from hotweights.checkpoint import lock
got, opened, real_open = threading.Event(), threading.Event(), os.open
def slow_open(*args):  # "between": the writer's thread is slow to go on once it has its fd
    fd = real_open(*args)
    if threading.current_thread() is not threading.main_thread():
        opened.set()
        time.sleep(0.5)
    return fd
if sys.argv[2] == "between":
    os.open = slow_open
def write():
    with lock.locked(sys.argv[1], finish_first=False):
        got.set()
        time.sleep(60)
threading.Thread(target=write, daemon=True).start()
if sys.argv[2] == "between":  # fork between the writer's open and its listing of the fd
    assert opened.wait(30)
deadline = time.monotonic() + 30
while sys.argv[2] == "waiting" and not lock._held:  # the writer waits for the test's lock
    assert time.monotonic() < deadline
    time.sleep(0.01)
{FORK}
got.wait(30)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("when", ["waiting", "between"])
def test_a_child_forked_while_a_writer_waits_for_the_lock_does_not_keep_it(tmp_path, when):
    """A fork while a writer waits: the child closes its copy of the fd the writer then
    locks (`_after_fork` knows it from the start), so the writer's death frees the lock.
    A fork the moment the writer opened its fd waits until the fd is listed."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    writer = subprocess.Popen([sys.executable, "-c", WAITING_WRITER, str(tmp_path), when],
                              stdout=subprocess.PIPE, text=True)
    child = int(writer.stdout.readline())
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        assert writer.wait(timeout=60) == -signal.SIGKILL
        os.kill(child, 0)  # alive
        assert not lock.held(tmp_path)
    finally:
        os.kill(child, signal.SIGKILL)
        writer.stdout.close()


def test_a_ctrl_c_while_a_fork_waits_for_a_writer_s_listing_is_kept_for_after_it(monkeypatch):
    """The fork hook's wait is cut by a Ctrl-C: an exception there would be dropped (and the
    fork go on unguarded, then release a lock another thread holds); it waits on, and the
    Ctrl-C comes once the fork is done."""
    class Interrupted:
        def __init__(self):
            self.calls, self.held = 0, 0

        def acquire(self):
            self.calls += 1
            if self.calls == 1:
                raise KeyboardInterrupt
            self.held += 1

        def release(self):
            self.held -= 1
    guard, interrupts = Interrupted(), []
    monkeypatch.setattr(lock, "_registering", guard)
    monkeypatch.setattr(lock._thread, "interrupt_main", lambda: interrupts.append(1))
    lock._before_fork()
    assert (guard.calls, guard.held, interrupts) == (2, 1, [1])
    lock._after_fork_in_parent()
    lock._after_fork_in_parent()  # a second call (no fork of its own): nothing to release
    assert guard.held == 0


def test_with_no_thread_to_be_had_the_finisher_s_work_runs_at_once(shards, monkeypatch):
    d, _, old, new, spec = shards
    start = threading.Thread.start

    def refuse(self):
        if self.name == "hotweights-finish":
            raise RuntimeError("can't start new thread")  # a limit on threads
        start(self)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    ran = []
    with lock.locked(d):
        journal.write_journal(d, [(n, o, new[n][o:o + k]) for n, o, k in spec])
        journal.apply(d, wait=False, mine=True)
        lock.later(d, lambda: ran.append(lock.held(d)))
        assert not (d / journal.JOURNAL_NAME).exists()  # fsync'd and removed already
        assert ran == [True]  # under the lock, handed over
    assert _state(d, old, new) == "new"
    assert not lock.held(d)  # the lock handed over was let go


# A commit from an atexit handler ("save on exit"): the interpreter no longer waits for a
# thread started then, and its thread pools take no work.
AT_EXIT = f"""
import atexit, json, sys, types
pkg = types.ModuleType("hotweights"); pkg.__path__ = [{SRC!r}]; sys.modules["hotweights"] = pkg
from hotweights.checkpoint import journal, lock
d, new, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
def save():
    patches = []
    for name, off, n in spec:
        with open(f"{{new}}/{{name}}", "rb") as f:
            f.seek(off); patches.append((name, off, f.read(n)))
    with lock.locked(d):
        journal.write_journal(d, patches)
        journal.apply(d, wait=False, mine=True)
atexit.register(save)
"""


# A commit at the end of a script: its finisher thread fsyncs while the interpreter shuts
# down, its thread pools closed (here while it waits for a pool's worker) and the main
# thread not yet ended.
AT_END = AT_EXIT.replace("atexit.register(save)", """
import concurrent.futures, time
concurrent.futures.ThreadPoolExecutor(1).submit(time.sleep, 1.5)  # the exit waits for it
real = journal._fsync_all
journal._fsync_all = lambda fds: (time.sleep(0.5), real(fds))[1]  # fsync'd meanwhile
save()
""")


@pytest.mark.parametrize("script", [AT_EXIT, AT_END], ids=["atexit", "end-of-script"])
def test_a_commit_at_interpreter_exit_is_made_durable_before_it_ends(shards, script):
    d, new, old, new_bytes, spec = shards
    done = subprocess.run([sys.executable, "-c", script, str(d), str(new), json.dumps(spec)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr, done.stderr
    assert not (d / journal.JOURNAL_NAME).exists()
    assert _state(d, old, new_bytes) == "new"


def test_a_commit_not_made_durable_is_reported_however_the_directory_is_written(
        shards, monkeypatch):
    d, _, old, new, spec = shards

    def fail(fds):
        for fd in fds:
            os.close(fd)
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(journal, "_fsync_all", fail)
    with lock.locked(d):
        journal.write_journal(d, [(n, o, new[n][o:o + k]) for n, o, k in spec])
        journal.apply(f"{d}/", wait=False, mine=True)  # as typed: a trailing slash
    finisher.finish()
    for name in (d, f"{d}/", f"{d}/../{d.name}"):
        assert "Input/output error" in journal.not_durable(name)
    assert (d / journal.JOURNAL_NAME).exists()  # kept: replayed by the next writer
    monkeypatch.undo()
    assert journal.recover(d) == "replayed" and _state(d, old, new) == "new"


def test_a_filesystem_without_flock_on_directories_is_named(tmp_path, monkeypatch):
    """NFS emulates flock with POSIX locks, which a directory (opened read-only) cannot
    take: a CheckpointError names the directory, and no fd is left open."""
    real = fcntl.flock

    def nfs(fd, op):
        if op & fcntl.LOCK_EX:
            raise OSError(9, "Bad file descriptor")
        real(fd, op)
    monkeypatch.setattr(lock.fcntl, "flock", nfs)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(CheckpointError, match=f"{tmp_path}: cannot take the directory's "
                       "writer lock .*local filesystem"):
        with lock.locked(tmp_path):
            pass
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_large_patch_written_in_memory_meanwhile_still_makes_a_sound_journal(tmp_path,
                                                                                monkeypatch):
    """The payload of a patch over the journal's chunk is hashed and written from one copy
    per chunk: a trainer writing the live tensor meanwhile (against the contract) changes
    what is patched, never makes a journal that recovery refuses as damaged."""
    (tmp_path / "f").write_bytes(bytes(3 * journal._CHUNK))
    payload = bytearray(b"\x01" * (2 * journal._CHUNK + 5))
    real = journal.write_all

    def write_all(fd, data):
        if len(data) >= journal._CHUNK and payload[0] == 1:  # hashed, not yet written:
            payload[:] = b"\x02" * len(payload)  # the step lands
        real(fd, data)

    monkeypatch.setattr(journal, "write_all", write_all)
    journal.write_journal(tmp_path, [("f", 0, payload)])
    monkeypatch.undo()
    assert journal.recover(tmp_path) == "replayed"
    data = (tmp_path / "f").read_bytes()
    assert data[:journal._CHUNK] == b"\x01" * journal._CHUNK
    assert data[journal._CHUNK:len(payload)] == b"\x02" * (len(payload) - journal._CHUNK)


@pytest.mark.parametrize("link", ["hard", "symlink"])
def test_a_link_made_after_the_crash_is_not_written_through_by_recover(shards, tmp_path,
                                                                        link):
    # e.g. a `cp -al` backup taken before anyone ran recover: the replay would patch it too
    d, new_dir, old, new, spec = shards
    assert _run(d, new_dir, spec, "after-rename:0") == -signal.SIGKILL
    shard, other = d / NAMES[0], tmp_path / "backup.safetensors"
    if link == "hard":
        os.link(shard, other)
    else:  # the file moved out, a symlink to it in its place (a Hugging Face cache blob)
        os.rename(shard, other)
        shard.symlink_to(other)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(shard))}: "
                       + (r"1 other hard link\(s\)" if link == "hard" else "a symlink to .*")
                       + r", which journal .* would write through; nothing was written and "
                         r"the journal is kept: give each other name a copy of its own"):
        journal.recover(d)
    assert other.read_bytes() == old[NAMES[0]] and journal.pending(d) == {"version": 2}
    if link == "hard":
        shutil.copy(other, tmp_path / "copy")
        os.replace(tmp_path / "copy", other)  # a copy of its own, as the error says
    else:
        os.replace(other, shard)  # its target moved over it, as the error says
    assert journal.recover(d) == "replayed"
    assert _state(d, old, new) == "new"
    if link == "hard":
        assert other.read_bytes() == old[NAMES[0]]


@pytest.mark.parametrize("linked", [0, 1])
def test_a_link_made_while_the_journal_is_written_fails_the_commit(shards, tmp_path, linked):
    """Linked before its first patch is streamed (1), or after (0): not committed."""
    d, _, old, new, spec = shards
    other = tmp_path / "backup.safetensors"

    def patches():
        for k, (name, off, n) in enumerate(spec):
            if k == 1:  # the first file's identity is recorded, its first patch too
                os.link(d / NAMES[linked], other)
            yield name, off, new[name][off:off + n]
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(d / NAMES[linked]))}: now 1 "
                       r"other hard link\(s\) \(made while this sync ran\)"):
        journal.write_journal(d, patches())
    assert journal.recover(d) == "none" and _state(d, old, new) == "old"


@pytest.mark.parametrize("left", ["journal", "stage"])
def test_uncommitted_leftovers_a_read_only_directory_keeps_are_named_not_raised(
        shards, monkeypatch, caplog, left):
    # e.g. `hotweights serve` of a checkpoint on a read-only mount: its shards are whole
    d, new_dir, old, new, spec = shards
    if left == "journal":
        assert _run(d, new_dir, spec, "before-rename:0") == -signal.SIGKILL
        leftover, what = d / journal._TMP_NAME, "an uncommitted journal"
    else:
        (d / journal.STAGE_DIR).mkdir()
        (d / journal.STAGE_DIR / NAMES[0]).write_bytes(new[NAMES[0]])
        leftover, what = d / journal.STAGE_DIR, "the files staged by an interrupted sync"
    assert leftover.exists()

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    monkeypatch.setattr(os, "unlink", read_only)
    monkeypatch.setattr(shutil, "rmtree", read_only)
    assert journal.recover(d) == "kept"
    monkeypatch.undo()
    assert f"{leftover}: {what}, which this process cannot remove (Read-only file system)" \
        in caplog.text
    assert _state(d, old, new) == "old" and leftover.exists()
    assert journal.recover(d) == "discarded" and not leftover.exists()


def test_a_journal_that_could_not_be_removed_once_applied_is_not_applied(shards):
    # the directory is immutable: the files would hold the commit and the journal stay
    d, new_dir, old, new, spec = shards
    assert _run(d, new_dir, spec, "after-rename:0") == -signal.SIGKILL
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i: not on this filesystem, or not root")
    try:
        with pytest.raises(CheckpointError, match=re.escape(
                f"{d / journal.JOURNAL_NAME}: this process cannot remove it (its directory "
                f"{d} is not writable by this process) once applied, so it is not applied; "
                "nothing was written and the journal is kept")):
            journal.recover(d)
        assert _state(d, old, new) == "old"
    finally:
        subprocess.run(["chattr", "-i", str(d)], check=True)
    assert journal.recover(d) == "replayed" and _state(d, old, new) == "new"


def test_a_file_put_back_after_a_crash_is_refused_when_its_device_changed(
        shards, tmp_path, monkeypatch):
    # across a reboot a filesystem's device number can change (loop, device-mapper, NVMe
    # renumbered): its inodes are then not compared, and a copy of the same size and header
    # would be patched; the bytes each patch replaces tell it apart
    d, new_dir, old, new, spec = shards
    assert _run(d, new_dir, spec, "after-rename:0") == -signal.SIGKILL
    other = bytes(b ^ 0x55 for b in old[NAMES[1]])  # another version, the same size
    (tmp_path / "copy").write_bytes(other)
    os.replace(tmp_path / "copy", d / NAMES[1])
    identity = journal._identity
    monkeypatch.setattr(journal, "_identity", lambda p: {**identity(p), "dev": -1}
                        if os.path.basename(p) in NAMES else identity(p))
    with pytest.raises(CheckpointError, match=re.escape(
            f"{d / NAMES[1]}: not the file journal {d / journal.JOURNAL_NAME} was committed "
            "for (its bytes at offset ") + r"\d+ are neither those the journal replaces nor "
            r"its own\), e\.g\. a copy put back after a crash; nothing was written"):
        journal.recover(d)
    assert (d / NAMES[1]).read_bytes() == other and (d / NAMES[0]).read_bytes() == old[NAMES[0]]
    assert journal.inspect(d)[1].startswith(f"{d / NAMES[1]}: not the file journal")
    (d / NAMES[1]).write_bytes(old[NAMES[1]])  # the file it was committed for, back
    assert journal.recover(d) == "replayed" and _state(d, old, new) == "new"


def _patches(new, spec):
    return [(n, off, (new / n).read_bytes()[off:off + k]) for n, off, k in spec]


def test_apply_refuses_a_file_whose_patched_bytes_changed_since_the_commit(shards):
    d, new, old, newb, spec = shards
    journal.write_journal(d, _patches(new, spec))
    name, off, k = spec[0]
    with open(d / name, "r+b") as f:  # same inode, size, header: bytes written in place
        f.seek(off)
        f.write(b"\x55" * k)
    with pytest.raises(CheckpointError, match="neither those the journal replaces"):
        journal.apply(d)


def test_the_journal_is_unlinked_only_after_every_patched_file_is_fsynced(shards, monkeypatch):
    d, new, old, newb, spec = shards
    log = []
    real_fsync, real_unlink = os.fsync, os.unlink
    def fsync(fd):
        log.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)
    def unlink(p, *a, **k):
        log.append(("unlink", os.path.basename(os.fspath(p))))
        real_unlink(p, *a, **k)
    journal.write_journal(d, _patches(new, spec))
    inos = {os.stat(d / n).st_ino for n in NAMES}
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "unlink", unlink)
    journal.apply(d, wait=True)
    finisher.finish()
    at = log.index(("unlink", journal.JOURNAL_NAME))
    assert inos <= {ino for op, ino in log[:at] if op == "fsync"}
    assert _state(d, old, newb) == "new"


def test_a_check_that_raises_discards_the_journal(shards):
    d, new, old, newb, spec = shards
    def check():
        raise CheckpointError("changed meanwhile")
    with pytest.raises(CheckpointError, match="changed meanwhile"):
        journal.write_journal(d, _patches(new, spec), check=check)
    assert journal.pending(d) is None and not os.path.exists(d / (journal.JOURNAL_NAME + ".tmp"))


def test_an_old_format_patch_beyond_the_file_s_end_is_refused(shards):
    d, new, old, newb, spec = shards
    raw = NAMES[0].encode()
    body = (journal._HEAD.pack(journal._MAGIC, 2, 2) + b"{}"
            + journal._REC.pack(b"R", len(raw), (64 << 10) - 10, 100) + raw + b"x" * 100)
    (d / journal.JOURNAL_NAME).write_bytes(
        body + journal._COMMIT.pack(b"C", 1, xxhash.xxh3_64_intdigest(body)))
    with pytest.raises(CheckpointError, match="beyond the file's end"):
        journal.recover(d)
    assert (d / NAMES[0]).read_bytes() == old[NAMES[0]]


def test_held_unlocks_the_lock_it_tried_not_only_closes_its_fd(tmp_path, monkeypatch):
    # a child forked between held()'s flock and its close shares the open file
    # description (simulated by a dup): closing alone would leave the lock held by it
    real_close, shared = os.close, []

    def close(fd):
        if not shared:
            shared.append(os.dup(fd))
        real_close(fd)
    monkeypatch.setattr(lock.os, "close", close)
    assert not lock.held(tmp_path)
    monkeypatch.undo()
    try:
        assert shared and not lock.held(tmp_path)
        with lock.locked(tmp_path):
            assert lock.held(tmp_path)
    finally:
        os.close(shared[0])


def test_a_journal_another_writer_put_in_place_meanwhile_is_not_removed(shards, monkeypatch):
    """The finisher thread removes the journal only if it is still the one its commit
    replayed: one another writer committed since (its own file) is left for its writer."""
    d, _, old, new, spec = shards
    real, path = journal._fsync_all, d / journal.JOURNAL_NAME

    def replaced(fds):
        real(fds)
        os.replace(d / "other.tmp", path)  # another writer's journal, a new file
    monkeypatch.setattr(journal, "_fsync_all", replaced)
    then = []
    with lock.locked(d):
        journal.write_journal(d, [(n, o, new[n][o:o + k]) for n, o, k in spec])
        (d / "other.tmp").write_bytes(b"another writer's journal")
        journal.apply(d, wait=False, mine=True, then=then.append)
    finisher.finish()
    assert path.read_bytes() == b"another writer's journal" and then == []
    assert _state(d, old, new) == "new" and journal.not_durable(d) is None


def test_finish_waits_for_every_finisher_thread_not_only_the_last():
    # each runs after the one before it: the last done means all are
    gate, done = threading.Event(), []
    finisher.start(lambda: (gate.wait(5), done.append(1)))
    finisher.start(lambda: done.append(2))
    timer = threading.Timer(0.1, gate.set)
    timer.start()
    finisher.finish()
    timer.join()
    assert done == [1, 2]


def test_finish_called_in_a_finisher_thread_does_not_wait_for_itself():
    # (what a commit's `then` calls may wait for the finisher, as writers do)
    errors, started = [], threading.Event()

    def run():
        started.wait(5)  # once `start` has made it the finisher `finish` joins
        try:
            finisher.finish()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    finisher.start(run)
    started.set()
    finisher.finish()
    assert errors == []
