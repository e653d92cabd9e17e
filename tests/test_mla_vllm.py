"""Multi-head latent attention (DeepSeek-V2/V3) trained in place through a real vLLM CPU
engine's shared weights, the decode path included.

vLLM derives `W_UV` and `W_UK_T` (what its decode path computes with) from `kv_b_proj` at
load, as views of its weight; the server shares them as views of the shared bytes
(`vllm_plugin.aliases`), so a trainer's step on `kv_b_proj` reaches the decode path too
(the prefill reads `kv_b_proj` itself: `tests/test_views_vllm.py` covers it).
"""

import pytest
import torch

from hotweights import build_hf_model, plan
from hotweights.bridge.loaded import check_loaded
from hotweights.protocol import shm
from hotweights.testing import tiny
from hotweights.vllm_plugin.local import hf_context, live_params

CASES = [("deepseek_v2", "bfloat16", "auto"), ("deepseek_v3", "float32", "auto")]
pytestmark = [pytest.mark.vllm, pytest.mark.parametrize(
    "engine_key", CASES, ids=["-".join(c) for c in CASES], scope="module")]
PROMPT = [1, 5, 9, 20, 33, 7, 101, 250, 64, 3]
TOL = {"bfloat16": 0.05, "float32": 1e-3}  # as tests/test_views_vllm.py's
assert {arch for arch, _, _ in CASES} == set(tiny.MLA_ARCHS)


def _served(llm) -> tuple[int, list[dict[int, float]]]:
    """The first token generated, and two tokens' logprobs: the first from the prefill,
    the second from the decode path (W_UK_T and W_UV)."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=2, temperature=0.0, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    return out.token_ids[0], [{t: lp.logprob for t, lp in step.items()}
                              for step in out.logprobs]


def _decode_matches(llm, model, dtype) -> bool:
    """vLLM's decode-path logprobs are the HF model's on the prompt and the first token."""
    first, (_, decoded) = _served(llm)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([[*PROMPT, first]])).logits
    ours = torch.log_softmax(logits[0, -1].float(), dim=-1)
    return all(abs(ours[t].item() - lp) < TOL[dtype] for t, lp in decoded.items())


def _derived_are_views_of_kv_b_proj(model) -> int:
    """In the engine: every MLA layer's W_UV and W_UK_T hold what kv_b_proj holds now."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    checked = 0
    for layer in model.modules():
        if isinstance(layer, MLAAttention):
            weight = layer.kv_b_proj.weight.T.view(layer.kv_lora_rank, layer.num_heads, -1)
            w_uk, w_uv = weight.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
            assert torch.equal(layer.W_UV, w_uv.transpose(0, 1))
            assert torch.equal(layer.W_UK_T, w_uk.permute(1, 2, 0))
            checked += 1
    return checked


@pytest.fixture(scope="module")
def shared(engine_key, vllm_engines, tiny_model, servable):
    arch, dtype, impl = engine_key
    servable(arch)
    llm = vllm_engines.get(arch, dtype, impl, unshared=True)
    before = _served(llm)
    manifest = shm.Manifest.from_dict(vllm_engines.share())
    checkpoint = {name: t.clone() for name, t in live_params(llm).items()}
    yield llm, manifest, tiny_model(arch), dtype, before
    with torch.no_grad():  # the engine's next tests get the checkpoint back
        for name, tensor in live_params(llm).items():
            tensor.copy_(checkpoint[name])
    llm.collective_rpc("hotweights_release")


def test_shared_weights_map_exactly_without_the_derived_ones(shared):
    llm, manifest, model_dir, dtype, before = shared
    assert _served(llm) == before  # sharing changed nothing served
    assert not [e.name for e in manifest.tensors if e.name.rpartition(".")[2].startswith("W_")]
    tensors = shm.attach(manifest)  # what a trainer process maps
    with hf_context(llm):
        model, report = build_hf_model(model_dir, tensors, layout=plan(model_dir, tensors))
    assert report.missing == () and report.unused == () and report.bytes_copied == 0
    assert check_loaded(model, model_dir) == len(list(model.parameters()))
    assert llm.apply_model(_derived_are_views_of_kv_b_proj)[0] == 2
    assert _decode_matches(llm, model, dtype)


def test_a_step_on_the_shared_bytes_reaches_the_decode_path(shared):
    llm, manifest, model_dir, dtype, before = shared
    tensors = shm.attach(manifest)
    with hf_context(llm):
        model, report = build_hf_model(model_dir, tensors, trainable=r"self_attn")
    assert any("kv_b_proj" in n for n in report.trainable)
    model(torch.tensor([PROMPT]), labels=torch.tensor([PROMPT])).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.01 * p.grad.sign())
    assert llm.apply_model(_derived_are_views_of_kv_b_proj)[0] == 2
    assert _served(llm)[1] != before[1]
    assert _decode_matches(llm, model, dtype)
