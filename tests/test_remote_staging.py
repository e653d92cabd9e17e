"""remote.staging: a receiver holds every round of an update, checked, until the commit."""

import json

import pytest
import torch

from hotweights.errors import DeltaError
from hotweights.remote import shards
from hotweights.remote.delta import encode_all
from hotweights.remote.packing import Round, pack
from hotweights.remote.shards import Shard
from hotweights.remote.staging import Staged
from test_delta import _flip, _same_bits, _state


def _specs(w: dict) -> dict:
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in w.items()}


def _load(weights: dict, patches) -> None:
    """What vLLM's loader does with the patches, on plain tensors."""
    for p in patches:
        w = weights[p.name]
        if p.indices is None:
            assert p.values.numel() == w.numel()
            w.view(-1).copy_(p.values)
        else:  # cast as the loader's copy_ does
            w.view(-1).index_copy_(0, p.indices.long(), p.values.to(w.dtype))


def _kinds(patches) -> dict:
    return {p.name: "dense" if p.indices is None else "sparse" for p in patches}


@pytest.mark.parametrize("max_bytes", [64, 200, 1 << 20])
def test_staged_rounds_load_bit_identical(max_bytes):
    old, new = _state()
    staged = Staged(_specs(old))
    staging = torch.empty(max_bytes, dtype=torch.uint8)  # one buffer, reused: staged copies
    for r in pack(encode_all(old, new), max_bytes=max_bytes, staging=staging):
        staged(r)
    got = {k: v.clone() for k, v in old.items()}
    patches = list(staged.patches())
    assert _kinds(patches) == {"a": "sparse", "b": "sparse", "c": "dense"}
    assert not list(staged.patches())  # each taken out of the staging as it was made
    _load(got, patches)
    assert _same_bits(got, new)
    direct = {k: v.clone() for k, v in old.items() if k != "b"}  # "b" through the loader
    staged = Staged(_specs(old), shards={k: shards.whole(v) for k, v in direct.items()})
    for r in pack(encode_all(old, new), max_bytes=max_bytes, staging=staging):
        staged(r)
    assert staged.apply_in_place() == {"a", "c"}
    rest = list(staged.patches())
    assert _kinds(rest) == {"b": "sparse"}
    merged = direct | {"b": old["b"].clone()}
    _load(merged, rest)
    assert _same_bits(merged, new)
    staged.clear()
    assert not list(staged.patches()) and staged.nbytes == 0


def _round(old, new) -> Round:
    (r,) = pack(encode_all(old, new), max_bytes=1 << 20)
    return Round(json.loads(r.header_bytes()), r.buffer)


def test_nan_in_patch_values_is_refused_by_name():
    old, new = _state()
    new["b"] = new["b"].clone()
    new["b"][7] = float("nan")
    with pytest.raises(DeltaError, match="`b`: the patch values hold NaN or Inf"):
        Staged(_specs(old))(_round(old, new))


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("max_bytes", [64, 200, 1 << 20])
def test_xor_values_stay_xors_until_the_commit_applies_them(compiled, max_bytes, monkeypatch):
    # A tensor written in place on the CPU keeps its xor values as xors (no old value read
    # while staging); the commit applies them. Without the compiled loops, or for a
    # tensor through the loader, they are decoded against the old values when staged.
    from hotweights.remote import jit
    if not compiled:
        monkeypatch.setattr(jit, "_loops", False)
    elif not jit.enabled():
        pytest.skip("numba is not installed: no compiled loops")
    old, new = _state()
    new["b"] = new["b"].clone()
    new["b"][9] = float("nan")  # not seen by the staging of a bare xor: the sender checks
    live = {k: v.clone() for k, v in old.items() if k != "a"}  # "a" through the loader
    # compiled: no old values given, none needed (the xors of "b" are not decoded)
    staged = Staged(_specs(old), old=None if compiled else old,
                    shards={k: shards.whole(v) for k, v in live.items()})
    rounds = list(pack(encode_all(old, new), max_bytes=max_bytes, values="xor"))
    assert any(e.get("values") == "xor" and e["name"] == "b" for r in rounds
               for e in r.header["entries"])
    if not compiled:
        with pytest.raises(DeltaError, match="`b`: the patch values hold NaN or Inf"):
            for r in rounds:
                staged(r)
        return
    for r in rounds:
        staged(r)
    assert _same_bits(live, {k: old[k] for k in live})  # nothing written before the commit
    assert staged.apply_in_place() == {"b", "c"}
    assert _same_bits(live, {k: new[k] for k in live})
    merged = live | {"a": old["a"].clone()}
    _load(merged, staged.patches())
    assert _same_bits(merged, new)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("values", ["raw", "xor"])
