"""codec: compact patch pieces (gap-coded indices, raw or xor values), zstd rounds; exact."""

import contextlib
import json
import re
import subprocess
import sys
import textwrap
import zlib
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch

from hotweights.errors import DeltaError, install
from hotweights.remote import codec, delta, jit, packing, prefilter, shards
from hotweights.remote.delta import encode, encode_all
from hotweights.remote.delta_apply import apply, checked
from hotweights.remote.packing import Round, pack
from hotweights.remote.staging import Staged
from test_delta import _flip, _random, _same_bits, _state

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
          torch.uint8, torch.int32, torch.int64, torch.bool]
OPTIONS = [{}, {"values": "xor"}, {"compress": "zstd"}, {"values": "xor", "compress": "zstd"}]


@pytest.fixture(params=["jit", "numpy"])
def decoder(request, monkeypatch):
    """Each test with it runs twice: patches decoded by the compiled loop, then by numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(jit, "_loops", False)
    elif not jit.enabled():
        pytest.skip("numba is not installed: no compiled decode")
    return request.param


def _sync(old: dict, new: dict, max_bytes: int = 1 << 20, **options) -> list[Round]:
    """Pack, send through JSON, apply to a copy of `old`; check it ends bit-identical."""
    rounds = list(pack(encode_all(old, new), max_bytes=max_bytes, **options))
    got = {k: v.clone() for k, v in old.items()}
    for r in rounds:
        apply(Round(json.loads(r.header_bytes()), r.buffer.clone()), got)
    assert _same_bits(got, new)
    return rounds


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", [[0], [2047], [0, 1, 2, 3], [0, 2047], [5, 6, 900, 2000],
                                   "scattered"])
def test_compact_round_trip_is_exact(dtype, where, options, decoder):
    old = _random((64, 32), dtype)
    index = torch.randperm(2048, generator=torch.Generator().manual_seed(2))[:40] \
        if where == "scattered" else where
    new = _flip(old, index)
    assert encode("w", old, new).kind == "patch"
    (r,) = _sync({"w": old}, {"w": new}, **options)
    (e,) = r.header["entries"]
    assert e["values"] == options.get("values", "raw") and e["count"] == len(index)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_xor_of_values_whose_sign_and_exponent_change(dtype, decoder):
    old = _random((64, 64), dtype)
    new = old.clone().view(-1)
    pick = torch.arange(0, 4096, 37)
    new[pick[0::3]] *= -1  # sign
    new[pick[1::3]] *= 1024  # exponent
    new[pick[2::3]] = float("inf")  # exact bit patterns: Inf too (Staged refuses it)
    new = new.view(64, 64)
    assert encode("w", old, new).kind == "patch"
    for options in OPTIONS:
        _sync({"w": old}, {"w": new}, **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_xor_values_decoded_without_old_values_are_the_xors(dtype, decoder):
    # what a receiver applying them in place at its commit keeps (`Staged`'s bare xors)
    old = _random((64, 32), dtype)
    new = _flip(old, torch.randperm(2048, generator=torch.Generator().manual_seed(5))[:300])
    (r,) = pack(encode_all({"w": old}, {"w": new}), max_bytes=1 << 20, values="xor")
    (e,) = r.header["entries"]
    data = r.buffer.numpy()[e["offset"]:e["offset"] + sum(e["sections"])]
    idx, xors = codec.decode(e, data, numel=old.numel(), itemsize=old.element_size(),
                             floating=dtype.is_floating_point)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[old.element_size()]
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[old.element_size()]
    was, now = (t.reshape(-1).view(ints).numpy().view(bits) for t in (old, new))
    assert np.array_equal(idx, np.flatnonzero(was != now))
    assert np.array_equal(xors, was[idx] ^ now[idx])


def test_int64_indices_and_huge_gaps_in_the_codec():
    numel = 1 << 40  # no tensor: the codec reads only the element count
    idx = np.array([0, 1, 3, 1 << 20, (1 << 39) + 5, numel - 2, numel - 1], np.int64)
    bits = np.arange(len(idx), dtype=np.uint16) * 1000
    for old in (None, bits ^ np.uint16(3)):
        fields, data = codec.encode(idx, bits, floating=True, old=old)
        assert fields["first"] == 0 and codec.check_fields(fields, numel, 2) == len(data)
        got_idx, got = codec.decode(fields, data, numel=numel, itemsize=2, floating=True,
                                    old=lambda i, old=old: old)
        assert got_idx.tolist() == idx.tolist() and got.tolist() == bits.tolist()
    fields, data = codec.encode(idx[:0], bits[:0], floating=True)
    assert len(data) == 0 and codec.decode(fields, data, numel=numel, itemsize=2,
                                           floating=True)[0].size == 0


@pytest.mark.parametrize("values", codec.VALUES)
def test_indices_decoded_as_int32_where_asked_are_those_of_int64(decoder, values):
    rng = np.random.default_rng(1)
    numel = 1 << 20
    idx = np.sort(rng.choice(numel, numel // 50, replace=False))
    bits = rng.integers(0, 1 << 16, len(idx), dtype=np.uint16)
    old = None if values == codec.RAW else bits ^ np.uint16(5)
    fields, data = codec.encode(idx, bits, floating=True, old=old)
    wide, narrow = (codec.decode(fields, data, numel=numel, itemsize=2, floating=True,
                                 index=index) for index in (np.int64, np.int32))
    assert wide[0].dtype == np.int64 and narrow[0].dtype == np.int32
    assert np.array_equal(wide[0], idx) and np.array_equal(narrow[0], idx)
    assert np.array_equal(wide[1], narrow[1])


def test_int64_index_tensor_round_trip(monkeypatch):
    monkeypatch.setattr(delta, "INT64_INDEX_FROM", 100)
    old = _random((40, 40), torch.bfloat16)
    new = _flip(old, [0, 1, 777, 1599])
    assert encode("w", old, new).indices.dtype == torch.int64
    for options in OPTIONS:
        _sync({"w": old}, {"w": new}, **options)


@pytest.mark.parametrize("max_bytes", [64, 100, 200, 300])
def test_compact_pieces_split_across_small_rounds(monkeypatch, max_bytes):
    monkeypatch.setattr(packing, "_BLOCK", 50)  # several pieces per tensor, split again by room
    old = _random((64, 64), torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    new = _flip(old, torch.randperm(4096, generator=g)[:600])
    for options in ({}, {"values": "xor"}):
        rounds = _sync({"w": old}, {"w": new}, max_bytes, **options)
        assert len(rounds) > 1 and all(r.buffer.numel() <= max_bytes for r in rounds)
        assert sum(e["count"] for r in rounds for e in r.header["entries"]) == 600


def _scattered(numel=1 << 22, seed=1) -> tuple[dict, torch.Tensor]:
    old = {"w": (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 0.02
                 ).to(torch.bfloat16)}
    g = torch.Generator().manual_seed(seed + 1)
    return old, torch.randperm(numel, generator=g)[:numel // 100]


def _per_element(old: dict, new: dict, **options) -> float:
    rounds = _sync(old, new, 64 << 20, **options)
    changed = sum(e["count"] for r in rounds for e in r.header["entries"])
    return sum(r.wire_bytes for r in rounds) / changed


def test_bytes_per_changed_element_at_one_percent_scattered_bf16():
    old, pick = _scattered()
    flip = {"w": _flip(old["w"], pick)}  # the lowest bit: the benchmark's update
    raw, xor = _per_element(old, flip), _per_element(old, flip, values="xor")
    assert raw <= 2.4 and xor <= 1.1, (raw, xor)
    # RL-like: a small relative step, rounded to bf16: a few low bits flip, some carry further
    w = old["w"].float()
    step = w * (1 + 0.02 * torch.randn(w.shape, generator=torch.Generator().manual_seed(4)))
    rl = w.clone()
    rl[pick] = step[pick]
    rl = {"w": rl.to(torch.bfloat16)}
    raw, xor = _per_element(old, rl), _per_element(old, rl, values="xor")
    assert raw <= 2.5 and xor <= 1.8 and xor < raw, (raw, xor)  # measured 2.38, 1.69


def test_a_patch_without_its_old_tensor_sends_raw_values_even_when_xor_is_asked():
    old, new = _state()
    deltas = [replace(d, old_values=None) if d.name == "b" else d for d in encode_all(old, new)]
    (r,) = pack(deltas, max_bytes=1 << 20, values="xor")
    assert next(e for e in r.header["entries"] if e["name"] == "b")["values"] == "raw"
    (r,) = pack(encode_all(old, new), max_bytes=1 << 20, values="xor")
    assert next(e for e in r.header["entries"] if e["name"] == "b")["values"] == "xor"
    got = {k: v.clone() for k, v in old.items()}
    for r in pack(deltas, max_bytes=1 << 20, values="xor"):
        apply(r, got)
    assert _same_bits(got, new)


def _specs(w: dict) -> dict:
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in w.items()}


def test_staged_decodes_xor_against_its_old_values_and_refuses_without_them():
    old, new = _state()
    rounds = list(pack(encode_all(old, new), max_bytes=200, values="xor", compress="zstd"))
    got = {k: v.clone() for k, v in old.items()}
    staged = Staged(_specs(old), old=old, shards={k: shards.whole(v) for k, v in got.items()})
    for r in rounds:
        staged(r)
    staged.clear()  # keeps its old values
    for r in rounds:
        staged(r)
    assert staged.apply_in_place() == {"a", "b", "c"}
    assert _same_bits(got, new)
    blind = Staged(_specs(old))
    with pytest.raises(DeltaError, match=r"this receiver cannot decode xor values for `b`"):
        for r in rounds:
            blind(r)
    with pytest.raises(DeltaError, match=r"cannot decode xor values for `b`"):
        Staged(_specs(old), old={"a": old["a"]})(next(
            r for r in rounds if any(e["name"] == "b" for e in r.header["entries"])))


def test_staged_refuses_nan_once_decoded():
    old, new = _state()
    new["b"] = new["b"].clone()
    new["b"][7] = float("nan")
    (r,) = pack(encode_all(old, new), max_bytes=1 << 20, values="xor")
    with pytest.raises(DeltaError, match="`b`: the patch values hold NaN or Inf"):
        Staged(_specs(old), old=old)(r)


def test_xor_values_for_a_tensor_targets_name_twice_are_refused():
    """Tied weights sent under both names, in two rounds: the second round's xors would
    decode against the first one's new values and write the old ones back."""
    old = torch.randn(8, 16).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[[3, 50, 100]] += 1
    deltas = list(encode_all({"embed": old, "lm_head": old}, {"embed": new, "lm_head": new}))
    rounds = list(pack(deltas, max_bytes=1 << 20, values="xor", cut_bytes=1))
    assert len(rounds) == 2
    w = old.clone()
    with pytest.raises(DeltaError, match=r"`embed`: xor values, and `lm_head` is the same "
                       r"tensor in targets \(tied\).*; nothing was written"):
        apply(rounds[0], {"embed": w, "lm_head": w})
    assert torch.equal(w, old)
    for r in pack(deltas, max_bytes=1 << 20, values="raw", cut_bytes=1):  # raw: exact
        apply(r, {"embed": w, "lm_head": w})
    assert torch.equal(w, new)


