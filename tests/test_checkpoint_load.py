"""checkpoint.load: a checkpoint loaded into a model's own tensors through save_pretrained's
name conversions (what a trainer resuming into the served weights runs inside an update),
or refused before anything is written."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hotweights.checkpoint import load as load_module
from hotweights.checkpoint.load import load_plan
from hotweights.checkpoint.source import open_dir
from hotweights.errors import CheckpointError
from hotweights.testing.tiny import make_config


def _model(arch: str, seed: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(make_config(arch, 300, **overrides),
                                            dtype=torch.bfloat16)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


@pytest.mark.parametrize("arch", ["llama_tied", "qwen3_moe", "mixtral"])
def test_a_saved_model_loads_into_another_s_own_tensors(arch, tmp_path):
    saved, into = _model(arch, 0), _model(arch, 1)
    saved.save_pretrained(tmp_path)
    views = {n: p.data_ptr() for n, p in into.named_parameters()}
    assert load_plan(into, tmp_path)() > 0
    assert _same(saved, into)
    assert {n: p.data_ptr() for n, p in into.named_parameters()} == views  # in place


def test_fused_experts_are_what_a_plain_load_state_dict_leaves_out(tmp_path):
    # why: transformers 5 saves fused experts per expert, and load_state_dict(strict=False)
    # (Trainer's resume) matches none of them, with a warning only
    from safetensors.torch import load_file

    _model("qwen3_moe", 0).save_pretrained(tmp_path)
    into = _model("qwen3_moe", 1)
    missing = into.load_state_dict(load_file(tmp_path / "model.safetensors"),
                                   strict=False).missing_keys
    assert missing and all(".experts." in n for n in missing)


@pytest.mark.parametrize(("other", "message"), [
    (dict(num_hidden_layers=1), r"holds no tensor for \d+ of the model's \(model\.layers\.1\."),
    (dict(intermediate_size=96), r"bfloat16 \[\d+, \d+\], the model's bfloat16 \[\d+, \d+\]"),
    (dict(dtype="float16"), r"float16 \[\d+, \d+\], the model's bfloat16")])  # no silent cast
def test_another_model_s_checkpoint_is_refused_before_anything_is_written(other, message,
                                                                         tmp_path):
    dtype = getattr(torch, other.pop("dtype", "bfloat16"))
    _model("llama", 0, **other).to(dtype).save_pretrained(tmp_path)
    into = _model("llama", 1)
    before = {n: t.clone() for n, t in into.state_dict().items()}
    with pytest.raises(CheckpointError, match=message + r".*Nothing was loaded"):
        load_plan(into, tmp_path)
    assert all(torch.equal(before[n], t) for n, t in into.state_dict().items())


def test_a_directory_without_safetensors_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: no safetensors checkpoint"):
        load_plan(_model("llama", 0), tmp_path)


def test_a_compiled_moe_model_loads_through_its_wrapper(tmp_path):
    saved, into = _model("qwen3_moe", 0), _model("qwen3_moe", 1)
    saved.save_pretrained(tmp_path)
    assert load_plan(torch.compile(into), tmp_path)() > 0
    assert _same(saved, into)


def test_a_checkpoint_whose_sync_was_cut_short_after_its_commit_is_finished_first(
        tmp_path, monkeypatch):
    # its shards may be half written until the journal is replayed: a load reads it whole
    from hotweights.checkpoint import finisher, journal
    from hotweights.checkpoint.shards import read_dir

    saved, into = _model("llama", 0), _model("llama", 1)
    saved.save_pretrained(tmp_path)
    shard, info = read_dir(tmp_path)["model.norm.weight"]
    new = torch.full_like(saved.model.norm.weight, 3.0)
    journal.write_journal(tmp_path, [(shard.path.rsplit("/", 1)[1], info.begin,
                                      new.view(torch.uint8).numpy().tobytes())])
    assert journal.pending(tmp_path) is not None  # committed, not applied: a crash
    load_plan(into, tmp_path)()
    assert torch.equal(into.model.norm.weight, new) and journal.pending(tmp_path) is None
    finisher.finish()


def test_a_class_keyed_conversion_names_what_save_pretrained_names(tmp_path):
    # GPT-NeoX's head is `embed_out` on disk (a conversion keyed by the model's class), and
    # a model not loaded from a checkpoint has no conversions of its own recorded
    from transformers import GPTNeoXConfig

    from hotweights.checkpoint import sync

    config = GPTNeoXConfig(vocab_size=300, hidden_size=64, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        model.get_output_embeddings().weight[0] += 1.0
    result = sync(tmp_path, model)
    assert result.tensors_changed == 1 and not result.missing_on_disk
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.get_output_embeddings().weight,
                       model.get_output_embeddings().weight)


def test_a_tensor_two_shards_hold_is_refused(tmp_path):
    # transformers and vLLM load the later file's copy, the index names the first's
    import json

    from safetensors.torch import load_file, save_file

    _model("llama", 0).save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.norm.weight"
    other = next(f for f in sorted(set(index.values())) if f != index[name])
    tensors = load_file(tmp_path / other)
    tensors[name] = torch.full((300,), 7.0, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / other, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name} is in .* and in "):
        load_plan(_model("llama", 1), tmp_path)


def test_a_tied_model_s_two_names_stored_unequal_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _model("llama_tied", 0).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # equal: loads
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    into = _model("llama_tied", 1)
    load_plan(into, tmp_path)()
    assert torch.equal(into.lm_head.weight, tensors["lm_head.weight"])
    tensors["lm_head.weight"] += 1  # saved untied
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    into = _model("llama_tied", 1)
    before = into.lm_head.weight.clone()
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight and lm_head\.weight "
                                              r"in .*: stored with different values, tied in "
                                              r"the model .*Nothing was loaded"):
        load_plan(into, tmp_path)
    assert torch.equal(into.lm_head.weight, before)


def test_a_missing_expert_names_the_live_tensor_it_converts_from(tmp_path):
    from safetensors.torch import load_file, save_file

    _model("qwen3_moe", 0).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^\S+: model\.layers\.1\.mlp\.experts\.3\."
                                              r"down_proj\.weight: converted from live model\."
                                              r"layers\.1\.mlp\.experts\.down_proj by "
                                              r"transformers.* Nothing was loaded$"):
        load_plan(_model("qwen3_moe", 1), tmp_path)


def _counting(monkeypatch):
    closed = []
    real = load_module.open_dir
    def open_dir(*a, **k):
        disk = real(*a, **k)
        close = disk.close
        def counted():
            closed.append(True)
            close()
        disk.close = counted
        return disk
    monkeypatch.setattr(load_module, "open_dir", open_dir)
    return closed


def test_the_load_returns_the_bytes_copied_and_closes_the_checkpoint(tmp_path, monkeypatch):
    _model("llama", 0).save_pretrained(tmp_path)
    into = _model("llama", 1)
    closed = _counting(monkeypatch)
    n = load_plan(into, tmp_path)()
    assert n == sum(t.numel() * t.element_size() for t in into.state_dict().values())
    assert closed == [True]


def test_a_refused_load_closes_the_checkpoint(tmp_path, monkeypatch):
    _model("llama", 0, intermediate_size=96).save_pretrained(tmp_path)
    closed = _counting(monkeypatch)
    with pytest.raises(CheckpointError):
        load_plan(_model("llama", 1), tmp_path)
    assert closed == [True]


def test_a_conversion_that_gives_a_copy_is_refused(tmp_path, monkeypatch):
    _model("llama", 0).save_pretrained(tmp_path)
    real = load_module.to_disk
    def to_disk(*a, **k):
        names = real(*a, **k)
        first = next(iter(names.tensors))
        names.tensors[first] = names.tensors[first].clone()
        return names
    monkeypatch.setattr(load_module, "to_disk", to_disk)
    with pytest.raises(CheckpointError, match="is a copy"):
        load_plan(_model("llama", 1), tmp_path)


def test_a_tensor_held_past_its_checkpoint_s_close_reads_its_bytes_and_unmaps_with_it(tmp_path):
    # closing the mapping under a tensor still held (a traceback's) crashed the process
    save_file({"w": torch.arange(16.0).reshape(4, 4)}, tmp_path / "model.safetensors")
    code = ("import sys; from hotweights.checkpoint.source import open_dir\n"
            "disk = open_dir(sys.argv[1]); w = disk['w']; disk.close(); print(float(w.sum()))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "120.0"), done.stderr

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return str(tmp_path / "model.safetensors") in f.read()

    disk = open_dir(tmp_path)
    w = disk["w"]
    disk.close()
    assert mapped() and float(w.sum()) == 120.0
    del w
    assert not mapped()
