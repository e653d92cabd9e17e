"""The fingerprint prefilter: `delta.encode(rows=)` compares only the rows given, and
`prefilter.candidates` gives the rows of the blocks whose fingerprint changed; together they
must give exactly the delta a whole compare gives."""

import random

import pytest
import torch

from hotweights.errors import DeltaError
from hotweights.remote import delta, prefilter
from hotweights.remote.delta import encode, encode_all
from test_delta import WORD_DTYPES, _at, _fields, _flip, _random


def _rows_of(shape, which) -> list[int]:
    row = torch.Size(shape).numel() // shape[0]
    return sorted({i // row for i in which})


def test_rows_superset_gives_the_same_delta_over_a_seeded_sweep(monkeypatch, both_paths):
    g, chunk0 = random.Random(20261124), delta._CHUNK
    shapes = [(50, 7), (40, 12), (16, 64), (4, 100), (3, 5, 8), (7, 1), (1, 33), (9, 24)]
    kinds = set()
    for i in range(300):
        shape, dtype = g.choice(shapes), g.choice(WORD_DTYPES)
        monkeypatch.setattr(delta, "_CHUNK", g.choice([chunk0, 8, 24, 40, 64, 100]))
        base = _random(shape, dtype, seed=i)
        n = base.numel()
        which = g.sample(range(n), g.choice([0, 1, 3, n // 10, n // 2, n]))
        if g.random() < 0.3:  # whole rows
            row = n // shape[0]
            which = [r * row + j for r in g.sample(range(shape[0]), min(shape[0], g.randint(1, 2)))
                     for j in range(row)]
        changed = _rows_of(shape, which)
        extra = g.sample(range(shape[0]), g.randint(0, shape[0]))
        rows = torch.tensor(sorted(set(changed) | set(extra)), dtype=torch.int64)
        old = _at(base, g.choice([0, 0, 1, 3, 8]))
        new = _at(_flip(base, which), g.choice([0, 0, 1, 3, 8]))
        want = encode("w", old, new)
        assert _fields(encode("w", old, new, rows=rows)) == _fields(want), i
        kinds.add(want.kind)
    assert kinds == {"same", "patch", "rows", "dense"}


def test_no_rows_is_same_and_rows_need_a_tensor_with_rows():
    old = _random((8, 4), torch.bfloat16)
    new = _flip(old, [0, 5])
    none = torch.zeros(0, dtype=torch.int64)
    assert encode("w", old, new, rows=none).kind == "same"  # the caller vouched: not compared
    flat = _random((10,), torch.float32)
    assert encode("b", flat, _flip(flat, [1]), rows=none).kind == "same"
    with pytest.raises(DeltaError, match=r"^b: `rows` given for a tensor without rows"):
        encode("b", flat, _flip(flat, [1]), rows=torch.tensor([0]))
    (d,) = encode_all({"w": old}, {"w": new}, rows={"other": none})  # not named: compared
    assert d.kind == "patch" and d.indices.tolist() == [0, 5]


@pytest.mark.parametrize("shape,dtype", [((10, 3), torch.int8), ((7, 5), torch.bfloat16),
                                         ((4, 3, 3), torch.float32), ((5, 1), torch.float64),
                                         ((100, 1000), torch.bfloat16)])
def test_blocks_are_whole_rows_and_whole_words(monkeypatch, shape, dtype):
    monkeypatch.setattr(prefilter, "BLOCK_BYTES", 64)
    t = _random(shape, dtype)
    k = prefilter._rows_per_block(t)
    row_bytes = t.numel() // shape[0] * t.element_size()
    assert k >= 1 and k * row_bytes % 8 == 0 and k * row_bytes >= min(64, row_bytes)
    ((rows, kind, hashes),) = prefilter.fingerprints({"w": t}).values()
    assert rows == k and kind == "xxh3_64" and len(hashes) == -(-shape[0] // k)


def test_candidates_are_the_rows_of_changed_blocks(monkeypatch):
    monkeypatch.setattr(prefilter, "BLOCK_BYTES", 64)  # 4 rows of 8 float16 per block
    old = {"w": _random((40, 8), torch.float16), "norm": _random((8,), torch.float32),
           "same": _random((40, 8), torch.float16), "dense": _random((16, 8), torch.float16),
           "resized": _random((8, 8), torch.float16)}
    new = dict(old, w=_flip(old["w"], [8 * 9, 8 * 30 + 3]), norm=_flip(old["norm"], [2]),
               dense=_flip(old["dense"], [0, 8 * 5, 8 * 9]),  # 3 of 4 blocks
               resized=_random((12, 8), torch.float16))
    before, now = prefilter.fingerprints(old), prefilter.fingerprints(new)
    got = prefilter.candidates(before, now, new)
    assert got["w"].tolist() == [8, 9, 10, 11, 28, 29, 30, 31]
    assert got["same"].tolist() == []
    assert "norm" not in got and "dense" not in got and "resized" not in got  # compared whole
    assert prefilter.candidates(None, now, new) == {}
    unchanged = dict(old, w=old["w"].clone())
    assert prefilter.candidates(before, prefilter.fingerprints(unchanged), unchanged)[
        "norm"].tolist() == []
    del old["resized"], new["resized"]
    want = [_fields(d) for d in encode_all(old, new)]
    assert [_fields(d) for d in encode_all(old, new, rows=got)] == want


def test_prefiltered_encode_is_exact_over_a_seeded_sweep(monkeypatch):
    g = random.Random(7)
    for i in range(40):
        monkeypatch.setattr(prefilter, "BLOCK_BYTES", g.choice([8, 64, 200, 4096]))
        old = {f"t{j}": _random(g.choice([(30, 16), (64, 3), (5, 2, 7), (33,)]),
                                g.choice(WORD_DTYPES), seed=100 * i + j) for j in range(4)}
        new = {k: _flip(t, g.sample(range(t.numel()), g.choice([0, 1, 2, 5, t.numel() // 3])))
               for k, t in old.items()}
        rows = prefilter.candidates(prefilter.fingerprints(old), prefilter.fingerprints(new),
                                    new)
        assert ([_fields(d) for d in encode_all(old, new, rows=rows)]
                == [_fields(d) for d in encode_all(old, new)]), i


def test_spared_and_the_skip_policy(monkeypatch):
    monkeypatch.setattr(prefilter, "BLOCK_BYTES", 64)  # 4 rows of 8 float16 per block
    old = {"w": _random((40, 8), torch.float16), "b": _random((16,), torch.float32)}
    rows = {"w": torch.tensor([0, 1, 2, 3]), "b": torch.zeros(0, dtype=torch.int64)}
    assert prefilter.spared(rows, old) == (640 - 64 + 64) / (640 + 64)
    assert prefilter.spared({}, old) == 0.0
    p = prefilter.Prefilter()
    got, prints = p.rows(old)
    assert got is None and prints is not None  # nothing known yet: compared whole
    p.prints = prints
    sparse = dict(old, w=_flip(old["w"], [3]))
    got, prints = p.rows(sparse)
    assert got["w"].tolist() == [0, 1, 2, 3] and got["b"].tolist() == []
    p.prints = prints
    everywhere = dict(sparse, w=_flip(sparse["w"], list(range(0, 320, 8))))
    got, prints = p.rows(everywhere)
    assert "w" not in got and prefilter.spared(got, everywhere) < prefilter.SPARE
    for _ in range(prefilter.SKIP):  # then skipped: no fingerprints, everything compared
        p.prints = prints
        assert p.rows(everywhere) == (None, None)
        prints = None
    p.prints = None
    got, prints = p.rows(everywhere)  # taken again, used at the next update
    assert got is None and prints is not None
    assert p.rows(everywhere, use=False)[0] is None


def test_a_tensor_whose_fingerprints_are_of_another_kind_is_compared_whole(monkeypatch):
    # hashes of another kind (a GPU's torch-mix64 vs the CPU's xxh3) say nothing: equal
    # values must not pass for "no block changed"
    monkeypatch.setattr(prefilter, "BLOCK_BYTES", 64)
    t = _random((40, 8), torch.float16)
    now = prefilter.fingerprints({"w": t})
    k, kind, h = now["w"]
    before = {"w": (k, "torch_mix64" if kind != "torch_mix64" else "xxh3_64", h.copy())}
    assert "w" not in prefilter.candidates(before, now, {"w": t})


def test_exactly_half_the_blocks_changed_is_still_gathered(monkeypatch):
    monkeypatch.setattr(prefilter, "BLOCK_BYTES", 64)  # 4 rows of 8 float16 per block
    old = _random((8, 8), torch.float16)  # 2 blocks
    new = _flip(old, [8 * 5])  # one of them: DENSER (0.5) of them, not more
    got = prefilter.candidates(prefilter.fingerprints({"w": old}),
                               prefilter.fingerprints({"w": new}), {"w": new})
    assert got["w"].tolist() == [4, 5, 6, 7]


def test_a_last_block_one_row_past_the_end_gives_no_row_past_the_end(monkeypatch):
    monkeypatch.setattr(prefilter, "BLOCK_BYTES", 64)  # 4 rows of 8 float16 per block
    old = _random((7, 8), torch.float16)  # blocks: rows 0-3, rows 4-6 (row 7 does not exist)
    new = _flip(old, [8 * 5])
    got = prefilter.candidates(prefilter.fingerprints({"w": old}),
                               prefilter.fingerprints({"w": new}), {"w": new})
    assert got["w"].tolist() == [4, 5, 6]


def test_tensors_without_bytes_are_all_spared_and_never_start_the_skip():
    empty = {"w": torch.zeros(0, 8), "b": torch.zeros(0)}
    assert prefilter.spared({}, empty) == 1.0 and prefilter.spared({}, {}) == 1.0
    p = prefilter.Prefilter()
    p.prints = p.rows(empty)[1]
    got, prints = p.rows(empty)
    assert got is not None and prints is not None  # not skipped at the next update
    assert p.rows(empty)[1] is not None


def test_known_prints_are_not_used_when_the_receivers_do_not_hold_them(monkeypatch):
    # use=False: a receiver lacks what `prints` describes: every tensor is compared whole
    monkeypatch.setattr(prefilter, "BLOCK_BYTES", 64)
    old = {"w": _random((40, 8), torch.float16)}
    p = prefilter.Prefilter()
    p.prints = p.rows(old)[1]
    got, prints = p.rows(dict(old, w=_flip(old["w"], [3])), use=False)
    assert got is None and prints is not None


def test_prints_that_spare_exactly_spare_are_kept(monkeypatch):
    monkeypatch.setattr(prefilter, "BLOCK_BYTES", 64)  # 4 rows of 8 float16 per block
    old = {"w": _random((16, 8), torch.float16)}  # 4 blocks
    new = {"w": _flip(old["w"], [8 * 0, 8 * 4, 8 * 8])}  # 3 changed: spares 1/4 = SPARE
    p = prefilter.Prefilter()
    p.prints = p.rows(old)[1]
    monkeypatch.setattr(prefilter, "DENSER", 1.0)  # gathered, not compared whole
    got, prints = p.rows(new)
    assert prefilter.spared(got, new) == prefilter.SPARE
    p.prints = prints
    assert p.rows(new)[1] is not None  # not skipped: it spared SPARE, not less
