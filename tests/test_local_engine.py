"""vllm_plugin.local: the environment an in-process engine sets up is put back."""

import os
from types import SimpleNamespace

import pytest

from hotweights.vllm_plugin import local


def test_a_shutdown_that_fails_still_puts_the_environment_back(monkeypatch):
    monkeypatch.setattr(local, "_environ", dict(os.environ))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as start_engine sets it
    before = local._environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")

    def shutdown():
        raise RuntimeError("engine core gone")
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(
        shutdown=shutdown)))
    with pytest.raises(RuntimeError, match="engine core gone"):
        local.stop_engine(llm)
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == before
    assert local._environ is None