@pytest.mark.parametrize("spec", [torch.float32, torch.bfloat16])
def test_a_slab_vllm_keeps_in_float32_takes_bf16_values_exactly(spec, values, compiled,
                                                               monkeypatch):
    # vLLM keeps GDN's A_log, some routers and correction biases in float32 whatever it
    # serves: bf16 values written into them in place would land as bit patterns. The
    # engine's spec is the slab's float32 (bf16 values widened, written in place); a spec
    # in bf16 (no map of the weights) sends them through the loader, which casts
    from hotweights.remote import jit
    if not compiled:
        monkeypatch.setattr(jit, "_loops", False)
    elif not jit.enabled():
        pytest.skip("numba is not installed: no compiled loops")
    old = {"a_log": torch.randn(300, 64).to(torch.bfloat16),
           "gate": torch.randn(1000).to(torch.bfloat16)}
    new = {"a_log": _flip(old["a_log"], slice(5 * 64, 9 * 64)),  # rows
           "gate": _flip(old["gate"], [3, 7, 99, 998])}  # a patch
    live = {k: v.float() for k, v in old.items()}  # the server's float32 slabs
    whole = {k: shards.whole(v) for k, v in live.items()}
    staged = Staged({k: torch.empty(v.shape, dtype=spec, device="meta")
                     for k, v in old.items()}, old=live, shards=whole)
    for r in pack(encode_all(old, new), max_bytes=1 << 20, values=values):
        staged(r)
    if spec == torch.float32:
        assert staged.apply_in_place() == {"a_log", "gate"}
        assert not list(staged.patches())
    else:
        assert staged.apply_in_place() == set()  # no bf16 bits in float32 words
        assert torch.equal(live["a_log"], old["a_log"].float())
        _load(live, staged.patches())
    assert all(torch.equal(live[k], new[k].float()) for k in new)
    # a TP worker's shard of one: its xors decode against its values cast to bf16
    assert torch.equal(whole["gate"].gather(torch.tensor([3, 4]), torch.bfloat16),
                       new["gate"][3:5])


def test_a_narrower_or_another_kind_of_dtype_is_refused_by_name():
    old = {"w": torch.randn(8, 4)}
    new = {"w": old["w"] + 1}
    for target in (torch.bfloat16, torch.int32, torch.float16):
        with pytest.raises(DeltaError, match=r"`w`: field 'dtype' is 'float32', the target's "
                                             rf"is '{str(target).removeprefix('torch.')}'"):
            Staged({"w": torch.empty(8, 4, dtype=target, device="meta")})(_round(old, new))
    bf16 = {k: v.to(torch.bfloat16) for k, v in (old | {"x": new["w"]}).items()}
    with pytest.raises(DeltaError, match=r"field 'dtype' is 'bfloat16', the target's is "
                                         r"'float16'"):  # fp16 holds no bf16's range
        Staged({"w": torch.empty(8, 4, dtype=torch.float16, device="meta")})(
            _round({"w": bf16["w"]}, {"w": bf16["x"]}))


