"""checkpoint.fileid: one identity for a file, with its safetensors header if asked."""

import os
import struct

import pytest

from hotweights.checkpoint.fileid import FileId


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
