"""checkpoint.dtypes: every dtype torch and safetensors share is saved and synced; the
others are refused by name."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotweights.checkpoint import dtypes, sync
from hotweights.checkpoint.source import open_dir
from hotweights.errors import CheckpointError


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # FP8 has no == on the CPU: compare bytes


def _disk(d: Path) -> dict[str, torch.Tensor]:
    return {n: t for p in sorted(d.glob("*.safetensors")) for n, t in load_file(p).items()}


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])


@pytest.mark.parametrize("name", sorted(dtypes.TORCH))
def test_a_dtype_of_the_table_round_trips_through_first_save_and_sync(tmp_path, name):
    dtype, g = dtypes.TORCH[name], torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (64, 256 * dtype.itemsize), dtype=torch.uint8, generator=g)
    live = {"w": raw.view(dtype), "other": torch.randn(64, 256, generator=g)}
    first = sync(tmp_path, live, max_shard_size=50_000, mode="journal")
    assert first.first_save and len(first.shards_changed) == 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["w"]
    assert _header(tmp_path / shard)["w"]["dtype"] == name
    again = sync(tmp_path, live, mode="journal")
    assert again.bytes_written == 0 and again.bytes_compared == 0  # the sidecars serve
    live["w"].view(torch.uint8)[5, 3:9] ^= 0x55  # a few bytes of one row
    result = sync(tmp_path, live, mode="journal")
    assert result.tensors_changed == 1 and result.shards_changed == (shard,)
    assert 0 < result.bytes_written <= 4096  # the page that changed
    disk = _disk(tmp_path)
    for n, t in live.items():
        assert disk[n].dtype == t.dtype and torch.equal(_u8(disk[n]), _u8(t)), n
    mapped = open_dir(tmp_path)
    assert mapped["w"].dtype == dtype and torch.equal(_u8(mapped["w"]), _u8(live["w"]))
    mapped.close()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16,
                                   torch.uint32, torch.uint64])
def test_fp8_and_unsigned_tensors_saved_by_safetensors_sync(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    live = {"w": torch.randint(0, 256, (32, 64 * dtype.itemsize), dtype=torch.uint8,
                               generator=g).view(dtype)}
    save_file(live, tmp_path / "model.safetensors", metadata={"format": "pt"})
    live["w"].view(torch.uint8)[-1] += 1
    result = sync(tmp_path, live)
    assert result.tensors_changed == 1
    assert torch.equal(_u8(load_file(tmp_path / "model.safetensors")["w"]), _u8(live["w"]))


def test_a_live_dtype_safetensors_lacks_is_refused_at_first_save(tmp_path):
    live = {"a": torch.zeros(3), "w": torch.zeros(3, dtype=torch.complex128)}
    with pytest.raises(CheckpointError, match=r"^w in model.safetensors: the live tensor is "
                                              r"complex128, which has no safetensors dtype; "
                                              r"nothing was written$"):
        sync(tmp_path, live)
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob(".hotweights*"))


def _shard_of_dtype(path: Path, dtype: str, shape: list[int], nbytes: int) -> None:
    head = json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}})
    head += " " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head.encode() + bytes(nbytes))


@pytest.mark.parametrize(("dtype", "nbytes", "message"), [
    ("F6_E2M3", 3, r"w in .*/model.safetensors: the file holds F6_E2M3, which has no torch "
                   r"dtype: hotweights cannot sync it; nothing was written"),
    ("F4", 2, r"w in .*/model.safetensors: the file holds F4, which has no torch dtype"),
    ("Q7", 4, r"model.safetensors: tensor w: unknown dtype 'Q7'; known: BOOL, U8"),
])
def test_a_file_dtype_torch_lacks_is_refused_by_name(tmp_path, dtype, nbytes, message):
    path = tmp_path / "model.safetensors"
    _shard_of_dtype(path, dtype, [4], nbytes)
    before = path.read_bytes()
    for convert in (False, True):
        with pytest.raises(CheckpointError, match=message):
            sync(tmp_path, {"w": torch.ones(4, dtype=torch.uint8)}, convert_dtype=convert)
    assert path.read_bytes() == before


def test_fp4_is_refused_for_its_dtype_not_the_shape_of_torch_s_packed_form(tmp_path):
    from hotweights.checkpoint import diagnose

    _shard_of_dtype(tmp_path / "model.safetensors", "F4", [8], 4)
    live = {"w": torch.empty(4, dtype=torch.float4_e2m1fn_x2)}  # two values an element
    with pytest.raises(CheckpointError, match=r"the file holds F4, which has no torch dtype"):
        sync(tmp_path, live)
    assert [m.field for m in diagnose(tmp_path, live).mismatches] == ["dtype"]


def test_convert_dtype_casts_floats_only_and_refuses_an_overflow(tmp_path):
    """Integer (or quantized) values cast to floats, or floats to integers, lose their
    meaning: refused even when asked to cast; a float cast that turns finite values into
    inf (1e6 in F16) is refused naming the tensor. Nothing is written either way."""
    save_file({"w": torch.zeros(4, dtype=torch.float16)}, tmp_path / "model.safetensors")
    before = (tmp_path / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match=r"w in .*/model.safetensors: the file holds F16, "
                       r"the live tensor is int8; nothing was written: only floats of 16 "
                       r"bits or more are cast \(integer, FP8 or other quantized"):
        sync(tmp_path, {"w": torch.ones(4, dtype=torch.int8)}, convert_dtype=True)
    with pytest.raises(CheckpointError, match=r"the live tensor is float8_e4m3fn; nothing was "
                       r"written: only floats of 16 bits or more are cast"):
        sync(tmp_path, {"w": torch.ones(4, dtype=torch.float8_e4m3fn)}, convert_dtype=True)
    with pytest.raises(CheckpointError, match=r"w in .*/model.safetensors: cast to the file's "
                       r"float16, 1 finite value\(s\) overflow to inf \(beyond 65504\); "
                       "nothing was written"):
        sync(tmp_path, {"w": torch.tensor([1.0, 1e6, float("inf"), 2.0])},
             convert_dtype=True)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    sync(tmp_path, {"w": torch.tensor([1.0, 6e4, float("inf"), 2.0])}, convert_dtype=True)
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], torch.tensor(
        [1.0, 6e4, float("inf"), 2.0]).half())
