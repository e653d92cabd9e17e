"""Qwen3.5: the map, checked against vLLM's live table and the naming rules in its source.

vLLM's Qwen3.5 module imports torchvision (qwen3_5.py -> qwen3_vl.py -> transformers'
Qwen2-VL image processor), which has no CPU wheel for torch 2.13 here, so CI starts no
Qwen3.5 engine (the live tests in test_views_vllm/test_shared_vllm/test_server skip; they
run where the module imports, see docs/qwen3_5.md). What CI runs instead:
- the live parameter table of the tiny Qwen3.5, recorded from a real engine by
  tests/fixtures/record_live.py qwen3_5 (provenance inside), must be what `plan` maps exactly;
- the rules vLLM's loader applies to Qwen3.5 checkpoint names (the `WeightsMapper` tables
  of Qwen3_5Model, Qwen3NextModel and Qwen3VLForConditionalGeneration), read with `ast`
  from the installed vLLM source and applied to the installed transformers' Qwen3.5
  models (text and multimodal), must give that recorded table, and `plan` must invert
  them exactly. These skip where vLLM is not installed (its source is what they read);
  the recorded table is checked against `plan` without it.
"""

import ast
import importlib.util
import json
from pathlib import Path

import pytest
import transformers

from hotweights import LayoutError, plan
from hotweights.layout.plan import hf_params
from hotweights.testing import tiny

SHARD_ORDER = {"q": 0, "k": 1, "v": 2}
LIVE = json.loads((Path(__file__).parent / "fixtures" / "qwen3_5_live.json").read_text())


def _live() -> tuple[transformers.PretrainedConfig, dict[str, tuple[int, ...]]]:
    """The recorded config and live table: vLLM name -> shape."""
    config = dict(LIVE["config"])
    config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    return config, {name: tuple(shape) for name, (shape, _) in LIVE["params"].items()}


