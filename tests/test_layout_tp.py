"""Tensor-parallel offset math of `hotweights.layout.plan.plan`, checked against a reference.

The reference below builds each rank's vLLM tensors from the HF tensors the way vLLM
shards them (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, FusedMoE,
VocabParallelEmbedding), with `torch.chunk` / `narrow` only; it shares no code with
`layout.py`. `plan()` is driven with synthetic shapes (`hf_shapes=`), so no model is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotweights.errors import LayoutError
from hotweights.layout.plan import Piece, hf_params, plan

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
PAD = 64  # vLLM pads the vocabulary to a multiple of 64


@dataclass(frozen=True)
class Model:
    kv: int  # num_key_value_heads
    heads: int  # num_attention_heads
    hd: int  # head_dim
    hidden: int
    inter: int  # intermediate_size (dense MLP)
    moe_inter: int  # moe_intermediate_size
    experts: int  # 0: dense MLP
    vocab: int
    layers: int
    bias: bool  # Qwen2-style q/k/v bias
    tied: bool
    tp: int
    fused: bool = False  # the checkpoint holds qkv_proj and the dense gate_up_proj (Phi-3)

    @property
    def padded(self) -> int:
        return math.ceil(self.vocab / PAD) * PAD

    @property
    def config(self) -> SimpleNamespace:
        return SimpleNamespace(num_attention_heads=self.heads, num_key_value_heads=self.kv)


def hf_tensors(m: Model, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """HF parameters (transformers 5 names) with distinct values, and the tied aliases."""
    gen = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {EMBED: (m.vocab, m.hidden)}
    fused: dict[str, tuple[str, ...]] = {}  # an HF name -> the parts it packs, in order
    for i in range(m.layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (m.heads * m.hd, m.hidden)
        shapes[p + "self_attn.k_proj.weight"] = (m.kv * m.hd, m.hidden)
        shapes[p + "self_attn.v_proj.weight"] = (m.kv * m.hd, m.hidden)
        if m.bias:
            shapes[p + "self_attn.q_proj.bias"] = (m.heads * m.hd,)
            shapes[p + "self_attn.k_proj.bias"] = (m.kv * m.hd,)
            shapes[p + "self_attn.v_proj.bias"] = (m.kv * m.hd,)
        shapes[p + "self_attn.o_proj.weight"] = (m.hidden, m.heads * m.hd)
        if m.experts:
            shapes[p + "mlp.gate.weight"] = (m.experts, m.hidden)
            shapes[p + "mlp.experts.gate_up_proj"] = (m.experts, 2 * m.moe_inter, m.hidden)
            shapes[p + "mlp.experts.down_proj"] = (m.experts, m.hidden, m.moe_inter)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (m.inter, m.hidden)
            shapes[p + "mlp.up_proj.weight"] = (m.inter, m.hidden)
            shapes[p + "mlp.down_proj.weight"] = (m.hidden, m.inter)
        if m.fused:
            for leaf in ("weight", "bias") if m.bias else ("weight",):
                fused[f"{p}self_attn.qkv_proj.{leaf}"] = tuple(
                    f"{p}self_attn.{x}_proj.{leaf}" for x in "qkv")
            if not m.experts:
                fused[p + "mlp.gate_up_proj.weight"] = (p + "mlp.gate_proj.weight",
                                                        p + "mlp.up_proj.weight")
        shapes[p + "input_layernorm.weight"] = (m.hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (m.hidden,)
    shapes["model.norm.weight"] = (m.hidden,)
    if not m.tied:
        shapes[LM_HEAD] = (m.vocab, m.hidden)
    tensors, base = {}, 1
    for name, shape in shapes.items():
        n = math.prod(shape)
        # Distinct values everywhere: a piece read from the wrong offset cannot match.
        values = torch.randperm(n, generator=gen, dtype=torch.float64) + base
        tensors[name] = values.reshape(shape)
        base += n
    for name, parts in fused.items():
        tensors[name] = torch.cat([tensors.pop(part) for part in parts])
    ties = {LM_HEAD: EMBED} if m.tied else {}
    return tensors, ties


def split_fused(m: Model, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parts of the tensors `m.fused` packs, as vLLM's loader cuts them."""
    q, kv = m.heads * m.hd, m.kv * m.hd
    out = dict(hf)
    for name in [n for n in hf if ".qkv_proj." in n]:
        parts = out.pop(name).split([q, kv, kv])
        out.update({name.replace("qkv_proj", f"{x}_proj"): t
                    for x, t in zip("qkv", parts, strict=True)})
    for name in [n for n in hf if ".gate_up_proj." in n]:
        gate, up = out.pop(name).chunk(2)
        out[name.replace("gate_up", "gate")], out[name.replace("gate_up", "up")] = gate, up
    return out


