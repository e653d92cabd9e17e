"""vllm_plugin.cpu_keep_weights: vLLM CPU's kernels chosen so the weights stay viewable."""

import types

import pytest
import torch
import torch.nn.functional as F


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


def _rope():
    """vLLM's rotary embedding (head size 64, GPT-J style) with the plugin installed."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from hotweights.vllm_plugin.cpu_keep_weights import install

    install()
    with set_current_vllm_config(VllmConfig()):
        return RotaryEmbedding(64, 64, 32, 10000.0, False, torch.float32)


def test_rotary_embedding_rotates_a_query_whose_heads_lie_apart():
    # DeepSeek's q_pe: the last 64 of each head's 128; vLLM's CPU kernel left it unrotated
    rope, positions = _rope(), torch.arange(5)
    q = torch.randn(5, 4, 128)
    k = torch.randn(5, 1, 64)
    want_q, want_k = rope.forward_native(positions, q[..., 64:].clone(), k.clone())
    got_q, got_k = rope.forward_cpu(positions, q[..., 64:], k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert not torch.equal(got_q[1:], q[1:, :, 64:])  # rotated (position 0: unchanged)


def test_rotary_embedding_rotates_a_query_of_several_heads_in_place():
    # LFM2's [tokens, heads, size]: vLLM's CPU kernel rotated each head wrongly
    rope, positions = _rope(), torch.arange(5)
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    got_q, got_k = rope.forward_cpu(positions, q, k)
    assert got_q is q and got_k is k  # (rotated in place, as the kernel does)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


def test_linear_layers_keep_their_weight_and_compute_on_it():
    # vLLM's CPU dispatch packs a linear weight and empties `layer.weight`
    from vllm.model_executor.layers import utils

    from hotweights.vllm_plugin.cpu_keep_weights import install

    install()
    layer = torch.nn.Linear(8, 4)
    weight, before = layer.weight, layer.weight.detach().clone()
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.weight is weight and torch.equal(layer.weight, before)
    x = torch.randn(3, 8)
    assert torch.equal(layer.cpu_linear(x, layer.weight, layer.bias),
                       F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("cpu", ["avx512_bf16", "amx", "arm_bf16"])
def test_gdn_conv_takes_the_torch_path_on_every_cpu(monkeypatch, cpu):
    # the C++ conv kernel reads the conv1d weight packed; only vLLM's GDN module sees "no"
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    from hotweights.vllm_plugin.cpu_keep_weights import install

    install()
    if cpu == "arm_bf16":
        from vllm.platforms import CpuArchEnum
        monkeypatch.setattr(gdn_attention.current_platform, "get_cpu_architecture",
                            lambda: CpuArchEnum.ARM)
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"bf16": True})
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: cpu == "avx512_bf16")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: cpu == "amx")
    assert not gdn_attention.torch.cpu._is_avx512_bf16_supported()
    assert not gdn_attention.torch.cpu._is_amx_tile_supported()
    assert not gdn_attention.is_arm_bf16()
    assert gdn_attention.torch.zeros is torch.zeros  # the rest of torch as it is
    assert torch.cpu._is_avx512_bf16_supported() == (cpu == "avx512_bf16")  # elsewhere too


def test_install_twice_wraps_the_rotary_kernel_once():
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from hotweights.vllm_plugin.cpu_keep_weights import install

    install()
    wrapped = RotaryEmbedding.forward_cpu
    install()
    assert RotaryEmbedding.forward_cpu is wrapped


def test_only_a_query_or_key_whose_heads_lie_apart_takes_the_torch_path():
    from hotweights.vllm_plugin.cpu_keep_weights import _rope_of_views

    shapes = []  # what the kernel was given
    forward = _rope_of_views(lambda self, positions, query, key: shapes.append(query.shape))
    rope = types.SimpleNamespace(forward_native=lambda positions, query, key: "torch")

    def path(query, key):
        shapes.clear()
        return "torch" if forward(rope, None, query, key) == "torch" else shapes[0]

    qkv = torch.randn(5, 3 * 4 * 16)
    packed = qkv[:, :64]  # Llama's q: a slice of qkv, [tokens, heads * size]
    k_pe = torch.randn(5, 80)[:, 64:].unsqueeze(1)  # DeepSeek's: [tokens, 1, size]
    apart = torch.randn(5, 4, 32)[..., 16:]  # DeepSeek's q_pe: heads 32 apart
    strided = torch.randn(5, 64, 2)[..., 0]  # elements apart
    assert path(packed, packed) == path(packed, None) == path(packed, k_pe) == (5, 64)
    assert path(packed.view(5, 4, 16), None) == (5, 64)  # given flat, the same bytes
    assert path(apart, k_pe) == path(packed, apart) == path(strided, None) == "torch"
    assert path(torch.randn(2, 5, 4, 32)[..., 16:], None) == "torch"


def _experts(w1, w2, topk_weights, topk_ids, activation, *, expert_map=None, b1=None,
             b2=None, on_input=False, dtype=torch.float32):
    """`CPUUnquantizedExperts.apply` as installed, of hidden states [tokens, H]."""
    import vllm._custom_ops  # noqa: F401  (vLLM's ops, as in a server)

    from hotweights.vllm_plugin.cpu_keep_weights import _experts_torch_apply

    torch.manual_seed(1)
    x = torch.randn(topk_ids.shape[0], w1.shape[2]).to(dtype)
    out = torch.full(x.shape, float("nan"), dtype=dtype)
    _experts_torch_apply(types.SimpleNamespace(w1_bias=b1, w2_bias=b2), out, x, w1.to(dtype),
                         w2.to(dtype), topk_weights, topk_ids, activation, w1.shape[0],
                         expert_map, None, None, None, None, None, on_input)
    return x, out


def _want(x, w1, w2, topk_weights, experts, act, b1=None, b2=None, on_input=False):
    """Each token's sum over its experts, one at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k, e in enumerate(experts[t]):
            if e < 0:
                continue
            h = w1[e].double() @ x[t].double() + (0 if b1 is None else b1[e].double())
            y = w2[e].double() @ act(h) + (0 if b2 is None else b2[e].double())
            out[t] += y if on_input else y * topk_weights[t, k].double()
    return out