@pytest.mark.parametrize("compiled", [True, False])
def test_tied_weights_sent_under_both_names_are_applied_once(compiled, monkeypatch):
    # one slab on the server for both names: xors applied once per name would cancel out
    from hotweights.remote import jit
    if not compiled:
        monkeypatch.setattr(jit, "_loops", False)
    elif not jit.enabled():
        pytest.skip("numba is not installed: no compiled loops")
    emb = torch.randn(64, 16).to(torch.bfloat16)
    old = {"model.embed_tokens.weight": emb, "lm_head.weight": emb}
    new = {k: v.clone() for k, v in old.items()}
    for v in new.values():
        v[::7, 3] += 1
    slab = emb.clone()  # the server's tied weight
    staged = Staged(_specs(old), old={k: slab for k in old},
                    shards={k: shards.whole(slab) for k in old})
    for r in pack(encode_all(old, new), max_bytes=1 << 20, values="xor"):
        staged(r)
    staged.apply_in_place()
    assert torch.equal(slab, new["lm_head.weight"])


def test_unknown_name_and_shape_mismatch_are_refused_before_anything_is_held():
    old, new = _state()
    specs = _specs(old)
    del specs["a"]
    staged = Staged(specs)
    with pytest.raises(DeltaError, match="unknown tensor `a`"):
        staged(_round(old, new))
    specs["a"] = torch.empty(301, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(DeltaError, match="`a`: field 'shape'"):
        Staged(specs)(_round(old, new))


def test_a_tensor_sent_twice_is_refused():
    old, new = _state()
    r = _round(old, new)
    staged = Staged(_specs(old))
    staged(Round({**r.header, "rounds": 2}, r.buffer))
    with pytest.raises(DeltaError, match="`a`: a rows piece starts at element 320, before"):
        staged(Round({**r.header, "round": 1, "rounds": 2}, r.buffer))


def test_indices_the_compiled_loop_writes_are_held_as_int32():
    # a server staging a scattered update holds 4 bytes per changed element's index, not 8
    from hotweights.remote import jit
    if not jit.enabled():
        pytest.skip("numba is not installed: no compiled loops")
    old = {"w": torch.randn(500, 64, generator=torch.Generator().manual_seed(0)).bfloat16()}
    changed = sorted(torch.randperm(old["w"].numel())[:320].tolist())
    new = {"w": _flip(old["w"], changed)}
    live = {"w": old["w"].clone()}
    staged = Staged(_specs(old), shards={"w": shards.whole(live["w"])})
    for r in pack(encode_all(old, new), max_bytes=1 << 20, values="xor"):
        staged(r)
    assert staged.nbytes == len(changed) * (4 + 2)  # int32 indices, bf16 xors
    assert staged.apply_in_place() == {"w"}
    assert _same_bits(live, new)


def test_a_checkpoint_tensor_of_a_dtype_torch_has_no_form_of_is_named(tmp_path):
    # F4 / F6 (quantized): the remote engine cannot check updates of it, said at the start
    import json
    import types

    from hotweights.errors import UnsupportedModelError
    from hotweights.vllm_plugin import remote_engine
    header = json.dumps({"q.weight": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}})
    header = header.encode() + b" " * (-len(header) % 8)
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + b"\0")
    engine = object.__new__(remote_engine.HotweightsEngine)
    engine._spec_map, engine.model_dir = None, tmp_path
    engine.model_config = types.SimpleNamespace(dtype=torch.bfloat16)
    with pytest.raises(UnsupportedModelError, match=r"q.weight: dtype F4 in .* has no torch "
                                                     r"form: --remote cannot check updates"):
        engine._specs()


