"""vllm_plugin.cpu_keep_weights: vLLM CPU's kernels chosen so the weights stay viewable."""

import types

import pytest
import torch


@pytest.mark.parametrize("amx", [False, True])
def test_latent_attention_takes_the_reference_backend_on_every_cpu(monkeypatch, amx):
    # AMX's MLA backend packs kv_b_proj into its own layout and empties the weight
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from hotweights.vllm_plugin.cpu_keep_weights import install

    install()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    mla = types.SimpleNamespace(use_sparse=False, use_mla=True)
    assert CpuPlatform.get_attn_backend_cls(None, mla) == \
        AttentionBackendEnum.CPU_MLA.get_path()


def test_rotary_embedding_rotates_a_query_whose_heads_lie_apart():
    # DeepSeek's q_pe: the last 64 of each head's 128; vLLM's CPU kernel left it unrotated
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from hotweights.vllm_plugin.cpu_keep_weights import install

    install()
    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(64, 64, 32, 10000.0, False, torch.float32)
    positions = torch.arange(5)
    q = torch.randn(5, 4, 128)
    k = torch.randn(5, 1, 64)
    want_q, want_k = rope.forward_native(positions, q[..., 64:].clone(), k.clone())
    got_q, got_k = rope.forward_cpu(positions, q[..., 64:], k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert not torch.equal(got_q[1:], q[1:, :, 64:])  # rotated (position 0: unchanged)
