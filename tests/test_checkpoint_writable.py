"""A file this process may not change (an immutable one, another user's in a sticky
directory) is found before a commit, and before a replay's first rename or write: never
half way through applying a journal (no vLLM)."""

import array
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hotweights.checkpoint import diagnose, finisher, journal, recover, sync, writable
from hotweights.errors import CheckpointError

FS_IOC_SETFLAGS = 0x40086602  # _IOW('f', 2, long), linux/fs.h
IMMUTABLE = 0x10


def _flags(path: Path, on: bool) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, writable.FS_IOC_GETFLAGS, flags)
        flags[0] = flags[0] | IMMUTABLE if on else flags[0] & ~IMMUTABLE
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags)
    finally:
        os.close(fd)


@contextlib.contextmanager
def immutable(path: Path):
    """`path` made immutable (`chattr +i`: not even root may rename over it or write)."""
    try:
        _flags(path, True)
    except OSError as e:
        pytest.skip(f"cannot make a file immutable here ({e.strerror}; needs root)")
    try:
        yield
    finally:
        _flags(path, False)


def _live(step: int = 0) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.w": torch.full((64, 64), float(i + step)) for i in range(3)}


@pytest.fixture
def saved(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    sync(d, _live(), max_shard_size=20_000)  # one tensor per shard
    finisher.finish()
    assert len(list(d.glob("*.safetensors"))) == 3
    return d


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.mark.parametrize(("mode", "verb"), [("auto", "replace"), ("journal", "write into")])
def test_a_shard_that_cannot_be_changed_is_refused_before_the_commit(saved, mode, verb):
    before = _files(saved)
    last = sorted(saved.glob("*.safetensors"))[-1]
    with immutable(last):
        with pytest.raises(CheckpointError, match=rf"{last}: this process cannot {verb} it "
                           r"\((the file is immutable \(chattr\)|Operation not permitted)\); "
                           "nothing was written"):
            sync(saved, _live(1), mode=mode)
        finisher.finish()
        why = (writable.why_not_writable if mode == "journal" else
               writable.why_not_replaceable)(str(last))
        assert diagnose(saved, mode=mode).problems == [
            f"{last}: a sync that changes it cannot {verb} it ({why})"]  # said first
        assert _files(saved) == before  # no shard of a new version beside old ones
        assert not (saved / journal.JOURNAL_NAME).exists()
        assert not (saved / journal.STAGE_DIR).exists()
    sync(saved, _live(1), mode=mode)  # once it can
    finisher.finish()
    assert _files(saved) != before and sync(saved, _live(1)).bytes_written == 0


@pytest.mark.parametrize("how", ["moved", "patched"])
def test_a_committed_journal_onto_a_file_that_cannot_be_changed_is_kept_whole(saved, how):
    """Made unchangeable after the commit (a crash, then chattr, a permission change):
    the replay refuses before its first rename or write, and keeps the journal."""
    names = sorted(p.name for p in saved.glob("*.safetensors"))
    if how == "moved":
        (saved / journal.STAGE_DIR).mkdir()
        for name in names:
            save_file({"x": torch.ones(2)}, saved / journal.STAGE_DIR / name)
        journal.write_journal(saved, [], moves=names)
    else:
        journal.write_journal(saved, [(name, os.path.getsize(saved / name) - 4, b"\xff" * 4)
                                      for name in names])
    before = _files(saved)
    with immutable(saved / names[-1]):
        with pytest.raises(CheckpointError, match=rf"{names[-1]}: this process cannot "
                           r".* it \(.*\), so journal .* cannot be applied; nothing was "
                           "written and the journal is kept: once it can, run hotweights "
                           "recover"):
            recover(saved)
        assert _files(saved) == before  # not one file of the new version
    assert recover(saved) == "replayed"
    assert _files(saved) != before and not (saved / journal.JOURNAL_NAME).exists()


def test_another_user_s_shard_in_a_sticky_directory_is_refused_before_the_commit(
        saved, monkeypatch):
    # /tmp-like: anyone may write in it, but only a file's owner (or the directory's)
    # may rename over the file
    before = _files(saved)
    *mine, last = sorted(saved.glob("*.safetensors"))
    try:
        for path in mine:
            os.chown(path, 4343, 4343)
        os.chown(last, 4242, 4242)
    except OSError as e:
        pytest.skip(f"cannot make files of other users here ({e.strerror})")
    os.chmod(saved, 0o1777)
    monkeypatch.setattr(os, "geteuid", lambda: 4343)  # this process: not the directory's
    monkeypatch.setattr(writable, "_may_own_any", lambda: False)  # nor root (CAP_FOWNER)
    with pytest.raises(CheckpointError, match=rf"{last}: this process cannot replace it "
                       r"\(its directory is sticky .* and the file is user 4242's"):
        sync(saved, _live(1))
    monkeypatch.undo()
    finisher.finish()
    assert _files(saved) == before and not (saved / journal.JOURNAL_NAME).exists()
    assert writable.why_not_replaceable(str(last)) is None  # root: may (CAP_FOWNER)
    sync(saved, _live(1))


def _sticky(tmp_path: Path) -> Path:
    d = tmp_path / "shared"
    d.mkdir()
    (d / "theirs").write_bytes(b"x")
    try:
        os.chown(d / "theirs", 4242, 4242)
        os.chown(d, 4343, 4343)
    except OSError as e:
        pytest.skip(f"cannot make files of other users here ({e.strerror})")
    os.chmod(d, 0o1777)
    return d / "theirs"


def test_the_sticky_rule_agrees_with_the_kernel_without_cap_fowner(tmp_path):
    """Root whose container dropped CAP_FOWNER may not rename over another user's file in
    a sticky directory: the check says so exactly when the kernel refuses."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv (util-linux) to drop CAP_FOWNER")
    d = _sticky(tmp_path).parent
    (d / "new").write_bytes(b"y")
    src = str(Path(writable.__file__).resolve().parents[1])
    code = (f"import sys, types, os; pkg = types.ModuleType('hotweights'); "
            f"pkg.__path__ = [{src!r}]; sys.modules['hotweights'] = pkg\n"
            "from hotweights.checkpoint.writable import why_not_replaceable\n"
            f"why = why_not_replaceable({str(d / 'theirs')!r})\n"
            "try:\n"
            f"    os.replace({str(d / 'new')!r}, {str(d / 'theirs')!r}); done = 'replaced'\n"
            "except PermissionError:\n    done = 'refused'\n"
            "print(done, why is not None)")
    out = subprocess.run([setpriv, "--inh-caps=-fowner", "--bounding-set=-fowner",
                          sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"setpriv could not drop CAP_FOWNER here: {out.stderr.strip()[-200:]}")
    assert out.stdout.split() == ["refused", "True"]


def test_diagnose_names_a_sidecar_directory_no_sync_can_write(saved):
    assert not diagnose(saved).problems
    with immutable(saved / ".hotweights"):
        (problem,) = diagnose(saved).problems
    assert problem == (f"{saved / '.hotweights'}: the sidecars cannot be written (its directory "
                       f"{saved / '.hotweights'} is not writable by this process): every sync "
                       "compares every shard with the file, byte by byte")


def test_the_sticky_rule_lets_the_directory_s_owner_and_cap_fowner_rename(tmp_path,
                                                                          monkeypatch):
    theirs = _sticky(tmp_path)
    monkeypatch.setattr(writable, "_may_own_any", lambda: False)
    monkeypatch.setattr(os, "geteuid", lambda: 4343)  # the directory's owner: may
    assert writable.why_not_replaceable(str(theirs)) is None
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # the file's owner: may
    assert writable.why_not_replaceable(str(theirs)) is None
    monkeypatch.setattr(os, "geteuid", lambda: 5555)  # anyone else: may not
    assert "its directory is sticky" in writable.why_not_replaceable(str(theirs))
    monkeypatch.setattr(writable, "_may_own_any", lambda: True)  # unless CAP_FOWNER
    assert writable.why_not_replaceable(str(theirs)) is None


def test_a_directory_this_process_may_write_but_not_search_is_refused():
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv (util-linux) to run as another user")
    top = Path(tempfile.mkdtemp(prefix="hw-search-"))  # pytest's tmp_path: root's only
    try:
        os.chmod(top, 0o755)
        d = top / "d"
        d.mkdir()
        (d / "f").write_bytes(b"x")
        os.chown(d, 4242, 4242)
        src = str(Path(writable.__file__).resolve().parents[1])
        code = (f"import sys, types; pkg = types.ModuleType('hotweights'); "
                f"pkg.__path__ = [{src!r}]; sys.modules['hotweights'] = pkg\n"
                "from hotweights.checkpoint.writable import why_not_replaceable\n"
                f"print(why_not_replaceable({str(d / 'f')!r}))")
        got = {}
        for mode in (0o300, 0o200):  # write and search; write only
            os.chmod(d, mode)
            out = subprocess.run([setpriv, "--reuid=4242", "--regid=4242", "--clear-groups",
                                  sys.executable, "-c", code], capture_output=True, text=True)
            if out.returncode != 0 and "Traceback" not in out.stderr:
                pytest.skip(f"setpriv could not run as another user: {out.stderr[-200:]}")
            got[mode] = (out.returncode, out.stdout.strip(), out.stderr[-300:])
        assert got[0o300][:2] == (0, "None"), got
        assert got[0o200][0] == 0 and "is not writable by this process" in got[0o200][1], got
    finally:
        shutil.rmtree(top, ignore_errors=True)
