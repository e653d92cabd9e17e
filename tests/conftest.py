import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub

import pytest

from hotweights import tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch) -> dir of a tiny random model with its tokenizer, built once."""
    root = tmp_path_factory.mktemp("tiny")

    def get(arch: str):
        return tiny.build(arch, root / arch)

    return get


@pytest.fixture(scope="session")
def servable():
    """servable(arch): skip the test unless this vLLM CPU build can serve `arch` here."""

    def check(arch: str) -> None:
        from hotweights.vllm_plugin.local import unservable

        if reason := unservable(arch):
            pytest.skip(reason)

    return check


@pytest.fixture(scope="session")
def custom_model(tiny_model, tmp_path_factory):
    """A tiny model of a custom type whose modeling code ships in the dir (auto_map)."""
    import json
    import shutil
    from pathlib import Path

    out = tmp_path_factory.mktemp("custom") / "tiny_custom"
    shutil.copytree(tiny_model("llama"), out)
    code = Path(__file__).parent / "fixtures" / "tiny_custom" / "modeling_tiny_custom.py"
    shutil.copy(code, out)
    config = json.loads((out / "config.json").read_text())
    entry = "modeling_tiny_custom.TinyCustom"
    config.update(
        model_type="tiny_custom",
        architectures=["TinyCustomForCausalLM"],
        auto_map={"AutoConfig": entry + "Config", "AutoModel": entry + "Model",
                  "AutoModelForCausalLM": entry + "ForCausalLM"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
