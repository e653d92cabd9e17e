"""Views compared with the checkpoint the server loaded (`bridge.loaded.check_loaded`): a
loader that reorders a tensor but keeps its name and shape is refused, not trained."""

import pytest
import torch
from safetensors.torch import load_file

from hotweights import build_hf_model
from hotweights.bridge.client import Bridge
from hotweights.bridge.loaded import check_loaded
from hotweights.errors import LayoutError, ServerError
from hotweights.protocol import shm
from hotweights.testing import tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.build("llama", tmp_path_factory.mktemp("llama"), dtype="float32")


def _served(model_dir, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """What a tp=1 vLLM Llama loads from `model_dir`: q/k/v and gate/up merged, the
    vocabulary padded to a multiple of 64, in the served dtype."""
    hf = load_file(model_dir / "model.safetensors")
    out = {}
    for name, t in hf.items():
        if ".q_proj." in name:
            parts = [hf[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
        elif ".gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [t, hf[name.replace("gate_proj", "up_proj")]])
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = -(-t.shape[0] // 64) * 64
            out[name] = torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = t
    return {n: t.to(dtype) for n, t in out.items()}


def test_views_of_what_the_server_loaded_pass_in_its_dtype(model_dir):
    for dtype in (torch.bfloat16, torch.float32):  # an fp32 checkpoint served in bf16 too
        model, report = build_hf_model(model_dir, _served(model_dir, dtype))
        assert check_loaded(model, model_dir) == len(list(model.parameters()))


def test_a_tensor_reordered_on_load_keeping_its_shape_is_refused(model_dir):
    """As vLLM's Bloom loader regroups q, k, v per head: the same name and shape, rows in
    another order."""
    served = _served(model_dir)
    config = tiny.make_config("llama", 1)
    q = config.num_attention_heads * config.head_dim
    qkv = served["model.layers.1.self_attn.qkv_proj.weight"]
    heads = qkv[:q].view(config.num_attention_heads, config.head_dim, -1)
    qkv[:q] = heads.transpose(0, 1).reshape(q, -1).clone()
    model, _ = build_hf_model(model_dir, served)
    with pytest.raises(LayoutError, match=r"1 of 21 views compared hold other values than "
                       r".* holds for them: model.layers.1.self_attn.q_proj.weight\. vLLM's "
                       r"loader of LlamaForCausalLM stores them in another order"):
        check_loaded(model, model_dir)


def test_a_bias_regrouped_with_its_weight_is_a_loader_s_order_not_a_stale_checkpoint():
    # vLLM's Bloom loader regroups query_key_value's weight and bias; a bias or norm that
    # differs alone says the server serves another checkpoint
    from hotweights.bridge.loaded import _message

    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    both = {"0.weight": "0.weight", "0.bias": "0.bias"}
    assert "stores them in another order" in _message(model, "m", both, 4)
    assert "does not serve this checkpoint" in _message(model, "m", {
        **both, "1.weight": "1.weight"}, 4)
    assert "does not serve this checkpoint" in _message(model, "m", both, 2)  # every one


def test_the_bridge_compares_only_while_the_server_serves_what_it_loaded(model_dir,
                                                                         monkeypatch):
    served = _served(model_dir)
    served["model.norm.weight"].mul_(2)  # as after a step: the server's weights moved on
    b = Bridge.__new__(Bridge)  # no server: its status and manifest stand in
    b.tensors, b.server_id, b.closed, b.url = served, "s", False, "http://h:8000"
    b.manifests = [shm.Manifest(shm.FORMAT, "s", "/dev/shm/x", 1, (), model=str(model_dir))]
    vocab = tiny.make_config("llama", 1).__class__.from_pretrained(model_dir).vocab_size
    monkeypatch.setattr(b, "server_info", lambda: {"model_config": {"vocab_size": vocab}})
    for status in ({"n": 3, "state": "idle", "server_id": "s"},
                   {"n": 0, "state": "paused", "server_id": "s"}):
        monkeypatch.setattr(b, "status", lambda status=status: status)
        assert b.model().model.norm.weight.data_ptr() == served["model.norm.weight"].data_ptr()
    monkeypatch.setattr(b, "status", lambda: {"n": 0, "state": "idle", "server_id": "s"})
    with pytest.raises(LayoutError, match=r"model.norm.weight\. The server does not serve "
                       r"this checkpoint as it is now"):
        b.model()
    b.model(check_loaded=False)
    statuses = iter([{"n": 0, "state": "idle", "server_id": "s"},
                     {"n": 0, "state": "paused", "server_id": "s"}])
    monkeypatch.setattr(b, "status", lambda: next(statuses))  # another trainer began
    b.model()  # meanwhile: its writes are no reorder (a warning, no error)
    statuses = iter([{"n": 0, "state": "idle", "server_id": "s"},
                     {"n": 0, "state": "idle", "server_id": "t"}])
    monkeypatch.setattr(b, "status", lambda: next(statuses))  # restarted meanwhile: the
    with pytest.raises(ServerError, match=r"is server t now, not s: it restarted"):  # views
        b.model()  # are of memory that is gone
    # a vocabulary that differs inside vLLM's padding of the rows (300 vs 310 in 320)
    monkeypatch.setattr(b, "status", lambda: {"n": 0, "state": "idle", "server_id": "s"})
    monkeypatch.setattr(b, "server_info", lambda: {"model_config": {"vocab_size": vocab + 3}})
    with pytest.raises(LayoutError, match=rf"vocab_size: the config says {vocab}, the server "
                       rf"loaded {vocab + 3}"):
        b.model(check_loaded=False)


def test_fused_experts_are_compared_as_the_checkpoint_s_own_experts(tmp_path):
    """transformers 5 fuses a checkpoint's per-expert gate/up/down into 3-D tensors: a
    spread of the experts is converted back and compared (gate and up swapped: refused)."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny.build("qwen3_moe", tmp_path / "moe", dtype="bfloat16", num_experts=16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    assert check_loaded(model, model_dir) == len(list(model.parameters()))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    fused = model.get_parameter(name)
    half = fused.shape[1] // 2
    with torch.no_grad():
        fused.copy_(torch.cat([fused[:, half:], fused[:, :half]], 1))
    # experts 1, 3, ..., 15 of 16 compared, each under its own number
    with pytest.raises(LayoutError, match=rf"{name} \(model.layers.1.mlp.experts.1.gate_proj"):
        check_loaded(model, model_dir)


def test_a_directory_without_safetensors_is_not_compared(model_dir, tmp_path):
    model, _ = build_hf_model(model_dir, _served(model_dir))
    assert check_loaded(model, tmp_path) == 0


def test_a_tensor_of_a_dtype_torch_lacks_leaves_the_others_compared(tmp_path):
    import json
    import struct

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

    model = One()
    header = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
              "mtp.extra": {"dtype": "F4", "shape": [2, 2], "data_offsets": [64, 66]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(tmp_path / "model.safetensors", "wb") as f:  # w differs on disk
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.write((model.w.detach() + 1).numpy().tobytes() + b"\0\0")
    with pytest.raises(LayoutError, match=r"1 of 1 views compared hold other values"):
        check_loaded(model, tmp_path)


def test_only_the_parameters_named_are_compared_and_none_left_out_is_warned_of(model_dir,
                                                                               caplog):
    served = _served(model_dir)
    served["model.norm.weight"].mul_(2)  # as `allow_missing` zeros: not the checkpoint's
    model, _ = build_hf_model(model_dir, served)
    names = [n for n, _ in model.named_parameters() if n != "model.norm.weight"]
    with caplog.at_level("WARNING", logger="hotweights.bridge.loaded"):
        assert check_loaded(model, model_dir, iter(names)) == len(names)
    assert caplog.records == []  # every parameter named was compared


def test_a_message_names_three_views_and_says_when_there_are_more():
    from hotweights.bridge.loaded import _message

    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(2)))
    three = {n: n for n in ("0.weight", "0.bias", "1.weight")}
    assert "holds for them: 0.weight, 0.bias, 1.weight. " in _message(model, "m", three, 4)
    assert "holds for them: 0.weight, 0.bias, 1.weight and 1 more. " in _message(
        model, "m", {**three, "1.bias": "1.bias"}, 4)


def test_writes_between_building_the_model_and_its_first_update_are_named(model_dir,
                                                                         monkeypatch, caplog):
    served = _served(model_dir)
    b = Bridge.__new__(Bridge)  # no server: its status and manifest stand in
    b.tensors, b.server_id, b.closed, b.version = served, "s", False, "3@s"
    b.manifests = [shm.Manifest(shm.FORMAT, "s", "/dev/shm/x", 1, (), model=str(model_dir))]
    monkeypatch.setattr(b, "server_info", lambda: {})
    monkeypatch.setattr(b, "status", lambda: {"n": 3, "state": "idle", "server_id": "s"})
    model = b.model()
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # a step outside `bridge.update()`
    with caplog.at_level("WARNING", logger="hotweights.bridge.client"):
        b._written_outside("update()")  # as the first update does before it begins
    assert "model.norm.weight or a view of the same vLLM tensor" in caplog.text


def test_a_view_is_compared_with_the_checkpoint_cast_to_the_served_dtype():
    from hotweights.bridge.loaded import _differs

    stored = torch.tensor([1e5, 0.3, -2.7, 1e-3])  # beyond float16's range, and rounded
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        assert not _differs(stored.to(dtype), stored), dtype
    assert _differs(stored.flip(0).to(torch.bfloat16), stored)


def test_a_tensor_of_another_shape_under_the_same_name_is_not_compared(tmp_path, caplog):
    from safetensors.torch import save_file

    model = torch.nn.Linear(4, 4)
    save_file({"weight": torch.zeros(2, 2), "bias": model.bias.detach().clone()},
              tmp_path / "model.safetensors")
    with caplog.at_level("WARNING", logger="hotweights.bridge.loaded"):
        assert check_loaded(model, tmp_path) == 1
    assert "1 of 2 parameters (the others are saved under names or shapes not found" in \
        caplog.text
