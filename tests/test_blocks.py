"""blocks: per-block fingerprints, their diff, and the file-bytes fallback (no vLLM)."""

import base64
import dataclasses
import json

import numpy as np
import pytest
import torch

from hotweights.changes import blocks
from hotweights.changes.blocks import TORCH, XXH3, Fingerprints, changed, compare_bytes, fingerprint
from hotweights.errors import FingerprintError

BS = 64  # small blocks keep every case tiny
KINDS = pytest.mark.parametrize("kind", [XXH3, TORCH])
DTYPES = [torch.bfloat16, torch.float32, torch.int32, torch.int8, torch.float16]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def _flip(t: torch.Tensor, *byte_offsets: int) -> torch.Tensor:
    out = t.clone()
    for o in byte_offsets:
        _u8(out)[o] ^= 0x10
    return out


def _ranges(old: dict, new: dict, kind: str, bs: int = BS) -> dict:
    c = changed(fingerprint(old, block_size=bs, kind=kind),
                fingerprint(new, block_size=bs, kind=kind))
    return {n: c.tensors[n].ranges.tolist() for n in c.tensors}


@KINDS
@pytest.mark.parametrize("dtype", DTYPES)
def test_unchanged_has_no_ranges(kind, dtype):
    t = (torch.randn(33, 7) * 100).to(dtype)  # 33*7 elements: a partial last block
    c = changed(fingerprint({"w": t}, block_size=BS, kind=kind),
                fingerprint({"w": t.clone()}, block_size=BS, kind=kind))
    tc = c.tensors["w"]
    assert tc.ranges.shape == (0, 2) and tc.blocks_changed == 0 and tc.density == 0.0
    assert c.bytes_changed == 0 and c.density == 0.0
    assert (c.added, c.removed, c.resized) == ((), (), ())


@KINDS
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_changed_byte_is_exactly_its_block(kind, dtype):
    t = (torch.randn(40, 10) * 100).to(dtype)
    nbytes = t.numel() * t.element_size()
    for off in (0, BS - 1, BS, 3 * BS + 5, nbytes - 1):
        start = off // BS * BS
        assert _ranges({"w": t}, {"w": _flip(t, off)}, kind) == {
            "w": [[start, min(start + BS, nbytes)]]}, off


@KINDS
def test_last_partial_block_and_ends(kind):
    t = torch.arange(100, dtype=torch.int8)  # 100 bytes: one full block + 36 bytes
    assert _ranges({"w": t}, {"w": _flip(t, 99)}, kind) == {"w": [[64, 100]]}
    assert _ranges({"w": t}, {"w": _flip(t, 64)}, kind) == {"w": [[64, 100]]}
    assert _ranges({"w": t}, {"w": _flip(t, 0, 99)}, kind) == {"w": [[0, 100]]}  # merged


@KINDS
def test_adjacent_blocks_merge_and_density(kind):
    t = torch.randn(256)  # 1024 bytes = 16 blocks
    new = _flip(t, 70, 130, 200, 900)  # blocks 1, 2, 3 and 14
    c = changed(fingerprint({"w": t}, block_size=BS, kind=kind),
                fingerprint({"w": new}, block_size=BS, kind=kind))
    tc = c.tensors["w"]
    assert tc.ranges.tolist() == [[64, 256], [896, 960]]
    assert tc.blocks_changed == 4 and tc.density == 4 / 16 and tc.bytes_changed == 256
    assert c.density == 4 / 16


@KINDS
def test_zero_element_tensor(kind):
    t = torch.zeros(0, 5, dtype=torch.bfloat16)
    fp = fingerprint({"e": t}, block_size=BS, kind=kind)
    assert fp.tensors["e"][0] == 0 and fp.tensors["e"][1].shape == (0,)
    tc = changed(fp, Fingerprints.from_dict(fp.to_dict())).tensors["e"]
    assert tc.blocks == 0 and tc.ranges.shape == (0, 2) and tc.density == 0.0


