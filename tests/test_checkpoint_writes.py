"""write_all, pwritev_all: every byte written, however few bytes each write takes; the
whole-page runs a clone is patched with."""

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


def test_a_clone_is_patched_in_whole_pages_of_the_file(tmp_path, monkeypatch):
    """`stage._page_runs`: the pages the changed ranges touch, each run whole pages (the old
    file's bytes around the changed tensors' live bytes, a tensor not on a page boundary),
    split at `_CHUNK`; written over the old file they make it hold the live tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    from hotweights.checkpoint import stage
    from hotweights.checkpoint.shards import read_dir

    old = {"a": torch.arange(3, dtype=torch.int8), "b": torch.arange(100000, dtype=torch.int16),
           "c": torch.ones(5000)}
    save_file(old, tmp_path / "model.safetensors")
    shard = read_dir(tmp_path)["b"][0]
    live = {k: v.clone() for k, v in old.items()}
    live["b"][10:30000] += 1
    live["c"][100] = 7
    live["a"][0] = 9  # not in the ranges: its bytes stay the file's
    monkeypatch.setattr(stage, "_CHUNK", 8192)
    out = bytearray((tmp_path / "model.safetensors").read_bytes())
    src = os.open(shard.path, os.O_RDONLY)
    try:
        for at, parts in stage._page_runs(shard, live, [("b", 20, 60000), ("c", 400, 404)], src):
            data = b"".join(parts)
            assert at % 4096 == 0 and 0 < len(data) <= 8192
            assert len(data) % 4096 == 0 or at + len(data) == shard.size
            out[at:at + len(data)] = data
    finally:
        os.close(src)
    (tmp_path / "new.safetensors").write_bytes(out)
    got = load_file(tmp_path / "new.safetensors")
    assert torch.equal(got["b"], live["b"]) and torch.equal(got["c"], live["c"])
    assert torch.equal(got["a"], old["a"])