def _models() -> Path:
    """vLLM's model sources (found, not imported: importing vLLM is slow), or skip."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed: this test reads its naming rules from its source")
    return Path(spec.origin).parent / "model_executor" / "models"


def _mapper(file: str, cls: str) -> dict[str, dict]:
    """The literal WeightsMapper(...) keyword tables in `cls.hf_to_vllm_mapper` of `file`."""
    tree = ast.parse((_models() / file).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    assign = next(n for n in node.body if isinstance(n, ast.Assign)
                  and any(getattr(t, "id", None) == "hf_to_vllm_mapper" for t in n.targets))
    tables: dict[str, dict] = {}
    for call in ast.walk(assign.value):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "WeightsMapper":
            for kw in call.keywords:
                tables.setdefault(kw.arg, {}).update(ast.literal_eval(kw.value))
    return tables


def _order(shard) -> int:
    if isinstance(shard, tuple):
        return min(shard)
    return SHARD_ORDER.get(shard, shard)


def _vllm_table(hf_shapes, prefixes: dict, stacked: dict) -> tuple[dict, dict]:
    """vLLM name -> shape, and vLLM name -> HF names in packing order, by vLLM's rules."""
    groups: dict[str, list] = {}
    for name, shape in hf_shapes.items():
        vname = name
        for old, new in prefixes.items():
            if vname.startswith(old):
                vname = None if new is None else new + vname[len(old):]
                break
        if vname is None:
            continue
        order = 0
        for old, (new, shard) in stacked.items():
            if old + "." in vname:
                vname, order = vname.replace(old + ".", new + ".", 1), _order(shard)
                break
        groups.setdefault(vname, []).append((order, name, shape))
    table, parts = {}, {}
    for vname, members in groups.items():
        members.sort()
        rows = sum(shape[0] for _, _, shape in members)
        if vname.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = -(-rows // 64) * 64  # vLLM pads the vocabulary to a multiple of 64
        table[vname] = (rows, *members[0][2][1:])
        parts[vname] = [name for _, name, _ in members]
    return table, parts


def _text_rules() -> tuple[dict, dict]:
    next_rules = _mapper("qwen3_next.py", "Qwen3NextModel")
    rules = _mapper("qwen3_5.py", "Qwen3_5Model")
    stacked = next_rules["orig_to_new_stacked"] | rules["orig_to_new_stacked"]
    prefixes = _mapper("qwen3_5.py", "Qwen3_5ForCausalLMBase")["orig_to_new_prefix"]
    return prefixes, stacked


def _check(layout, parts):
    for vname, names in parts.items():
        pieces = layout.pieces[vname]
        assert [p.hf_name for p in pieces] == names, vname
        assert all(p.whole for p in pieces), vname
        edges = [0] + [p.rows[1] for p in pieces]
        assert [p.rows[0] for p in pieces] == edges[:-1], vname  # packed back to back


def test_vllm_source_has_the_rules_we_read():
    prefixes, stacked = _text_rules()
    assert stacked[".in_proj_qkv"] == (".in_proj_qkvz", (0, 1, 2))
    assert stacked[".in_proj_z"] == (".in_proj_qkvz", 3)
    assert stacked[".q_proj"] == (".qkv_proj", "q")
    assert "model.language_model." in prefixes


def test_text_model_map_inverts_vllm_rules():
    config = tiny.make_config("qwen3_5", 300)
    shapes = hf_params(config)
    table, parts = _vllm_table(shapes[0], *_text_rules())
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in table
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in table
    layout = plan(config, table, hf_shapes=shapes)  # strict: nothing unmapped
    _check(layout, parts)
    qkvz = layout.pieces["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert [p.hf_name.rsplit(".", 2)[1] for p in qkvz] == ["in_proj_qkv", "in_proj_z"]


def test_recorded_live_table_is_mapped_exactly():
    config, live = _live()
    layout = plan(config, live)  # strict: nothing unmapped
    assert set(layout.pieces) == set(live) and layout.missing == ()
    assert {name for name, (_, dtype) in LIVE["params"].items() if dtype == "float32"} == {
        "model.layers.0.linear_attn.A_log"}  # held in fp32 like Qwen3-Next's


def test_recorded_live_table_follows_vllm_rules():
    config, live = _live()
    shapes = hf_params(config)
    table, parts = _vllm_table(shapes[0], *_text_rules())
    assert live == table
    _check(plan(config, live, hf_shapes=shapes), parts)  # strict: nothing unmapped


def test_multimodal_checkpoint_names_map_to_the_language_model():
    text = tiny.make_config("qwen3_5", 300).to_dict()
    config = transformers.Qwen3_5Config(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128,
                           out_hidden_size=text["hidden_size"]),
    )
    shapes = hf_params(config)
    prefixes = _mapper("qwen3_vl.py", "Qwen3VLForConditionalGeneration")["orig_to_new_prefix"]
    _, stacked = _text_rules()
    language = {n: s for n, s in shapes[0].items() if not n.startswith("model.visual.")}
    table, parts = _vllm_table(language, prefixes, stacked)
    assert "language_model.model.layers.0.linear_attn.in_proj_qkvz.weight" in table
    assert "language_model.lm_head.weight" in table
    layout = plan(config, table, strict=False, hf_shapes=shapes)
    assert layout.unused == ()
    assert set(layout.missing) == {n for n in shapes[0] if n.startswith("model.visual.")}
    _check(layout, parts)


def test_tensor_parallel_gdn_projections_are_refused_not_guessed():
    tp = 2
    config, live = _live()  # vLLM's own names and shapes, recorded
    shapes = hf_params(config)
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    local = {name: (live[name][0] // tp, live[name][1])}
    with pytest.raises(LayoutError, match=r"in_proj_qkvz\.weight: tensor parallelism over "
                       r"gated-delta-net .*in_proj_qkv\.weight"):
        plan(config, local, tp_size=tp, tp_rank=0, strict=False, hf_shapes=shapes)
