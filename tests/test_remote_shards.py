"""remote.shards: a TP worker stages and writes only its shard of each HF tensor.

Every check is bit-exact against the full update applied to the HF tensors, then sliced the
way vLLM shards them (`test_layout_tp.reference_local`, which shares no code with `layout`).
"""

import math

import pytest
import torch

from hotweights.errors import LayoutError
from hotweights.layout.plan import Layout, Piece, plan
from hotweights.remote import shards
from hotweights.remote.delta import DENSE, PATCH, ROWS, encode_all
from hotweights.remote.packing import pack
from hotweights.remote.shards import Shard
from hotweights.remote.staging import Staged
from test_delta import _flip
from test_layout_tp import LM_HEAD, Model, hf_tensors, reference_local


def _specs(w: dict) -> dict:
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in w.items()}


def _changed(old: dict) -> dict:
    """`old` with every kind of change: whole tensors, whole rows, scattered elements."""
    new = {}
    for i, (name, t) in enumerate(old.items()):
        n, kind = t.numel(), i % 4
        if kind == 0:
            new[name] = _flip(t, slice(None))
        elif kind == 1 and t.dim() >= 2:  # rows 1, 2 and the last
            row = n // t.shape[0]
            new[name] = _flip(_flip(t, slice(row, 3 * row)), slice(n - row, n))
        elif kind == 3:
            new[name] = t.clone()
        else:
            new[name] = _flip(t, sorted({0, n // 3, n // 2 + 1, n - 1}))
    return new


def _stage(old: dict, new: dict, held: dict, *, full: bool = False, **options) -> Staged:
    staged = Staged(_specs(new), shards=held)
    deltas = encode_all(None if full else old, new)
    for r in pack(deltas, **options):
        staged(r)
    return staged


def _stage_xor(old: dict, new: dict, held: dict, olds: dict) -> None:
    """Stage `new` as xor-coded values of `old` (some, at least), decoded against `olds` (the
    live values, or the shards of them), and apply it in place."""
    staged = Staged(_specs(new), shards=held, old=olds)
    rounds = list(pack(encode_all(old, new), max_bytes=1 << 16, values="xor"))
    assert any(e.get("values") == "xor" for rd in rounds for e in rd.header["entries"])
    for rd in rounds:
        staged(rd)
    staged.apply_in_place()


def _ranks(m: Model, old: dict, ties: dict):
    """(rank, its vLLM parameters holding `old`, its shards) for each TP rank of `m`."""
    shapes = {k: tuple(v.shape) for k, v in old.items()}
    for r in range(m.tp):
        params = reference_local(m, old, r)
        layout = plan(m.config, {k: tuple(v.shape) for k, v in params.items()}, tp_size=m.tp,
                      tp_rank=r, hf_shapes=(shapes, ties))
        yield r, params, shards.of(layout, params, shapes | {a: shapes[t] for a, t in
                                                             ties.items()})


def _run(m: Model, options: dict) -> None:
    hf, ties = hf_tensors(m, seed=m.tp)
    old = {k: v.float() for k, v in hf.items()}
    new = _changed(old)
    kinds = {d.kind for d in encode_all(old, new)}
    assert {DENSE, ROWS, PATCH} <= kinds
    for r, params, held in _ranks(m, old, ties):
        staged = _stage(old, new, held, **options)
        assert not list(staged.patches())  # the plan maps every tensor: no loader
        assert staged.apply_in_place() <= set(old)
        want = reference_local(m, new, r)
        for name, t in want.items():
            assert torch.equal(params[name].view(torch.int32), t.view(torch.int32)), (name, r)


MODELS = {  # (kv, heads, tp, experts, vocab, tied)
    "kv split, qkv bias": Model(kv=2, heads=4, hd=4, hidden=16, inter=8, moe_inter=2,
                                experts=0, vocab=150, layers=2, bias=True, tied=False, tp=2),
    "kv replicated, experts (gate|up on dim 1: two runs)": Model(
        kv=1, heads=4, hd=4, hidden=16, inter=4, moe_inter=4, experts=3, vocab=100, layers=1,
        bias=False, tied=True, tp=4),
    "ranks of vocab padding only": Model(kv=4, heads=4, hd=2, hidden=8, inter=4, moe_inter=4,
                                         experts=0, vocab=10, layers=1, bias=False, tied=False,
                                         tp=4),
    "tp=1": Model(kv=2, heads=4, hd=4, hidden=16, inter=8, moe_inter=2, experts=2, vocab=70,
                  layers=1, bias=True, tied=False, tp=1),
    "qkv and gate_up packed on disk (Phi-3: three runs, two runs)": Model(
        kv=2, heads=4, hd=4, hidden=16, inter=8, moe_inter=2, experts=0, vocab=150, layers=2,
        bias=True, tied=False, tp=2, fused=True),
}


@pytest.mark.parametrize("options", [{"max_bytes": 1 << 20}, {"max_bytes": 96},
                                     {"max_bytes": 200, "patches": "flat"}])
@pytest.mark.parametrize("model", list(MODELS))
def test_each_rank_writes_its_shard_of_the_update(model, options):
    _run(MODELS[model], options)


def test_a_full_sync_stages_only_the_shard_share():
    m = MODELS["kv split, qkv bias"]
    hf, ties = hf_tensors(m, seed=0)
    old = {k: v.float() for k, v in hf.items()}
    shapes = {k: tuple(v.shape) for k, v in old.items()}
    total = sum(t.nbytes for t in old.values())
    for r in range(m.tp):
        params = reference_local(m, old, r)
        layout = plan(m.config, {k: tuple(v.shape) for k, v in params.items()}, tp_size=m.tp,
                      tp_rank=r, hf_shapes=(shapes, ties))
        held = shards.of(layout, params, shapes)
        staged = _stage(old, old, held, full=True, max_bytes=4096)
        share = sum(math.prod(held[k].held) * 4 for k in old)
        assert staged.nbytes == share < 0.6 * total
        assert share < staged.peak <= share + 4096
        replicated = [k for k in old if held[k].whole]
        assert replicated and all("norm" in k for k in replicated)


@pytest.mark.parametrize("shape,dim,runs", [
    ((12, 5), 0, ((2, 3), (8, 4))),  # two runs on the split dim
    ((4, 9, 3), 1, ((0, 2), (5, 3))),  # two runs on a middle dim: strided blocks
    ((6, 10), 1, ((4, 6),)),  # one column run, to the end
    ((6, 10), 0, ()),  # holds nothing
])
@pytest.mark.parametrize("max_bytes", [64, 136, 1 << 16])
def test_cut_pieces_match_the_full_update_sliced(shape, dim, runs, max_bytes):
    g = torch.Generator().manual_seed(len(runs) + dim)
    old = {"t": torch.randn(shape, generator=g)}
    new = _changed({"a": old["t"], "b": old["t"], "c": old["t"]})  # dense, rows, patch
    for t in new.values():
        slabs = [old["t"].narrow(dim, a, n).clone() for a, n in runs]
        shard = Shard(shape, dim, runs, tuple((s,) for s in slabs))
        staged = _stage(old, {"t": t}, {"t": shard}, max_bytes=max_bytes)
        staged.apply_in_place()
        for (a, n), s in zip(runs, slabs, strict=True):
            assert torch.equal(s.view(torch.int32), t.narrow(dim, a, n).view(torch.int32))


def test_a_tensor_without_a_shard_goes_to_the_loader_whole():
    m = MODELS["kv split, qkv bias"]
    hf, ties = hf_tensors(m, seed=0)
    old = {k: v.float() for k, v in hf.items()}
    new = _changed(old)
    shapes = {k: tuple(v.shape) for k, v in old.items()}
    params = reference_local(m, old, 1)
    layout = plan(m.config, {k: tuple(v.shape) for k, v in params.items()}, tp_size=2,
                  tp_rank=1, hf_shapes=(shapes, ties))
    held = shards.of(layout, params, shapes)
    del held[LM_HEAD]
    staged = _stage(old, new, held, max_bytes=1 << 20)
    (patch,) = staged.patches()
    assert patch.name == LM_HEAD and patch.shape == shapes[LM_HEAD]


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("model", ["kv split, qkv bias", "ranks of vocab padding only",
                                   "kv replicated, experts (gate|up on dim 1: two runs)",
                                   "qkv and gate_up packed on disk (Phi-3: three runs, two "
                                   "runs)"])
def test_each_rank_applies_xor_values_to_its_own_shard(model, compiled, monkeypatch):
    # a TP worker holds no whole tensor: xor values are cut to its slabs and applied to
    # them at the commit; without the compiled loops they decode against its slabs when
    # staged (`gather`: each run from the slab that holds it), 0 where it holds nothing,
    # and those elements are cut away before anything is kept
    from hotweights.remote import jit
    if not compiled:
        monkeypatch.setattr(jit, "_loops", False)
    elif not jit.enabled():
        pytest.skip("numba is not installed: no compiled loops")
    m = MODELS[model]
    hf, ties = hf_tensors(m, seed=m.tp)
    old = {k: v.float() for k, v in hf.items()}
    for t in old.values():
        t.view(-1)[::7] = 1.0
    new = _changed(old)
    for t in new.values():  # 1.0 -> 2.0: their xor, decoded against 0, is +Inf
        t.view(-1)[::7] = 2.0
    for r, params, held in _ranks(m, old, ties):
        _stage_xor(old, new, held, held)
        for name, t in reference_local(m, new, r).items():
            assert torch.equal(params[name].view(torch.int32), t.view(torch.int32)), (name, r)


def test_gather_reads_the_held_run_and_zero_elsewhere():
    old = torch.arange(4 * 9, dtype=torch.float32).view(4, 9)
    slab = old.narrow(1, 2, 3).contiguous()  # columns 2..4 held
    shard = Shard((4, 9), 1, ((2, 3),), ((slab,),))
    idx = torch.tensor([0, 2, 4, 5, 9 + 3, 35])
    assert shard.gather(idx, torch.float32).tolist() == [0, 2, 4, 0, 12, 0]
    assert Shard((4, 9), 0, ()).gather(idx, torch.float32).tolist() == [0] * 6
    runs = Shard((4, 9), 1, ((0, 1), (6, 2)), ((old.narrow(1, 0, 1).contiguous(),),
                                              (old.narrow(1, 6, 2).contiguous(),)))
    idx = torch.tensor([0, 1, 6, 7, 8, 9 + 7, 27, 35])  # two runs: columns 0 and 6..7
    assert runs.gather(idx, torch.float32).tolist() == [0, 0, 6, 7, 0, 16, 27, 0]


def test_a_scalar_parameter_is_mapped_viewed_and_staged():
    """A 0-d parameter (a learned logit scale): one piece, a view of itself, a shard."""
    from types import SimpleNamespace

    from hotweights.layout.views import view_of

    old = {"logit_scale": torch.tensor(0.5), "w": torch.randn(4, 3)}
    shapes = {k: tuple(v.shape) for k, v in old.items()}
    params = {k: v.clone() for k, v in old.items()}
    layout = plan(SimpleNamespace(), shapes, hf_shapes=(shapes, {}))
    (piece,) = layout.pieces["logit_scale"]
    assert piece.whole and view_of(params["logit_scale"], piece) is params["logit_scale"]
    held = shards.of(layout, params, shapes)
    assert held["logit_scale"].whole
    new = {"logit_scale": torch.tensor(0.75), "w": old["w"] + 1}
    _stage(old, new, held, max_bytes=1 << 16).apply_in_place()
    assert params["logit_scale"].item() == 0.75 and torch.equal(params["w"], new["w"])


def _layout(*pieces, missing=()) -> Layout:
    """vLLM name -> one piece each: (vLLM name, HF rows on dim `dim` it holds, dim)."""
    return Layout({v: (Piece("w", (8, 6), (0, n), dim, start),) for v, start, n, dim in pieces},
                  missing=missing)


def test_runs_listed_out_of_order_are_held_in_order():
    # vLLM's parameters need not come in the HF order of what they hold
    old = {"w": torch.randn(8, 6)}
    params = {"hi": old["w"][5:8].clone(), "lo": old["w"][0:2].clone()}
    held = shards.of(_layout(("hi", 5, 3, 0), ("lo", 0, 2, 0)), params, {"w": (8, 6)})
    assert held["w"].runs == ((0, 2), (5, 3)) and held["w"].held == (5, 6)
    new = {"w": _flip(old["w"], slice(None))}
    assert _stage(old, new, held, max_bytes=1 << 20).apply_in_place() == {"w"}
    assert torch.equal(params["lo"], new["w"][0:2]) and torch.equal(params["hi"], new["w"][5:])


def test_pieces_on_two_dims_or_overlapping_are_refused_and_touching_runs_are_not():
    params = {"a": torch.zeros(8, 6), "b": torch.zeros(8, 6)}
    with pytest.raises(LayoutError, match=r"w: held split on dims \[0, 1\]; one expected"):
        shards.of(_layout(("a", 0, 2, 0), ("b", 0, 2, 1)), params, {})
    with pytest.raises(LayoutError, match=r"w: held runs \[0, 4\) and \[3, \.\.\.\) overlap"):
        shards.of(_layout(("a", 0, 4, 0), ("b", 3, 2, 0)), params, {})
    held = shards.of(_layout(("a", 0, 3, 0), ("b", 3, 2, 0)), params, {})
    assert held["w"].runs == ((0, 3), (3, 2))


def test_a_tensor_the_layout_lists_as_missing_gets_no_shard():
    # it goes through the loader whole; a name no piece holds on this rank holds nothing
    held = shards.of(_layout(("a", 0, 8, 0), missing=("gone",)), {"a": torch.zeros(8, 6)},
                     {"w": (8, 6), "gone": (4,), "pad": (3,)})
    assert set(held) == {"w", "pad"} and held["pad"].runs == () and held["w"].whole


def test_a_run_two_parameters_hold_is_written_into_both():
    # tied weights: one HF run, two vLLM slabs (neither is written through the other)
    old = {"w": torch.randn(8, 6)}
    params = {"a": old["w"].clone(), "b": old["w"].clone()}
    pieces = {v: (Piece("w", (8, 6), (0, 8)),) for v in params}
    held = shards.of(Layout(pieces), params, {"w": (8, 6)})
    new = {"w": _flip(old["w"], [1, 17, 40])}
    assert _stage(old, new, held, max_bytes=1 << 20).apply_in_place() == {"w"}
    assert torch.equal(params["a"], new["w"]) and torch.equal(params["b"], new["w"])


def test_a_scalar_held_whole_is_staged_and_written():
    old = {"s": torch.tensor(0.5)}
    live = old["s"].clone()
    held = {"s": shards.whole(live)}
    assert held["s"].whole and held["s"].held == ()
    assert _stage(old, {"s": torch.tensor(0.75)}, held, max_bytes=1 << 20).apply_in_place() == {"s"}
    assert live.item() == 0.75

