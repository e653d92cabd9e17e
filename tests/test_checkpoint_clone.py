import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import remove_synced
from hotweights.checkpoint import clone
from hotweights.errors import CheckpointError

REFLINK_FS = {"xfs", "btrfs", "bcachefs", "ocfs2", "nfs", "nfs4"}


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    monkeypatch.setattr(clone, "_probed", {})


@pytest.fixture
def xfs(xfs_dir, request):
    d = xfs_dir / re.sub(r"\W", "_", request.node.name)
    d.mkdir()
    yield d
    remove_synced(d)


@pytest.fixture(params=["tmp_path", "dev_shm"])
def plain_dir(request, tmp_path):
    """A directory on a filesystem without reflinks (ext4 here, tmpfs)."""
    if request.param == "tmp_path":
        kind = clone.fs_type(tmp_path)[0]
        if kind in REFLINK_FS:
            pytest.skip(f"tmp_path is on {kind}, which may support reflinks")
        yield tmp_path
    else:
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        d = Path(os.path.realpath("/dev/shm")) / f"hotweights-test-{os.getpid()}"
        d.mkdir()
        yield d
        remove_synced(d)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write: a read-only tmpfs as root, else mode 0o555."""
    d = tmp_path / "read only"  # a space: /proc/self/mounts writes it as \040
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {' '.join(done.stderr.split())}")
    yield d
    subprocess.run(["umount", str(d)], check=True)


def _write(path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def test_reflink_clones_and_the_copies_diverge(xfs):
    data = _write(xfs / "a.safetensors", (8 << 20) + 123)
    clone.reflink(xfs / "a.safetensors", xfs / "b.safetensors")
    assert (xfs / "b.safetensors").read_bytes() == data
    assert (xfs / "a.safetensors").stat().st_ino != (xfs / "b.safetensors").stat().st_ino
    assert (xfs / "b.safetensors").stat().st_mode & 0o777 == 0o644 & ~_umask()
    with open(xfs / "b.safetensors", "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 4096)
    assert (xfs / "a.safetensors").read_bytes() == data
    changed = (xfs / "b.safetensors").read_bytes()
    assert changed[4096:8192] == b"\xff" * 4096
    assert changed[:4096] + changed[8192:] == data[:4096] + data[8192:]


def test_reflink_shares_blocks(xfs):
    with open(xfs / "a", "wb") as f:
        f.write(os.urandom(32 << 20))
        os.fsync(f.fileno())  # allocated, not delayed
    free = os.statvfs(xfs).f_bfree
    clone.reflink(xfs / "a", xfs / "b")
    assert (free - os.statvfs(xfs).f_bfree) * os.statvfs(xfs).f_frsize < (4 << 20)


def test_reflink_refuses_an_existing_dst(xfs):
    _write(xfs / "a", 100)
    (xfs / "b").write_bytes(b"mine")
    with pytest.raises(CheckpointError, match=r"b: cannot clone .*: File exists"):
        clone.reflink(xfs / "a", xfs / "b")
    assert (xfs / "b").read_bytes() == b"mine"


def test_reflink_across_filesystems(xfs, tmp_path):
    _write(xfs / "a", 100)
    with pytest.raises(CheckpointError, match="different filesystems"):
        clone.reflink(xfs / "a", tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_extents_are_counted_where_the_filesystem_says(xfs, tmp_path):
    _write(xfs / "a", 1 << 20)
    os.sync()
    assert clone.extents(xfs / "a") == 1
    clone.reflink(xfs / "a", xfs / "b")
    with open(xfs / "b", "r+b") as f:  # a page in the middle: the clone's extent splits
        f.seek(512 << 10)
        f.write(b"x" * 4096)
        f.flush()
        os.fsync(f.fileno())
    assert clone.extents(xfs / "b") == 3
    (tmp_path / "c").write_bytes(b"c" * 4096)
    if clone.fs_type(tmp_path)[0] != "tmpfs":  # (no FIEMAP there: below)
        assert clone.extents(tmp_path / "c") >= 1  # ext4 (tmp_path) counts them too
    assert clone.extents(tmp_path / "missing") is None
    if os.path.isdir("/dev/shm"):
        (shm := Path("/dev/shm") / f"hotweights-extents-{os.getpid()}").write_bytes(b"s")
        try:
            assert clone.extents(shm) is None  # tmpfs has no FIEMAP
        finally:
            shm.unlink()


def test_supports_reflink_on_xfs(xfs):
    ok, reason = clone.supports_reflink(xfs)
    assert ok, reason
    kind, mount = clone.fs_type(xfs)
    assert reason == f"xfs at {mount} supports reflinks"
    assert os.listdir(xfs) == []
    assert clone.supports_reflink(xfs) == (ok, reason)  # cached


def test_no_reflinks(plain_dir):
    kind, mount = clone.fs_type(plain_dir)
    ok, reason = clone.supports_reflink(plain_dir)
    assert not ok
    assert reason.startswith(f"{kind} at {mount} does not support reflinks (FICLONE: ")
    _write(plain_dir / "a", 100)
    where = re.escape(str(plain_dir))
    with pytest.raises(CheckpointError,
                       match=f"cannot clone .*: the filesystem of {where} does not support"):
        clone.reflink(plain_dir / "a", plain_dir / "b")
    assert os.listdir(plain_dir) == ["a"]  # no dst, no probe files


def test_read_only_dir(read_only_dir):
    ok, reason = clone.supports_reflink(read_only_dir)
    assert not ok
    assert re.fullmatch(f"{re.escape(str(read_only_dir))} is read-only \\(.*\\)", reason)
    if os.geteuid() == 0:
        assert clone.fs_type(read_only_dir) == ("tmpfs", str(read_only_dir))


def test_missing_dir(tmp_path):
    assert clone.supports_reflink(tmp_path / "nope") == (
        False, f"{tmp_path / 'nope'}: No such file or directory")


def test_fs_type(tmp_path):
    findmnt = shutil.which("findmnt")
    if findmnt:
        out = subprocess.run([findmnt, "-n", "-o", "FSTYPE,TARGET", "--target", str(tmp_path)],
                             capture_output=True, text=True, check=True).stdout.split(None, 1)
        assert clone.fs_type(tmp_path) == (out[0], out[1].strip())
    if os.path.isdir("/dev/shm"):
        assert clone.fs_type("/dev/shm") == ("tmpfs", "/dev/shm")
    assert clone.fs_type("/") == clone.fs_type("/proc/..")
    assert clone.fs_type("/proc/self") == ("proc", "/proc")


def test_fs_type_on_xfs(xfs_dir):
    assert clone.fs_type(xfs_dir / "not" / "there") == ("xfs", str(xfs_dir))


def test_fs_type_unreadable(monkeypatch):
    def no_proc(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(clone, "open", no_proc, raising=False)
    assert clone.fs_type("/") == ("unknown", "")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_two_threads_probing_one_directory_both_get_the_filesystem_s_answer(tmp_path,
                                                                            monkeypatch):
    # a probe file named by the process alone: the second thread found it taken ("cannot
    # probe"), and `auto` rewrote whole shards on a filesystem that clones
    import threading

    both_in = threading.Barrier(2, timeout=10)

    def unsupported(src, dst):  # both probes at once, each with a file of its own
        both_in.wait()
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    monkeypatch.setattr(clone, "_clone", unsupported)
    monkeypatch.setattr(clone, "_probed", {})
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(clone.supports_reflink(tmp_path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 2
    assert all(not ok and "does not support reflinks (FICLONE" in why for ok, why in answers)
    assert list(tmp_path.iterdir()) == []


def test_the_probe_s_answer_is_not_taken_for_the_next_filesystem_on_the_device(tmp_path,
                                                                                monkeypatch):
    """An unmount frees the device number and the next mount of the loop device takes it,
    another filesystem maybe: an XFS's "clones" was the ext4's answer after it, and `auto`
    failed to clone instead of rewriting whole."""
    mkfs = {k: shutil.which(f"mkfs.{k}") or shutil.which(f"mkfs.{k}", path="/usr/sbin:/sbin")
            for k in ("xfs", "ext4")}
    if os.geteuid() != 0 or None in mkfs.values():
        pytest.skip("needs root, mkfs.xfs and mkfs.ext4")
    monkeypatch.setattr(clone, "_probed", {})
    image, mnt = tmp_path / "img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(512 << 20)
    answers, devices = [], []
    for kind, options in (("xfs", ["-q", "-m", "reflink=1"]), ("ext4", ["-q", "-F"])):
        subprocess.run([mkfs[kind], *options, str(image)], check=True, capture_output=True)
        if subprocess.run(["mount", "-o", "loop", str(image), str(mnt)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot loop-mount here")
        try:
            devices.append(os.stat(mnt).st_dev)
            answers.append(clone.supports_reflink(mnt)[0])
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    if devices[0] != devices[1]:
        pytest.skip("the second mount got another device number")
    assert answers == [True, False]


def test_recover_removes_the_probes_of_processes_gone_only(tmp_path):
    from hotweights.checkpoint import journal

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = [f"{clone.PROBE}{dead}-k1ll3d", f"{clone.PROBE}{dead}-k1ll3d.clone"]
    mine = f"{clone.PROBE}{os.getpid()}-pr0b1ng"  # another thread of this process, probing
    for name in (*left, mine, ".hotweights-probe-x"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    assert journal.recover(tmp_path) == "none"
    assert sorted(os.listdir(tmp_path)) == sorted([mine, ".hotweights-probe-x"])


@pytest.mark.parametrize("kind", ["btrfs", "tmpfs"])
def test_a_full_disk_s_probe_still_says_whether_it_clones(kind, request, tmp_path):
    # the probe's 4 KiB cannot be written: an empty file's clone answers (a "cannot probe"
    # sent a full btrfs's sync to copy mode, whose whole-shard need overstates the patch's).
    # A btrfs keeps metadata apart: its data full, files are still made (an XFS then makes
    # none: no sync can run)
    if kind == "tmpfs":
        d = tmp_path / "tiny"
        d.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)],
                          capture_output=True).returncode != 0:
            pytest.skip("a small tmpfs mount needs root")
        request.addfinalizer(lambda: subprocess.run(["umount", str(d)], check=True))
    else:
        d = request.getfixturevalue(f"{kind}_dir") / "full"
        d.mkdir()
        request.addfinalizer(lambda: shutil.rmtree(d))
    with open(d / "filler", "wb") as f:
        with pytest.raises(OSError) as e:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
                os.fsync(f.fileno())
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError, match="No space"):  # not even a page left
        (d / "page").write_bytes(bytes(4096))
    (d / "page").unlink(missing_ok=True)
    ok, reason = clone.supports_reflink(d)
    assert ok is (kind != "tmpfs"), reason
    assert reason.startswith(f"{kind} at ")
    assert sorted(os.listdir(d)) == ["filler"] and clone._probed == {}  # asked again later