@pytest.mark.parametrize("tail", ["garbage", "another frame", "cut off"])
def test_a_zstd_buffer_is_one_whole_frame(tail):
    zstandard = pytest.importorskip("zstandard")
    frame = zstandard.ZstdCompressor().compress(b"a" * 100)
    data = {"garbage": frame + b"garbage", "another frame": frame + frame,
            "cut off": frame[:-3]}[tail]
    with pytest.raises(codec.CodecError, match="cut off inside its zstd frame" if
                       tail == "cut off" else r"holds \d+ bytes after its zstd frame"):
        codec.zstd_decompress(data, 100)
    assert codec.zstd_decompress(frame, 100) == b"a" * 100


def test_zstd_shrinks_rows_and_is_named_when_missing(monkeypatch):
    old, new = _state()
    (plain,) = pack(encode_all(old, new), max_bytes=1 << 20)
    (z,) = _sync(old, new, compress="zstd")
    assert z.header["compress"] == "zstd" and z.header["raw_nbytes"] == plain.header["nbytes"]
    assert z.buffer.numel() < plain.buffer.numel()
    staging = torch.empty(1 << 20, dtype=torch.uint8)
    (s,) = pack(encode_all(old, new), max_bytes=1 << 20, staging=staging, compress="zstd")
    assert s.buffer.data_ptr() == staging.data_ptr() and torch.equal(s.buffer, z.buffer)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import fails
    with pytest.raises(DeltaError, match=r"compress='zstd' needs the zstandard package: "
                       rf"{re.escape(install('zstd'))}"):
        pack([], max_bytes=128, compress="zstd")
    with pytest.raises(DeltaError, match=re.escape(install("zstd"))):
        apply(z, {k: v.clone() for k, v in old.items()})


