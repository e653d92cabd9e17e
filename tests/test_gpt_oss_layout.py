"""GPT-OSS: transformers keeps its experts [E, in, out], vLLM [E, out, in]; the HF tensors are
vLLM's with their last two dims swapped, viewed (never copied) and updated through them.

vLLM's tensors are built here from HF ones the way its GPT-OSS loader lays them out (names,
qkv merged, experts transposed, the vocabulary padded), sharing no code with `layout`; the
real engine is checked in test_views_vllm.
"""

import pytest
import torch

from hotweights.errors import LayoutError
from hotweights.layout.plan import Piece, hf_params, plan
from hotweights.layout.views import build_hf_model, slab_of, verify_shared, view_of
from hotweights.remote import shards
from hotweights.remote.delta import DENSE, PATCH, ROWS, encode_all
from hotweights.testing import tiny
from test_remote_shards import _changed, _stage, _stage_xor

VOCAB = 300  # vLLM pads it to 320
W13, W2 = "model.layers.1.mlp.experts.routed_experts.w13_weight", \
    "model.layers.1.mlp.experts.routed_experts.w2_weight"
GATE_UP, DOWN = "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"


@pytest.fixture(scope="module")
def config():
    return tiny.make_config("gpt_oss", VOCAB)


def _hf(config, seed: int = 0) -> dict[str, torch.Tensor]:
    shapes, _ = hf_params(config)
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _vllm(hf: dict[str, torch.Tensor], tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """What vLLM's GPT-OSS holds on TP rank `rank` of `tp` for the HF tensors `hf` (its
    loader's cuts: q/k/v and the sinks by head, o_proj by its input, the vocabulary padded
    then in equal runs, gate/up columns and down rows in equal runs, the down bias on the
    first rank only)."""
    def run(t: torch.Tensor, dim: int) -> torch.Tensor:
        n = t.shape[dim] // tp
        return t.narrow(dim, rank * n, n)

    out = {}
    for name, t in hf.items():
        v = name.replace(".self_attn.", ".attn.").replace("embed_tokens", "embedding")
        leaf = name.rpartition(".")[2]
        if v.endswith(("embedding.weight", "lm_head.weight")):
            t = run(torch.cat([t, t.new_zeros(-t.shape[0] % 64, t.shape[1])]), 0)
        elif ".experts." in name:
            v = v.replace(".experts.", ".experts.routed_experts.").replace(
                "gate_up_proj", "w13").replace("down_proj", "w2")
            v += "" if leaf.endswith("_bias") else "_weight"
            if leaf == "gate_up_proj":
                t = run(t, 2).transpose(1, 2)
            elif leaf == "down_proj":
                t = run(t, 1).transpose(1, 2)
            elif leaf == "gate_up_proj_bias":
                t = run(t, 1)
            elif rank:
                t = torch.zeros_like(t)
        elif leaf == "sinks" or ".q_proj." in name:
            qkv = [run(hf[name.replace("q_proj", p)], 0) for p in ("q_proj", "k_proj", "v_proj")]
            v, t = v.replace("q_proj", "qkv_proj"), run(t, 0) if leaf == "sinks" else \
                torch.cat(qkv)
        elif name.endswith("o_proj.weight"):
            t = run(t, 1)
        if ".k_proj." not in name and ".v_proj." not in name:
            out[v] = t.contiguous()
    return out


def _xor(old: dict, new: dict, held: dict) -> None:
    """Stage and apply `new` as xors of `old`, decoded against the live slabs as a remote
    server's workers read them (`RemoteEngine._old`): views that are not contiguous."""
    olds = {n: s.dests[0][0] if s.whole else s for n, s in held.items()}
    assert olds.keys() == new.keys()  # every tensor decodes xor values
    _stage_xor(old, new, held, olds)


def test_every_tensor_is_mapped_and_the_experts_transposed(config):
    """The down projection is square (as wide as the model, as in gpt-oss-20b): only the
    model type can tell that it is transposed."""
    hf = _hf(config)
    assert hf[DOWN].shape[1] == hf[DOWN].shape[2]
    vllm = _vllm(hf)
    layout = plan(config, vllm)
    assert layout.missing == () and layout.unused == ()
    assert layout.pieces[W13] == (Piece(GATE_UP, tuple(hf[GATE_UP].shape), (0, 4),
                                        transposed=True),)
    (down,) = layout.pieces[W2]
    assert down.transposed and down.whole and down.hf_dim == 0
    for name, pieces in layout.pieces.items():
        for p in pieces:
            assert p.transposed == (".experts." in name and name.endswith("_weight")), name
            if p.whole:
                assert torch.equal(view_of(vllm[name], p), hf[p.hf_name]), p.hf_name


def test_the_hf_model_trains_vllm_s_experts_in_place(config):
    hf = _hf(config)
    vllm = _vllm(hf)
    model, report = build_hf_model(config, vllm)
    assert report.bytes_copied == 0 and report.missing == ()
    assert verify_shared(model, vllm, plan(config, vllm)) == len(report.mapped)
    for name, t in model.state_dict().items():
        assert torch.equal(t, hf[name]), name
    experts = model.model.layers[1].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj[2, 5, 7] += 1.0  # [E, H, 2I]: hidden 5, column 7
        experts.down_proj[3, 1, 0] += 1.0  # [E, I, H]: intermediate 1, hidden 0
    assert vllm[W13][2, 7, 5] == hf[GATE_UP][2, 5, 7] + 1.0
    assert vllm[W2][3, 0, 1] == hf[DOWN][3, 1, 0] + 1.0


@pytest.mark.parametrize("values", ["plain", "xor"])
def test_each_tensor_parallel_rank_writes_its_shard_of_an_update(config, values):
    """TP=2: each rank's slabs of the experts (its run of gate/up columns and down rows,
    seen transposed), of the sinks (its heads) and the rest take exactly its share of an
    update; the down bias only on the first rank (vLLM holds zeros on the others)."""
    from hotweights.remote import jit

    if values == "xor" and not jit.enabled():
        pytest.skip("numba is not installed: no compiled loops")
    old = _hf(config, seed=2)
    new = _changed(old)
    shapes = {k: tuple(v.shape) for k, v in old.items()}
    for rank in range(2):
        params = _vllm(old, 2, rank)
        layout = plan(config, params, tp_size=2, tp_rank=rank)
        held = shards.of(layout, params, shapes)
        assert held[GATE_UP].held == (4, 128, 128) and held[DOWN].held == (4, 64, 128)
        bias = "model.layers.1.mlp.experts.down_proj_bias"
        assert held[bias].whole if rank == 0 else held[bias].runs == ()
        if values == "plain":
            _stage(old, new, held, max_bytes=4096).apply_in_place()
        else:
            _xor(old, new, held)
        for name, t in _vllm(new, 2, rank).items():
            assert torch.equal(params[name].view(torch.int32), t.view(torch.int32)), \
                (name, rank)


def test_a_run_that_does_not_split_evenly_is_refused(config):
    vllm = {W13: tuple(_vllm(_hf(config))[W13].shape)}
    with pytest.raises(LayoutError, match="cannot be split over tp=3"):
        plan(config, vllm, tp_size=3, tp_rank=0, strict=False)


@pytest.mark.parametrize("values", ["plain", "xor"])
def test_a_remote_update_lands_in_the_transposed_experts(config, values):
    """A remote server's shards of the experts are vLLM's slabs seen transposed: dense,
    row and patch pieces of the HF tensors land there, and xor values decode against them."""
    from hotweights.remote import jit

    old = _hf(config, seed=1)
    new = _changed(old)
    assert {DENSE, ROWS, PATCH} <= {d.kind for d in encode_all(old, new)}
    params = _vllm(old)
    shapes = {k: tuple(v.shape) for k, v in old.items()}
    held = shards.of(plan(config, params), params, shapes)
    assert held[GATE_UP].whole and held[GATE_UP].held == shapes[GATE_UP]
    if values == "plain":
        _stage(old, new, held, max_bytes=4096).apply_in_place()
    else:
        if not jit.enabled():
            pytest.skip("numba is not installed: no compiled loops")
        _xor(old, new, held)
    for name, t in _vllm(new).items():
        assert torch.equal(params[name].view(torch.int32), t.view(torch.int32)), name


def test_slab_of_and_hf_dim():
    t = torch.arange(2 * 3 * 5).view(2, 3, 5)
    p = Piece("x", (2, 5, 3), (1, 2), dim=0, transposed=True)
    assert torch.equal(slab_of(t, p), t[1:2].transpose(1, 2))
    assert [Piece("x", (2, 5, 3), (0, 1), dim=d, transposed=True).hf_dim
            for d in (0, 1, 2)] == [0, 2, 1]
    # vLLM's dim 1 (3 rows) is HF's dim 2
    assert Piece("x", (2, 5, 3), (0, 3), dim=1, transposed=True).whole
    assert not Piece("x", (2, 5, 3), (0, 3), dim=1).whole