@KINDS
def test_added_removed_resized_by_name(kind):
    a, b = torch.randn(10), torch.randn(20)
    c = changed(fingerprint({"keep": a, "gone": a, "grow": a}, block_size=BS, kind=kind),
                fingerprint({"keep": a, "grow": b, "new": b}, block_size=BS, kind=kind))
    assert (c.added, c.removed, c.resized) == (("new",), ("gone",), ("grow",))
    assert list(c.tensors) == ["keep"]


def test_xxh3_and_torch_paths_find_the_same_blocks():
    g = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(3000, generator=g).to(torch.bfloat16),
           "b": torch.randint(-1000, 1000, (777,), generator=g, dtype=torch.int32),
           "c": torch.randn(50, 50, generator=g)}
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        u8 = _u8(t)
        idx = torch.randint(0, u8.numel(), (5,), generator=g)
        u8[idx] += 1
    assert _ranges(old, new, XXH3) == _ranges(old, new, TORCH)
    assert _ranges(old, new, XXH3, bs=4096) == _ranges(old, new, TORCH, bs=4096)


def test_compiled_xxh3_hashes_every_block_as_xxhash_does(monkeypatch):
    import xxhash

    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    per_call = {size: [xxhash.xxh3_64_intdigest(data[i:i + size].tobytes())
                       for i in range(0, len(data), size)]
                for size in (8, 64, 4096, 10_000, 1 << 20)}  # last blocks short or whole
    if (loop := blocks._xxh3_loop()) is None:
        pytest.skip("the compiled loops are off here (no numba)")
    for size, want in per_call.items():
        assert loop.hashes(data, size).tolist() == want
        assert blocks._xxh3(memoryview(data), size).tolist() == want
    assert blocks._xxh3(memoryview(data[:0]), 64).tolist() == []
    monkeypatch.setattr(blocks, "_xxh3_loop", lambda: None)  # one call per block
    assert blocks._xxh3(memoryview(data), 64).tolist() == per_call[64]


def test_torch_hash_sees_changes_a_linear_sum_would_cancel():
    # Negating the 4th bf16 of two words flips bit 63 of both: 2**63 + 2**63 == 0 mod 2**64.
    t = torch.ones(32, dtype=torch.bfloat16)
    new = t.clone()
    new[3], new[7] = -1, -1
    assert _ranges({"w": t}, {"w": new}, TORCH) == {"w": [[0, 64]]}


def test_torch_path_on_a_misaligned_view():
    base = torch.randn(1001, dtype=torch.bfloat16)
    view = base[1:]  # storage offset of 2 bytes: cannot be read as int64 in place
    a = fingerprint({"v": view}, block_size=BS, kind=TORCH)
    b = fingerprint({"v": view.clone()}, block_size=BS, kind=TORCH)
    assert np.array_equal(a.tensors["v"][1], b.tensors["v"][1])


def test_default_kind_and_block_size():
    fp = fingerprint({"w": torch.randn(4)})
    assert fp.kind == XXH3 and fp.block_size == blocks.DEFAULT_BLOCK_SIZE
    assert fp.tensors["w"][1].shape == (1,)


def test_requires_grad_parameter():
    p = torch.nn.Parameter(torch.randn(100))
    assert fingerprint({"p": p}, block_size=BS).tensors["p"][0] == 400


@KINDS
def test_non_contiguous_is_refused_by_name(kind):
    with pytest.raises(FingerprintError, match=r"non contiguous tensor: `w\.T`"):
        fingerprint({"w.T": torch.randn(8, 4).t()}, block_size=BS, kind=kind)


@pytest.mark.parametrize("bs", [0, -8, 12, 8.0, True])
def test_bad_block_size(bs):
    with pytest.raises(FingerprintError, match="'block_size' must be a positive multiple of 8"):
        fingerprint({"w": torch.randn(4)}, block_size=bs)


def test_bad_kind():
    with pytest.raises(FingerprintError, match="field 'kind' must be one of"):
        fingerprint({"w": torch.randn(4)}, kind="md5")


