"""A config that does not match vLLM's live tensors fails, naming the parameter and shapes.

vLLM's live tensors are the tiny Llama's, as recorded from a real engine by
tests/fixtures/record_live.py (tests/fixtures/llama_live.json): the errors need their
names, shapes and dtypes only, so no engine starts here. The one `vllm` test below checks
the recording against a live engine (the one the suite shares, tests/conftest.py).
"""

import json
from pathlib import Path

import pytest
import torch

from hotweights import LayoutError, build_hf_model, plan
from hotweights.layout.plan import load_config

LIVE = json.loads((Path(__file__).parent / "fixtures" / "llama_live.json").read_text())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny Llama's model dir (its config) and vLLM's live tensors, as recorded."""
    model_dir = tmp_path_factory.mktemp("llama")
    (model_dir / "config.json").write_text(json.dumps(LIVE["config"]))
    params = {name: torch.zeros(shape, dtype=getattr(torch, dtype))
              for name, (shape, dtype) in LIVE["params"].items()}
    return model_dir, params


def _config(model_dir, **changes):
    config = load_config(model_dir)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def test_wrong_hidden_size_names_parameter_and_both_shapes(llama):
    model_dir, params = llama
    config = _config(model_dir, hidden_size=192)
    with pytest.raises(LayoutError, match=r"model\.embed_tokens\.weight: vLLM shape \(320, 128\)"
                       r" does not hold HF model\.embed_tokens\.weight shape \(\d+, 192\)"):
        plan(config, params)


def test_wrong_kv_heads_names_packed_parameter(llama):
    model_dir, params = llama
    config = _config(model_dir, num_key_value_heads=1)
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight: "
                       r"expected 384 rows on dim 0 \(q_proj 256 \+ k_proj 64 \+ v_proj 64\), "
                       r"found 512 \(vLLM shape \(512, 128\)\).*num_key_value_heads=1"):
        plan(config, params)


def test_config_with_an_extra_layer_names_the_missing_parameters(llama):
    model_dir, params = llama
    config = _config(model_dir, num_hidden_layers=3)
    with pytest.raises(LayoutError, match=r"held by no vLLM parameter.*model\.layers\.2\."):
        plan(config, params)
    with pytest.raises(LayoutError, match=r"held by no vLLM tensor: model\.layers\.2\..*"
                       r"allow_missing"):
        build_hf_model(config, params)
    model, report = build_hf_model(config, params, allow_missing=r"layers\.2\.")
    assert report.missing and all(".layers.2." in n for n in report.missing)
    assert report.bytes_copied > 0


def test_vllm_layer_the_config_lacks_is_unused(llama):
    model_dir, params = llama
    config = _config(model_dir, num_hidden_layers=1)
    with pytest.raises(LayoutError, match=r"match no HF parameter.*model\.layers\.1\."):
        plan(config, params)
    layout = plan(config, params, strict=False)
    assert layout.unused and all(".layers.1." in n for n in layout.unused)
    with pytest.raises(LayoutError, match=r"hold no HF parameter: model\.layers\.1\."):
        build_hf_model(config, params, layout=layout, allow_unused=False)


def test_unknown_packed_parameter_is_named(llama):
    model_dir, params = llama
    bad = dict(params)
    bad["model.layers.0.self_attn.qkvg_proj.weight"] = torch.empty(640, 128)
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.self_attn\.qkvg_proj\.weight"):
        plan(model_dir, bad)


def test_tensor_of_wrong_rank_is_named(llama):
    model_dir, params = llama
    bad = dict(params)
    bad["model.norm.weight"] = torch.empty(128, 1)
    with pytest.raises(LayoutError, match=r"model\.norm\.weight: vLLM shape \(128, 1\) and HF "
                       r"model\.norm\.weight shape \(128,\) differ in rank"):
        plan(model_dir, bad)


def test_unreadable_config_names_the_directory(tmp_path):
    with pytest.raises(LayoutError, match=str(tmp_path)):
        plan(tmp_path, {})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hidden_size", "128", r"cannot read a transformers config \(\w+"),
    ("num_hidden_layers", None, r"cannot read a transformers config \(\w+"),
    ("num_attention_heads", 0, r"\(ZeroDivisionError"),
    ("vocab_size", -5, r"transformers cannot build the model of this config"),
])
def test_a_config_field_transformers_refuses_is_a_named_layout_error(tmp_path, field, value,
                                                                     message):
    """`hotweights layout DIR` and `plan` say which config, not a traceback."""
    from hotweights.cli.main import main

    (tmp_path / "config.json").write_text(json.dumps({**LIVE["config"], field: value}))
    with pytest.raises(LayoutError, match=rf"{tmp_path}.*{message}"):
        plan(tmp_path, {})
    if field != "vocab_size":  # (that one the CLI finds once vLLM has started)
        assert main(["layout", str(tmp_path)]) == 1


def test_a_quantized_model_is_refused_naming_the_field(llama):
    """Colocate and the views API reach no server's refusal: the layout itself says a
    quantized model cannot be trained (before, its fp8 weights became trainable views, or
    an error about a float8 storage, by the dtype a tie picked)."""
    model_dir, params = llama
    config = _config(model_dir, quantization_config={"quant_method": "fp8",
                                                      "weight_block_size": [128, 128]})
    for build in (lambda: plan(config, params), lambda: build_hf_model(config, params)):
        with pytest.raises(LayoutError, match=r"LlamaConfig: quantized \(field "
                           r"quantization_config, quant_method 'fp8'\)"):
            build()


@pytest.mark.vllm
@pytest.mark.parametrize("engine_key", [("llama", "bfloat16", "auto")], ids="-".join)
def test_recorded_table_is_what_vllm_serves(engine_key, vllm_engines, tiny_model):
    from hotweights.vllm_plugin.local import live_params

    live = {name: [list(t.shape), str(t.dtype).removeprefix("torch.")]
            for name, t in live_params(vllm_engines.get(*engine_key)).items()}
    assert live == LIVE["params"], "re-record: .venv/bin/python tests/fixtures/record_live.py"

    def config(values: dict) -> dict:
        return {k: v for k, v in values.items() if k != "transformers_version"}

    built = json.loads((tiny_model("llama") / "config.json").read_text())
    assert config(built) == config(LIVE["config"]), "hotweights.testing.tiny changed: re-record"