# -- corrupt pieces: refused by name, nothing written, never out of bounds --------------------

def _compact(unary_widths: bool = True):
    """(old, a round of xor pieces, its piece of `b`: 6 float32 values, each's lowest bit
    flipped; their bit lengths in unary, or with `unary_widths` False in bytes)."""
    old, new = _state()
    new["b"] = _flip(old["b"], [3, 7, 99, 300, 301, 998])
    with _widths_in_bytes(not unary_widths):
        (r,) = pack(encode_all(old, new), max_bytes=1 << 20, values="xor")
    b = next(e for e in r.header["entries"] if e["name"] == "b")
    assert b["count"] == 6 and b["values"] == "xor" and ("widths" in b) == unary_widths
    return old, r, b


def _widths_in_bytes(on: bool = True):
    """While `on`: xor values' bit lengths coded in bytes (deflated where smaller), never in
    unary."""
    return mock.patch.object(codec, "_unary_min", lambda lengths, k: None) if on else \
        contextlib.nullcontext()


def _with_byte(r, b, section: int, value: int) -> Round:
    """`r` with the first byte of `b`'s section `section` set to `value`."""
    buf = r.buffer.clone()
    buf[b["offset"] + sum(b["sections"][:section])] = value
    return Round(r.header, buf)


def _with(r, **fields) -> Round:
    h = json.loads(r.header_bytes())
    next(e for e in h["entries"] if e["name"] == "b").update(fields)
    return Round(h, r.buffer)


def _without(r, field: str) -> Round:
    h = json.loads(r.header_bytes())
    del next(e for e in h["entries"] if e["name"] == "b")[field]
    return Round(h, r.buffer)


