"""Tiny random models, built locally, for the demo, the tests and the benchmarks.

Nothing is downloaded: the tokenizer is trained on an embedded corpus and the weights are
random. Sizes respect vLLM's CPU kernels (head_dim 64) and are kept odd enough (q width
!= hidden size, vocab not a multiple of 64) that a wrong split point cannot go unnoticed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# What vLLM CPU serves. vLLM's Qwen3.5 module imports torchvision (through transformers'
# Qwen2-VL image processor), which has no CPU wheel for torch 2.13 here: see docs/qwen3_5.md.
ARCHS = ("llama", "llama_tied", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5",
         "mistral", "mixtral", "phi3", "gemma2", "gemma3_text", "olmo2", "olmoe", "qwen2_moe",
         "glm4", "granite", "smollm3", "starcoder2", "stablelm", "exaone4", "ernie4_5",
         "hunyuan_v1_dense", "deepseek_v2", "deepseek_v3", "gpt_oss", "glm4_moe", "olmo3",
         "seed_oss", "granitemoe")
GDN_ARCHS = ("qwen3_next", "qwen3_5")  # vLLM's CPU gated-delta-net kernels run bf16 only
MLA_ARCHS = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention
TRANSPOSED_ARCHS = ("gpt_oss",)  # experts [E, in, out] in transformers, [E, out, in] in vLLM

_CORPUS = """\
One copy of the weights, two jobs. The server generates, the trainer learns.
The quick brown fox jumps over the lazy dog while the model keeps serving requests.
Weights live in shared memory; the trainer sees them as a normal transformers model.
In place updates are safe when generation is paused, written, then resumed.
hotweights maps vLLM parameters to Hugging Face parameters without copying a byte.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 64 128 256 512 1024. Punctuation, too: (a) [b] {c}!?
"""

_BASE = dict(
    hidden_size=128,
    intermediate_size=320,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_GDN = dict(
    tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention"],  # repeated over the depth
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
)

_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)

_MLA = dict(
    tie_word_embeddings=False,
    hidden_size=256,
    num_key_value_heads=4,  # transformers' MLA expands k and v to every head
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)

_ARCH_CONFIG: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    # vLLM's Qwen2 ignores `head_dim` (hidden_size // heads): keep them consistent.
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False, hidden_size=256)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_MOE, tie_word_embeddings=False)),
    # Hybrid: a gated-delta-net (linear attention) layer, then a full-attention layer, both
    # with MoE + shared expert. vLLM's CPU GDN kernels need linear key/value head dim 64.
    "qwen3_next": ("Qwen3NextConfig", dict(_GDN, **_MOE, shared_expert_intermediate_size=160)),
    # Qwen3.5 text: like Qwen3-Next, but the checkpoint keeps the gated-delta-net input
    # projections apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), and a dense MLP.
    "qwen3_5": ("Qwen3_5TextConfig", _GDN),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    # transformers renames Mixtral's `block_sparse_moe` to `mlp`; vLLM keeps the former
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, sliding_window=None,
                                      num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False)),  # fused qkv and gate_up on disk
    # Gemma: tied, scaled embeddings, (1 + w) norms, sliding-window layers, soft-capping (2)
    "gemma2": ("Gemma2Config", dict(sliding_window=64, query_pre_attn_scalar=64)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=64, query_pre_attn_scalar=64)),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False)),  # q/k norm over all heads
    # vLLM's Qwen2-MoE and OLMoE ignore `head_dim` too; both with MoE, Qwen2-MoE with a
    # gated shared expert
    "olmoe": ("OlmoeConfig", dict(tie_word_embeddings=False, hidden_size=256, num_experts=4,
                                  num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_MOE, tie_word_embeddings=False, hidden_size=256,
                                         shared_expert_intermediate_size=160)),
    "glm4": ("Glm4Config", dict(tie_word_embeddings=False)),  # fused gate_up, post-norms
    "granite": ("GraniteConfig", dict(tie_word_embeddings=False)),  # scaled residuals, logits
    "smollm3": ("SmolLM3Config", dict(tie_word_embeddings=False)),  # layers without RoPE
    # LayerNorms with biases, a plain (ungated) MLP; vLLM's derive head_dim from the hidden
    # size as Qwen2's does
    "starcoder2": ("Starcoder2Config", dict(tie_word_embeddings=False, hidden_size=256,
                                            sliding_window=None)),
    "stablelm": ("StableLmConfig", dict(tie_word_embeddings=False, hidden_size=256)),
    "exaone4": ("Exaone4Config", dict(tie_word_embeddings=False)),  # post-norms, q/k norm
    "ernie4_5": ("Ernie4_5Config", dict(tie_word_embeddings=False)),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(tie_word_embeddings=False)),
    # Multi-head latent attention (vLLM's CPU kernel: kv_lora_rank + rope dim = 576 only),
    # a dense layer, then MoE with a shared expert; DeepSeek-V3 with a q_lora_rank (vLLM
    # fuses q_a_proj and kv_a_proj_with_mqa) and the router's score correction bias
    "deepseek_v2": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None)),
    # (transformers' DeepSeek-V3 routes by sigmoid and always has the bias; vLLM reads both
    # from the keys DeepSeek's own configs carry, as does a real checkpoint)
    "deepseek_v3": ("DeepseekV3Config", dict(_MLA, q_lora_rank=64, topk_method="noaux_tc",
                                            scoring_func="sigmoid")),
    # Experts kept [E, in, out] by transformers (vLLM: [E, out, in]), gate and up
    # interleaved, biases everywhere, attention sinks, sliding-window layers; the MLP as
    # wide as the model, as in gpt-oss-20b/120b, so a view of down_proj that is not
    # transposed has the right shape and the wrong values (vLLM's norms: eps 1e-5, fixed)
    "gpt_oss": ("GptOssConfig", dict(tie_word_embeddings=False, intermediate_size=128,
                                      rms_norm_eps=1e-5,
                                      num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=64,
                                      layer_types=["sliding_attention", "full_attention"],
                                      rope_parameters=dict(  # YaRN beyond position 16
                                          rope_type="yarn", factor=32.0,
                                          original_max_position_embeddings=16,
                                          beta_fast=32.0, beta_slow=1.0, rope_theta=150000.0,
                                          truncate=False))),
    # GLM-4.5/4.6: partial rotary, a dense layer, then sigmoid-routed MoE with a shared
    # expert and the router's correction bias (as DeepSeek-V3's)
    "glm4_moe": ("Glm4MoeConfig", dict(tie_word_embeddings=False, n_routed_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=96,
                                       n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                       topk_group=1)),
    "olmo3": ("Olmo3Config", dict(tie_word_embeddings=False, sliding_window=64)),  # + OLMo 2's
    "seed_oss": ("SeedOssConfig", dict(tie_word_embeddings=False)),  # q/k/v and o biases
    # Granite's scalings with MoE experts; vLLM's derives head_dim from the hidden size
    "granitemoe": ("GraniteMoeConfig", dict(tie_word_embeddings=False, hidden_size=256,
                                            num_local_experts=4, num_experts_per_tok=2)),
}


def train_tokenizer(out_dir: Path, *, vocab_size: int = 300) -> int:
    """Train a small byte-level BPE tokenizer on the embedded corpus; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.save_pretrained(out_dir)
    return len(fast)


