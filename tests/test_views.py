"""Views without vLLM: an HF model over stand-in vLLM tensors (merged qkv/gate_up, padded vocab)."""

import pytest
import torch

from hotweights import build_hf_model
from hotweights.testing import tiny

VOCAB, PADDED = 300, 320  # vLLM pads the vocabulary rows to a multiple of 64


def _vllm_params(config) -> dict[str, torch.Tensor]:
    # What a tp=1 vLLM Llama holds; tied: lm_head is embed_tokens, listed once.
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv, inter = config.num_key_value_heads * config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (PADDED, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (PADDED, h)
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes |= {pre + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                   pre + "self_attn.o_proj.weight": (h, q),
                   pre + "mlp.gate_up_proj.weight": (2 * inter, h),
                   pre + "mlp.down_proj.weight": (h, inter),
                   pre + "input_layernorm.weight": (h,),
                   pre + "post_attention_layernorm.weight": (h,)}
    torch.manual_seed(0)
    return {n: torch.randn(s) * 0.05 for n, s in shapes.items()}


@pytest.mark.parametrize("selection", [r"^lm_head\.", ["lm_head.weight"],
                                       lambda name: name.startswith("lm_head.")])
def test_trainable_may_name_the_tied_alias(selection):
    config = tiny.make_config("llama_tied", VOCAB)
    params = _vllm_params(config)
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