def test_mixing_kinds_or_block_sizes_is_an_error():
    t = {"w": torch.randn(100)}
    with pytest.raises(FingerprintError, match=r"field 'kind' differs \(old 'xxh3_64', new"):
        changed(fingerprint(t, block_size=BS, kind=XXH3), fingerprint(t, block_size=BS,
                                                                      kind=TORCH))
    with pytest.raises(FingerprintError, match=r"field 'block_size' differs \(old 64, new 128"):
        changed(fingerprint(t, block_size=64), fingerprint(t, block_size=128))


@KINDS
def test_json_round_trip(kind):
    t = {"a": torch.randn(1000).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64),
         "e": torch.zeros(0)}
    fp = fingerprint(t, block_size=BS, kind=kind)
    d = json.loads(json.dumps(fp.to_dict()))
    assert d["format"] == blocks.FORMAT and isinstance(d["tensors"]["a"]["hashes"], str)
    back = Fingerprints.from_dict(d, source="x.sidecar")
    assert (back.kind, back.block_size) == (kind, BS) and list(back.tensors) == list(t)
    for n in t:
        assert back.tensors[n][0] == fp.tensors[n][0]
        assert np.array_equal(back.tensors[n][1], fp.tensors[n][1])
    assert changed(fp, back).bytes_changed == 0


def _good() -> dict:  # 160 B: 3 blocks, 1 coarse
    return fingerprint({"w": torch.randn(40)}, block_size=BS, kind=XXH3, coarse=True).to_dict()


def _set(path: str, value):
    d = _good()
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return d


@pytest.mark.parametrize("d, match", [
    ([], "expected a JSON object, found list"),
    (_set("format", KeyError), "field 'format' must be 1, found None"),
    (_set("kind", KeyError), "field 'kind' must be one of .*, found None"),
    (_set("block_size", KeyError), "'block_size' must be a positive multiple of 8, found None"),
    (_set("tensors", KeyError), "field 'tensors' must be an object, found None"),
    (_set("format", 2), "field 'format' must be 1, found 2"),
    (_set("kind", "sha1"), "field 'kind' must be one of"),
    (_set("block_size", 100), "field 'block_size' must be a positive multiple of 8, found 100"),
    (_set("tensors", []), r"field 'tensors' must be an object, found \[\]"),
    (_set("tensors.w", 5), "field 'tensors.w' must be an object"),
    (_set("tensors.w.hashes", KeyError), "field 'tensors.w.hashes' must be a base64 string"),
    (_set("tensors.w.hashes", "not base64!"), r"field 'tensors.w.hashes' is not base64"),
    (_set("tensors.w.hashes", "AAAA"), r"'tensors.w.hashes' holds 3 bytes, not a multiple of 8"),
    (_set("tensors.w.hashes", base64.b64encode(bytes(16)).decode()),
     r"'tensors.w.hashes' must be 3 uint64 values \(160 bytes in 64-byte blocks\)"),
    (_set("tensors.w.nbytes", KeyError), r"'tensors.w.nbytes' must be an int >= 0, found None"),
    (_set("tensors.w.nbytes", -1), r"'tensors.w.nbytes' must be an int >= 0, found -1"),
    (_set("tensors.w.nbytes", 1000), r"'tensors.w.hashes' must be 16 uint64 values"),
    (_set("tensors.w.coarse", 7), "field 'tensors.w.coarse' must be a base64 string"),
    (_set("tensors.w.coarse", "AAAA"), r"'tensors.w.coarse' holds 3 bytes"),
    (_set("tensors.w.coarse", base64.b64encode(bytes(16)).decode()),
     r"'tensors.w.coarse' must be 1 uint64 values, found \(2,\)"),
    (_set("kind", TORCH), "coarse hashes are xxh3_64 only, found kind 'torch-mix64-v1'"),
])
def test_from_dict_validation(d, match):
    with pytest.raises(FingerprintError, match=r"^x\.sidecar: .*" + match):
        Fingerprints.from_dict(d, source="x.sidecar")


