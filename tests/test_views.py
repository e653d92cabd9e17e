"""Views without vLLM: an HF model over stand-in vLLM tensors (merged qkv/gate_up, padded vocab)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from hotweights import build_hf_model
from hotweights.errors import LayoutError
from hotweights.layout.plan import Piece, meta_model, plan
from hotweights.layout.views import outside_served, slab_of, verify_shared, view_of
from hotweights.testing import tiny

VOCAB = 300  # vLLM pads the vocabulary rows to a multiple of 64 (320)


def _vllm_params(config) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: torch.randn(s) * 0.05 for n, s in tiny.vllm_llama_shapes(config).items()}


@pytest.mark.parametrize("selection", [r"^lm_head\.", ["lm_head.weight"],
                                       lambda name: name.startswith("lm_head."),
                                       "a generator"])  # read once: it trained nothing
def test_trainable_may_name_the_tied_alias(selection):
    config = tiny.make_config("llama_tied", VOCAB)
    params = _vllm_params(config)
    if selection == "a generator":
        selection = (n for n in ["lm_head.weight"])
    model, report = build_hf_model(config, params, trainable=selection)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert set(report.trainable) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "model.embed_tokens.weight"]

    before = params["model.embed_tokens.weight"].clone()
    ids = torch.tensor([[1, 5, 9, 20, 33]])
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        model.lm_head.weight.sub_(0.01 * model.lm_head.weight.grad.sign())
    assert not torch.equal(params["model.embed_tokens.weight"][:VOCAB], before[:VOCAB])


def test_untied_lm_head_selection_leaves_the_embedding_frozen():
    config = tiny.make_config("llama", VOCAB)
    model, report = build_hf_model(config, _vllm_params(config), trainable=r"^lm_head\.")
    assert report.trainable == ("lm_head.weight",)
    assert not model.model.embed_tokens.weight.requires_grad


@pytest.mark.parametrize(("selection", "named"), [
    (r"layers\.9\.", r"trainable='layers\\\\.9\\\\.' matches no HF parameter"),
    (["model.rotary_emb.inv_freq"], r"'model.rotary_emb.inv_freq' \(a buffer\)"),
    (["model.layers.0.mlp.gate_up_proj.weight"], r"names no HF parameter: "
     r"'model.layers.0.mlp.gate_up_proj.weight' \(they are named like 'model"),
    (None, "trainable=None: a bool, a regex, HF parameter names or a predicate"),
])
def test_a_trainable_selection_that_selects_nothing_is_refused(selection, named):
    from hotweights.errors import LayoutError
    config = tiny.make_config("llama", VOCAB)
    with pytest.raises(LayoutError, match=named):
        build_hf_model(config, _vllm_params(config), trainable=selection)


def test_a_config_that_ties_what_the_server_holds_apart_is_refused():
    """The server loaded untied weights (an lm_head of its own); a tied config would train
    the embedding as the output layer while vLLM computes with its lm_head."""
    from hotweights.errors import LayoutError
    params = _vllm_params(tiny.make_config("llama", VOCAB))
    assert "lm_head.weight" in params
    with pytest.raises(LayoutError, match=r"lm_head.weight: vLLM holds it as a tensor of its "
                       r"own, but the config ties lm_head.weight to model.embed_tokens.weight"):
        build_hf_model(tiny.make_config("llama_tied", VOCAB), params)


def test_a_config_whose_vocabulary_is_smaller_than_the_server_s_is_refused():
    from hotweights.errors import LayoutError
    params = _vllm_params(tiny.make_config("llama", VOCAB))  # 320 rows: 300 padded
    with pytest.raises(LayoutError, match=r"model.embed_tokens.weight: vLLM holds 320 rows "
                       r"\(x tp=1\), more than HF model.embed_tokens.weight's 200"):
        build_hf_model(tiny.make_config("llama", 200), params)


def test_the_meta_model_reserves_no_memory_for_its_parameters():
    # petabytes of parameters: allocating them, even untouched, fails on any machine
    config = tiny.make_config("llama", 2**31, hidden_size=2**20, intermediate_size=2**22,
                              num_attention_heads=16, num_key_value_heads=16)
    model = meta_model(config, dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.shape == (2**31, 2**20)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    inv_freq = model.model.rotary_emb.inv_freq  # computed, so real
    assert not inv_freq.is_meta and inv_freq.shape == (config.head_dim // 2,)


def test_meta_builds_leave_other_threads_modules_and_torch_as_they_were():
    """A module made in another thread while meta models build keeps its parameters, and
    two builds that overlap in two threads leave `register_parameter` as it was."""
    import threading

    original = torch.nn.Module.register_parameter
    config = tiny.make_config("llama", VOCAB)
    start, errors = threading.Barrier(3), []

    def builds() -> None:
        try:
            start.wait()
            for _ in range(10):
                assert all(p.is_meta for p in meta_model(config).parameters())
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=builds) for _ in range(2)]
    for t in threads:
        t.start()
    start.wait()
    made = []
    while any(t.is_alive() for t in threads):
        made.append(torch.nn.Linear(4, 4).weight.device.type)
    for t in threads:
        t.join()
    assert not errors and made and set(made) == {"cpu"}
    assert torch.nn.Module.register_parameter is original
    assert torch.nn.Linear(4, 4).weight.device.type == "cpu"


@pytest.mark.parametrize("extra", ["a buffer made by a filler", "a filler's value read",
                                   "a tensor attribute made by a filler"])
def test_a_model_computing_with_fillers_is_built_parameter_by_parameter(monkeypatch, extra):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaRotaryEmbedding.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if extra == "a buffer made by a filler":
            self.register_buffer("scale", torch.full((3,), 2.0), persistent=False)
        elif extra == "a tensor attribute made by a filler":
            self.scale = torch.full((3,), 2.0)
        else:
            self.factor = float(torch.ones(1))  # raises on meta

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "__init__", init)
    model = meta_model(tiny.make_config("llama", VOCAB))
    assert all(p.is_meta for p in model.parameters())
    if extra != "a filler's value read":
        assert torch.equal(model.model.rotary_emb.scale, torch.full((3,), 2.0))
    else:
        assert model.model.rotary_emb.factor == 1.0
    want = meta_model(tiny.make_config("llama", VOCAB)).model.rotary_emb.inv_freq
    assert torch.equal(model.model.rotary_emb.inv_freq, want)


def test_a_layout_of_another_model_is_refused():
    # its rows would be another model's: up_proj taken from the gate half, say
    config = tiny.make_config("llama", VOCAB)
    params = _vllm_params(config)
    other = tiny.make_config("llama", VOCAB, intermediate_size=config.intermediate_size // 2)
    wrong = plan(other, tiny.vllm_llama_shapes(other))
    with pytest.raises(LayoutError, match=r"^layout= is not the plan of these vLLM tensors "
                       r"for this model \(plan\(config, vllm_params\)\): the pieces of vLLM "
                       r"model\.layers\.0\.mlp\.gate_up_proj\.weight differ"):
        build_hf_model(config, params, layout=wrong)
    model, _ = build_hf_model(config, params, layout=plan(config, params))  # its own: taken
    extra = {"extra.a": torch.zeros(1), "extra.b": torch.zeros(1)}  # in another order
    build_hf_model(config, {**params, **extra}, allow_unused=True,
                   layout=plan(config, {**dict(reversed(extra.items())), **params},
                               strict=False))
    with pytest.raises(LayoutError, match=r"gate_proj\.weight: not a view of vLLM .*gate_up"
                                          r"_proj\.weight rows \(0, 160\) \(data_ptr .*\(320, "):
        verify_shared(model, params, wrong)  # the same address, another shape
    name = "model.layers.0.mlp.gate_up_proj.weight"
    bad = dataclasses.replace(wrong, pieces={name: tuple(
        dataclasses.replace(piece, hf_shape=(160, 7)) for piece in wrong.pieces[name])})
    with pytest.raises(LayoutError, match=r"gate_proj\.weight: rows \(0, 160\) of its vLLM "
                                          r"tensor \(640, 128\) are \(160, 128\), not the HF "
                                          r"shape \(160, 7\)"):
        verify_shared(model, params, bad)
    with pytest.raises(LayoutError, match=r"^vLLM model\.norm\.weight: in the layout, not "
                                          r"among the vLLM tensors"):
        verify_shared(model, {n: t for n, t in params.items() if n != "model.norm.weight"},
                      plan(config, params))
    with pytest.raises(LayoutError, match=r"^vllm_params is empty"):
        build_hf_model(config, {}, allow_missing=True)


def test_an_hf_parameter_two_vllm_tensors_hold_is_refused():
    # the first would be trained, the other served
    config = tiny.make_config("llama", VOCAB)
    params = _vllm_params(config)
    params["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(
        params["model.layers.0.self_attn.qkv_proj.weight"].shape[0] // 4, config.hidden_size)
    with pytest.raises(LayoutError, match=r"k_proj\.weight is held by vLLM "
                                          r"model\.layers\.0\.self_attn\.(qkv|k)_proj\.weight "
                                          "already"):
        plan(config, params)


def test_a_parameter_cut_to_another_shape_is_no_view():
    config = tiny.make_config("llama", VOCAB)
    params = _vllm_params(config)
    model, _ = build_hf_model(config, params)
    layout = plan(config, params)
    q = model.model.layers[0].self_attn.q_proj
    q.weight = torch.nn.Parameter(q.weight.detach()[:8])  # the same address and strides
    with pytest.raises(LayoutError, match=r"q_proj\.weight: not a view of vLLM "
                                          r".*qkv_proj\.weight .*\(8, \d+\)"):
        verify_shared(model, params, layout)


def test_a_tied_alias_of_a_missing_parameter_is_missing_too():
    # no vLLM tensor holds the embedding: lm_head.weight, tied to it, has no source either
    config = tiny.make_config("llama_tied", VOCAB)
    params = _vllm_params(config)
    del params["model.embed_tokens.weight"]
    layout = plan(config, params, strict=False)
    assert set(layout.missing) == {"model.embed_tokens.weight", "lm_head.weight"}
    model, report = build_hf_model(config, params, allow_missing=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one zeros tensor
    assert not model.lm_head.weight.is_meta
    assert set(report.missing) == {"model.embed_tokens.weight", "lm_head.weight"}


_HEADS = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)  # plan's config


def test_a_row_parallel_bias_is_whole_on_every_rank():
    # o_proj splits its weight by input columns; its bias (GPT-OSS) is not split
    p = "model.layers.0.self_attn.o_proj."
    hf = ({p + "weight": (8, 16), p + "bias": (8,)}, {})
    for rank in (0, 1):
        layout = plan(_HEADS, {p + "weight": (8, 8), p + "bias": (8,)}, tp_size=2,
                      tp_rank=rank, hf_shapes=hf)
        assert layout.pieces[p + "bias"] == (Piece(p + "bias", (8,), (0, 8)),)
        assert layout.pieces[p + "weight"] == (Piece(p + "weight", (8, 16), (0, 8), 1, 8 * rank),)


def test_a_packed_gate_up_of_odd_rows_is_refused_at_tp_2():
    # no even cut into gate and up: mapping it would leave a row behind
    name = "model.layers.0.mlp.gate_up_proj.weight"
    with pytest.raises(LayoutError, match=r"gate_up_proj\.weight: HF .* shape \(17, 8\) packs "
                                          r"gate_proj \+ up_proj; its cut is not mapped"):
        plan(_HEADS, {name: (8, 8)}, tp_size=2, hf_shapes=({name: (17, 8)}, {}))


def _embedding(vocab_rows: int, tp: int = 1):
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    name = "model.embed_tokens.weight"
    return lambda: plan(config, {name: (vocab_rows, 8)}, tp_size=tp,
                        hf_shapes=({name: (VOCAB, 8)}, {}))


def test_an_embedding_one_row_short_of_the_vocabulary_is_refused():
    with pytest.raises(LayoutError, match=r"embed_tokens\.weight: vLLM shape \(299, 8\) x "
                                          r"tp=1 has fewer rows than HF"):
        _embedding(VOCAB - 1)()
    assert _embedding(VOCAB)().pieces["model.embed_tokens.weight"][0].rows == (0, VOCAB)


def test_an_embedding_padded_by_a_whole_64_rows_more_is_another_vocabulary():
    # vLLM pads to the next multiple of 64: 64 rows more is never padding
    with pytest.raises(LayoutError, match=r"vLLM holds 364 rows \(x tp=1\), more than"):
        _embedding(VOCAB + 64)()
    assert _embedding(VOCAB + 63)().pieces["model.embed_tokens.weight"][0].rows == (0, VOCAB)


def test_a_row_parallel_weight_of_the_wrong_width_is_refused():
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(LayoutError, match=r"down_proj\.weight: vLLM shape \(8, 7\) does not "
                                          r"match HF .* split over tp=2 on dim 1 \(expected 8\)"):
        plan(_HEADS, {name: (8, 7)}, tp_size=2, hf_shapes=({name: (8, 16)}, {}))


def test_a_weight_whose_split_dim_tp_does_not_divide_is_refused():
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(LayoutError, match=r"down_proj\.weight: HF .* shape \(8, 15\) cannot be "
                                          r"split over tp=2 on dim 1"):
        plan(_HEADS, {name: (8, 7)}, tp_size=2, hf_shapes=({name: (8, 15)}, {}))


def test_a_multimodal_config_quantized_in_its_text_config_is_refused():
    # Qwen2.5-VL-style configs keep the text model's fields, quantization too, apart
    config = SimpleNamespace(model_type="qwen2_5_vl", text_config=SimpleNamespace(
        quantization_config={"quant_method": "fp8"}))
    with pytest.raises(LayoutError, match=r"SimpleNamespace: quantized \(field "
                                          r"quantization_config, quant_method 'fp8'\)"):
        plan(config, {}, hf_shapes=({}, {}))


def test_a_view_of_a_shard_is_refused_naming_the_rows_it_holds():
    # rows 4..8 of an 8-row HF tensor (rank 1 of 2): no view can stand in for all of it,
    # even where the shard's element count happens to match the HF shape
    shard = Piece("w", (8, 4), (0, 4), 0, 4)
    with pytest.raises(LayoutError, match=r"w: this rank holds only a shard of it \(rows "
                                          r"\(0, 4\) on its dim 0\); views need tp=1"):
        view_of(torch.zeros(4, 8), shard)


def test_a_transposed_piece_is_viewed_with_its_last_two_dims_swapped():
    # GPT-OSS experts: vLLM holds [E, out, in], transformers [E, in, out]
    vllm = torch.arange(24.0).view(2, 3, 4)
    piece = Piece("e", (2, 4, 3), (0, 3), 1, 0, True)
    hf = view_of(vllm, piece)
    assert hf.shape == (2, 4, 3) and hf.data_ptr() == vllm.data_ptr()
    assert torch.equal(hf, vllm.transpose(1, 2))
    assert torch.equal(slab_of(vllm, piece), vllm.transpose(1, 2))


def test_the_model_takes_the_dtype_most_vllm_tensors_have():
    # a missing parameter is made as zeros in the model's dtype: float32 here, though one
    # tensor (the final norm) is bf16
    config = tiny.make_config("llama", 300)
    torch.manual_seed(0)
    params = {n: torch.randn(s) * 0.05 for n, s in tiny.vllm_llama_shapes(config).items()}
    params["model.norm.weight"] = params["model.norm.weight"].bfloat16()
    del params["model.layers.0.input_layernorm.weight"]
    model, report = build_hf_model(config, params, allow_missing=True)
    assert report.missing == ("model.layers.0.input_layernorm.weight",)
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.float32
    assert model.model.norm.weight.dtype == torch.bfloat16  # a view: its own dtype


@pytest.mark.parametrize("rank", [0, 1])
def test_a_layout_of_a_rank_of_2_is_planned_at_tp_2_and_refused_as_a_shard(rank):
    # build_hf_model plans again at the layout's tp to compare: at tp=1 these rank-local
    # shapes would read as another model
    config = tiny.make_config("llama", 300)
    halve = {"qkv_proj": 0, "gate_up_proj": 0, "o_proj": 1, "down_proj": 1,
             "embed_tokens": 0, "lm_head": 0}
    params = {}
    for name, shape in tiny.vllm_llama_shapes(config).items():
        dim = halve.get(name.split(".")[-2])
        params[name] = torch.zeros([s // 2 if d == dim else s for d, s in enumerate(shape)])
    layout = plan(config, params, tp_size=2, tp_rank=rank, strict=False)
    with pytest.raises(LayoutError, match=r"this rank holds only a shard of it .*views need "
                                          r"tp=1"):
        build_hf_model(config, params, layout=layout)


def _llama_params(device: str = "cpu") -> tuple[object, dict[str, torch.Tensor]]:
    config = tiny.make_config("llama", 300)
    torch.manual_seed(0)
    return config, {n: (torch.randn(s) * 0.05).to(device)
                    for n, s in tiny.vllm_llama_shapes(config).items()}


def test_a_layout_whose_missing_or_unused_names_differ_is_refused():
    config, params = _llama_params()
    layout = plan(config, params, strict=False)
    for field in ("missing", "unused"):
        other = dataclasses.replace(layout, **{field: ("model.norm.weight",)})
        with pytest.raises(LayoutError, match=rf"its {field} names differ"):
            build_hf_model(config, params, layout=other)


def test_the_report_maps_no_missing_parameter():
    config, params = _llama_params()
    del params["model.norm.weight"]
    model, report = build_hf_model(config, params, allow_missing=True)
    assert report.missing == ("model.norm.weight",)
    assert "model.norm.weight" not in report.mapped
    assert "lm_head.weight" in report.mapped


def test_computed_buffers_follow_the_vllm_tensors_device():
    # the rotary table is real (computed on the CPU), the vLLM tensors are elsewhere
    # (`meta` stands in for a GPU)
    config, params = _llama_params("meta")
    model, _ = build_hf_model(config, params)
    assert {b.device.type for b in model.buffers()} == {"meta"}


def test_verify_shared_refuses_a_view_at_another_offset_of_the_right_tensor():
    # gate and up lie in one vLLM gate_up_proj, same shape: swapped, each is a view of the
    # right tensor at the wrong rows
    config, params = _llama_params()
    model, _ = build_hf_model(config, params)
    layout = plan(config, params)
    assert verify_shared(model, params, layout) > 0
    mlp = model.model.layers[0].mlp
    mlp.gate_proj.weight, mlp.up_proj.weight = mlp.up_proj.weight, mlp.gate_proj.weight
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: not a "
                                          r"view of vLLM model\.layers\.0\.mlp\.gate_up_proj"):
        verify_shared(model, params, layout)


def test_verify_shared_refuses_a_view_of_the_right_start_with_other_strides():
    config, params = _llama_params()
    model, _ = build_hf_model(config, params)
    norm = params["model.norm.weight"]
    model.model.norm.weight = torch.nn.Parameter(torch.as_strided(norm, norm.shape, (0,)))
    with pytest.raises(LayoutError, match=r"model\.norm\.weight: not a view of vLLM "
                                          r"model\.norm\.weight"):
        verify_shared(model, params, plan(config, params))


def test_outside_served_names_copies_but_leaves_out_the_missing_zeros():
    config, params = _llama_params()
    del params["model.norm.weight"]
    model, report = build_hf_model(config, params, allow_missing=True)
    assert outside_served(model, params) == ["model.norm.weight"]  # zeros: a copy
    assert outside_served(model, params, report.missing) == []
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert outside_served(model, params, report.missing) == ["lm_head.weight"]


def test_outside_served_leaves_out_frozen_copies():
    # only what training changes must be vLLM's memory
    config, params = _llama_params()
    model, _ = build_hf_model(config, params)
    frozen = model.model.embed_tokens.weight.detach().clone()
    model.model.embed_tokens.weight = torch.nn.Parameter(frozen, requires_grad=False)
    assert outside_served(model, params) == []


def test_a_persistent_buffer_gets_the_vllm_bytes_as_a_buffer_not_a_parameter():
    # (`hf_params` lists the buffers a checkpoint holds: DeepSeek-V3's router bias)
    from hotweights.layout.views import _set_param

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].register_buffer("scale", torch.zeros(2))
    vllm = torch.ones(2)
    _set_param(model, "0.scale", torch.nn.Parameter(vllm))
    assert "scale" in model[0]._buffers and "scale" not in dict(model[0].named_parameters())
    assert model[0].scale.data_ptr() == vllm.data_ptr() and not model[0].scale.requires_grad
