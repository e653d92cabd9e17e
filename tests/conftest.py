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
