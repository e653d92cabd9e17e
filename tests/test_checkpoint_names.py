"""checkpoint.names on checkpoints written by transformers' save_pretrained."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen3MoeConfig,
)

from hotweights.checkpoint import sync
from hotweights.checkpoint.names import to_disk
from hotweights.errors import CheckpointError

_TINY = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _save(config: PretrainedConfig, d: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A bf16 model from config, saved in >= 2 shards; the model and every tensor on disk."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(d, max_shard_size="60KB")
    shards = sorted(d.glob("*.safetensors"))
    assert len(shards) >= 2
    disk = {}
    for shard in shards:
        disk.update(load_file(shard))
    return model, disk


def _assert_bit_equal(got: dict[str, torch.Tensor], disk: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(disk)
    for name, t in got.items():
        want = disk[name]
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert torch.equal(t.contiguous().view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("tie", [True, False])
def test_dense_llama_maps_every_disk_name_to_itself(tmp_path: Path, tie: bool) -> None:
    model, disk = _save(LlamaConfig(**_TINY, tie_word_embeddings=tie), tmp_path)
    live = model.state_dict()
    m = to_disk(live, disk.keys())
    _assert_bit_equal(m.tensors, disk)
    assert all(m.tensors[n] is live[n] for n in m.tensors)  # no copy, no conversion
    assert m.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if tie else {})
    assert m.only_live == () and m.only_disk == ()


@pytest.mark.parametrize("config", [
    Qwen3MoeConfig(**_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    MixtralConfig(**_TINY, num_local_experts=4, num_experts_per_tok=2),  # + block_sparse_moe
], ids=["qwen3_moe", "mixtral"])
def test_moe_fused_experts_split_as_save_pretrained_does(
        tmp_path: Path, config: PretrainedConfig) -> None:
    model, disk = _save(config, tmp_path)
    live = model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in live  # fused in memory
    assert not any(".experts.gate_up_proj" in n for n in disk)  # one tensor per expert on disk
    for kw in ({"model": model}, {"model_type": config.model_type}):
        m = to_disk(live, set(disk), **kw)
        _assert_bit_equal(m.tensors, disk)
        assert m.only_live == () and m.only_disk == ()
    # loaded by from_pretrained: the conversions it recorded on the model are used
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded._weight_conversions
    got = to_disk(loaded.state_dict(), disk.keys(), model=loaded)
    _assert_bit_equal(got.tensors, disk)
    # gate_up_proj and down_proj split into views of the live tensors, each expert's gate
    # and up rows contiguous: a sync reads no copy
    held = {t.untyped_storage().data_ptr() for t in live.values()}
    assert all(t.untyped_storage().data_ptr() in held and t.is_contiguous()
               for t in m.tensors.values())


def test_moe_without_mapping_reports_fused_tensors_only_live(tmp_path: Path) -> None:
    config = Qwen3MoeConfig(**_TINY, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32)
    model, disk = _save(config, tmp_path)
    m = to_disk(model.state_dict(), disk.keys())  # no model, no model_type: names only
    assert "model.layers.1.mlp.experts.down_proj" in m.only_live
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in m.only_disk


def test_unknown_live_and_missing_disk_names_are_reported(tmp_path: Path) -> None:
    config = Qwen3MoeConfig(**_TINY, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32)
    model, disk = _save(config, tmp_path)
    live = dict(model.state_dict())
    live["model.extra.weight"] = torch.zeros(3)
    del live["model.norm.weight"]
    m = to_disk(live, disk.keys(), model=model)
    assert m.only_live == ("model.extra.weight",)
    assert m.only_disk == ("model.norm.weight",)


def test_expert_missing_on_disk_is_an_error(tmp_path: Path) -> None:
    config = Qwen3MoeConfig(**_TINY, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32)
    model, disk = _save(config, tmp_path)
    names = set(disk) - {"model.layers.0.mlp.experts.3.gate_proj.weight"}
    with pytest.raises(CheckpointError, match=r"experts.3.gate_proj.weight: converted from live"):
        to_disk(model.state_dict(), names, model=model)


@pytest.mark.parametrize("given", ["model", "state_dict_and_config"])
@pytest.mark.parametrize("config", [
    Qwen3MoeConfig(**_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    MixtralConfig(**_TINY, num_local_experts=4, num_experts_per_tok=2),  # + block_sparse_moe
], ids=["qwen3_moe", "mixtral"])
def test_moe_first_save_writes_the_names_and_bytes_save_pretrained_does(
        tmp_path: Path, config: PretrainedConfig, given: str) -> None:
    model, disk = _save(config, tmp_path / "hf")
    live = ({"live": model} if given == "model" else
            {"live": model.state_dict(), "config": config})
    result = sync(tmp_path / "ours", **live, max_shard_size="60KB")
    assert result.first_save and result.tied == ()
    ours = {}
    for shard in sorted((tmp_path / "ours").glob("*.safetensors")):
        ours.update(load_file(shard))
    assert not any(".experts.gate_up_proj" in n for n in ours)  # one tensor per expert
    _assert_bit_equal(ours, disk)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    our_index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert our_index["weight_map"] == index["weight_map"]  # the same shards, too
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.bfloat16)
    want = model.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t.view(torch.uint8), want[name].view(torch.uint8)), name


def test_changed_patterns_select_every_reading_of_a_name(tmp_path: Path) -> None:
    """`matching` (`sync(changed=)`, `--changed`): a name with pattern characters is that
    name and a pattern too, a string that is a wrapped name and an inner name selects
    both, and a change to the tensor meant is written whichever was meant."""
    from hotweights.checkpoint.names import matching, unwrapped

    z = torch.zeros(4)
    live = {"a[0]": z, "a0": z + 1, "b": z + 2}
    assert matching(live, ["a[0]"]) == {"a[0]", "a0"}
    assert matching(live, ["b"]) == {"b"}
    ddp = unwrapped({"module.weight": z, "module.module.weight": z + 1})
    assert set(ddp) == {"weight", "module.weight"}
    assert matching(ddp, ["module.weight"]) == {"weight", "module.weight"}
    assert matching(ddp, ["module.module.*"]) == {"module.weight"}
    with pytest.raises(CheckpointError, match=r"changed 'c\*' matches none of the 3 live"):
        matching(live, ["c*"])
    d = tmp_path / "ckpt"
    sync(d, {n: t.clone() for n, t in live.items()})
    new = {n: t.clone() for n, t in live.items()}
    new["a[0]"] += 1
    assert sync(d, new, changed=["a[0]"]).tensors_changed == 1
    assert torch.equal(load_file(d / "model.safetensors")["a[0]"], new["a[0]"])


def test_live_tensors_half_of_which_have_no_place_are_taken_more_are_refused():
    live = {n: torch.zeros(2) for n in ("a", "b", "x", "y")}
    half = to_disk(live, ["a", "b"])
    assert half.only_live == ("x", "y") and half.unplaced("d") is None
    assert "3 of 4 live tensors have no place" in to_disk(live, ["a"]).unplaced("d")


def test_a_view_of_part_of_a_tensor_is_not_taken_for_a_tied_alias(tmp_path):
    # same storage and offset, another shape: two tensors, both written
    base = torch.arange(8, dtype=torch.float32)
    sync(tmp_path, {"fused.weight": base, "first.weight": base[:4]})
    disk = load_file(tmp_path / "model.safetensors")
    assert torch.equal(disk["fused.weight"], base) and torch.equal(disk["first.weight"],
                                                                   base[:4])


def test_a_pattern_of_the_names_inside_the_wrappers_matches_a_wrapped_model_s():
    from hotweights.checkpoint.names import matching, unwrapped

    live = unwrapped({"module.a.weight": torch.zeros(2), "module.b.weight": torch.zeros(2)})
    assert matching(live, ["a.*"]) == {"a.weight"}