def _bad_compact():
    old, r, b = _compact()  # unary bit lengths
    _, rb, bb = _compact(unary_widths=False)  # in bytes
    sec = bb["sections"]
    z = next(iter(pack(encode_all(*_state()), max_bytes=1 << 20, compress="zstd")))
    garbage = z.buffer.clone()
    garbage[len(garbage) // 2:] ^= 0x5A
    return old, {
        "count_high": (_with(r, count=1001), r"`b`: field 'count' 1001 elements"),
        "count_type": (_with(r, count="6"), r"`b`: field 'count' must be an int"),
        "first": (_with(r, first=998), r"`b`: field 'indices' run past the 1000 elements"),
        "first_out": (_with(r, first=1000), r"`b`: field 'count'"),
        "shift": (_with(r, shift=63), r"`b`: field 'count'"),
        "values": (_with(r, values="delta"), r"`b`: field 'values' must be one of"),
        "sections_len": (_with(r, sections=sec[:4]), r"`b`: field 'sections' must be 5"),
        "section_size": (_with(r, sections=[sec[0] + 1, *sec[1:]]),
                         r"`b`: field 'sections' \[0\] is"),
        "zipped": (_with(rb, zipped=[0]), r"`b`: field 'zipped' must list some of \[3\]"),
        "zipped_unary": (_with(rb, zipped=[1]), r"`b`: field 'zipped' must list some of \[3\]"),
        "high": (_with(r, high="bytes"), r"`b`: field 'high' must be 'unary' or absent"),
        "bytes_high": (_without(r, "high"),
                       r"`b`: field 'sections' \[1\] is \d+ bytes, 6 elements make 5"),
        "unzipped": (_with(rb, zipped=[3]),
                     r"`b`: field 'values' (does not inflate|inflates to)"),
        "xor_bits": (_with(rb, sections=[*sec[:4], sec[4] + 8], nbytes=bb["nbytes"] + 8),
                     r"`b`: field '(values|nbytes|offset)'"),
        "escapes": (_with(rb, sections=[sec[0], sec[1], 8, *sec[3:]], nbytes=bb["nbytes"] + 8),
                    r"`b`: field 'indices' hold 0 escaped gaps, section \[2\] 1"),
        "widths": (_with(r, widths="bytes"),
                   r"`b`: field 'widths' must be 'unary' \(xor values only\) or absent"),
        "widths_raw": (_with(r, values="raw"), r"`b`: field 'widths' must be 'unary' \(xor"),
        "wmin": (_with(r, wmin=33), r"`b`: field 'wmin' must be an int from 0 to 32, found 33"),
        "wmin_type": (_with(r, wmin="1"), r"`b`: field 'wmin' must be an int"),
        "wmin_missing": (_without(r, "wmin"), r"`b`: field 'wmin' must be an int"),
        "widths_zipped": (_with(r, zipped=[3]), r"`b`: field 'zipped' must list some of \[\]"),
        "widths_size": (_with(r, sections=[*b["sections"][:3], 0, b["sections"][4]],
                              nbytes=b["nbytes"] - 8),
                        r"`b`: field 'sections' \[3\] is 0 bytes: not 6 unary bit lengths"),
        "widths_count": (_with_byte(r, b, 3, 0xFF),
                         r"`b`: field 'values' hold 8 unary bit lengths in 1 bytes, expected 6"),
        "widths_long": (_with(_with_byte(r, b, 3, 0b01111110), wmin=32),
                        r"`b`: field 'values' hold a unary bit length of 1 zeros, more than 0"),
        "zstd_garbage": (Round(z.header, garbage), r"field '(buffer|raw_nbytes)'"),
        "zstd_size": (Round({**z.header, "raw_nbytes": z.header["raw_nbytes"] + 8}, z.buffer),
                      r"field 'raw_nbytes' is \d+, the entries make"),
    }


@pytest.mark.parametrize("case", list(_bad_compact()[1]))
def test_corrupt_compact_piece_is_refused_by_name_and_nothing_is_written(case, decoder):
    old, cases = _bad_compact()
    r, match = cases[case]
    targets = {k: v.clone() for k, v in old.items()}
    with pytest.raises(DeltaError, match=match):
        apply(r, targets)
    assert _same_bits(targets, old)


def test_random_corruption_never_escapes_as_another_error_or_writes_out_of_bounds(decoder):
    old, new = _state()
    g = np.random.default_rng(0)
    for options, unary_widths in (({}, None), ({"values": "xor"}, True),
                                  ({"values": "xor"}, False)):
        with _widths_in_bytes(unary_widths is False):
            (r,) = pack(encode_all(old, new), max_bytes=1 << 20, **options)
        b = next(e for e in r.header["entries"] if e["name"] == "b")
        assert ("widths" in b) == bool(unary_widths)
        for _ in range(300):
            buf = r.buffer.clone()
            at = b["offset"] + int(g.integers(0, max(1, sum(b["sections"]))))
            buf[at] ^= int(g.integers(1, 256))
            targets = {k: v.clone() for k, v in old.items()}
            try:
                for e, _, (idx, _vals) in (x for x in checked(Round(r.header, buf), targets,
                                                              old=targets)
                                           if x[0]["name"] == "b"):
                    assert e["count"] == len(idx) and int(idx.min()) >= 0 and \
                        int(idx.max()) < 1000 and bool((idx[1:] > idx[:-1]).all())
            except DeltaError as err:
                assert "`b`" in str(err)


def _bits_reference(x: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The bit stream written one bit at a time: the wire format the codec must keep."""
    bits = [(int(v) >> b) & 1 for v, w in zip(x, widths, strict=True) for b in range(int(w))]
    return np.packbits(np.array(bits, np.uint8), bitorder="little") if bits else \
        np.zeros(0, np.uint8)


@pytest.mark.parametrize("seed", range(6))
def test_bit_packing_matches_the_bit_by_bit_stream_at_every_width(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    x = rng.integers(0, 1 << 63, n, dtype=np.uint64) << np.uint64(1) | np.uint64(seed & 1)
    for width in (1, 3, 5, 7, 9, 13, 31, 33, 55, 56, 57, 62):  # fixed (whole bytes: a byte path)
        packed = codec._pack_fixed(x, width)
        assert np.array_equal(packed, _bits_reference(x, np.full(n, width)))
        mask = np.uint64((1 << width) - 1)
        assert np.array_equal(codec._unpack_fixed(packed, n, width), x & mask)
    widths = rng.integers(0, 64, n)  # varying, zero widths included
    widths[rng.random(n) < 0.3] = 0
    for w in (widths, widths % 57, np.full(n, 5)):  # any; grouped reads; one width
        packed = codec._pack_varying(x, w)
        assert np.array_equal(packed, _bits_reference(x, w))
        mask = (np.uint64(1) << w.astype(np.uint64)) - np.uint64(1)
        assert np.array_equal(codec._unpack_varying(packed, w), x & mask)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_bit_length_is_exact_at_every_size(dtype):
    top = np.iinfo(dtype).max
    x = np.array([0, 1, 2, 3, top >> 1, (top >> 1) + 1, top - 1, top], dtype)
    assert codec._bit_length(x).tolist() == [int(v).bit_length() for v in x]


@pytest.mark.parametrize("high", [1, 3, 255])
def test_gaps_that_would_wrap_when_shifted_are_refused(high, decoder):
    # shift 62: a high byte of 1 makes a gap of 2**62, 3 one past int64: never read as
    # negative indices (an escaped 255 stands for section [2]'s uint64)
    escape = np.array([999], "<u8").view(np.uint8) if high == 255 else np.zeros(0, np.uint8)
    data = np.concatenate([np.zeros(8, np.uint8), [high], escape, [0x7F, 0x7F], [0, 0]])
    fields = {"count": 2, "first": 0, "shift": 62, "values": "raw",
              "sections": [8, 1, len(escape), 2, 2], "zipped": []}
    assert codec.check_fields(fields, 1000, 2) == len(data)
    with pytest.raises(codec.CodecError, match="run past the 1000 elements"):
        codec.decode(fields, data.astype(np.uint8), numel=1000, itemsize=2, floating=True)


@pytest.mark.parametrize("unary, match", [
    ([0b11], None),  # two gaps of 0: indices 0, 1, 2
    ([0b1, 0b1], None),  # gaps 0 and 7
    ([0b111], r"hold 3 unary gaps in 1 bytes, expected 2"),
    ([0b11, 0], r"hold 2 unary gaps in 2 bytes, expected 2"),  # a byte past the last one
    ([0b1], r"hold 1 unary gaps in 1 bytes, expected 2"),
    ([0b1, 0, 0b100], r"a unary gap of 17 zeros, more than 16"),
    ([0b1, 0, 0b10], r"hold 1 escaped gaps, section \[2\] 0"),  # 16 zeros: escaped
])
def test_unary_gaps_are_read_exactly_or_refused_by_name(unary, match, decoder):
    fields = {"count": 3, "first": 0, "shift": 0, "high": "unary", "values": "raw",
              "sections": [0, len(unary), 0, 3, 3], "zipped": []}
    data = np.array([*unary, 0x7F, 0x7F, 0x7F, 0, 0, 0], np.uint8)
    assert codec.check_fields(fields, 1000, 2) == len(data)
    args = dict(numel=1000, itemsize=2, floating=True)
    if match is None:
        idx, _ = codec.decode(fields, data, **args)
        assert idx.tolist() == ([0, 1, 2] if len(unary) == 1 else [0, 1, 9])
        return
    with pytest.raises(codec.CodecError, match=match):
        codec.decode(fields, data, **args)


def test_format_2_pieces_with_high_bytes_are_still_read(decoder):
    rng = np.random.default_rng(0)
    idx = np.r_[np.sort(rng.choice(50_000, 500, replace=False)), 99_999]  # one escaped
    new = rng.integers(0, 1 << 16, len(idx), dtype=np.uint16)
    shift = 5
    gaps = (np.diff(idx) - 1).astype(np.uint64)
    high = gaps >> np.uint64(shift)
    sections = [codec._pack_fixed(gaps, shift), np.minimum(high, 255).astype(np.uint8),
                high[high >= 255].astype("<u8").view(np.uint8),
                *codec._planes(codec._rotl(new, 16), 2)]
    fields = {"count": len(idx), "first": int(idx[0]), "shift": shift, "values": "raw",
              "sections": [len(x) for x in sections], "zipped": []}
    data = np.concatenate(sections)
    assert codec.check_fields(fields, 100_000, 2) == len(data)
    got = codec.decode(fields, data, numel=100_000, itemsize=2, floating=True)
    assert np.array_equal(got[0], idx) and np.array_equal(got[1], new)


def test_gaps_at_random_cost_about_their_entropy():
    # 1 % of elements at random: geometric gaps of mean ~99 carry ~8.1 bits each
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(1_000_000, 10_000, replace=False))
    fields, _ = codec.encode(idx, np.zeros(len(idx), np.uint16), floating=True,
                             old=np.zeros(len(idx), np.uint16))
    bits = 8 * (fields["sections"][0] + fields["sections"][1] + fields["sections"][2])
    assert fields["shift"] == 6 and bits / (len(idx) - 1) < 8.4


def test_xor_bit_lengths_go_unary_where_that_costs_next_to_their_entropy(decoder):
    # a step of one or two units in the last place: ~geometric bit lengths, as small in
    # unary as deflated; the lowest bit flipped everywhere: one length, deflated to nothing
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(1_000_000, 10_000, replace=False))
    old = rng.integers(0, 1 << 15, len(idx), dtype=np.uint16)
    for new, unary in ((old + rng.integers(1, 3, len(idx)).astype(np.uint16), True),
                       (old ^ np.uint16(1), False)):
        fields, data = codec.encode(idx, new, floating=True, old=old)
        with _widths_in_bytes():
            deflated, _ = codec.encode(idx, new, floating=True, old=old)
        assert deflated["zipped"] == [3] and "widths" not in deflated
        if unary:
            assert fields["widths"] == "unary" and fields["wmin"] == 1 and not fields["zipped"]
            assert fields["sections"][3] <= 1.1 * deflated["sections"][3]
        else:
            assert fields == deflated and fields["sections"][3] < 64
        got = codec.decode(fields, data, numel=1_000_000, itemsize=2, floating=True, old=None)
        assert np.array_equal(got[0], idx) and np.array_equal(got[1], old ^ new)


def _random_piece(seed: int):
    """(value size, its unsigned dtype, the tensor's element count, sorted indices, old
    values of the whole tensor, new values at the indices) of a random piece: every value
    size; escapes (one huge gap) every third seed; wide xors (more than 56 bits at 8 bytes)
    on even seeds; on odd ones a step of one or two units in the last place where 1 mod 4
    (bit lengths in unary), else one flipped bit per value."""
    if not jit.enabled():
        pytest.skip("numba is not installed: nothing compiled")
    rng = np.random.default_rng(seed)
    s = [1, 2, 4, 8][seed % 4]
    utype, numel = codec.UINT[s], int(rng.integers(2, 1 << 20))
    idx = np.sort(rng.choice(numel, int(rng.integers(1, min(numel, 5000))), replace=False))
    if seed % 3 == 0:
        idx = np.unique(np.r_[0, idx[: len(idx) // 2], numel - 1])
    old = rng.integers(0, np.iinfo(utype).max, numel, dtype=utype, endpoint=True)
    new = rng.integers(0, np.iinfo(utype).max, len(idx), dtype=utype, endpoint=True)
    if seed % 4 == 1:
        new = old[idx] + rng.integers(1, 3, len(idx)).astype(utype)  # wraps: any bits
    elif seed % 2:
        new = old[idx] ^ (np.uint64(1) << rng.integers(0, 8 * s, len(idx)).astype(np.uint64)
                          ).astype(utype)
    return s, utype, numel, idx, old, new


def _numpy(monkeypatch, call, *args, **kwargs):
    """`call(*args, **kwargs)` with the compiled loops off."""
    monkeypatch.setattr(jit, "_loops", False)
    try:
        return call(*args, **kwargs)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("seed", range(8))
def test_compiled_decode_gives_the_numpy_decode_bit_for_bit(seed, monkeypatch):
    s, utype, numel, idx, old, new = _random_piece(seed)
    for kwargs in ({"old": old[idx]}, {}):
        for floating in (True, False):
            fields, data = codec.encode(idx, new, floating=floating, **kwargs)
            args = dict(numel=numel, itemsize=s, floating=floating)
            compiled = [codec.decode(fields, data, **args, old=o) for o in (old, lambda i: old[i])]
            ref = _numpy(monkeypatch, codec.decode, fields, data, **args, old=lambda i: old[i])
            assert np.array_equal(ref[0], idx) and np.array_equal(ref[1], new)
            for got in compiled:
                assert got[0].dtype == np.int64 and np.array_equal(got[0], ref[0])
                assert got[1].dtype == utype and np.array_equal(got[1], ref[1])


def test_the_compiled_decode_is_off_with_hotweights_jit_0(monkeypatch):
    monkeypatch.setattr(jit, "_loops", None)
    monkeypatch.setenv("HOTWEIGHTS_JIT", "0")
    assert not jit.enabled()
    jit.warm()  # a no-op


@pytest.mark.parametrize("seed", range(8))
def test_compiled_encode_writes_the_numpy_bytes(seed, monkeypatch):
    _, _, numel, idx, old, new = _random_piece(seed)
    for xor in (True, False):
        for floating in (True, False):
            for index, at in ((idx, slice(None)), (idx.astype(np.int32), slice(None)),
                              (idx[:1], slice(1))):
                kwargs = {"floating": floating, "old": old[idx][at] if xor else None}
                got = codec.encode(index, new[at], **kwargs)
                want = _numpy(monkeypatch, codec.encode, index, new[at], **kwargs)
                assert got[0] == want[0] and np.array_equal(got[1], want[1])


def test_the_compiled_loops_escape_where_the_codec_does():
    if not jit.enabled():
        pytest.skip("numba is not installed")
    from hotweights.remote import jit_loops

    assert (jit_loops._ESC, jit_loops._UNARY_ESC) == (codec._ESC, codec._UNARY_ESC)


def test_trailing_zeros_of_every_bit_position_both_ways():
    if not jit.enabled():
        pytest.skip("numba is not installed")
    import numba

    from hotweights.remote import jit_loops

    both = numba.njit(lambda x: (jit_loops.ctz(x), jit_loops.ctz_de_bruijn(x)))
    rng = np.random.default_rng(0)
    for tz in range(64):
        for x in {1 << tz, (1 << tz) | (int(rng.integers(0, 1 << 62)) << tz & (1 << 64) - 1)}:
            assert both(np.uint64(x)) == (tz, tz)


def test_unary_bit_lengths_of_every_excess_both_ways():
    # excesses up to 63 zeros: runs across word boundaries, each a value's whole width
    if not jit.enabled():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(0)
    widths = rng.integers(1, 65, 3000).astype(np.uint8)
    widths[:64] = np.arange(1, 65)
    packed = jit.unary_pack(widths, 1)
    assert np.array_equal(packed, codec._pack_unary(widths.astype(np.int64) - 1))
    assert np.array_equal(jit.unary_widths(packed, len(widths), 1, 63), widths)
    assert np.array_equal(codec._unary(packed, len(widths), 63, "values", "bit length") + 1,
                          widths)
    assert jit.unary_widths(packed, len(widths), 1, 62) is None  # a width of 64 is too long
    assert jit.unary_widths(packed, len(widths) + 1, 1, 63) is None  # one short
    assert jit.unary_widths(np.r_[packed, 0].astype(np.uint8), len(widths), 1, 63) is None


def test_compiled_scatter_writes_nothing_when_an_index_is_outside():
    if not jit.enabled():
        pytest.skip("numba is not installed")
    flat = np.zeros(10, np.uint16)
    assert jit.scatter(flat, np.array([1, 9], np.int64), np.array([5, 6], np.uint16))
    assert flat.tolist() == [0, 5] + [0] * 7 + [6]
    for bad in ([2, 10], [-1, 2]):
        assert not jit.scatter(flat, np.array(bad, np.int64), np.array([7, 7], np.uint16))
        assert not jit.xor_scatter(flat, np.array(bad, np.int64), np.array([7, 7], np.uint16))
    assert flat.tolist() == [0, 5] + [0] * 7 + [6]
    assert jit.xor_scatter(flat, np.array([1, 9], np.int64), np.array([5, 3], np.uint16))
    assert flat.tolist() == [0, 0] + [0] * 7 + [5]


def test_a_staged_xor_piece_outside_its_tensor_writes_nothing_and_is_named():
    from hotweights.remote.delta_apply import writer
    if not jit.enabled():
        pytest.skip("numba is not installed")
    target = torch.ones(8, dtype=torch.bfloat16)
    entry = {"name": "w", "kind": "patch", "xor": True}
    xors = torch.tensor([1, 1], dtype=torch.int16).view(torch.bfloat16)
    writer(entry, target, (torch.tensor([0, 7]), xors))()
    assert target.view(torch.int16).tolist() == [16256 ^ 1] + [16256] * 6 + [16256 ^ 1]
    with pytest.raises(DeltaError, match="`w`: a patch index is outside the tensor"):
        writer(entry, target, (torch.tensor([1, 8]), xors))()
    assert target.view(torch.int16).tolist() == [16256 ^ 1] + [16256] * 6 + [16256 ^ 1]


def test_numba_loaded_leaves_vllms_engine_start_alone():
    # vLLM starts an engine by reading vars() of every object of every module that has a
    # __dict__; llvmlite's library wrapper (numba's) answered `__dict__` with a C function
    # wrapper: every in-process engine started after the compiled loops loaded died
    if not jit.enabled():
        pytest.skip("numba is not installed")
    dispatcher = pytest.importorskip("vllm.triton_utils.dispatcher")
    if not hasattr(dispatcher, "_rebind_kernels"):
        pytest.skip("this vLLM does not rebind its kernels that way")
    dispatcher._rebind_kernels([])


def test_warm_compiles_what_an_update_then_runs():
    """`packing.warm` (a trainer's first update starts it) compiles the compare and the patch
    encode for the dtypes given with the signatures a real update uses: encoding one after
    it compiles nothing more."""
    if not jit.enabled():
        pytest.skip("numba is not installed: nothing compiled")
    loops = jit._get()
    names = ("compare1", "compare2", "compare4", "compare8", "encode")
    packing.warm([torch.bfloat16, torch.float32, torch.complex64])  # complex: refused, quietly
    compiled = {n: list(getattr(loops, n).signatures) for n in names}
    g = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(256, 1024, generator=g).to(torch.bfloat16),
           "odd": torch.randn(33, 7, generator=g).to(torch.bfloat16),
           "b": torch.randn(1001, generator=g)}
    new = {k: t.clone() for k, t in old.items()}
    for t in new.values():
        flat = t.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
        flat[torch.randperm(flat.numel(), generator=g)[:flat.numel() // 100 + 1]] ^= 1
    rows = prefilter.candidates(prefilter.fingerprints(old), prefilter.fingerprints(new), new)
    for r in (None, rows):
        rounds = list(packing.pack(delta.encode_each(old, new, rows=r), max_bytes=1 << 22,
                                   values="xor"))
        assert {e["kind"] for r_ in rounds for e in r_.header["entries"]} == {delta.PATCH}
    assert {n: list(getattr(loops, n).signatures) for n in names} == compiled


ARGS = dict(numel=1000, itemsize=2, floating=True)


def test_an_escaped_gap_that_wraps_to_a_negative_index_is_refused(decoder):
    # an escape of 2**64 - 2 is -2 as int64: the second index would be -1 (the last
    # element, written through numpy's negative indexing) were escapes not bounded
    escape = np.array([(1 << 64) - 2], "<u8").view(np.uint8)
    data = np.concatenate([[255], escape, [0x7F, 0x7F], [0, 0]]).astype(np.uint8)
    fields = {"count": 2, "first": 0, "shift": 0, "values": "raw",
              "sections": [0, 1, 8, 2, 2], "zipped": []}
    assert codec.check_fields(fields, 1000, 2) == len(data)
    with pytest.raises(codec.CodecError, match="hold a gap past the 1000 elements"):
        codec.decode(fields, data, **ARGS)


def test_an_xor_bit_length_past_the_element_size_is_refused_by_name(decoder):
    # a length of 17 bits in a 2-byte element: a CodecError, never an IndexError
    fields = {"count": 1, "first": 5, "shift": 0, "values": "xor",
              "sections": [0, 0, 0, 1, 2], "zipped": []}
    data = np.array([17, 0xFF, 0xFF], np.uint8)
    assert codec.check_fields(fields, 1000, 2) == len(data)
    with pytest.raises(codec.CodecError, match="hold an xor of 17 bits, more than 16"):
        codec.decode(fields, data, **ARGS)


def test_a_deflated_section_followed_by_other_bytes_is_refused(decoder):
    z = zlib.compressobj(1, zlib.DEFLATED, -15)
    zipped = z.compress(bytes([0x7F, 0x7F])) + z.flush() + b"\x00"  # a byte after the stream
    data = np.concatenate([np.frombuffer(zipped, np.uint8), [0, 0]]).astype(np.uint8)
    fields = {"count": 2, "first": 0, "shift": 0, "values": "raw",
              "sections": [0, 1, 0, len(zipped), 2], "zipped": [3]}
    data = np.concatenate([[0], data]).astype(np.uint8)  # section [1]: one gap of 0
    assert codec.check_fields(fields, 1000, 2) == len(data)
    ok = dict(fields, sections=[0, 1, 0, len(zipped) - 1, 2])
    assert codec.decode(ok, np.delete(data, len(zipped)), **ARGS)[0].tolist() == [0, 1]
    with pytest.raises(codec.CodecError, match="inflates to 2 bytes, expected 2"):
        codec.decode(fields, data, **ARGS)


def test_an_escape_section_not_whole_uint64s_is_refused_by_check_fields():
    fields = {"count": 2, "first": 0, "shift": 0, "values": "raw",
              "sections": [0, 1, 3, 2, 2], "zipped": []}
    with pytest.raises(codec.CodecError, match=r"\[2\] is 3 bytes: not 8 per escaped gap"):
        codec.check_fields(fields, 1000, 2)


def test_a_deflated_section_far_longer_than_its_elements_is_refused():
    fields = {"count": 2, "first": 0, "shift": 0, "values": "raw",
              "sections": [0, 1, 0, 2 + 1024, 2], "zipped": [3]}
    assert codec.check_fields(fields, 1000, 2) == 2 + 1024 + 3
    fields["sections"][3] += 1
    with pytest.raises(codec.CodecError, match="too long for 2 elements"):
        codec.check_fields(fields, 1000, 2)


def test_a_zstd_frame_that_does_not_state_the_expected_size_is_refused_unread():
    zstandard = pytest.importorskip("zstandard")
    raw = bytes(1 << 20)
    for frame in (zstandard.ZstdCompressor(write_content_size=True).compress(raw),
                  zstandard.ZstdCompressor(write_content_size=False).compress(raw)):
        with pytest.raises(codec.CodecError, match=r"is 10, the buffer's zstd frame says"):
            codec.zstd_decompress(frame, 10)


def test_xor_bits_longer_than_the_elements_hold_are_refused_by_check_fields():
    fields = {"count": 1, "first": 0, "shift": 0, "values": "xor",
              "sections": [0, 0, 0, 1, 2], "zipped": []}
    assert codec.check_fields(fields, 1000, 2) == 3
    fields["sections"][4] = 3
    with pytest.raises(codec.CodecError, match=r"\[4\] is 3 bytes, more than 1 values hold"):
        codec.check_fields(fields, 1000, 2)


def _compiled(fields, data, numel, itemsize, floating, old):
    """`jit.decode` of a piece straight from its sections (no numpy fallback): None where
    the compiled loop refuses it."""
    k, parts = fields["count"], np.split(data, np.cumsum(fields["sections"])[:-1])
    third = codec._unzip(parts[3], k, "values") if 3 in fields["zipped"] else parts[3]
    if "widths" in fields:
        third = jit.unary_widths(third, k, fields["wmin"], 8 * itemsize - fields["wmin"])
        assert third is not None
    return jit.decode(k, fields["first"], numel, fields["shift"], parts[0], parts[1],
                      "high" in fields, parts[2].view("<u8"), fields["values"] == "xor",
                      third, parts[4], old, floating, codec.UINT[itemsize])


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_decode_takes_every_valid_piece_itself(seed):
    # a valid piece handed back (None) still decodes, the numpy way: only this notices
    _, utype, numel, idx, old, new = _random_piece(seed)
    for xor in (True, False):
        for floating in (True, False):
            fields, data = codec.encode(idx, new, floating=floating,
                                        old=old[idx] if xor else None)
            got = _compiled(fields, data, numel, utype().itemsize, floating, old)
            assert got is not None, fields
            assert np.array_equal(got[0], idx) and np.array_equal(got[1], new)


def test_a_gap_of_exactly_the_unary_escape_is_decoded_compiled():
    # high parts of 16 (the escape itself: 16 zeros, then the gap in section [2]) and 15
    if not jit.enabled():
        pytest.skip("numba is not installed")
    idx = np.r_[np.arange(100), 116, 132, np.arange(133, 233)]  # gaps 16 and 15, else 0
    new = np.arange(len(idx), dtype=np.uint16)
    fields, data = codec.encode(idx, new, floating=False)
    assert fields["shift"] == 0 and fields["sections"][2] == 8  # one escaped gap
    got = _compiled(fields, data, 1000, 2, False, None)
    assert got is not None and np.array_equal(got[0], idx) and np.array_equal(got[1], new)


def test_the_compiled_loops_are_on_where_numba_is_installed(monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.setattr(jit, "_loops", None)
    monkeypatch.delenv("HOTWEIGHTS_JIT", raising=False)
    assert jit.enabled()


def test_warm_compiles_what_a_staged_update_then_runs():
    """`jit.warm` (a server joining a trainer) compiles the decode, the unary bit lengths and
    both scatters for int32 and int64 indices: decoding pieces read from a received buffer
    (read-only) and applying them compiles nothing more. A fresh process: the loops that
    other tests ran are not yet there."""
    if not jit.enabled():
        pytest.skip("numba is not installed")
    script = textwrap.dedent("""
        import numpy as np
        from hotweights.remote import codec, jit
        loops = jit._get()
        names = ("decode", "xor_gather", "unary_widths", "scatter", "xor_scatter")
        jit.warm((2,))
        before = {n: list(getattr(loops, n).signatures) for n in names}
        idx = np.arange(0, 4000, 7)
        old = np.arange(4000, dtype=np.uint16)
        i = np.arange(1, len(idx) + 1)
        new = old[idx] ^ (i & -i).astype(np.uint16)  # xors of 1, 2, 3.. bits: unary lengths
        for xor in (True, False):
            fields, data = codec.encode(idx, new, floating=True, old=old[idx] if xor else None)
            assert ("widths" in fields) == xor
            data = np.frombuffer(data.tobytes(), np.uint8)  # read-only, as received
            for index in (np.int32, np.int64):
                for o in (old, None):
                    i, v = codec.decode(fields, data, numel=4000, itemsize=2, floating=True,
                                        old=o, index=index)
                    assert jit.scatter(old.copy(), i, v) and jit.xor_scatter(old.copy(), i, v)
        after = {n: list(getattr(loops, n).signatures) for n in names}
        assert after == before, (before, after)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_compiled_encode_counts_xor_bit_lengths_only():
    if not jit.enabled():
        pytest.skip("numba is not installed")
    idx, old = np.array([3, 9, 40, 41], np.int64), np.full(4, 5, np.uint16)
    new = old ^ np.array([1, 0x300, 0x8000, 0], np.uint16)  # xors of 1, 10, 16 and 0 bits
    _, hist = jit.encode(idx, new, old, True, 0, codec._BIT_LENGTH16)
    assert hist.nonzero()[0].tolist() == [0, 1, 10, 16] and hist.sum() == 4
    assert jit.encode(idx, new, None, True, 0, codec._BIT_LENGTH16)[1] is None  # raw values


def test_an_escape_that_no_gap_uses_is_refused():
    # section [2] one escape longer than the gaps escape: refused by both decoders
    if not jit.enabled():
        pytest.skip("numba is not installed")
    fields, data = codec.encode(np.array([2, 5, 9], np.int64), np.arange(3, dtype=np.uint16),
                                floating=False)
    s = fields["sections"]
    at = s[0] + s[1]
    data = np.concatenate([data[:at], np.zeros(8, np.uint8), data[at:]])
    fields = {**fields, "sections": [s[0], s[1], 8, s[3], s[4]]}
    assert codec.check_fields(fields, 1000, 2) == len(data)
    assert _compiled(fields, data, 1000, 2, False, None) is None
    with pytest.raises(codec.CodecError, match=r"hold 0 escaped gaps, section \[2\] 1"):
        codec.decode(fields, data, numel=1000, itemsize=2, floating=False)
