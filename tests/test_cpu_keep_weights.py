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