def reference_local(m: Model, hf: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    """Rank r's vLLM parameters, sharded as vLLM shards them."""
    tp, hf = m.tp, split_fused(m, hf)

    def kv_shard(t: torch.Tensor) -> torch.Tensor:
        if tp <= m.kv:
            return t.chunk(tp)[r]
        head = r // (tp // m.kv)  # each rank holds one whole (replicated) kv head
        return t[head * m.hd : (head + 1) * m.hd]

    def vocab_shard(t: torch.Tensor) -> torch.Tensor:
        per = m.padded // tp
        padded = torch.zeros((m.padded, *t.shape[1:]), dtype=t.dtype)
        padded[: m.vocab] = t
        return padded[r * per : (r + 1) * per].clone()

    out = {EMBED: vocab_shard(hf[EMBED])}
    for i in range(m.layers):
        h = f"model.layers.{i}."
        leaves = ("weight", "bias") if m.bias else ("weight",)
        for leaf in leaves:
            q, k, v = (hf[f"{h}self_attn.{x}_proj.{leaf}"] for x in "qkv")
            out[f"{h}self_attn.qkv_proj.{leaf}"] = torch.cat(
                [q.chunk(tp)[r], kv_shard(k), kv_shard(v)]
            )
        out[h + "self_attn.o_proj.weight"] = hf[h + "self_attn.o_proj.weight"].chunk(tp, 1)[r]
        if m.experts:
            out[h + "mlp.gate.weight"] = hf[h + "mlp.gate.weight"].clone()
            gate_part, up_part = hf[h + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
            out[h + "mlp.experts.w13_weight"] = torch.cat(
                [gate_part.chunk(tp, dim=1)[r], up_part.chunk(tp, dim=1)[r]], dim=1
            )
            out[h + "mlp.experts.w2_weight"] = hf[h + "mlp.experts.down_proj"].chunk(tp, 2)[r]
        else:
            out[h + "mlp.gate_up_proj.weight"] = torch.cat(
                [
                    hf[h + "mlp.gate_proj.weight"].chunk(tp)[r],
                    hf[h + "mlp.up_proj.weight"].chunk(tp)[r],
                ]
            )
            out[h + "mlp.down_proj.weight"] = hf[h + "mlp.down_proj.weight"].chunk(tp, 1)[r]
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[h + norm] = hf[h + norm].clone()
    out["model.norm.weight"] = hf["model.norm.weight"].clone()
    if not m.tied:
        out[LM_HEAD] = vocab_shard(hf[LM_HEAD])
    return {name: t.contiguous() for name, t in out.items()}


# (num_key_value_heads, heads per kv head, tp) that vLLM accepts: tp divides the q heads,
# and either splits the kv heads or is a multiple of them (each rank: one whole kv head).
HEADS = [
    (kv, group, tp)
    for kv in range(1, 9)
    for group in range(1, 5)
    for tp in (1, 2, 3, 4, 6, 8)
    if kv * group % tp == 0 and (kv % tp == 0 or tp % kv == 0)
]
KV_SPLIT = [h for h in HEADS if 1 < h[2] <= h[0]]
KV_REPLICATED = [h for h in HEADS if h[2] > h[0]]


@st.composite
def models(draw, *, tp: int | None = None) -> Model:
    if tp is None:  # equal odds for split and replicated kv heads
        choice = st.sampled_from(KV_SPLIT) | st.sampled_from(KV_REPLICATED) | st.sampled_from(HEADS)
    else:
        choice = st.sampled_from([h for h in HEADS if h[2] == tp])
    kv, group, tp = draw(choice)
    # the padded vocab (a multiple of 64) must split evenly: 192 = lcm(64, 3) = lcm(64, 6)
    if tp % 3:
        vocab = draw(st.integers(1, 200) | st.sampled_from([64, 128, 192]))
    else:
        vocab = draw(st.integers(129, 192))
    experts = draw(st.one_of(st.just(0), st.integers(1, 4)))
    return Model(
        kv=kv,
        heads=kv * group,
        hd=draw(st.sampled_from([2, 4, 8])),
        hidden=8 * draw(st.integers(1, 3)),
        inter=tp * draw(st.integers(1, 3)),
        moe_inter=tp * draw(st.integers(1, 3)),
        experts=experts,
        vocab=vocab,
        layers=draw(st.integers(1, 2)),
        bias=draw(st.booleans()),
        tied=draw(st.booleans()),
        tp=tp,
        fused=draw(st.booleans()),
    )


def hf_view(hf: dict[str, torch.Tensor], ties: dict[str, str]) -> dict[str, torch.Tensor]:
    """HF tensors by every name, the tied aliases included."""
    return {**hf, **{alias: hf[target] for alias, target in ties.items()}}


def assemble(
    pieces: dict[str, tuple[Piece, ...]],
    like: dict[str, torch.Tensor],
    hf: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Each local vLLM tensor built from the HF tensors using only the pieces."""
    out = {}
    for vname, ps in pieces.items():
        t = torch.zeros_like(like[vname])
        for p in ps:
            n = p.rows[1] - p.rows[0]
            src = hf[p.hf_name].narrow(p.dim, p.hf_start, n)
            t.narrow(p.dim, p.rows[0], n).copy_(src)
        out[vname] = t
    return out


def check_rank(m: Model, hf, ties, r: int, covered: dict[str, torch.Tensor]) -> None:
    ref = reference_local(m, hf, r)
    shapes = {name: tuple(t.shape) for name, t in hf.items()}
    local_shapes = {name: tuple(t.shape) for name, t in ref.items()}
    kwargs = dict(tp_size=m.tp, tp_rank=r, hf_shapes=(shapes, ties))
    layout = plan(m.config, local_shapes, strict=True, **kwargs)
    assert layout.missing == () and layout.unused == ()
    assert (layout.tp_size, layout.tp_rank, layout.ties) == (m.tp, r, ties)
    assert set(layout.pieces) == set(ref)
    full = hf_view(hf, ties)

    # (1) the pieces rebuild the reference tensor exactly (vocab padding left zero)
    built = assemble(layout.pieces, ref, full)
    for vname, want in ref.items():
        assert torch.equal(built[vname], want), (vname, layout.pieces[vname])

    for vname, ps in layout.pieces.items():
        live = local_shapes[vname]
        own = [p for p in ps if p.hf_name not in ties]
        # tied aliases mirror the pieces of the tensor they alias, one for one
        alias_of = {target: alias for alias, target in ties.items()}
        assert sorted((p.hf_name, p.rows, p.dim, p.hf_start) for p in ps if p.hf_name in ties) == (
            sorted(
                (alias_of[p.hf_name], p.rows, p.dim, p.hf_start)
                for p in own
                if p.hf_name in alias_of
            )
        )
        dims = {p.dim for p in ps}
        assert len(dims) <= 1, (vname, ps)
        dim = dims.pop() if dims else 0
        # (2) each row on the piece dim is held by exactly one piece (padding: by none)
        count = torch.zeros(live[dim] if live else 1, dtype=torch.int64)
        for p in ps:
            hf_shape = shapes[ties.get(p.hf_name, p.hf_name)]
            assert p.hf_shape == hf_shape
            n = p.rows[1] - p.rows[0]
            assert n > 0 and 0 <= p.rows[0] and p.rows[1] <= live[dim], (vname, p)
            assert 0 <= p.hf_start and p.hf_start + n <= hf_shape[p.dim], (vname, p)
            for d, (a, b) in enumerate(zip(live, hf_shape, strict=True)):
                assert d == p.dim or a == b, (vname, p)
            if p.hf_name not in ties:
                count[p.rows[0] : p.rows[1]] += 1
            # (3) record the HF elements this rank reads
            covered[p.hf_name].narrow(p.dim, p.hf_start, n).fill_(True)
        expect = torch.ones_like(count)
        if vname in (EMBED, LM_HEAD):
            per = m.padded // m.tp
            real = max(0, min(per, m.vocab - r * per))
            expect[real:] = 0
        assert torch.equal(count, expect), (vname, ps)

    # (4) at tp=1 every piece is a whole HF tensor
    if m.tp == 1:
        assert all(p.whole for ps in layout.pieces.values() for p in ps)


def check_model(m: Model, seed: int) -> None:
    hf, ties = hf_tensors(m, seed)
    full = hf_view(hf, ties)
    covered = {name: torch.zeros(t.shape, dtype=torch.bool) for name, t in full.items()}
    for r in range(m.tp):
        check_rank(m, hf, ties, r, covered)
    # (3) across the ranks, every element of every HF tensor (and alias) is read
    for name, mask in covered.items():
        assert bool(mask.all()), (name, m)


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(m=models(), seed=st.integers(0, 2**16))
def test_tp_pieces_match_vllm_sharding(m: Model, seed: int) -> None:
    check_model(m, seed)


@FAST
@given(m=models(tp=1), seed=st.integers(0, 2**16))
def test_tp1_pieces_are_whole(m: Model, seed: int) -> None:
    check_model(m, seed)


@pytest.mark.parametrize(
    "kv,heads,tp",
    [(1, 4, 4), (2, 8, 8), (4, 4, 4), (8, 8, 2), (2, 6, 6), (3, 6, 3), (3, 6, 6)],
)
@pytest.mark.parametrize("experts", [0, 3])
@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
def test_tp_examples(kv: int, heads: int, tp: int, experts: int, fused: bool) -> None:
    """Fixed corners: kv replicated, kv split, tp == heads, tp=3/6 (padded vocab 192); the
    checkpoint's q/k/v and gate/up apart, or packed (Phi-3)."""
    m = Model(
        kv=kv,
        heads=heads,
        hd=4,
        hidden=16,
        inter=2 * tp,
        moe_inter=tp,
        experts=experts,
        vocab=150,
        layers=2,
        bias=True,
        tied=experts == 0,
        tp=tp,
        fused=fused,
    )
    check_model(m, seed=tp)


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_padding_only_rank(tied: bool) -> None:
    """vocab=10, tp=4: padded 64, 16 rows a rank; ranks 1..3 hold nothing but padding."""
    m = Model(
        kv=4,
        heads=4,
        hd=2,
        hidden=8,
        inter=4,
        moe_inter=4,
        experts=0,
        vocab=10,
        layers=1,
        bias=False,
        tied=tied,
        tp=4,
    )
    check_model(m, seed=0)


def _hf_shapes(m: Model) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    hf, ties = hf_tensors(m, 0)
    return {name: tuple(t.shape) for name, t in hf.items()}, ties


@pytest.mark.parametrize("arch", ["LlamaConfig", "Qwen2Config", "Qwen3MoeConfig"])
def test_synthetic_names_match_transformers(arch: str) -> None:
    """The synthetic HF names and shapes above are what transformers builds (on meta)."""
    import transformers

    m = Model(
        kv=2,
        heads=4,
        hd=8,
        hidden=16,
        inter=24,
        moe_inter=12,
        experts=4 if arch == "Qwen3MoeConfig" else 0,
        vocab=100,
        layers=2,
        bias=arch == "Qwen2Config",
        tied=arch == "LlamaConfig",
        tp=1,
    )
    kwargs = dict(
        vocab_size=m.vocab,
        hidden_size=m.hidden,
        intermediate_size=m.inter,
        num_hidden_layers=m.layers,
        num_attention_heads=m.heads,
        num_key_value_heads=m.kv,
        head_dim=m.hd,
        tie_word_embeddings=m.tied,
    )
    if m.experts:
        kwargs.update(
            num_experts=m.experts,
            num_experts_per_tok=2,
            moe_intermediate_size=m.moe_inter,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    config = getattr(transformers, arch)(**kwargs)
    shapes, ties = hf_params(config)
    if arch == "Qwen3MoeConfig":  # Qwen3 has q/k norms; not part of the TP math
        shapes = {n: s for n, s in shapes.items() if "_norm." not in n}
    assert (shapes, ties) == _hf_shapes(m)


def test_transformers_renames_of_the_model_type_map_vllm_s_names() -> None:
    """Mixtral: vLLM keeps the checkpoint's `block_sparse_moe`, transformers 5 calls it
    `mlp` (its conversion mapping): the plan maps one to the other."""
    from hotweights.testing import tiny

    config = tiny.make_config("mixtral", 300)
    shapes, _ = hf_params(config)
    vllm = {n.replace(".mlp.", ".block_sparse_moe.")
            .replace(".experts.gate_up_proj", ".experts.w13_weight")
            .replace(".experts.down_proj", ".experts.w2_weight"): s for n, s in shapes.items()}
    assert any(".block_sparse_moe.gate." in n for n in vllm)
    layout = plan(config, vllm)
    assert layout.pieces["model.layers.0.block_sparse_moe.experts.w13_weight"][0].hf_name == \
        "model.layers.0.mlp.experts.gate_up_proj"
    assert layout.pieces["model.layers.1.block_sparse_moe.gate.weight"][0].hf_name == \
        "model.layers.1.mlp.gate.weight"


# ------------------------------------------------------------------ error messages


def test_experts_transformers_keeps_transposed_are_named_as_such() -> None:
    from hotweights.testing import tiny

    config = tiny.make_config("qwen3_moe", 300)
    shapes, _ = hf_params(config)
    vllm = dict(shapes)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    e, rows, cols = vllm.pop(name)
    vllm["model.layers.0.mlp.experts.w13_weight"] = (e, cols, rows)  # HF's, transposed
    with pytest.raises(LayoutError, match=r"holds it transposed: transformers keeps this "
                       r"model type's experts \[E, in, out\], and only gpt_oss's"):
        plan(config, vllm)


def test_a_packed_qkv_of_no_whole_heads_is_named() -> None:
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    with pytest.raises(LayoutError, match=r"qkv_proj\.weight: HF .* shape \(50, 16\) does "
                       r"not hold num_attention_heads=4 \+ 2 x num_key_value_heads=2 heads"):
        plan(config, {name: (25, 16)}, tp_size=2, strict=False,
             hf_shapes=({name: (50, 16)}, {}))


def test_llama_4_is_refused_by_name_before_any_shape() -> None:
    from transformers import Llama4Config, Llama4TextConfig

    for config in (Llama4TextConfig(), Llama4Config()):
        with pytest.raises(LayoutError, match=r"Llama 4 is not supported: .* reorders its q/k"):
            plan(config, {})


@pytest.mark.parametrize(("model_type", "fields", "refused"), [
    ("bloom", {}, "Bloom"),
    ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2), "Falcon"),
    ("falcon", dict(multi_query=False), "Falcon"),  # one k and v per head: regrouped too
    ("falcon", dict(multi_query=True), None)])  # [q; k; v] as vLLM keeps it
def test_models_whose_qkv_vllm_regroups_at_load_are_refused(model_type, fields, refused):
    # same name and shape, other row order: a remote server's update would land on the
    # wrong rows (`check_loaded` guards only the bridge's model)
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, hidden_size=64, n_head=4, num_attention_heads=4,
                                  **fields)
    if refused is None:
        plan(config, {}, strict=False)  # mapped (nothing here to map)
        return
    with pytest.raises(LayoutError, match=rf"{refused} is not supported.*regroups its fused "
                                          r"query_key_value"):
        plan(config, {})


def test_expert_gate_and_up_halves_are_named_in_a_row_mismatch() -> None:
    """tp=2: each rank's w13 holds its chunk of gate, then of up; a wrong count names both
    halves, and no attention heads."""
    from hotweights.testing import tiny

    config = tiny.make_config("qwen3_moe", 300)
    e, rows, cols = hf_params(config)[0]["model.layers.0.mlp.experts.gate_up_proj"]
    vllm = {"model.layers.0.mlp.experts.w13_weight": (e, rows // 2 + 2, cols)}
    half = rows // 4
    with pytest.raises(LayoutError, match=rf"w13_weight: expected {rows // 2} rows on dim 1 "
                       rf"\(gate {half} \+ up {half}\), found {rows // 2 + 2} \(vLLM shape "
                       r"\([^)]*\)\); tp=2$"):
        plan(config, vllm, tp_size=2, strict=False)


def test_vllm_parameters_derived_at_load_as_copies_are_named_with_why() -> None:
    """MLA's W_UV / W_UK_T, where vLLM made them copies of kv_b_proj (views are left out
    of the map by the plugin: `vllm_plugin.aliases`): refused, saying so."""
    from hotweights.testing import tiny

    config = tiny.make_config("llama", 300)
    shapes, _ = hf_params(config)
    derived = "model.layers.0.self_attn.mla_attn.mla_attn."
    with pytest.raises(LayoutError, match="derived W_UV and W_UK_T from kv_b_proj at load as "
                                          "a copy, not as views of it"):
        plan(config, {**shapes, derived + "W_UV": (4, 8, 8), derived + "W_UK_T": (4, 8, 8)})


def test_latent_attention_at_tp_2() -> None:
    """DeepSeek-V3's attention as vLLM holds it on rank 1 of 2: q_a_proj and
    kv_a_proj_with_mqa fused and whole on every rank, q_b_proj and kv_b_proj split by
    heads, o_proj by its input; the router's correction bias (a buffer in transformers)."""
    from hotweights.testing import tiny

    config = tiny.make_config("deepseek_v3", 300)
    shapes, _ = hf_params(config)
    a, b = "model.layers.0.self_attn.", "model.layers.1.mlp.gate."
    assert shapes[b + "e_score_correction_bias"] == (4,)
    q_a, kv_a = shapes[a + "q_a_proj.weight"], shapes[a + "kv_a_proj_with_mqa.weight"]
    q_b, kv_b, o = (shapes[a + n + ".weight"] for n in ("q_b_proj", "kv_b_proj", "o_proj"))
    vllm = {a + "fused_qkv_a_proj.weight": (q_a[0] + kv_a[0], q_a[1]),
            a + "q_b_proj.weight": (q_b[0] // 2, q_b[1]),
            a + "kv_b_proj.weight": (kv_b[0] // 2, kv_b[1]),
            a + "o_proj.weight": (o[0], o[1] // 2), b + "e_score_correction_bias": (4,)}
    layout = plan(config, vllm, tp_size=2, tp_rank=1, strict=False)
    assert layout.unused == ()
    assert layout.pieces[a + "fused_qkv_a_proj.weight"] == (
        Piece(a + "q_a_proj.weight", q_a, (0, q_a[0])),
        Piece(a + "kv_a_proj_with_mqa.weight", kv_a, (q_a[0], q_a[0] + kv_a[0])))
    assert layout.pieces[a + "kv_b_proj.weight"] == (
        Piece(a + "kv_b_proj.weight", kv_b, (0, kv_b[0] // 2), 0, kv_b[0] // 2),)
    assert layout.pieces[a + "o_proj.weight"] == (
        Piece(a + "o_proj.weight", o, (0, o[1] // 2), 1, o[1] // 2),)
    assert layout.pieces[b + "e_score_correction_bias"] == (
        Piece(b + "e_score_correction_bias", (4,), (0, 4)),)


def _qkv_case(kv: int, heads: int, hd: int = 4, hidden: int = 8):
    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv)
    p = "model.layers.0.self_attn."
    shapes = {
        p + "q_proj.weight": (heads * hd, hidden),
        p + "k_proj.weight": (kv * hd, hidden),
        p + "v_proj.weight": (kv * hd, hidden),
    }
    return config, p + "qkv_proj.weight", (shapes, {})


def test_error_tp_not_multiple_of_kv_heads() -> None:
    config, vname, hf = _qkv_case(kv=2, heads=6)
    with pytest.raises(LayoutError, match=r"tp=3 is not a multiple of num_key_value_heads=2"):
        plan(config, {vname: (16, 8)}, tp_size=3, tp_rank=0, strict=False, hf_shapes=hf)


def test_error_qkv_wrong_row_count() -> None:
    config, vname, hf = _qkv_case(kv=2, heads=4, hd=4)
    # rank-local rows at tp=2: q 8 + k 4 + v 4 = 16
    plan(config, {vname: (16, 8)}, tp_size=2, tp_rank=1, hf_shapes=hf)
    with pytest.raises(LayoutError, match=r"expected 16 rows") as err:
        plan(config, {vname: (17, 8)}, tp_size=2, tp_rank=1, hf_shapes=hf)
    assert vname in str(err.value) and "found 17" in str(err.value)
    # replicated kv heads at tp=4 > kv=2: q 4 + k 4 + v 4 = 12
    plan(config, {vname: (12, 8)}, tp_size=4, tp_rank=3, hf_shapes=hf)
    with pytest.raises(LayoutError, match=r"expected 12 rows"):
        plan(config, {vname: (10, 8)}, tp_size=4, tp_rank=3, hf_shapes=hf)


def test_a_multimodal_config_s_heads_come_from_its_text_config() -> None:
    # Qwen2.5-VL, Gemma 3, Qwen3.5: no num_key_value_heads at the top
    text, vname, hf = _qkv_case(kv=2, heads=4)
    config = SimpleNamespace(get_text_config=lambda: text)
    plan(config, {vname: (12, 8)}, tp_size=4, tp_rank=3, hf_shapes=hf)  # kv replicated
    # its vision tower's attention has a KV head per head: split as any rows
    vision = {k.replace("model.layers.", "model.vision_tower.layers."): (16, 8) for k in hf[0]}
    plan(config, {vname.replace("model.layers.", "model.vision_tower.layers."): (12, 8)},
         tp_size=4, tp_rank=3, hf_shapes=(vision, {}))  # 16 / 4 rows of each of q, k, v


@pytest.mark.parametrize("rank,size", [(2, 2), (-1, 2), (0, 0), (1, 1)])
def test_error_tp_rank_out_of_range(rank: int, size: int) -> None:
    config, vname, hf = _qkv_case(kv=2, heads=4)
    with pytest.raises(LayoutError, match=rf"tp_rank={rank} is outside tp_size={size}"):
        plan(config, {vname: (16, 8)}, tp_size=size, tp_rank=rank, hf_shapes=hf)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_padded_vocabulary_under_another_name_is_mapped(tp):
    # Falcon's embedding is `word_embeddings`; vLLM pads its rows as every vocabulary's
    import transformers

    config = transformers.FalconConfig(vocab_size=300, hidden_size=128, num_hidden_layers=1,
                                       num_attention_heads=2, multi_query=True, bias=False,
                                       new_decoder_architecture=False, parallel_attn=True)
    shapes, _ = hf_params(config)
    name = "transformer.word_embeddings.weight"
    live = {**shapes, name: (320 // tp, 128)}
    pieces = [plan(config, live, strict=False, tp_size=tp, tp_rank=r).pieces[name][0]
              for r in range(tp)]
    assert [(p.rows, p.hf_start) for p in pieces] == (
        [((0, 300), 0)] if tp == 1 else [((0, 160), 0), ((0, 140), 160)])
    live[name] = (300 + 64, 128)  # more than the padding: another vocabulary
    with pytest.raises(LayoutError, match=r"word_embeddings\.weight: vLLM shape \(364, 128\) "
                                          r"does not match"):
        plan(config, live, strict=False)
