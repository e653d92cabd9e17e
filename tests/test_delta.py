"""delta: exact per-tensor encodings, packing into bounded rounds, checked in-place apply."""

import json
import math
import types

import numpy as np
import pytest
import torch

from hotweights.errors import DeltaError
from hotweights.remote import delta, delta_apply, jit, packing
from hotweights.remote.delta import encode, encode_all
from hotweights.remote.delta_apply import apply, check
from hotweights.remote.packing import Round, pack
from hotweights.testing import tiny

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
          torch.uint8, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.uint16, torch.uint32]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_BITS[t.dtype.itemsize])


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _flip(t: torch.Tensor, index) -> torch.Tensor:
    """A copy of `t` with the lowest bit of the chosen flat elements flipped."""
    out = t.clone()
    _bits(out)[index] ^= 1
    return out


def _random(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _sync(old: dict, new: dict, max_bytes: int = 1 << 20, **options) -> tuple[dict, list[Round]]:
    got = {k: v.clone() for k, v in old.items()}
    rounds = list(pack(encode_all(old, new), max_bytes=max_bytes, **options))
    for r in rounds:
        apply(r, got)
    return got, rounds


CASES = {  # kind -> flat elements of a (64, 32) tensor to change
    "same": [],
    "patch": [5, 200, 201, 1000, 2047],
    "rows": slice(3 * 32, 7 * 32),
    "dense": slice(None),
}


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(CASES))
def test_round_trip_is_exact_and_kind_is_cheapest(kind, dtype, compiled, monkeypatch):
    if not compiled:  # torch's index_copy_ has no CPU kernel for FP8 or uint16 / uint32
        monkeypatch.setattr(jit, "_loops", False)
    old = _random((64, 32), dtype)
    new = _flip(old, CASES[kind])
    d = encode("w", old, new)
    assert d.kind == kind
    s = dtype.itemsize
    assert d.nbytes == {"same": 0, "patch": 5 * (4 + s), "rows": 16 + 4 * 32 * s,
                        "dense": 64 * 32 * s}[kind]
    got, rounds = _sync({"w": old}, {"w": new})
    assert _same_bits(got, {"w": new})
    assert len(rounds) == 1 and [e["kind"] for e in rounds[0].header["entries"]] == (
        [] if kind == "same" else [kind])


