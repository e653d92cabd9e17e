"""`packing.pack`: a round's bytes (its padding zeroed, whatever the staging held), where
it is cut, when it goes uncompressed, and the staging it refuses."""

import json

import pytest
import torch

from hotweights.errors import DeltaError
from hotweights.remote.delta import encode_all
from hotweights.remote.delta_apply import apply
from hotweights.remote.packing import Round, pack
from test_delta import _flip, _random, _same_bits, _state


def _buffers(old, new, fill, **options):
    # one staging tensor first filled with `fill`: what a round leaves of it is its own
    staging = torch.full((1 << 12,), fill, dtype=torch.uint8)
    return [r.buffer.clone() for r in pack(encode_all(old, new), max_bytes=1 << 12,
                                           staging=staging, **options)]


def test_a_rounds_bytes_do_not_depend_on_what_the_staging_held_before():
    # alignment padding is zeroed: no stale bytes of an earlier round go on the wire
    old, new = _state()
    for options in ({}, {"patches": "flat"}, {"values": "xor"}):
        a, b = _buffers(old, new, 0, **options), _buffers(old, new, 0xFF, **options)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), options


def test_xor_values_go_as_xor_where_the_delta_holds_the_old_values():
    old = {"b": _random(1000, torch.float32)}
    new = {"b": _flip(old["b"], [3, 7, 99])}
    (r,) = pack(encode_all(old, new), max_bytes=1 << 12, values="xor")
    assert [e["values"] for e in r.header["entries"]] == ["xor"]
    got = {"b": old["b"].clone()}
    apply(r, got)
    assert _same_bits(got, new)
    (r,) = pack(encode_all(old, new), max_bytes=1 << 12)
    assert [e["values"] for e in r.header["entries"]] == ["raw"]


def test_a_flat_patch_of_an_odd_count_round_trips():
    # 3 int32 indices: 12 bytes, the values start at the next 8-byte boundary
    old = {"b": _random(1000, torch.bfloat16)}
    new = {"b": _flip(old["b"], [3, 7, 99])}
    (r,) = pack(encode_all(old, new), max_bytes=1 << 12, patches="flat")
    got = {"b": old["b"].clone()}
    apply(Round(json.loads(r.header_bytes()), r.buffer), got)
    assert _same_bits(got, new)


def test_a_round_that_zstd_does_not_shrink_goes_uncompressed():
    # random bits: compressed they would be longer, and past max_bytes
    g = torch.Generator().manual_seed(0)
    new = {"w": torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)}
    rounds = list(pack(encode_all(None, new), max_bytes=4096, compress="zstd"))
    assert all("compress" not in r.header and r.buffer.numel() <= 4096 for r in rounds)
    got = {"w": torch.zeros(4096, dtype=torch.uint8)}
    for r in rounds:
        apply(r, got)
    assert torch.equal(got["w"], new["w"])


def test_a_strided_or_two_dim_staging_is_refused_by_name():
    strided = torch.empty(256, dtype=torch.uint8)[::2]  # 128 bytes, every other one
    with pytest.raises(DeltaError, match=r"pack: field 'staging' must be contiguous 1-D uint8 "
                                         r"tensors of >= 128 bytes, found torch.uint8 of "
                                         r"shape \(128,\)"):
        pack([], max_bytes=128, staging=strided)
    with pytest.raises(DeltaError, match=r"found torch.uint8 of shape \(2, 64\)"):
        pack([], max_bytes=128, staging=torch.empty(2, 64, dtype=torch.uint8))
    with pytest.raises(DeltaError, match=r"pack: field 'max_bytes' must be an int >= 64, "
                                         r"found 128.0"):
        pack([], max_bytes=128.0)


def test_a_round_is_cut_once_its_deltas_cover_exactly_cut_bytes():
    old = {k: _random(1000, torch.float32, seed=i) for i, k in enumerate("ab")}  # 4000 bytes
    new = {k: _flip(t, [1, 2]) for k, t in old.items()}
    rounds = list(pack(encode_all(old, new), max_bytes=1 << 16, cut_bytes=4000))
    assert [[e["name"] for e in r.header["entries"]] for r in rounds] == [["a"], ["b"]]


def test_a_round_is_cut_once_it_holds_exactly_cut_payload():
    new = {k: _random(1000, torch.float32, seed=i) for i, k in enumerate("ab")}  # dense: 4000
    rounds = list(pack(encode_all(None, new), max_bytes=1 << 16, cut_bytes=1,
                       cut_payload=4000, cut_wait=3600.0))
    assert [[e["name"] for e in r.header["entries"]] for r in rounds] == [["a"], ["b"]]


def test_padding_after_odd_sized_sections_is_zeroed():
    # a dense piece of 13 bytes, flat indices of 12 bytes: both padded to 16 with zeros
    old = {"d": _random((13,), torch.int8), "b": _random((1000,), torch.bfloat16)}
    new = {"d": _flip(old["d"], slice(None)), "b": _flip(old["b"], [3, 7, 99])}
    a = _buffers(old, new, 0, patches="flat")
    b = _buffers(old, new, 0xFF, patches="flat")
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
