"""checkpoint.fileid: one identity for a file, with its safetensors header if asked."""

import os
import struct

import pytest

from hotweights.checkpoint.fileid import MAX_HEADER, FileId


def test_another_file_or_this_one_changed_differs(tmp_path):
    p = tmp_path / "a"
    p.write_bytes(b"x" * 10)
    fid = FileId.of(p)
    st = os.stat(p)
    assert fid == FileId(st.st_dev, st.st_ino, 10, st.st_mtime_ns) == FileId.of(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert FileId.of(p) != fid
    (tmp_path / "b").write_bytes(b"x" * 10)
    os.replace(tmp_path / "b", p)
    assert FileId.of(p).ino != fid.ino


def test_header_digest_only_for_a_safetensors_header(tmp_path):
    p = tmp_path / "a.safetensors"
    header = b'{"__metadata__":{}}'
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    fid = FileId.of(p, header=True)
    assert fid.header_end == 8 + len(header) and len(fid.header) == 16
    assert FileId.of(p).header is None  # not asked for
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"\0" * 8)  # a length past the end
    assert (FileId.of(p, header=True).header_end, FileId.of(p, header=True).header) == (0, None)
    with pytest.raises(FileNotFoundError):
        FileId.of(tmp_path / "gone", header=True)


def test_a_changed_ctime_alone_is_not_unchanged(tmp_path):
    # a write in place whose mtime was put back: equal as FileIds, yet not unchanged
    was = FileId(1, 2, 3, 4, 0, None, 5)
    now = FileId(1, 2, 3, 4, 0, None, 6)
    assert was == now and not was.unchanged(now) and was.unchanged(FileId(1, 2, 3, 4, 0, None, 5))
    p = tmp_path / "a"
    p.write_bytes(b"x")
    assert FileId.of(p).ctime_ns == os.stat(p).st_ctime_ns != 0


def _file(path, n_claimed: int, header: bytes, tail: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", n_claimed) + header + tail)


def test_the_header_digest_at_the_bounds_of_the_file(tmp_path):
    p = tmp_path / "a.safetensors"
    header = b'{"__metadata__":{}}'
    _file(p, len(header), header)  # the header fills the file exactly: still a header
    fid = FileId.of(p, header=True)
    assert fid.header_end == 8 + len(header) and fid.header is not None
    for past in (1, 4, 8):  # a length past the file's end by a few bytes: none
        _file(p, len(header) + past, header)
        assert (FileId.of(p, header=True).header_end, FileId.of(p, header=True).header) == \
            (0, None), past
    _file(p, len(header), header[:-1] + b"]")  # the header's last byte is in its digest
    assert FileId.of(p, header=True).header != fid.header


def test_a_header_longer_than_the_loader_takes_is_not_read(tmp_path):
    p = tmp_path / "big.safetensors"
    with open(p, "wb") as f:  # sparse: a claimed header of MAX_HEADER + 1 bytes that fits
        f.write(struct.pack("<Q", MAX_HEADER + 1))
        f.truncate(8 + MAX_HEADER + 16)
    fid = FileId.of(p, header=True)
    assert (fid.header_end, fid.header) == (0, None)
