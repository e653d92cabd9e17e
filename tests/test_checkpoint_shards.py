"""checkpoint.shards: safetensors headers read and validated, data never read (no vLLM)."""

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hotweights.checkpoint import diagnose, sync
from hotweights.checkpoint.incremental import UNREADABLE
from hotweights.checkpoint.shards import read_dir, read_index, read_shard
from hotweights.errors import CheckpointError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(7, generator=g),
        "c.weight": torch.randn(4, 2, 3, generator=g).to(torch.bfloat16),
        "d.scalar": torch.tensor(1.5),
        "e.empty": torch.zeros(0, 4),
    }


def _bytes_of(path: Path, info) -> bytes:
    with open(path, "rb") as f:
        f.seek(info.begin)
        return f.read(info.nbytes)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _snapshot(d: Path) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) if p.exists() else os.readlink(p)
            for p in sorted(d.rglob("*"))}  # (a dangling symlink: where it points)


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    p = tmp_path / "model.safetensors"
    save_file(_tensors(), p, metadata={"format": "pt"})
    return p


def test_offsets_give_bit_identical_bytes(shard: Path):
    s = read_shard(shard)
    assert s.size == shard.stat().st_size and s.file.ino == shard.stat().st_ino
    assert s.metadata == {"format": "pt"}
    live = _tensors()
    assert set(s.tensors) == set(live)
    with safe_open(str(shard), "pt") as f:
        for name, info in s.tensors.items():
            t = f.get_tensor(name)
            assert info.dtype == {torch.bfloat16: "BF16", torch.float32: "F32"}[t.dtype]
            assert info.shape == tuple(t.shape) == tuple(live[name].shape)
            assert s.data_start <= info.begin <= info.end <= s.size
            assert _bytes_of(shard, info) == _raw(t) == _raw(live[name])


def test_a_header_rewritten_in_place_is_read_again(shard: Path):
    """Headers are parsed once per content: the same bytes, with no new stat in between
    (same size and inode, a mtime in the same clock tick), still give the new header."""
    first = read_shard(shard)
    data = bytearray(shard.read_bytes())
    at = data.index(b'"pt"')
    data[at:at + 4] = b'"qt"'  # the same length
    with open(shard, "r+b") as f:
        f.write(data)
    again = read_shard(shard)
    assert again.metadata == {"format": "qt"} and first.metadata == {"format": "pt"}
    data[data.index(b'"dtype"')] = ord("[")  # corrupt, still the same length
    with open(shard, "r+b") as f:
        f.write(data)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_shard(shard)


