"""Views without vLLM: an HF model over stand-in vLLM tensors (merged qkv/gate_up, padded vocab)."""

import dataclasses

import pytest
import torch

from hotweights import build_hf_model
from hotweights.errors import LayoutError
from hotweights.layout.plan import meta_model, plan
from hotweights.layout.views import verify_shared
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
