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
        from hotweights.vllm_plugin.cpu_keep_weights import conv_kernel_reads_packed_weights

        if arch in tiny.GDN_ARCHS and conv_kernel_reads_packed_weights():
            pytest.skip("this CPU runs vLLM's packed GDN conv kernel: hotweights refuses it")
        if arch == "qwen3_5":
            try:
                import vllm.model_executor.models.qwen3_5  # noqa: F401
            except (ImportError, RuntimeError, OSError) as e:  # torchvision: docs/qwen3_5.md
                pytest.skip(f"vLLM's Qwen3.5 module cannot be imported here: {e}")

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