def make_config(arch: str, vocab_size: int, **overrides: Any):
    """The transformers config of a tiny model of `arch` (see ARCHS)."""
    import transformers

    if arch not in _ARCH_CONFIG:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(_ARCH_CONFIG)}")
    cls_name, extra = _ARCH_CONFIG[arch]
    kwargs = {**_BASE, **extra, "vocab_size": vocab_size, **overrides}
    if "layer_types" in kwargs:  # repeat the hybrid pattern over the requested depth
        pattern = kwargs["layer_types"]
        kwargs["layer_types"] = [pattern[i % len(pattern)]
                                 for i in range(kwargs["num_hidden_layers"])]
    return getattr(transformers, cls_name)(**kwargs)


def build(arch: str, out_dir: str | Path, *, dtype: str = "bfloat16", seed: int = 0,
          **overrides: Any) -> Path:
    """Write a tiny random model of `arch` with its tokenizer to `out_dir`; return the dir.

    Reuses `out_dir` if it already holds a model built with the same arguments.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    stamp = json.dumps({"arch": arch, "dtype": dtype, "seed": seed, **overrides},
                       sort_keys=True)
    if (out / ".tiny").is_file() and (out / ".tiny").read_text() == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out)
    config = make_config(arch, vocab, **overrides)
    config.dtype = dtype
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    fp32 = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms too: ones would hide a swap
            if "norm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.05)
        for module in model.modules():  # persistent buffers (DeepSeek-V3's router bias),
            for leaf, buf in module._buffers.items():  # in the dtype transformers keeps
                if buf is not None and buf.is_floating_point() and \
                        leaf not in module._non_persistent_buffers_set:
                    module._buffers[leaf] = buf.to(torch.float32 if leaf in fp32 else
                                                   buf.dtype).normal_(0.0, 0.05)
    model.save_pretrained(out)
    (out / ".tiny").write_text(stamp)
    logger.info("built tiny %s model in %s", arch, out)
    return out


def vllm_llama_shapes(config) -> dict[str, tuple[int, ...]]:
    """What a tp=1 vLLM Llama holds, for stand-in servers: name -> shape, q/k/v and
    gate/up merged on dim 0, the vocabulary padded to a multiple of 64; tied embeddings:
    one tensor, `model.embed_tokens.weight`."""
    h, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    vocab = -(-config.vocab_size // 64) * 64
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes |= {pre + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                   pre + "self_attn.o_proj.weight": (h, q),
                   pre + "mlp.gate_up_proj.weight": (2 * inter, h),
                   pre + "mlp.down_proj.weight": (h, inter),
                   pre + "input_layernorm.weight": (h,),
                   pre + "post_attention_layernorm.weight": (h,)}
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def llama_tensors(*, hidden: int, inter: int, kv: int, vocab: int, layers: int,
                  scale: float = 1.0, seed: int = 0) -> dict:
    """Random bf16 tensors with a Llama model's HF names and shapes, no model around them
    (for the weight-transfer tests and benchmarks): the same in every process for a seed.

    Args:
        hidden, inter, kv, vocab, layers: hidden size, MLP width, k/v projection width,
            vocabulary rows and decoder layers.
        scale: the standard deviation of the values.
        seed: the generator's seed.
    Returns:
        HF name -> tensor, in a fixed order (embedding, norm, head, then layer by layer).
    """
    import torch

    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden),
                   p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden),
                   p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden),
                   p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter),
                   p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * scale).to(torch.bfloat16)
            for n, s in shapes.items()}