def test_the_loader_gets_the_patches_a_bounded_chunk_of_one_kind_at_a_time(monkeypatch):
    # each made from the staging as the chunks before it are loaded, so a worker holds one
    # chunk's index arrays (int64 per element) and device copies, not the whole update's
    from hotweights.vllm_plugin import remote_engine
    old, new = _state()
    engine = object.__new__(remote_engine.HotweightsEngine)  # the parts the apply reads
    engine.staged, engine.model, engine.device = Staged(_specs(old)), None, torch.device(
        "cpu")
    for r in pack(encode_all(old, new), max_bytes=1 << 20):
        engine.staged(r)
    calls, made = [], []
    patches = engine.staged.patches

    def counted():
        for p in patches():
            made.append(p.name)
            yield p
    monkeypatch.setattr(engine.staged, "patches", counted)
    monkeypatch.setattr(remote_engine, "PATCH_CHUNK", 1)  # a call per tensor
    monkeypatch.setattr(remote_engine, "load_checkpoint_weight_patches",
                        lambda model, chunk, **kw: calls.append(
                            (list(made), [p.name for p in chunk])))
    engine.finish_weight_update()
    # (the next tensor's patch is made before a chunk goes: it may be another kind)
    assert calls == [(["a", "b"], ["a"]), (["a", "b", "c"], ["b"]), (["a", "b", "c"], ["c"])]


def _edited(r: Round, at: int, ints: list, dtype=torch.int64) -> Round:
    """`r` (a copy of its buffer) with `ints` written as `dtype` at byte `at`: a sender's
    malformed piece, which `delta_apply.checked` passes."""
    buf = r.buffer.clone()
    data = torch.tensor(ints, dtype=dtype).view(torch.uint8)
    buf[at:at + data.numel()] = data
    return Round(json.loads(json.dumps(r.header)), buf)


def _flat():
    """(old, new, its one round: `r` rows [1, 3) and [4, 6) at byte 0, `p` patch indices
    [3, 9] as int32 at byte 96)."""
    old = {"r": torch.arange(32.).view(8, 4), "p": torch.arange(16.)}
    new = {"r": _flip(_flip(old["r"], slice(4, 12)), slice(16, 24)),
           "p": _flip(old["p"], [3, 9])}
    (r,) = pack(encode_all(old, new), max_bytes=1 << 20, patches="flat")
    assert [(e["name"], e["offset"]) for e in r.header["entries"]] == [("r", 0), ("p", 96)]
    return old, new, r


def test_rows_ranges_that_touch_are_taken_and_ranges_that_overlap_are_refused():
    old, _, r = _flat()
    touching = _edited(r, 0, [1, 3, 3, 5])  # rows [1, 3) and [3, 5): still 4 rows
    staged = Staged(_specs(old))
    staged(touching)
    got = {k: v.clone() for k, v in old.items()}
    _load(got, staged.patches())
    rows = r.buffer[32:96].view(torch.float32).view(4, 4)  # the 4 rows sent
    assert torch.equal(got["r"][1:5], rows) and torch.equal(got["r"][5:], old["r"][5:])
    with pytest.raises(DeltaError, match="`r`: the rows ranges do not increase; refused"):
        Staged(_specs(old))(_edited(r, 0, [1, 3, 2, 4]))


def test_patch_indices_that_repeat_are_refused():
    old, _, r = _flat()
    with pytest.raises(DeltaError, match="`p`: the patch indices do not increase; refused"):
        Staged(_specs(old))(_edited(r, 96, [3, 3], torch.int32))


@pytest.mark.parametrize("name,first", [("c", 0), ("p", 9)])
def test_a_piece_that_repeats_the_last_element_staged_is_refused(name, first):
    # a dense tensor sent twice; a patch piece starting at the index the one before ended on
    old, new = _state()
    old["p"] = torch.arange(16.)
    new["p"] = _flip(old["p"], [3, 9])
    old, new = {name: old[name]}, {name: new[name]}
    (r,) = pack(encode_all(old, new), max_bytes=1 << 20, patches="flat")
    again = r if name == "c" else _edited(r, 0, [9, 12], torch.int32)  # indices [3, 9]
    staged = Staged(_specs(old))
    staged(Round({**r.header, "rounds": 2}, r.buffer))
    with pytest.raises(DeltaError, match=rf"`{name}`: a \w+ piece starts at element {first}, "
                                         "before"):
        staged(Round({**again.header, "round": 1, "rounds": 2}, again.buffer))


