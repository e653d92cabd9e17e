"""benchmarks/gpu_update.py on a CPU machine: the no-CUDA JSON, the 8 B stand-in's shapes
(derived, never allocated), and its three methods end to end on a tiny CPU model (the
server's tensors in /dev/shm instead of CUDA IPC, gloo instead of NCCL)."""

import json

import pytest
import torch

from hotweights import plan

KEYS = {"params_b", "update_ms", "ipc_copy_ms", "nccl_bcast_ms", "speedup_vs_copy", "skipped",
        "digest_gbps"}


@pytest.fixture
def bench(load_bench):
    return load_bench("gpu_update")


def test_without_cuda_the_json_has_every_key_null_and_says_why(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == KEYS
    assert out["skipped"] == {"cuda": "no CUDA device"}
    assert out["params_b"] == pytest.approx(8.03, abs=0.01)  # the size, derived
    assert all(out[k] is None for k in KEYS - {"params_b", "skipped"})


def test_the_default_stand_in_is_llama_3_8b_as_vllm_holds_it(bench):
    config = bench.llama_config()
    shapes = bench.vllm_shapes(config)
    assert bench.numel(shapes) == 8_030_261_248  # Llama-3-8B's parameter count
    assert shapes["model.layers.31.self_attn.qkv_proj.weight"] == (4096 + 2 * 1024, 4096)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 14336, 4096)
    layout = plan(config, shapes)  # strict: every HF parameter has a vLLM home
    assert layout.num_mapped == 32 * 9 + 3
    assert bench.numel(bench.vllm_shapes(bench.llama_config(2))) < 1.5e9


def test_vocab_is_padded_as_vllm_pads_it(bench):
    shapes = bench.vllm_shapes(bench.llama_config(1, vocab_size=300))
    assert shapes["model.embed_tokens.weight"][0] == shapes["lm_head.weight"][0] == 320


@pytest.mark.timeout(120)
def test_every_method_runs_and_is_verified_on_a_tiny_cpu_model(bench, capsys):
    config = bench.llama_config(2, hidden_size=256, intermediate_size=512, head_dim=64,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    skips = bench.Skips()
    ms = bench.measure(config, repeat=2, device="cpu", skips=skips)
    assert skips.reasons == {}
    assert set(ms) == {"update_ms", "ipc_copy_ms", "nccl_bcast_ms"}
    assert all(v > 0 for v in ms.values())
    assert "the server sees it" in capsys.readouterr().out


def test_the_digest_rate_is_measured_on_the_device_given(bench):
    assert bench.digest_gbps(1, "cpu") > 0.05