def test_sharded_save_pretrained(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from hotweights.testing.tiny import make_config

    config = make_config("llama", 300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    before = _snapshot(tmp_path)
    index = read_index(tmp_path)
    entries = read_dir(tmp_path)
    assert _snapshot(tmp_path) == before
    assert set(index.values()) == set(files) and set(entries) == set(index)
    assert len({id(s) for s, _ in entries.values()}) == len(files)  # one header read each
    state = model.state_dict()
    for name, (s, info) in entries.items():
        assert Path(s.path).name == index[name] and info.dtype == "BF16"
        with safe_open(s.path, "pt") as f:
            assert _bytes_of(Path(s.path), info) == _raw(f.get_tensor(name))
        if name in state:
            assert _bytes_of(Path(s.path), info) == _raw(state[name])


def _rewrite(path: Path, edit) -> None:
    """Edit the JSON header of a valid shard in place, keeping its data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


def _set(name, field, value):
    return lambda p: _rewrite(p, lambda h: h[name].__setitem__(field, value))


def _del(name, field):
    return lambda p: _rewrite(p, lambda h: h[name].pop(field))


def _bytes(fn):
    return lambda p: p.write_bytes(fn(p.read_bytes()))


def _header_len(raw: bytes) -> int:
    return struct.unpack("<Q", raw[:8])[0]


CORRUPT = {
    "short": (_bytes(lambda r: r[:5]), r"truncated: 5 bytes, shorter than the 8-byte"),
    "len_past_end": (_bytes(lambda r: struct.pack("<Q", len(r)) + r[8:]),
                     r"header length \d+ runs past the end of the file"),
    "len_absurd": (_bytes(lambda r: struct.pack("<Q", 2**40) + r[8:]), r"is absurd"),
    "not_json": (_bytes(lambda r: r[:8] + b"#" * _header_len(r) + r[8 + _header_len(r):]),
                 r"header is not valid JSON"),
    "nested_too_deep": (_bytes(lambda r: struct.pack("<Q", 10**5) + b"[" * 10**5),
                        r"header is not valid JSON"),  # past Python's recursion limit
    "not_object": (_bytes(lambda r: r[:8] + b"[1]".ljust(_header_len(r))
                          + r[8 + _header_len(r):]), r"header is a JSON list, expected"),
    "no_dtype": (_del("b.bias", "dtype"), r"tensor b.bias: missing field 'dtype'"),
    "no_shape": (_del("b.bias", "shape"), r"tensor b.bias: missing field 'shape'"),
    "no_offsets": (_del("b.bias", "data_offsets"),
                   r"tensor b.bias: missing field 'data_offsets'"),
    "entry_type": (lambda p: _rewrite(p, lambda h: h.__setitem__("b.bias", 3)),
                   r"tensor b.bias: entry is a JSON int"),
    "dtype_type": (_set("b.bias", "dtype", 4), r"tensor b.bias: dtype 4 is not a string"),
    "unknown_dtype": (_set("b.bias", "dtype", "Q7"), r"tensor b.bias: unknown dtype 'Q7'"),
    "shape_type": (_set("b.bias", "shape", [7.0]), r"tensor b.bias: shape \[7.0\] is not"),
    "offsets_type": (_set("b.bias", "data_offsets", [1]),
                     r"tensor b.bias: data_offsets \[1\] is not \[begin, end\]"),
    "out_of_range": (_set("b.bias", "data_offsets", [10**6, 10**6 + 28]),
                     r"tensor b.bias: data_offsets \[1000000, 1000028\] past the end"),
    "begin_gt_end": (_set("b.bias", "data_offsets", [28, 0]), r"tensor b.bias: .*begin > end"),
    "size_mismatch": (_set("b.bias", "shape", [6]),
                      r"tensor b.bias: data_offsets .* hold 28 bytes, but F32 x \[6\] needs 24"),
    "overlap": (lambda p: _rewrite(p, lambda h: h["c.weight"].__setitem__(
        "data_offsets", [h["a.weight"]["data_offsets"][0],
                         h["a.weight"]["data_offsets"][0] + 48])), r"overlaps tensor"),
    "truncated_data": (_bytes(lambda r: r[:-6]), r"past the end of the data section"),
    "trailing": (_bytes(lambda r: r + b"\0" * 4), r"4 trailing bytes after the last tensor"),
    "metadata_type": (lambda p: _rewrite(p, lambda h: h.__setitem__("__metadata__", {"a": 1})),
                      r"__metadata__ must map strings to strings"),
    "metadata_false": (lambda p: _rewrite(p, lambda h: h.__setitem__("__metadata__", False)),
                       r"__metadata__ must map strings to strings"),  # as the loader says
    "nan": (lambda p: _rewrite(p, lambda h: h["b.bias"].__setitem__("x", float("nan"))),
            r"header is not valid JSON: NaN is not JSON"),
    "huge_dim": (_set("e.empty", "shape", [0, 2**64]),
                 r"tensor e.empty: shape \[0, 18446744073709551616\] .*< 2\*\*63"),
    "duplicate": (_bytes(lambda r: r[:8] + r[8:8 + _header_len(r)].replace(
        b'"b.bias"', b'"a.weight"') + r[8 + _header_len(r):]), r"duplicate key 'a.weight'"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_shard_named_error(shard: Path, case: str):
    corrupt, message = CORRUPT[case]
    corrupt(shard)
    before = _snapshot(shard.parent)
    with pytest.raises(CheckpointError, match=message) as e:
        read_shard(shard)
    assert str(shard) in str(e.value)
    with pytest.raises(CheckpointError, match=message):
        read_dir(shard.parent)
    assert _snapshot(shard.parent) == before


@pytest.mark.parametrize("case", ["not_json", "trailing", "no_dtype"])
def test_a_sync_onto_a_corrupt_shard_says_what_to_do(shard: Path, case: str):
    """sync and diagnose name the fault and the next step (restore the file, or save anew
    into an empty directory); nothing is written."""
    CORRUPT[case][0](shard)
    before = _snapshot(shard.parent)
    with pytest.raises(CheckpointError, match=CORRUPT[case][1]) as e:
        sync(shard.parent, _tensors())
    assert str(shard) in str(e.value) and UNREADABLE in str(e.value)
    found = diagnose(shard.parent)
    assert found.error == str(e.value) and found.problems
    assert _snapshot(shard.parent) == before


def test_an_unreadable_index_says_what_to_do(sharded: Path):
    INDEX_CASES["not_json"][0](sharded)
    with pytest.raises(CheckpointError, match=r"index.json: not valid JSON.*from a copy"):
        sync(sharded, _tensors())


def test_gap_between_tensors(tmp_path: Path):
    p = tmp_path / "x.safetensors"
    h = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}).encode()
    p.write_bytes(struct.pack("<Q", len(h)) + h + bytes(24))
    with pytest.raises(CheckpointError, match=r"8 unclaimed bytes before tensor b"):
        read_shard(p)


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    t = _tensors()
    save_file({k: t[k] for k in ("a.weight", "b.bias")}, tmp_path / "m-1.safetensors")
    save_file({k: t[k] for k in ("c.weight", "d.scalar")}, tmp_path / "m-2.safetensors")
    wm = {"a.weight": "m-1.safetensors", "b.bias": "m-1.safetensors",
          "c.weight": "m-2.safetensors", "d.scalar": "m-2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return tmp_path


def _edit_index(d: Path, edit) -> None:
    p = d / "model.safetensors.index.json"
    doc = json.loads(p.read_text())
    edit(doc)
    p.write_text(json.dumps(doc))


INDEX_CASES = {
    "not_json": (lambda d: (d / "model.safetensors.index.json").write_text("{oops"),
                 r"model.safetensors.index.json: not valid JSON"),
    "nested_too_deep": (lambda d: (d / "model.safetensors.index.json").write_text("[" * 10**5),
                        r"model.safetensors.index.json: not valid JSON"),
    "no_weight_map": (lambda d: _edit_index(d, lambda doc: doc.pop("weight_map")),
                      r"no 'weight_map' object"),
    "missing_shard": (lambda d: (d / "m-2.safetensors").unlink(),
                      r"tensor c.weight is in shard m-2.safetensors, which does not exist"),
    "dangling_link": (lambda d: ((d / "m-2.safetensors").unlink(),
                                 (d / "m-2.safetensors").symlink_to("../blobs/ab12")),
                      r"tensor c.weight is in shard m-2.safetensors, a symlink to "
                      r"../blobs/ab12, which does not exist \(a Hugging Face cache blob"),
    "link_loop": (lambda d: ((d / "m-2.safetensors").unlink(),
                             (d / "m-2.safetensors").symlink_to("m-2.safetensors")),
                  r"tensor c.weight is in shard m-2.safetensors, a symlink to m-2.safetensors, "
                  r"in a loop of symlinks"),
    "escaping_name": (lambda d: _edit_index(d, lambda doc: doc["weight_map"].__setitem__(
        "b.bias", "../m-1.safetensors")), r"weight_map\['b.bias'\] = '../m-1.safetensors'"),
    "absent_tensor": (lambda d: _edit_index(d, lambda doc: doc["weight_map"].__setitem__(
        "z.weight", "m-1.safetensors")),
        r"1 tensors listed but absent from their shard's header: z.weight \(in m-1"),
    "a_tensor_in_two_shards": (  # both loaders take every tensor of each shard
        lambda d: save_file({**{k: v for k, v in _tensors().items() if k in (
            "c.weight", "d.scalar")}, "a.weight": torch.zeros(3, 5, dtype=torch.bfloat16)},
            d / "m-2.safetensors"),
        r"tensor a.weight is in m-1.safetensors \(the index's\) and in m-2.safetensors: "
        r"transformers and vLLM load both"),
    "an_unnamed_tensor_in_two_shards": (
        lambda d: [save_file({**{k: v for k, v in _tensors().items() if k in names},
                              "z.stale": torch.zeros(2)}, d / f"m-{i}.safetensors")
                   for i, names in ((1, ("a.weight", "b.bias")), (2, ("c.weight", "d.scalar")))],
        r"tensor z.stale is in m-1.safetensors and in m-2.safetensors"),
    "no_tensor_in_the_weight_map": (
        lambda d: _edit_index(d, lambda doc: doc.__setitem__("weight_map", {})),
        r"index.json: its 'weight_map' names no tensor: remove the index"),
    "a_stale_single_file_beside": (  # transformers would load it, vLLM the index's shards
        lambda d: shutil.copy(d / "m-1.safetensors", d / "model.safetensors"),
        r"both model.safetensors and model.safetensors.index.json \(of other shards\): "
        r"transformers loads model.safetensors and ignores the index"),
}


def test_a_dangling_single_file_link_is_named_so(tmp_path: Path):
    (tmp_path / "model.safetensors").symlink_to("../blobs/ab12")
    with pytest.raises(CheckpointError, match=r"model.safetensors: a symlink to "
                       r"../blobs/ab12, which does not exist \(a Hugging Face cache blob"):
        read_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").symlink_to("x.safetensors")
    (tmp_path / "x.safetensors").symlink_to("model.safetensors")  # exists, as a link
    with pytest.raises(CheckpointError, match=r"model.safetensors: a symlink to "
                       r"x.safetensors, in a loop of symlinks$"):
        read_dir(tmp_path)


def test_sharded_dir(sharded: Path):
    entries = read_dir(sharded)
    assert sorted(entries) == ["a.weight", "b.bias", "c.weight", "d.scalar"]
    assert entries["a.weight"][0] is entries["b.bias"][0]
    assert Path(entries["c.weight"][0].path).name == "m-2.safetensors"


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_bad_index_named_error(sharded: Path, case: str):
    corrupt, message = INDEX_CASES[case]
    corrupt(sharded)
    before = _snapshot(sharded)
    with pytest.raises(CheckpointError, match=message):
        read_dir(sharded, strict=True)  # (as a sync reads it)
    assert _snapshot(sharded) == before


def test_a_tensor_two_shards_hold_is_the_index_s_unless_strict(sharded: Path):
    corrupt, message = INDEX_CASES["a_tensor_in_two_shards"]  # a server, a RemoteGroup's
    corrupt(sharded)  # checkpoint read it as vLLM loads it; a sync refuses it (above)
    shard, info = read_dir(sharded)["a.weight"]
    assert Path(shard.path).name == "m-1.safetensors"
    with pytest.raises(CheckpointError, match=message):
        sync(sharded, _tensors())


def test_a_tensor_a_shard_holds_beyond_the_index_is_on_disk(sharded: Path):
    t = _tensors()  # transformers and vLLM load it: a sync must write it
    save_file({k: t[k] for k in ("c.weight", "d.scalar", "e.empty")},
              sharded / "m-2.safetensors")
    entries = read_dir(sharded)
    assert Path(entries["e.empty"][0].path).name == "m-2.safetensors"


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "model.safetensors"])
def test_a_directory_where_the_index_or_the_single_shard_belongs_is_named(tmp_path: Path,
                                                                           name: str):
    (tmp_path / name).mkdir()  # not taken as no checkpoint (a first save would fail last)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: not a file \(a directory"):
        read_dir(tmp_path)


def test_single_file_and_empty_dir(tmp_path: Path, shard: Path):
    assert read_index(tmp_path) == dict.fromkeys(_tensors(), "model.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert read_index(empty) is None and read_dir(empty) is None  # a first full save
    assert read_index(tmp_path / "absent") is None
    os.rename(shard, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match=r"\['other.safetensors'\] but neither"):
        read_index(tmp_path)


def test_a_header_read_before_is_checked_again_against_the_file_s_new_size(shard: Path):
    """The same header bytes in a file grown or cut since: its tensors no longer tile
    the data section, and the loader would refuse it."""
    read_shard(shard)
    with open(shard, "ab") as f:
        f.write(b"\0" * 4)
    with pytest.raises(CheckpointError, match="4 trailing bytes after the last tensor"):
        read_shard(shard)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    with pytest.raises(CheckpointError, match="past the end of the data section"):
        read_shard(shard)


@pytest.mark.parametrize(("corrupt", "message"), [
    # the tensors tile the data section, but a and c share one byte
    (lambda p: _rewrite(p, lambda h: (
        h["c.weight"].__setitem__("data_offsets", [61, 109]),
        h.__setitem__("f.tail", {"dtype": "U8", "shape": [1], "data_offsets": [109, 110]}))),
     r"tensor c.weight \[\d+, \d+\) overlaps tensor a.weight"),
    # 9 four-bit values are 4.5 bytes: no whole number of bytes holds them
    (lambda p: _rewrite(p, lambda h: h["d.scalar"].update(dtype="F4", shape=[9])),
     r"tensor d.scalar: data_offsets \[28, 32\] hold 4 bytes, but F4 x \[9\] needs 4.5"),
])
def test_tensors_that_share_a_byte_or_end_inside_one_are_refused(shard: Path, corrupt,
                                                                 message):
    corrupt(shard)
    with pytest.raises(CheckpointError, match=message):
        read_shard(shard)