def test_constructor_validates_arrays():
    with pytest.raises(FingerprintError, match=r"'tensors.w.hashes' must be 2 uint64 values"):
        Fingerprints(XXH3, BS, {"w": (100, np.zeros(2, dtype=np.int64))})


@pytest.fixture(params=["compiled", "numpy"])
def compare_path(request, monkeypatch):
    """`compare_bytes` through its compiled loop, then through numpy's calls per range."""
    if request.param == "numpy":
        monkeypatch.setattr(blocks, "_compare_loop", lambda: None)
    elif blocks._compare_loop() is None:
        pytest.skip("no compiled loops here (numba missing or HOTWEIGHTS_JIT=0)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_compare_bytes_agrees_with_fingerprints(dtype, compare_path):
    g = torch.Generator().manual_seed(1)
    disk_t = (torch.randn(1234, generator=g) * 100).to(dtype)
    disk = _u8(disk_t).numpy().tobytes()  # what a file read gives: plain bytes
    nbytes = len(disk)
    for offs in [(), (0,), (nbytes - 1,), (5, 64, 65, 300, nbytes - 2)]:
        live = _flip(disk_t, *offs)
        want = _ranges({"w": disk_t}, {"w": live}, XXH3)["w"]
        odd = memoryview(b"x" + disk)[1:]  # a buffer that is not 8-byte aligned
        for buf in (disk, memoryview(disk), np.frombuffer(disk, np.uint8), odd):
            got = compare_bytes("w", live, buf, block_size=BS)
            assert got.ranges.tolist() == want, offs
        assert got.blocks == -(-nbytes // BS)


def test_compare_bytes_chunks(monkeypatch, compare_path):
    monkeypatch.setattr(blocks, "_CHUNK", 3 * BS)  # several chunks, the last one partial
    t = torch.arange(1000, dtype=torch.int8)
    live = _flip(t, 0, 190, 191, 192, 999)
    want = _ranges({"w": t}, {"w": live}, TORCH)["w"]
    assert compare_bytes("w", live, _u8(t).numpy(), block_size=BS).ranges.tolist() == want
    assert want == [[0, 64], [128, 256], [960, 1000]]


def test_compare_bytes_only_the_ranges_asked(monkeypatch, compare_path):
    monkeypatch.setattr(blocks, "_CHUNK", 3 * BS)  # a range spanning chunks
    t = torch.arange(1000, dtype=torch.int8)
    live = _flip(t, 0, 70, 400, 999)
    got = compare_bytes("w", live, _u8(t).numpy(), block_size=BS,
                        ranges=[(64, 512), (960, 1000)])
    assert got.ranges.tolist() == [[64, 128], [384, 448], [960, 1000]]  # byte 0 not asked
    assert got.blocks == 16 and got.blocks_changed == 3
    with pytest.raises(FingerprintError, match=r"w: range \[10, 64\) is not block-aligned"):
        compare_bytes("w", live, _u8(t).numpy(), block_size=BS, ranges=[(10, 64)])
    with pytest.raises(FingerprintError, match=r"w: range \[960, 1064\)"):
        compare_bytes("w", live, _u8(t).numpy(), block_size=BS, ranges=[(960, 1064)])
    assert compare_bytes("w", live, _u8(t).numpy(), block_size=BS, ranges=[]).blocks_changed == 0


def test_compare_bytes_errors():
    with pytest.raises(FingerprintError, match="w: live tensor has 16 bytes, the file 12"):
        compare_bytes("w", torch.zeros(4), b"\0" * 12, block_size=BS)
    with pytest.raises(FingerprintError, match="non contiguous tensor: `w`"):
        compare_bytes("w", torch.zeros(4, 4).t(), b"\0" * 64, block_size=BS)


def test_compare_bytes_zero_elements(compare_path):
    tc = compare_bytes("e", torch.zeros(0), b"", block_size=BS)
    assert tc.blocks == 0 and tc.ranges.shape == (0, 2)


def _equal_fp(a: Fingerprints, b: Fingerprints) -> bool:
    return (a.kind, a.block_size, list(a.tensors), list(a.coarse)) == \
        (b.kind, b.block_size, list(b.tensors), list(b.coarse)) and all(
        a.tensors[n][0] == b.tensors[n][0] and np.array_equal(a.tensors[n][1], b.tensors[n][1])
        for n in a.tensors) and all(np.array_equal(a.coarse[n], b.coarse[n]) for n in a.coarse)


def test_coarse_hashes_round_trip_and_are_dropped_at_another_grain():
    fp = fingerprint({"a": torch.randn(1000), "b": torch.randn(3)}, block_size=BS, kind=XXH3,
                     coarse=True)
    assert [len(fp.coarse[n]) for n in "ab"] == [-(-4000 // (BS * blocks.COARSE)), 1]
    d = json.loads(json.dumps(fp.to_dict()))
    assert _equal_fp(Fingerprints.from_dict(d), fp)
    d["coarse_blocks"] = blocks.COARSE * 2  # written by a build with another grain
    assert Fingerprints.from_dict(d).coarse == {}
    assert fingerprint({"a": torch.randn(4)}, block_size=BS, kind=XXH3).coarse == {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_refresh_equals_hashing_from_scratch(dtype):
    gen = torch.Generator().manual_seed(1)
    big = BS * blocks.COARSE  # bytes per coarse hash
    old = {"w": torch.randn(5 * big + 40, generator=gen).to(dtype),  # partial last region
           "e": torch.zeros(0, dtype=dtype), "s": torch.randn(3).to(dtype),
           "gone": torch.randn(9).to(dtype), "resized": torch.randn(big).to(dtype)}
    fp = fingerprint(old, block_size=BS, kind=XXH3, coarse=True)
    n = old["w"].nbytes
    everywhere = tuple(range(0, n, big // 2))
    for flips in [(), (0,), (big - 1, big), (n - 1,), everywhere, (3 * big + 7,)]:
        new = dict(old, w=_flip(old["w"], *flips), resized=torch.randn(big + 8).to(dtype),
                   added=torch.randn(70).to(dtype))
        del new["gone"]
        got = blocks.refresh(fp, new)
        scratch = fingerprint(new, block_size=BS, kind=XXH3, coarse=True)
        assert _equal_fp(dataclasses.replace(got, coarse={}),
                         dataclasses.replace(scratch, coarse={})), flips
        assert all(np.array_equal(h, scratch.coarse[k]) for k, h in got.coarse.items())
        # Kept where they will likely pay: not for a tensor changed all over, nor for
        # one without coarse hashes before that changed (or was resized, or added).
        assert set(got.coarse) == {"e", "s"} | ({"w"} if flips != everywhere else set())
        if len(flips) == 1:
            lo = flips[0] // BS * BS
            assert changed(fp, got).tensors["w"].ranges.tolist() == [[lo, min(lo + BS, n)]]


def test_refresh_gives_coarse_hashes_back_to_a_tensor_found_unchanged():
    ts = {"a": torch.randn(3 * BS), "b": torch.randn(3 * BS)}
    plain = fingerprint(ts, block_size=BS, kind=XXH3)  # e.g. after a sync that named them
    got = blocks.refresh(plain, dict(ts, b=_flip(ts["b"], 5)))
    assert list(got.coarse) == ["a"]
    assert np.array_equal(got.coarse["a"], fingerprint(ts, block_size=BS, kind=XXH3,
                                                       coarse=True).coarse["a"])


def test_refresh_hashes_per_block_only_where_a_coarse_hash_differs(monkeypatch):
    big = BS * blocks.COARSE
    old = {"w": torch.randn(8 * big // 4), "x": torch.randn(2 * big // 4)}
    fp = fingerprint(old, block_size=BS, kind=XXH3, coarse=True)
    seen = []
    real = blocks._xxh3
    monkeypatch.setattr(blocks, "_xxh3", lambda mv, size: seen.append((len(mv), size)) or
                        real(mv, size))
    new = dict(old, w=_flip(old["w"], 2 * big + 5, 6 * big))
    blocks.refresh(fp, new)
    per_block = sum(length for length, size in seen if size == BS)
    assert per_block == 2 * big  # the two regions that changed, not 10 regions' worth
    seen.clear()
    blocks.refresh(dataclasses.replace(fp, coarse={"w": fp.coarse["w"]}), old)  # x: none
    assert sum(length for length, size in seen if size == BS) == old["x"].nbytes


def test_refresh_and_coarse_errors():
    with pytest.raises(FingerprintError, match="refresh takes xxh3_64 fingerprints"):
        blocks.refresh(fingerprint({"a": torch.randn(4)}, block_size=BS, kind=TORCH), {})
    fp = fingerprint({"a": torch.randn(4)}, block_size=BS, kind=XXH3, coarse=True)
    with pytest.raises(FingerprintError, match="'tensors.b.coarse' has no block hashes"):
        Fingerprints(XXH3, BS, fp.tensors, {"b": fp.coarse["a"]})
    with pytest.raises(FingerprintError, match="non contiguous tensor: `t`"):
        blocks.refresh(fp, {"t": torch.randn(4, 4).t()})


def test_refresh_hashes_only_the_blocks_written_tells(monkeypatch):
    big = BS * blocks.COARSE
    old = {"w": torch.randn(3 * big // 4 + 5), "x": torch.randn(big // 4)}
    fp = fingerprint(old, block_size=BS, kind=XXH3, coarse=True)
    new = dict(old, w=_flip(old["w"], 5, 2 * big + BS + 1))
    seen = []
    real = blocks._xxh3
    monkeypatch.setattr(blocks, "_xxh3", lambda mv, size: seen.append(len(mv)) or
                        real(mv, size))
    got = blocks.refresh(fp, new, written={"w": [(0, 8), (2 * big + BS, 2 * big + BS + 2)],
                                           "x": []})
    assert seen == [BS, BS]  # one block per range, nothing of x
    scratch = fingerprint(new, block_size=BS, kind=XXH3, coarse=True)
    assert _equal_fp(dataclasses.replace(got, coarse={}), dataclasses.replace(scratch, coarse={}))
    assert list(got.coarse) == ["x"]  # w's no longer describe its bytes
    assert np.array_equal(got.coarse["x"], scratch.coarse["x"])


def test_refresh_hashes_the_block_a_written_range_starts_inside():
    # a watch's pages need not start on a block: the block holding the first written
    # byte is hashed again, else its change is never written
    old = {"w": torch.randn(4 * BS // 4)}  # 4 blocks
    fp = fingerprint(old, block_size=BS, kind=XXH3, coarse=True)
    new = dict(old, w=_flip(old["w"], BS + 5))
    got = blocks.refresh(fp, new, written={"w": [(BS + 4, BS + 8)]})
    assert changed(fp, got).tensors["w"].ranges.tolist() == [[BS, 2 * BS]]


def test_one_tensor_off_the_cpu_makes_the_default_kind_the_torch_hash():
    # xxh3 only when every tensor is on the CPU: one elsewhere (here `meta`) takes all
    # of them to the torch hash
    cpu, off = torch.zeros(8), torch.zeros(8, device="meta")
    assert blocks.kind_of([cpu, off]) == TORCH
    assert blocks.kind_of([off, cpu]) == TORCH
    assert blocks.kind_of([cpu, cpu]) == XXH3


def test_xxh3_of_a_tensor_off_the_cpu_is_refused_by_name():
    with pytest.raises(FingerprintError, match=r"m: xxh3_64 needs a CPU tensor, found meta; "
                                               r"use kind='torch-mix64-v1'"):
        fingerprint({"c": torch.zeros(8), "m": torch.zeros(8, device="meta")}, kind=XXH3)
