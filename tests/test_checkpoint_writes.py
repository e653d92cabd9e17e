"""write_all, pwritev_all: every byte written, however few bytes each write takes."""

import os

import pytest

from hotweights.checkpoint import writes


@pytest.mark.parametrize("offset", [None, 3])
def test_write_all_goes_on_after_short_writes(tmp_path, monkeypatch, offset):
    """Each call takes 2 bytes of at most `_CHUNK`; at `offset`, the bytes before it stay
    a hole."""
    asked, write, pwrite = [], os.write, os.pwrite
    monkeypatch.setattr(writes, "_CHUNK", 5)
    monkeypatch.setattr(os, "write", lambda fd, b: asked.append(len(b)) or write(fd, b[:2]))
    monkeypatch.setattr(os, "pwrite",
                        lambda fd, b, at: asked.append(len(b)) or pwrite(fd, b[:2], at))
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        writes.write_all(fd, memoryview(bytes(range(11))), offset)
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert path.read_bytes() == b"\0" * (offset or 0) + bytes(range(11))
    assert asked == [5, 5, 5, 5, 3, 1]


@pytest.mark.parametrize("iov_max", [1024, 2])
def test_pwritev_all_writes_the_parts_back_to_back(tmp_path, monkeypatch, iov_max):
    """One call for all the parts (joined first where they are more than the kernel takes);
    a short write goes on with the rest."""
    calls, pwritev = [], os.pwritev
    monkeypatch.setattr(writes, "IOV_MAX", iov_max)
    monkeypatch.setattr(os, "pwritev", lambda fd, parts, at: calls.append(len(parts)) or
                        pwritev(fd, [b"".join(parts)[:4]], at))  # takes 4 bytes at most
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        parts = [b"abc", memoryview(bytes(range(5))), b"", b"xy"]
        assert writes.pwritev_all(fd, parts, 2) == 10
        assert writes.pwritev_all(fd, [], 0) == 0
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert path.read_bytes() == b"\0\0abc" + bytes(range(5)) + b"xy"
    assert calls == [4 if iov_max > 4 else 1]