def test_a_shard_of_another_shape_than_its_spec_sends_the_tensor_to_the_loader():
    old, new = _state()
    live = {k: v.clone() for k, v in old.items()}
    staged = Staged(_specs(old), shards={"c": shards.whole(live["c"].view(-1))})  # flat
    for r in pack(encode_all(old, new), max_bytes=200):
        staged(r)
    assert staged.apply_in_place() == set()
    _load(live, staged.patches())
    assert _same_bits(live, new)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.int64])
def test_integer_patches_are_staged_without_a_nan_check(dtype):
    old = {"w": torch.arange(600).view(50, 12).to(dtype)}
    new = {"w": _flip(old["w"], [3, 77, 500])}
    staged = Staged(_specs(old))
    for r in pack(encode_all(old, new), max_bytes=1 << 20):
        staged(r)
    (p,) = staged.patches()  # (torch has no CPU index_copy_ of uint16 / uint32)
    assert p.indices.tolist() == [3, 77, 500]
    assert torch.equal(p.values, new["w"].view(-1)[[3, 77, 500]])


def _jit(compiled: bool, monkeypatch) -> None:
    from hotweights.remote import jit
    if not compiled:
        monkeypatch.setattr(jit, "_loops", False)
    elif not jit.enabled():
        pytest.skip("numba is not installed: no compiled loops")


def test_indices_the_loader_takes_are_held_as_int64():
    # converted while the server still serves, not at the commit: 8 bytes per index
    old = {"p": torch.arange(16.)}
    new = {"p": _flip(old["p"], [3, 9])}
    staged = Staged(_specs(old))
    for r in pack(encode_all(old, new), max_bytes=1 << 20, patches="flat"):  # int32 on the wire
        staged(r)
    assert staged.nbytes == 2 * (8 + 4)
    (p,) = staged.patches()
    assert p.indices.dtype == torch.int64 and p.indices.tolist() == [3, 9]


def test_a_tp_shards_xor_indices_are_held_as_int32(monkeypatch):
    # cut to the shard (int64 there), then narrowed for the compiled loop that applies them
    _jit(True, monkeypatch)
    old = {"w": torch.randn(8, 16, generator=torch.Generator().manual_seed(0))}
    new = {"w": _flip(old["w"], [3, 20, 70, 100])}  # rows 0, 1 (held), 4, 6 (not)
    slab = old["w"][:4].clone()
    staged = Staged(_specs(old), shards={"w": Shard((8, 16), 0, ((0, 4),), ((slab,),))})
    for r in pack(encode_all(old, new), max_bytes=1 << 20, values="xor"):
        staged(r)
    assert staged.nbytes == 2 * (4 + 4)  # the two held: int32 indices, float32 xors
    assert staged.apply_in_place() == {"w"}
    assert torch.equal(slab.view(torch.int32), new["w"][:4].view(torch.int32))


def test_peak_and_rounds_count_every_round_until_clear_and_clear_takes_the_update_again():
    old = {"big": torch.randn(1024), "small": torch.randn(16)}
    new = {"big": _flip(old["big"], slice(None)), "small": _flip(old["small"], [5])}
    staged = Staged(_specs(old))
    rounds = list(pack(encode_all(old, new), max_bytes=4096))  # the small one in a round 2
    for _ in range(2):
        held = []
        for r in rounds:
            staged(r)
            held.append(staged.nbytes + r.buffer.nbytes)
        assert staged.rounds == len(rounds) == 2 and staged.peak == max(held) > held[-1]
        got = {k: v.clone() for k, v in old.items()}
        _load(got, staged.patches())
        assert _same_bits(got, new)
        staged.clear()  # the next update may write the same elements again
        assert staged.nbytes == staged.peak == staged.rounds == 0