@pytest.mark.parametrize("dtype,zero,nan_a,nan_b", [
    (torch.float32, 0x80000000, 0x7FC00001, 0x7FC00002),
    (torch.bfloat16, 0x8000, 0x7FC1, 0x7FC2),
    (torch.float16, 0x8000, 0x7E01, 0x7E02),
])
def test_bit_patterns_minus_zero_and_nan_payloads(dtype, zero, nan_a, nan_b):
    bits = _BITS[dtype.itemsize]
    as_signed = lambda v: v - (1 << 8 * dtype.itemsize) if v >= 1 << (8 * dtype.itemsize - 1) \
        else v  # noqa: E731
    old = torch.zeros(16, 8, dtype=dtype)
    _bits(old)[20] = as_signed(nan_a)  # equal NaNs in both: not a change
    _bits(old)[10] = as_signed(nan_a)
    new = old.clone()
    _bits(new)[3] = as_signed(zero)  # 0.0 -> -0.0
    _bits(new)[10] = as_signed(nan_b)  # a NaN's payload changes
    d = encode("w", old, new)
    assert (d.kind, d.changed, d.indices.tolist()) == ("patch", 2, [3, 10])
    got, _ = _sync({"w": old}, {"w": new})
    assert torch.equal(got["w"].view(bits), new.view(bits))
    # Two NaN bit patterns sent whole (rows) are exact too; a dense one is refused unless asked.
    new2 = _flip(old, slice(0, 32))
    _bits(new2)[1] = as_signed(nan_b)
    assert encode("w", old, new2).kind == "rows"
    got, _ = _sync({"w": old}, {"w": new2})
    assert torch.equal(got["w"].view(bits), new2.view(bits))
    (r,) = pack([delta.dense("w", new2)], max_bytes=1 << 20)
    with pytest.raises(DeltaError, match=r"`w`: field 'values' holds NaN or Inf"):
        apply(r, {"w": old.clone()})
    got = old.clone()
    apply(r, {"w": got}, check_finite=False)
    assert torch.equal(got.view(bits), new2.view(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_finite_reads_bounded_chunks_of_elements_whatever_the_shape(monkeypatch, dtype):
    monkeypatch.setattr(delta_apply, "_CHUNK", 8)
    seen, real = [], torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda c: seen.append(c.numel()) or real(c))
    rows = torch.zeros(5, 8, dtype=torch.float32)
    assert delta_apply.finite(rows.to(dtype))
    assert seen == [8] * 5  # rows of a rows update: 40 elements, 8 at a time
    for bad in (float("nan"),) if dtype.itemsize == 1 else (float("nan"), float("inf")):
        v = rows.clone()  # (float8 e4m3fn has no Inf)
        v[4, 7] = bad  # in the last chunk
        assert not delta_apply.finite(v.to(dtype))


def test_int64_indices_past_the_threshold(monkeypatch):
    monkeypatch.setattr(delta, "INT64_INDEX_FROM", 100)
    old = _random((10, 10), torch.bfloat16)
    new = _flip(old, [0, 42, 99])
    d = encode("w", old, new)
    assert d.kind == "patch" and d.indices.dtype == torch.int64 and d.nbytes == 3 * (8 + 2)
    small = encode("v", old[:9], new[:9])  # 90 elements: below the threshold
    assert small.indices.dtype == torch.int32
    got, (r,) = _sync({"w": old}, {"w": new}, patches="flat")
    assert r.header["entries"][0]["index_dtype"] == "int64"
    assert _same_bits(got, {"w": new})
    got, (r,) = _sync({"w": old}, {"w": new})  # compact: the same, whatever the index width
    assert r.header["entries"][0]["first"] == 0 and _same_bits(got, {"w": new})


@pytest.mark.parametrize("chunk", [16, 24, 64, 1000])  # rows of 32: longer, uneven, whole
def test_small_chunks_give_the_same_delta(monkeypatch, chunk):
    old = _random((40, 32), torch.float16)
    new = _flip(old, [0, 33, 34, 700, 1279])
    new = _flip(new, slice(10 * 32, 13 * 32))
    want = encode("w", old, new)
    monkeypatch.setattr(delta, "_CHUNK", chunk)
    got = encode("w", old, new)
    assert (got.kind, got.changed, got.nbytes) == (want.kind, want.changed, want.nbytes)
    assert got.ranges.tolist() == want.ranges.tolist() == [[0, 2], [10, 13], [21, 22],
                                                            [39, 40]]
    scattered = _flip(old, [1, 500, 1000])
    assert encode("w", old, scattered).indices.tolist() == [1, 500, 1000]


def _state(seed=0) -> dict:
    """A few tensors of every kind of change, for splitting and bad-input tests."""
    old = {"a": _random((300, 64), torch.bfloat16, seed), "b": _random(1000, torch.float32, seed),
           "c": _random((50, 8, 4), torch.float16, seed), "d": _random((7, 5), torch.int8, seed)}
    new = {"a": _flip(_flip(old["a"], slice(5 * 64, 9 * 64)), slice(100 * 64, 101 * 64)),
           "b": _flip(old["b"], [3, 7, 99, 998]), "c": _flip(old["c"], slice(None)),
           "d": old["d"].clone()}
    return old, new


@pytest.mark.parametrize("options", [{}, {"patches": "flat"}, {"values": "xor"}])
@pytest.mark.parametrize("max_bytes", [64, 100, 136, 200, 1000, 1 << 20])
def test_split_across_rounds_gives_identical_results(max_bytes, options):
    old, new = _state()
    assert [d.kind for d in encode_all(old, new)] == ["rows", "patch", "dense", "same"]
    got, rounds = _sync(old, new, max_bytes, **options)
    assert _same_bits(got, new)
    assert all(r.buffer.numel() <= max_bytes for r in rounds)
    assert [r.header["round"] for r in rounds] == list(range(len(rounds)))
    assert [r.header["rounds"] for r in rounds] == [0] * (len(rounds) - 1) + [len(rounds)]
    # One staging tensor reused for every round: each applied before the next is packed.
    staging, again = torch.empty(max_bytes, dtype=torch.uint8), {k: v.clone() for k, v in
                                                                 old.items()}
    for r in pack(encode_all(old, new), max_bytes=max_bytes, staging=staging, **options):
        assert r.buffer.data_ptr() == staging.data_ptr()
        apply(Round(json.loads(r.header_bytes()), r.buffer), again)  # through JSON
    assert _same_bits(again, new)
    # Two, in turn: a round stays intact while the next one is packed (read ahead).
    two, again, held = [torch.empty(max_bytes, dtype=torch.uint8) for _ in range(2)], \
        {k: v.clone() for k, v in old.items()}, None
    for i, r in enumerate(pack(encode_all(old, new), max_bytes=max_bytes, staging=two,
                               **options)):
        assert r.buffer.data_ptr() == two[i % 2].data_ptr()
        if held is not None:
            apply(held, again)
        held = Round(json.loads(r.header_bytes()), r.buffer)
    apply(held, again)
    assert _same_bits(again, new)


@pytest.mark.parametrize("options", [{}, {"values": "xor"}, {"patches": "flat"}])
@pytest.mark.parametrize("cut_bytes", [1, 5000, 40000, 1 << 30])
def test_rounds_go_while_later_tensors_are_still_encoded(cut_bytes, options):
    old, new = _state()
    new["e"] = old["e"] = _random((20, 16), torch.bfloat16, 1)  # unchanged, last
    read = []

    def deltas():
        for d in delta.encode_each(old, new):
            read.append(d.name)
            yield d
    got, seen, rounds = {k: v.clone() for k, v in old.items()}, [], []
    for r in pack(deltas(), max_bytes=1 << 20, cut_bytes=cut_bytes, **options):
        seen.append(list(read))
        rounds.append(r.header["rounds"])
        assert r.header["entries"]  # the last round is never an empty one
        apply(Round(json.loads(r.header_bytes()), r.buffer), got)
    assert _same_bits(got, new)
    assert rounds == [0] * (len(rounds) - 1) + [len(rounds)]
    # a round is handed out once the next tensor with a change needs a new one: "b" (4
    # elements, 4000 bytes) begins the second round when "a" (38400 bytes) covers the cut
    assert seen[0] == {1: ["a", "b"], 5000: ["a", "b"], 40000: ["a", "b", "c"],
                       1 << 30: list(new)}[cut_bytes]
    assert len(rounds) == {1: 3, 5000: 2, 40000: 2, 1 << 30: 1}[cut_bytes]


@pytest.mark.parametrize(("payload", "wait", "slow", "names"), [
    (0, 60.0, False, [["a"], ["b"], ["c"]]),  # cut_bytes alone
    (1 << 30, 60.0, False, [["a", "b", "c"]]),  # never enough payload, nor waited enough
    (1 << 30, 0.0, False, [["a"], ["b"], ["c"]]),  # waited enough at once
    (1 << 30, 0.03, True, [["a", "b"], ["c"]]),  # "c" comes 0.05 s after the round opened
])
def test_a_small_round_is_cut_once_it_holds_enough_or_was_open_long_enough(
        payload, wait, slow, names, monkeypatch):
    old, new = _state()
    now = [0.0]  # the pack's clock, moved by hand: the machine's pace cannot cut a round
    monkeypatch.setattr(packing, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    def deltas():
        for d in delta.encode_each(old, new):
            if slow and d.name == "c":
                now[0] += 0.05
            yield d
    got, rounds = {k: v.clone() for k, v in old.items()}, []
    for r in pack(deltas(), max_bytes=1 << 20, cut_bytes=1, cut_payload=payload,
                  cut_wait=wait):
        rounds.append([e["name"] for e in r.header["entries"]])
        apply(Round(json.loads(r.header_bytes()), r.buffer), got)
    assert rounds == names
    assert _same_bits(got, new)


def test_an_encode_that_fails_midway_fails_the_rounds_after_the_ones_sent():
    old, new = _state()

    def deltas():
        yield from delta.encode_each(old, {k: new[k] for k in "ab"})
        yield encode("w", torch.zeros(4, 4), torch.zeros(4, 5))
    rounds = pack(deltas(), max_bytes=1 << 20, cut_bytes=1)
    assert next(rounds).header["rounds"] == 0
    with pytest.raises(DeltaError, match=r"w: field 'shape' differs"):
        next(rounds)


def test_full_sync_and_empty_update():
    old, new = _state()
    got, _ = _sync({k: torch.zeros_like(v) for k, v in old.items()}, new)
    assert _same_bits(got, new)
    cold = {k: torch.zeros_like(v) for k, v in new.items()}
    for r in pack(encode_all(None, new), max_bytes=4096):
        apply(r, cold)
    assert _same_bits(cold, new)
    (r,) = pack(encode_all(new, new), max_bytes=4096)
    assert r.header["entries"] == [] and r.buffer.numel() == 0 and r.header["rounds"] == 1
    assert apply(r, dict(new)) == []


def _one_round():
    old, new = _state()  # flat patches: the byte offsets below are format 1's layout
    (r,) = pack(encode_all(old, new), max_bytes=1 << 20, patches="flat")
    assert [e["name"] for e in r.header["entries"]] == ["a", "b", "c"]
    return old, r


def _entry(r, name):
    return next(e for e in r.header["entries"] if e["name"] == name)


def _with(r, name, **fields) -> Round:
    h = json.loads(r.header_bytes())
    next(e for e in h["entries"] if e["name"] == name).update(fields)
    return Round(h, r.buffer)


def _set_bytes(r, offset, values: torch.Tensor) -> Round:
    buf = r.buffer.clone()
    raw = values.reshape(-1).view(torch.uint8)
    buf[offset:offset + raw.numel()] = raw
    return Round(r.header, buf)


def _bad_rounds():
    old, r = _one_round()
    a, b, c = (_entry(r, n) for n in "abc")
    nan_c = _set_bytes(r, c["offset"] + 6, torch.tensor([float("nan")], dtype=torch.float16))
    inf_c = _set_bytes(r, c["offset"], torch.tensor([float("-inf")], dtype=torch.float16))
    return old, {
        "unknown": (r, {k: v for k, v in old.items() if k != "c"}, r"unknown tensor `c`"),
        "shape": (_with(r, "c", shape=[50, 32]), old, r"`c`: field 'shape'"),
        "dtype": (_with(r, "c", dtype="float32"), old, r"`c`: field 'dtype'"),
        "target_dtype": (r, {**old, "c": old["c"].to(torch.bfloat16)}, r"`c`: field 'dtype'"),
        "index_high": (_set_bytes(r, b["offset"] + 4, torch.tensor([1000], dtype=torch.int32)),
                       old, r"`b`: field 'indices' hold \[3, 1000\], out of the 1000"),
        "index_low": (_set_bytes(r, b["offset"], torch.tensor([-1], dtype=torch.int32)), old,
                      r"`b`: field 'indices'"),
        "rows_high": (_set_bytes(r, a["offset"] + 8, torch.tensor([301])), old,
                      r"`a`: field 'ranges'"),
        "rows_count": (_set_bytes(r, a["offset"] + 8, torch.tensor([8])), old,
                       r"`a`: field 'nrows' is 5, the ranges cover 4"),
        "short_buffer": (Round(r.header, r.buffer[:-8]), old, r"field 'nbytes' is \d+, the "
                         r"buffer holds \d+"),
        "entry_nbytes": (_with(r, "b", count=5), old, r"`b`: field 'nbytes'"),
        "outside": (_with(r, "c", offset=r.header["nbytes"]), old, r"`c`: field 'offset'"),
        "dense_range": (_with(r, "c", start=1, stop=1601), old, r"`c`: field 'stop'"),
        "nan": (nan_c, old, r"`c`: field 'values' holds NaN or Inf"),
        "inf": (inf_c, old, r"`c`: field 'values' holds NaN or Inf"),
        "kind": (_with(r, "c", kind="sparse"), old, r"`c`: field 'kind'"),
        "rows_1d": (_with(r, "b", kind="rows", nranges=0, nrows=0), old, r"`b`: field 'kind'"),
        "format": (Round({**r.header, "format": 99}, r.buffer), old, r"field 'format'"),
        "compress": (Round({**r.header, "compress": "lz4"}, r.buffer), old,
                     r"field 'compress' must be one of \['zstd'\], found 'lz4'"),
    }


@pytest.mark.parametrize("case", list(_bad_rounds()[1]))
def test_bad_round_is_refused_by_name_and_nothing_is_written(case):
    old, cases = _bad_rounds()
    r, targets, match = cases[case]
    targets = {k: v.clone() for k, v in targets.items()}
    before = {k: v.clone() for k, v in targets.items()}
    with pytest.raises(DeltaError, match=match):
        apply(r, targets)
    assert _same_bits(targets, before)  # "a" and "b" come first and are untouched too


def test_format_1_rounds_are_still_read():
    old, r = _one_round()
    got = {k: v.clone() for k, v in old.items()}
    apply(Round({**r.header, "format": 1}, r.buffer), got)
    assert _same_bits(got, _state()[1])


def test_check_reads_the_header_only_and_apply_names_what_it_wrote():
    old, r = _one_round()
    check(r.header, old)
    assert apply(r, {k: v.clone() for k, v in old.items()}) == ["a", "b", "c"]
    with pytest.raises(DeltaError, match=r"unknown tensor `a`"):
        check(r.header, {"b": old["b"], "c": old["c"]})


def test_encode_and_pack_refuse_bad_input_by_name():
    t = torch.zeros(4, 4)
    with pytest.raises(DeltaError, match=r"w: field 'shape' differs"):
        encode("w", t, torch.zeros(4, 5))
    with pytest.raises(DeltaError, match=r"w: field 'dtype' differs"):
        encode("w", t, t.half())
    with pytest.raises(DeltaError, match=r"non-contiguous|not contiguous"):
        encode("w", t.t(), t.t().clone().t())
    with pytest.raises(DeltaError, match=r"w: field 'dtype' complex128 is not supported"):
        encode("w", t.to(torch.complex128), t.to(torch.complex128))
    for rows in ([1, 4], [-1]):  # the compiled compare reads rows where they are: checked
        with pytest.raises(DeltaError, match=r"w: `rows` holds rows outside 0\.\.3"):
            encode("w", t, t.clone(), rows=torch.tensor(rows))
    with pytest.raises(DeltaError, match=r"pack: field 'max_bytes' must be an int >= 64"):
        pack([], max_bytes=32)
    with pytest.raises(DeltaError, match=r"pack: field 'staging'"):
        pack([], max_bytes=128, staging=torch.empty(64, dtype=torch.uint8))
    with pytest.raises(DeltaError, match=r"pack: field 'staging' must be contiguous 1-D uint8 "
                       r"tensors of >= 128 bytes, found torch.float32 of shape \(128,\)"):
        pack([], max_bytes=128, staging=[torch.empty(128, dtype=torch.uint8),
                                         torch.empty(128)])
    with pytest.raises(DeltaError, match=r"pack: field 'values' must be one of \['raw', 'xor'\]"):
        pack([], max_bytes=128, values="delta")
    with pytest.raises(DeltaError, match=r"pack: field 'compress' must be one of"):
        pack([], max_bytes=128, compress="gzip")
    with pytest.raises(DeltaError, match=r"pack: field 'patches' must be one of"):
        pack([], max_bytes=128, patches="sparse")
    with pytest.raises(DeltaError, match=r"pack: field 'cut_bytes' must be an int >= 1, "
                       r"found 0"):
        pack([], max_bytes=128, cut_bytes=0)
    with pytest.raises(DeltaError, match=r"pack: field 'cut_payload' must be an int >= 0"):
        pack([], max_bytes=128, cut_bytes=1, cut_payload=-1)
    with pytest.raises(DeltaError, match=r"pack: field 'cut_wait' must be seconds >= 0"):
        pack([], max_bytes=128, cut_bytes=1, cut_wait=-1.0)
    with pytest.raises(DeltaError, match=r"pack: field 'values' 'xor' needs patches='compact'"):
        pack([], max_bytes=128, values="xor", patches="flat")


def _llama_like(hidden=256, inter=688, kv=64, vocab=2048, layers=2) -> dict:
    return tiny.llama_tensors(hidden=hidden, inter=inter, kv=kv, vocab=vocab, layers=layers)


def _ratio(old: dict, new: dict) -> float:
    got, rounds = _sync(old, new, max_bytes=1 << 20)
    assert _same_bits(got, new)
    return sum(r.wire_bytes for r in rounds) / sum(t.nbytes for t in old.values())


def test_bytes_on_the_wire_llama_like():
    old, g = _llama_like(), torch.Generator().manual_seed(1)
    rows = {}  # 1 % of each matrix's rows (at least one), scattered
    for n, t in old.items():
        if t.dim() < 2:
            rows[n] = t.clone()
            continue
        pick = torch.randperm(t.shape[0], generator=g)[:max(1, t.shape[0] // 100)]
        rows[n] = _flip(t, (pick[:, None] * t.shape[1] + torch.arange(t.shape[1])).reshape(-1))
    assert _ratio(old, rows) <= 0.03
    scattered = {n: _flip(t, torch.randperm(t.numel(), generator=g)[:t.numel() // 100])
                 for n, t in old.items()}  # RL-like: 1 % of elements at random
    # compact patches: ~2.3 bytes per changed bf16 element (headers weigh more on this small
    # model than on a real one)
    assert 0.009 <= _ratio(old, scattered) <= 0.015
    full = {n: _flip(t, slice(None)) for n, t in old.items()}
    assert 1.0 <= _ratio(old, full) <= 1.01


# encode compares 8-byte words where the chunk allows, then the elements inside the words that
# differ: the cases below are where that word path and the element path part ways.

WORD_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.bool,
               torch.float64]  # elements per 8-byte word: 4, 4, 2, 8, 8, 1


def _reference(old: torch.Tensor, new: torch.Tensor) -> tuple:
    """(kind, nbytes, changed, changed flat indices) by brute force: an element bit compare;
    dense n*s, rows 16*runs + rows*row*s, patch count*(index bytes + s); of equal costs
    dense, then rows, then patch."""
    diff = _bits(old) != _bits(new)
    where = torch.nonzero(diff).view(-1)
    n, s = new.numel(), new.dtype.itemsize
    if not len(where):
        return "same", 0, 0, where
    costs = [(n * s, "dense", n)]
    if new.dim() >= 2:
        row = n // new.shape[0]
        flags = diff.view(new.shape[0], row).any(1).tolist()
        runs = sum(f and (i == 0 or not flags[i - 1]) for i, f in enumerate(flags))
        costs.append((16 * runs + sum(flags) * row * s, "rows", sum(flags) * row))
    isz = 8 if n >= delta.INT64_INDEX_FROM else 4
    costs.append((len(where) * (isz + s), "patch", len(where)))
    nbytes, kind, changed = min(costs, key=lambda c: c[0])  # the first of equal costs
    return kind, nbytes, changed, where


def _at(t: torch.Tensor, offset: int) -> torch.Tensor:
    """`t`'s value in a contiguous view of a bigger tensor, at storage offset `offset`."""
    big = torch.zeros(t.numel() + offset + 8, dtype=t.dtype)
    view = big[offset:offset + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.storage_offset() == offset
    return view


def _exact(old: torch.Tensor, new: torch.Tensor):
    """encode agrees with `_reference` and its delta round-trips bit for bit."""
    d = encode("w", old, new)
    kind, nbytes, changed, where = _reference(old, new)
    assert (d.kind, d.nbytes, d.changed) == (kind, nbytes, changed)
    if kind == "patch":
        assert d.indices.dtype == (torch.int64 if new.numel() >= delta.INT64_INDEX_FROM
                                   else torch.int32)
        assert d.indices.tolist() == where.tolist()
        assert d.values.dtype == new.dtype
        assert torch.equal(_bits(d.values), _bits(new)[where])
    got, _ = _sync({"w": old}, {"w": new})
    assert _same_bits(got, {"w": new.contiguous()})
    return d


def _spy(monkeypatch) -> list:
    """The elements per compared unit that encode's chunks get from `_word`."""
    seen, real = [], delta._word
    monkeypatch.setattr(delta, "_word", lambda *a: seen.append(real(*a)) or seen[-1])
    return seen


WORD_CASES = [  # shape, dtype, storage offsets of old and new, _CHUNK (None: as is), words
    ((16, 64), torch.bfloat16, (0, 0), None, {4}),  # 16 words a row: flags 8 at a time
    ((16, 64), torch.bfloat16, (0, 0), 64, {4}),  # one row a chunk
    ((40, 12), torch.bfloat16, (0, 0), None, {4}),  # 3 words a row
    ((40, 12), torch.bfloat16, (0, 0), 40, {4}),  # 36-element chunks, the last of 12
    ((50, 7), torch.bfloat16, (0, 0), None, {1}),  # rows not whole words
    ((40, 6), torch.bfloat16, (0, 0), None, {1}),  # whole words a chunk, not a row
    ((8, 3), torch.int8, (0, 0), None, {1}),
    ((50, 7), torch.float16, (0, 0), 24, {1}),
    ((13,), torch.float32, (0, 0), None, {1}),
    ((13,), torch.float32, (0, 0), 4, {2, 1}),  # the last chunk a single element
    ((1001,), torch.bfloat16, (0, 0), None, {1}),
    ((1001,), torch.bfloat16, (0, 0), 64, {4, 1}),  # the last chunk of 41
    ((1000,), torch.int8, (0, 0), 24, {8}),
    ((30, 16), torch.bool, (0, 0), None, {8}),  # 2 words a row
    ((16, 64), torch.bool, (0, 0), None, {8}),  # 8 words a row
    ((16, 64), torch.float64, (0, 0), None, {1}),  # 64 flags a row, 8 at a time
    ((50, 7), torch.float64, (0, 0), 24, {1}),
    ((25, 8), torch.float32, (0, 0), 24, {2}),
    # contiguous views at a storage offset: both odd, one odd, both whole words
    ((16, 64), torch.bfloat16, (1, 1), None, {1}),
    ((16, 64), torch.bfloat16, (0, 3), None, {1}),
    ((16, 64), torch.bfloat16, (6, 0), 64, {1}),
    ((16, 64), torch.bfloat16, (4, 8), 64, {4}),
    ((40, 12), torch.bfloat16, (2, 2), 40, {1}),
    ((1000,), torch.int8, (5, 0), 64, {1}),
    ((1000,), torch.bool, (8, 16), 64, {8}),
    ((1000,), torch.bool, (3, 3), None, {1}),
    ((25, 8), torch.float32, (1, 1), None, {1}),
    ((25, 8), torch.float32, (3, 0), 24, {1}),
    ((13,), torch.float64, (1, 2), 4, {1}),
    # rows longer than a chunk: each chunk inside one row, word-aligned or not by itself
    ((4, 100), torch.bfloat16, (0, 0), 24, {4}),
    ((4, 100), torch.bool, (0, 0), 24, {8, 1}),  # odd rows start half a word in
    ((3, 50), torch.float32, (0, 0), 16, {2}),
    ((3, 51), torch.float32, (0, 0), 16, {2, 1}),
    ((3, 50), torch.float32, (1, 0), 16, {1}),
]


def _patterns(n: int):
    yield [n - 1]  # the last element
    yield list(range(min(n, 3)))  # adjacent, in the first word
    yield sorted({max(0, n // 2 - 1), n // 2, min(n - 1, n // 2 + 1)})  # adjacent, mid-way
    yield list(range(max(0, n - 5), n))  # the tail: the last (partial) chunk
    yield [i for i in range(n) if i % 8 in (1, 2, 5)]  # several in every word
    yield list(range(0, n, 9))  # one in scattered words
    yield slice(None)  # every element


@pytest.mark.parametrize("shape,dtype,offsets,chunk,words", WORD_CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-at{c[2]}-chunk{c[3]}" for c in WORD_CASES])
def test_word_compare_is_exact(monkeypatch, shape, dtype, offsets, chunk, words):
    if chunk is not None:
        monkeypatch.setattr(delta, "_CHUNK", chunk)
    seen = _spy(monkeypatch)
    base = _random(shape, dtype, seed=3)
    old = _at(base, offsets[0])
    assert encode("w", old, _at(base, offsets[1])).kind == "same"
    n = base.numel()
    for which in _patterns(n):
        new = _at(_flip(base, which), offsets[1])
        d = _exact(old, new)
        if which == slice(None):
            assert (d.kind, d.changed, d.nbytes) == ("dense", n, n * dtype.itemsize)
    assert set(seen) == words  # the path each chunk took is the one meant


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("isz", [4, 8])
@pytest.mark.parametrize("layout", ["spread", "packed", "tail"])
@pytest.mark.parametrize("chunk", [None, 16, 40])
@pytest.mark.parametrize("dtype", WORD_DTYPES)
def test_patch_until_it_costs_as_much_as_dense(monkeypatch, dtype, chunk, layout, isz, offset):
    if chunk is not None:
        monkeypatch.setattr(delta, "_CHUNK", chunk)
    if isz == 8:
        monkeypatch.setattr(delta, "INT64_INDEX_FROM", 1)
    s, tie = dtype.itemsize, 24
    n = tie * (isz + s) // s  # 24 changed elements cost exactly the dense tensor
    assert tie * (isz + s) == n * s
    base = _random((n,), dtype, seed=5)
    old = _at(base, offset)
    for count in (1, tie - 2, tie - 1, tie, tie + 1):
        which = {"spread": sorted({n - 1 - i * n // count for i in range(count)}),
                 "packed": list(range(count)), "tail": list(range(n - count, n))}[layout]
        assert len(which) == count
        d = _exact(old, _at(_flip(base, which), offset))
        want = ("patch", count, count * (isz + s)) if count < tie else ("dense", n, n * s)
        assert (d.kind, d.changed, d.nbytes) == want


def _sweep_case(monkeypatch, g, shapes: list, i: int, chunk0: int) -> tuple:
    """One seeded sweep case: (shape, dtype, base tensor), encode's chunk and int64 index
    threshold drawn with it."""
    shape, dtype = g.choice(shapes), g.choice(WORD_DTYPES)
    monkeypatch.setattr(delta, "_CHUNK", g.choice([chunk0, 8, 24, 40, 64, 100]))
    monkeypatch.setattr(delta, "INT64_INDEX_FROM", g.choice([2**31, 2**31, 1, 500]))
    return shape, dtype, _random(shape, dtype, seed=i)


def test_random_sweep_matches_brute_force(monkeypatch, both_paths):
    import random

    g, chunk0 = random.Random(20261123), delta._CHUNK
    shapes = [(13,), (1001,), (64,), (1,), (), (50, 7), (40, 12), (16, 64), (4, 100),
              (3, 5, 8), (7, 1), (1, 33), (9, 24)]
    kinds = set()
    for i in range(400):
        shape, dtype, base = _sweep_case(monkeypatch, g, shapes, i, chunk0)
        n, s = base.numel(), dtype.itemsize
        how = g.choice(["few", "cluster", "rows", "density", "near", "all", "none"])
        if how == "few":
            which = g.sample(range(n), min(n, g.randint(1, 4)))
        elif how == "cluster":
            at = g.randrange(n)
            which = list(range(at, min(n, at + g.randint(2, 9))))
        elif how == "rows" and len(shape) >= 2:
            row = n // shape[0]
            which = [r * row + j for r in g.sample(range(shape[0]), g.randint(1, shape[0]))
                     for j in range(row)] + g.sample(range(n), g.randint(0, 2))
        elif how in ("density", "rows"):
            p = g.choice([0.05, 0.2, 0.3, 0.5, 0.9])
            which = [j for j in range(n) if g.random() < p]
        elif how == "near":  # around the count where a patch costs as much as dense
            count = min(n, max(1, -(-n * s // (4 + s)) + g.randint(-2, 2)))
            at = g.randrange(n - count + 1)
            which = (list(range(at, at + count)) if g.random() < 0.5
                     else g.sample(range(n), count))
        else:
            which = slice(None) if how == "all" else []
        old = _at(base, g.choice([0, 0, 0, 1, 2, 3, 4, 8]))
        new = _at(_flip(base, which), g.choice([0, 0, 0, 1, 2, 3, 4, 8]))
        kinds.add(_exact(old, new).kind)
    assert kinds == {"same", "patch", "rows", "dense"}


def _fields(d) -> tuple:
    return (d.name, d.kind, d.dtype, d.shape, d.changed, d.nbytes,
            None if d.indices is None else (d.indices.dtype, d.indices.tolist()),
            None if d.values is None else _bits(d.values).tolist(),
            None if d.ranges is None else d.ranges.tolist(),
            None if d.tensor is None else d.tensor.data_ptr())


def test_a_dense_patch_is_expanded_on_the_way_and_stays_exact(monkeypatch):
    # The changed words of a patch are expanded into elements only if the patch is chosen,
    # or as soon as they hold half the dense size: 20 % scattered in bf16 gets there.
    monkeypatch.setattr(delta, "_CHUNK", 1024)
    calls, expand = [], delta._expand
    monkeypatch.setattr(delta, "_expand", lambda *a: calls.append(a) or expand(*a))
    old = _random((64, 256), torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    new = _flip(old, torch.randperm(old.numel(), generator=g)[:old.numel() // 5])
    d = _exact(old, new)
    assert d.kind == "patch" and len(calls) > old.numel() // 1024  # expanded on the way
    calls.clear()
    rows = _flip(old, list(range(256 * 3, 256 * 5)))  # two whole rows: sent as rows
    assert _exact(old, rows).kind == "rows" and not calls  # never expanded


def test_torch_compare_with_more_threads_gives_the_same_delta():
    threads = torch.get_num_threads()
    old = _random((64, 256), torch.bfloat16)
    cases = [_flip(old, [5, 700, 701]), _flip(old, list(range(256 * 2, 256 * 4))),
             _flip(old, slice(None))]
    want = [_fields(encode("w", old, new)) for new in cases]
    try:
        torch.set_num_threads(4)  # above 2: torch's compare instead of numpy's
        assert [_fields(encode("w", old, new)) for new in cases] == want
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("ranges", [[], [[0, 0]], [[3, 4]], [[0, 2], [5, 9], [9, 10]],
                                    [[7, 8], [100, 164]]])
def test_row_index_lists_the_rows_of_the_runs_in_order(ranges):
    r = torch.tensor(ranges, dtype=torch.int64).view(-1, 2)
    got = delta._row_index(r)
    assert got.dtype == torch.int64
    assert got.tolist() == [i for a, b in ranges for i in range(a, b)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int8,
                                   torch.bool])
@pytest.mark.parametrize("shape", [(4096,), (1000, 64), (3, 1 << 21), (5000, 7), (1 << 23,)])
@pytest.mark.parametrize("how", ["scattered", "rows", "many"])
def test_the_compiled_compare_gives_numpys_deltas(dtype, shape, how, monkeypatch):
    from hotweights.remote import jit

    if not jit.enabled():
        pytest.skip("numba is not installed: no compiled compare")
    if dtype.itemsize > 2 and math.prod(shape) > 1 << 21:
        pytest.skip("big enough in the narrow dtypes")
    old = _random(shape, dtype, seed=math.prod(shape) % 97)
    g = torch.Generator().manual_seed(len(shape))
    n = old.numel()
    if how == "scattered":
        index = torch.randint(0, n, (max(1, n // 100),), generator=g)
    elif how == "rows":
        row = n // shape[0]
        index = torch.cat([torch.arange(r * row, (r + 1) * row)
                           for r in torch.randint(0, shape[0], (3,), generator=g).tolist()])
    else:
        index = torch.randint(0, n, (n // 3,), generator=g)
    new = _flip(old, index)
    rows = {"w": torch.arange(0, shape[0], 2)} if len(shape) >= 2 else None
    got = encode_all({"w": old}, {"w": new}, rows=rows)
    monkeypatch.setattr(jit, "_loops", False)
    want = encode_all({"w": old}, {"w": new}, rows=rows)
    for a, b in zip(got, want, strict=True):
        for field in ("kind", "changed", "nbytes", "dtype", "shape"):
            assert getattr(a, field) == getattr(b, field), field
        for field in ("indices", "values", "old_values"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None) == (y is None) and (x is None or torch.equal(_bits(x), _bits(y)))
        assert (a.ranges is None) == (b.ranges is None)
        assert a.ranges is None or np.array_equal(a.ranges, b.ranges)


@pytest.mark.parametrize("options", [{}, {"values": "xor"}])
def test_values_of_a_narrower_float_are_widened_into_the_target_exactly(options):
    # a bf16 trainer's values for a slab vLLM keeps in float32 (GDN's A_log, routers)
    old, new = _state()
    old, new = ({k: v.to(torch.bfloat16) for k, v in d.items() if k in "ab"} for d in (old, new))
    got = {k: v.float() for k, v in old.items()}
    for r in pack(encode_all(old, new), max_bytes=1 << 20, **options):
        apply(r, got)
    assert all(torch.equal(got[k], new[k].float()) for k in new)


def test_a_widened_entry_into_a_non_contiguous_target_is_refused_before_any_write():
    old = {"a": torch.randn(4, 8).to(torch.bfloat16), "b": torch.randn(8, 4).to(torch.bfloat16)}
    new = {k: v + 1 for k, v in old.items()}
    got = {"a": old["a"].float(), "b": old["b"].float().t().contiguous().t()}  # strided
    before = {k: v.clone() for k, v in got.items()}
    (r,) = pack(encode_all(old, new), max_bytes=1 << 20)
    with pytest.raises(DeltaError, match=r"`b`: field 'shape' the target is not contiguous"):
        apply(r, got)
    assert all(torch.equal(got[k], before[k]) for k in got)
    assert not delta_apply.widens(torch.float8_e4m3fn, torch.bfloat16)  # FP8 stays FP8


def _more_bad_rounds():
    old, r = _one_round()
    a, b, c = (_entry(r, n) for n in "abc")
    total = r.header["nbytes"]
    assert c["offset"] + c["nbytes"] == total  # c ends the buffer
    return old, {
        # c slid 8 bytes: its last 8 bytes past the buffer's end
        "past_end": (_with(r, "c", offset=c["offset"] + 8), r"`c`: field 'offset'"),
        "misaligned": (_with(r, "a", offset=a["offset"] + 4), r"`a`: field 'offset'"),
        "entry_longer": (_with(r, "b", nbytes=b["nbytes"] + 8), r"`b`: field 'nbytes' is"),
        "long_buffer": (Round(r.header, torch.cat([r.buffer, torch.zeros(8, dtype=torch.uint8)])),
                        r"field 'nbytes' is \d+, the buffer holds \d+"),
        # a's first run [5, 9) made empty [9, 9), its second [100, 101) made [96, 101):
        # the rows still sum to 5
        "empty_run": (_set_bytes(r, a["offset"], torch.tensor([9, 9, 96, 101])),
                      r"`a`: field 'ranges'"),
    }


@pytest.mark.parametrize("case", list(_more_bad_rounds()[1]))
def test_more_bad_rounds_are_refused_by_name_and_nothing_is_written(case):
    old, cases = _more_bad_rounds()
    r, match = cases[case]
    targets = {k: v.clone() for k, v in old.items()}
    with pytest.raises(DeltaError, match=match):
        apply(r, targets)
    assert _same_bits(targets, old)


def test_a_complex_tensor_is_refused_by_name():
    # complex64 is 8 bytes wide, as int64: only its dtype tells it apart
    old = torch.zeros(4, dtype=torch.complex64)
    with pytest.raises(DeltaError, match=r"^z: field 'dtype' complex64 is not supported"):
        encode("z", old, old.clone())
    with pytest.raises(DeltaError, match=r"^z: field 'dtype' complex64 is not supported"):
        delta.dense("z", old)


def test_the_dense_delta_of_a_tensor_without_elements_is_same():
    d = delta.dense("e", torch.zeros(0, 4, dtype=torch.bfloat16))
    assert (d.kind, d.changed, d.nbytes, d.tensor) == ("same", 0, 0, None)
    (d,) = encode_all(None, {"e": torch.zeros(0)})  # a full sync of an empty tensor
    assert d.kind == "same"


def test_a_dtype_or_shape_mismatch_names_which_side_is_which():
    old = torch.zeros(4, 2)
    with pytest.raises(DeltaError, match=r"^w: field 'dtype' differs \(old torch\.float32, "
                                         r"new torch\.bfloat16\)"):
        encode("w", old, old.to(torch.bfloat16))
    with pytest.raises(DeltaError, match=r"^w: field 'shape' differs \(old \(4, 2\), "
                                         r"new \(2, 4\)\)"):
        encode("w", old, old.reshape(2, 4))


def test_a_dense_delta_of_a_tensor_with_rows_carries_no_ranges():
    old = _random((6, 4), torch.float32)
    d = encode("w", old, _flip(old, slice(None)))
    assert d.kind == "dense" and d.ranges is None and d.indices is None


def test_encode_all_sends_a_name_missing_from_old_dense():
    old = {"a": _random((4, 4), torch.float32)}
    new = {"a": old["a"].clone(), "b": _random((3,), torch.bfloat16)}
    kinds = {d.name: d.kind for d in encode_all(old, new)}
    assert kinds == {"a": "same", "b": "dense"}


def test_encode_all_compares_only_the_rows_given_for_a_name():
    old = _random((8, 16), torch.bfloat16)
    new = _flip(old, [3, 5 * 16 + 1])  # rows 0 and 5 changed
    (d,) = encode_all({"w": old}, {"w": new}, rows={"w": torch.tensor([0])})
    assert d.kind == "patch" and d.indices.tolist() == [3]  # row 5: vouched unchanged


def _units(n: int, changed) -> tuple[np.ndarray, np.ndarray]:
    """(old, new) int64 units, `n` of them, `new` differing at `changed` (lowest bit)."""
    old = np.arange(n, dtype=np.int64) * 1000003
    new = old.copy()
    new[changed] ^= 1
    return old, new


def _compare(old, new, **kwargs):
    if not jit.enabled():
        pytest.skip("numba is not installed: no compiled compare")
    kwargs = {"per_row": 0, "limit": 1 << 20} | kwargs
    return jit.compare(old, new, np.int64, **kwargs)


def test_the_compiled_compare_of_equal_chunks_finds_nothing_itself():
    # 0 changed elements is an answer, not a hand-back to numpy's compare
    c, pos, olds, news, flags = _compare(*_units(4096, []), per_row=64)
    assert c == 0 and len(pos) == len(olds) == len(news) == 0
    assert flags.tolist() == [False] * 64


@pytest.mark.parametrize("rows", [None, np.array([1, 3, 6], np.int64)])
def test_the_compiled_compare_keeps_exactly_limit_changes_and_refuses_one_more(rows):
    changed = [70, 71, 200, 230, 401]  # rows (of 64 units) 1, 3, 6
    old, new = _units(512, changed)
    c, pos, olds, news, flags = _compare(old, new, per_row=64, limit=5, rows=rows)
    want = changed if rows is None else [6, 7, 72, 102, 145]  # places in the gathered rows
    assert c == 5 and pos.tolist() == want
    assert np.array_equal(olds, old[changed]) and np.array_equal(news, new[changed])
    assert flags.nonzero()[0].tolist() == ([1, 3, 6] if rows is None else [0, 1, 2])
    assert _compare(old, new, per_row=64, limit=4, rows=rows) is None


def test_the_compiled_compare_stops_at_the_limit_in_any_row():
    # the limit passed in the first of the given rows: later rows do not bring it back
    old, new = _units(512, list(range(64, 74)) + [400])
    assert _compare(old, new, per_row=64, limit=5, rows=np.array([1, 6], np.int64)) is None


def test_the_compiled_compare_hands_back_chunks_whose_sample_mostly_differs():
    # every 61st unit sampled: 2 of 122 here; half of them differing is not most
    old, new = _units(122, [0])
    assert _compare(old, new)[0] == 1
    assert _compare(*_units(122, [0, 61])) is None
    assert _compare(*_units(6100, slice(None))) is None  # a full update: numpy counts it
