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


def test_what_the_program_set_after_the_engine_started_stays(monkeypatch):
    monkeypatch.delenv("HW_TEST_LATER", raising=False)
    monkeypatch.delenv("HW_TEST_ENGINE", raising=False)
    monkeypatch.setenv("HW_TEST_BOTH", "mine")
    before = dict(os.environ)
    os.environ["HW_TEST_ENGINE"] = "1"  # the setup's
    os.environ["HW_TEST_BOTH"] = "setup"
    after = dict(os.environ)
    os.environ["HW_TEST_LATER"] = "token"  # the program's, since (HF_TOKEN, WANDB_*)
    os.environ["HW_TEST_BOTH"] = "changed again"
    local.restore_environ(before, after)
    assert "HW_TEST_ENGINE" not in os.environ  # the setup's change undone
    assert os.environ["HW_TEST_LATER"] == "token"  # what was set since stays
    assert os.environ["HW_TEST_BOTH"] == "changed again"
    del os.environ["HW_TEST_LATER"]