def test_a_fresh_staging_keeps_the_old_values_and_the_shards(monkeypatch):
    _jit(False, monkeypatch)  # xor values decoded against `old` when staged
    old, new = _state()
    live = {k: v.clone() for k, v in old.items()}
    staged = Staged(_specs(old), old=live,
                    shards={k: shards.whole(v) for k, v in live.items()}).fresh()
    for r in pack(encode_all(old, new), max_bytes=1 << 20, values="xor"):
        staged(r)
    assert staged.apply_in_place() == {"a", "b", "c"}
    assert _same_bits(live, new)


def test_two_tensors_of_one_size_each_keep_their_xors_for_the_commit(monkeypatch):
    # only one slab under two names (tied) is decoded when staged: two slabs of the same size
    # and dtype are not one, and need no old values
    _jit(True, monkeypatch)
    g = torch.Generator().manual_seed(0)
    old = {k: torch.randn(64, 16, generator=g).bfloat16() for k in ("x", "y")}
    new = {k: _flip(v, [1, 99, 500 + i]) for i, (k, v) in enumerate(old.items())}
    live = {k: v.clone() for k, v in old.items()}
    staged = Staged(_specs(old), shards={k: shards.whole(v) for k, v in live.items()})
    for r in pack(encode_all(old, new), max_bytes=1 << 20, values="xor"):
        staged(r)
    assert staged.apply_in_place() == {"x", "y"}
    assert _same_bits(live, new)


def test_rows_of_a_3d_tensor_load_and_a_repeat_is_refused_at_its_first_element():
    old = {"e": torch.randn(6, 5, 4)}
    new = {"e": _flip(old["e"], slice(2 * 20, 4 * 20))}  # rows 2 and 3: elements [40, 80)
    (r,) = pack(encode_all(old, new), max_bytes=1 << 20)
    assert r.header["entries"][0]["kind"] == "rows"
    staged = Staged(_specs(old))
    staged(Round({**r.header, "rounds": 2}, r.buffer))
    with pytest.raises(DeltaError, match="`e`: a rows piece starts at element 40, before"):
        staged(Round({**r.header, "round": 1, "rounds": 2}, r.buffer))
    got = {"e": old["e"].clone()}
    _load(got, staged.patches())  # what the first round staged
    assert _same_bits(got, new)


def test_an_empty_patch_piece_is_taken_before_or_after_the_others():
    # it writes nothing: no order to keep (as `delta_apply.apply` takes it)
    old, new, r = _flat()
    e = {**r.header["entries"][1], "count": 0, "nbytes": 0, "offset": 0}  # `p`, no element
    empty = Round({"format": 4, "round": 0, "rounds": 0, "nbytes": 0, "entries": [e]},
                  torch.empty(0, dtype=torch.uint8))
    staged = Staged(_specs(old))
    staged(empty)
    staged(Round({**r.header, "round": 1, "rounds": 0}, r.buffer))
    staged(Round({**empty.header, "round": 2, "rounds": 3}, empty.buffer))
    got = {k: v.clone() for k, v in old.items()}
    _load(got, staged.patches())
    assert _same_bits(got, new)


def test_what_the_commit_wrote_is_freed_and_not_written_again(monkeypatch):
    # xors applied twice would put the old values back
    _jit(True, monkeypatch)
    old, new = _state()
    live = {k: v.clone() for k, v in old.items()}
    staged = Staged(_specs(old), shards={k: shards.whole(v) for k, v in live.items()})
    for r in pack(encode_all(old, new), max_bytes=1 << 20, values="xor"):
        staged(r)
    assert staged.apply_in_place() == {"a", "b", "c"}
    assert staged.apply_in_place() == set()
    assert _same_bits(live, new)
