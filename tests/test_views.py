"""Views without vLLM: an HF model over stand-in vLLM tensors (merged qkv/gate_up, padded vocab)."""

import pytest
import torch

from hotweights import build_hf_model
from hotweights.testing import tiny

VOCAB = 300  # vLLM pads the vocabulary rows to a multiple of 64 (320)


def _vllm_params(config) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: torch.randn(s) * 0.05 for n, s in tiny.vllm_llama_shapes(config).items()}


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
