"""write_all, copy_all: every byte written or copied, however few each call takes; the
whole-page runs a clone is patched with."""

import errno
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


@pytest.mark.parametrize("to", [None, 3])
@pytest.mark.parametrize("how", ["short copies", "another filesystem"])
def test_copy_all_goes_on_after_short_copies(tmp_path, monkeypatch, to, how):
    """Each call copies 2 bytes of at most `_CHUNK`; at `to` (else the file position), the
    position kept; a source that ends first is an error. Where copy_file_range refuses two
    files (EXDEV: a shard symlinked into another filesystem's cache), the bytes are read
    and written instead, as a copy would put them."""
    asked, copy = [], os.copy_file_range

    def short(src, dst, n, at, where):
        asked.append(n)
        return copy(src, dst, min(n, 2), at, where)

    def other_filesystem(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")
    monkeypatch.setattr(writes, "_CHUNK", 5)
    monkeypatch.setattr(os, "copy_file_range", short if how == "short copies"
                        else other_filesystem)
    (tmp_path / "src").write_bytes(bytes(range(20)))
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        writes.copy_all(src, dst, 11, 4, to)
        assert os.lseek(dst, 0, os.SEEK_CUR) == (0 if to else 11)
        with pytest.raises(OSError, match="unexpected end of the source at byte 20"):
            writes.copy_all(src, dst, 3, 18, 40)
    finally:
        os.close(src)
        os.close(dst)
    monkeypatch.undo()
    assert (tmp_path / "dst").read_bytes()[:(to or 0) + 11] == \
        b"\0" * (to or 0) + bytes(range(4, 15))
    if how == "short copies":
        assert asked[:6] == [5, 5, 5, 5, 3, 1]


@pytest.mark.parametrize("batch_pages", [1, 3, 2048])
def test_a_clone_is_patched_in_whole_pages_of_the_file(tmp_path, monkeypatch, batch_pages):
    """`stage._write_pages`: the pages the changed ranges touch (`_page_offsets`), whole
    pages of the file (the old file's bytes around the changed tensors' live bytes, a tensor
    not on a page boundary, one inside a single page, the file's partial last page) back to
    back, built a batch at a time; cloned over the old file at `_runs` they make it hold
    the live tensors."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from hotweights.checkpoint import stage
    from hotweights.checkpoint.shards import read_dir

    old = {"a": torch.arange(3, dtype=torch.int8), "b": torch.arange(100000, dtype=torch.int16),
           "c": torch.ones(5000), "d": torch.arange(7, dtype=torch.int16)}
    save_file(old, tmp_path / "model.safetensors")
    shard = read_dir(tmp_path)["b"][0]
    assert shard.size % 4096 and shard.tensors["b"].begin % 4096
    live = {k: v.clone() for k, v in old.items()}
    live["b"][10:30000] += 1
    live["c"][100] = 7
    live["c"][-1] = 8  # the file's partial last page
    live["d"][3] = -1  # a tensor inside one page
    live["a"][0] = 9  # not in the ranges: its bytes stay the file's
    ranges = [("b", 20, 60000), ("c", 400, 404), ("c", 19996, 20000), ("d", 6, 8)]
    monkeypatch.setattr(stage, "_DIRECT_BUFFER", batch_pages * 4096)
    offsets = stage._page_offsets(shard, ranges)
    want = sorted({p for n, lo, hi in ranges for p in range(
        (shard.tensors[n].begin + lo) // 4096 * 4096, shard.tensors[n].begin + hi, 4096)})
    assert offsets.tolist() == want
    tensors = [(shard.tensors[n].begin, shard.tensors[n].end, stage.raw(live[n]))
               for n in ("b", "c", "d")]
    before = (tmp_path / "model.safetensors").read_bytes()
    fd = os.open(tmp_path / "pages", os.O_RDWR | os.O_CREAT)
    try:
        stage._write_pages(fd, offsets, np.frombuffer(before, np.uint8), tensors)
    finally:
        os.close(fd)
    pages = (tmp_path / "pages").read_bytes()
    runs = stage._runs(offsets, shard.size)
    assert len(pages) == sum(n for _, _, n in runs) and runs[-1][1] + runs[-1][2] == shard.size
    out = bytearray(before)
    for pos, at, n in runs:
        assert at % 4096 == 0 and pos % 4096 == 0 and (n % 4096 == 0 or at + n == shard.size)
        out[at:at + n] = pages[pos:pos + n]
    (tmp_path / "new.safetensors").write_bytes(out)
    got = load_file(tmp_path / "new.safetensors")
    for k in "bcd":
        assert torch.equal(got[k], live[k]), k
    assert torch.equal(got["a"], old["a"])


class _Sink:
    """`stage._sink`'s interface, keeping what is written."""

    def __init__(self):
        self.data = bytearray()

    def write(self, data):
        self.data.extend(bytes(data))

    def end(self):
        pass

    def close(self):
        pass


def test_patched_pages_match_a_byte_by_byte_reference(monkeypatch):
    """`_page_offsets`, `_runs`, `_write_pages` against a plain reference on random layouts:
    tensors of any length at any offset (inside one page, across many, touching the file's
    end), random changed ranges, batches of 1 to 5 pages."""
    import random

    import numpy as np
    import torch

    from hotweights.checkpoint import stage
    from hotweights.checkpoint.fileid import FileId
    from hotweights.checkpoint.shards import Shard, TensorInfo

    g = random.Random(20261128)
    for case in range(200):
        size = g.randint(1, 6 * 4096)
        old = np.frombuffer(g.randbytes(size), np.uint8)
        cuts = sorted(g.sample(range(size + 1), min(size + 1, g.randint(2, 8))))
        infos, live, ranges = {}, {}, []
        for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            if g.random() < 0.3:
                continue  # bytes no live tensor holds (a header, say)
            name = f"t{i}"
            infos[name] = TensorInfo(name, "U8", (b - a,), a, b)
            live[name] = torch.from_numpy(np.frombuffer(g.randbytes(b - a), np.uint8).copy())
            for _ in range(g.randint(0, 3)):
                lo = g.randint(0, b - a)
                ranges.append((name, lo, g.randint(lo, b - a)))
        shard = Shard("unused", FileId(0, 0, size, 0), 0, infos, {})
        stage_batch = g.randint(1, 5) * 4096
        want_pages = sorted({p for n, lo, hi in ranges if hi > lo for p in range(
            (infos[n].begin + lo) // 4096 * 4096, infos[n].begin + hi, 4096)})
        offsets = stage._page_offsets(shard, ranges)
        assert offsets.tolist() == want_pages, case
        new = old.copy()  # what the file holds once every live tensor in `ranges` is in it
        for n in dict.fromkeys(n for n, _, _ in ranges):
            new[infos[n].begin:infos[n].end] = live[n].numpy()
        tensors = [(infos[n].begin, infos[n].end, live[n])
                   for n in dict.fromkeys(n for n, _, _ in ranges)]
        sink = _Sink()
        monkeypatch.setattr(stage, "_DIRECT_BUFFER", stage_batch)
        monkeypatch.setattr(stage, "_sink", lambda fd, sink=sink: sink)
        stage._write_pages(-1, offsets, old, tensors)
        written = sink.data
        runs = stage._runs(offsets, size)
        assert len(written) == sum(n for _, _, n in runs), case
        for pos, at, n in runs:
            assert bytes(written[pos:pos + n]) == new[at:at + n].tobytes(), (case, at)


def test_a_direct_write_refused_midway_goes_on_buffered_from_where_it_stopped(tmp_path,
                                                                              monkeypatch):
    """`stage._Direct`: where the device refuses an O_DIRECT write (EINVAL) after part of
    the buffer went out, the rest is written buffered from the file's position: no byte
    written twice, none left out."""
    import random

    from hotweights.checkpoint import stage

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        sink = stage._sink(fd)
        if not isinstance(sink, stage._Direct):
            pytest.skip("no O_DIRECT on this filesystem")
        calls, write = [], os.write

        def refuse_once(f, b):  # the first page goes out, then the device says EINVAL
            calls.append(len(b))
            if len(calls) == 1:
                return write(f, b[:4096])
            if len(calls) == 2:
                raise OSError(errno.EINVAL, "Invalid argument")
            return write(f, b)
        monkeypatch.setattr(os, "write", refuse_once)
        data = random.Random(0).randbytes(12800)  # 3 pages and a part
        sink.write(memoryview(data))
        sink.end()
        sink.close()
        monkeypatch.undo()
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data