def _silu_and_mul(h):
    gate, up = h.chunk(2)
    return F.silu(gate) * up


@pytest.mark.parametrize("on_input", [False, True])
def test_moe_experts_compute_each_token_s_experts_on_the_checkpoint_layout(on_input):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    torch.manual_seed(0)
    E, H, inter = 4, 8, 16  # (vLLM's silu_and_mul: a multiple of 16)
    w1, w2 = torch.randn(E, 2 * inter, H), torch.randn(E, H, inter)  # w13, w2
    b1, b2 = torch.randn(E, 2 * inter), torch.randn(E, H)
    ids = torch.tensor([[0, 2], [3, 0], [2, 1], [1, 3], [0, 0]])
    weights = torch.rand(ids.shape)
    x, got = _experts(w1, w2, weights, ids, MoEActivation.SILU, b1=b1, b2=b2,
                      on_input=on_input)
    want = _want(x, w1, w2, weights, ids.tolist(), _silu_and_mul, b1, b2, on_input)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_moe_experts_of_another_expert_parallel_rank_are_skipped():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    torch.manual_seed(0)
    w1, w2 = torch.randn(2, 32, 8), torch.randn(2, 8, 16)  # this rank's 2 of 4 experts
    ids = torch.tensor([[0, 3], [1, 2], [3, 1], [2, 0]])  # global ids
    expert_map = torch.tensor([-1, 0, -1, 1])  # global -> local, -1: another rank's
    weights = torch.rand(ids.shape)
    x, got = _experts(w1, w2, weights, ids, MoEActivation.SILU, expert_map=expert_map)
    want = _want(x, w1, w2, weights, expert_map[ids].tolist(), _silu_and_mul)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_moe_experts_accumulate_in_float32_and_round_once():
    from vllm.model_executor.layers.fused_moe.activation import (
        MoEActivation,
        apply_moe_activation,
    )

    torch.manual_seed(0)
    w1, w2 = torch.randn(3, 16, 32), torch.randn(3, 32, 8)
    ids = torch.tensor([[0, 1, 2]] * 64)  # every token: every expert, in slot order
    weights = torch.rand(ids.shape)
    x, got = _experts(w1, w2, weights, ids, MoEActivation.SILU, dtype=torch.bfloat16)
    want = torch.zeros(x.shape)
    for e in range(3):  # each expert's bf16 output, weighted and summed in float32
        h = F.linear(x, w1[e].bfloat16())
        act = apply_moe_activation(MoEActivation.SILU, h.new_empty(64, 8), h)
        want += F.linear(act, w2[e].bfloat16()).float() * weights[:, e, None]
    assert torch.equal(got, want.bfloat16())


def test_gpt_oss_experts_use_the_clamped_swiglu_of_its_checkpoint():
    # vLLM's CPU build has no swigluoai_and_mul op: its torch form, alpha 1.702, limit 7
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    def swigluoai(h):  # gate and up interleaved
        gate, up = h[::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)

    torch.manual_seed(0)
    w1, w2 = 4 * torch.randn(2, 12, 8), torch.randn(2, 8, 6)  # values past the limit
    ids = torch.tensor([[0, 1], [1, 0], [1, 1]])
    weights = torch.rand(ids.shape)
    x, got = _experts(w1, w2, weights, ids, MoEActivation.SWIGLUOAI)
    want = _want(x, w1, w2, weights, ids.tolist(), swigluoai)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_moe_experts_keep_the_checkpoint_layout_at_load():
    # no zero-padding of the intermediate dim, no ISA repack: the live weights stay viewable
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    from hotweights.vllm_plugin.cpu_keep_weights import _experts_torch_apply, install

    install()
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.randn(2, 6, 8), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.randn(2, 8, 3), requires_grad=False)
    w13, w2 = layer.w13_weight, layer.w2_weight
    for cls in [cpu_moe.CPUUnquantizedExperts, *cpu_moe.CPUUnquantizedExperts.__subclasses__()]:
        experts = object.__new__(cls)
        experts.process_weights_after_loading(layer)
        assert layer.w13_weight is w13 and layer.w2_weight is w2
        assert cls.apply is _experts_torch_apply


def test_an_isa_variant_of_the_experts_does_not_override_the_torch_path_back():
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    from hotweights.vllm_plugin.cpu_keep_weights import (
        _experts_keep_layout,
        _experts_torch_apply,
        install,
    )

    class Variant(cpu_moe.CPUUnquantizedExperts):  # as a vLLM version may add one
        def process_weights_after_loading(self, layer):
            raise AssertionError("repacked")

        def apply(self, *args):
            raise AssertionError("its own kernel")

    install()
    assert Variant.process_weights_after_loading is _experts_keep_layout
    assert Variant.apply is _experts_torch_apply
