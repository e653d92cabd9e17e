"""hotweights.integrations.trl's checks of a trainer's options, without a server or a vLLM
engine (test_trl_grpo.py, which starts them, is marked vllm as a whole)."""

import types

import pytest
import torch

pytest.importorskip("trl")

from hotweights.errors import ConfigError  # noqa: E402
from hotweights.integrations import trl as trl_mod  # noqa: E402
from hotweights.protocol.renewer import MAX_LEASE_S  # noqa: E402


@pytest.mark.parametrize("update_mode, lease_s, ok", [
    ("keep", MAX_LEASE_S, True), ("abort", 0.5, True), ("wait", 120, True),
    ("fast", 120.0, False), ("wait", 0, False), ("wait", True, False),
    ("wait", MAX_LEASE_S + 1, False), ("wait", "60", False)])
def test_update_options_are_checked_up_to_the_longest_lease_a_server_grants(
        monkeypatch, update_mode, lease_s, ok):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if ok:
        trl_mod._check_process(update_mode, lease_s)
        return
    with pytest.raises(ConfigError, match=r"^update_mode=" if update_mode == "fast"
                       else rf"^lease_s={lease_s!r}: seconds \(> 0, at most 86400\)"):
        trl_mod._check_process(update_mode, lease_s)


def test_an_evaluation_cast_is_refused_where_any_served_weight_is_of_another_dtype():
    args = types.SimpleNamespace(bf16_full_eval=True, fp16=False, bf16=False)
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    trl_mod._check_dtypes(args, {"w": bf16, "ids": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(ConfigError, match=r"bf16_full_eval=True: evaluation would cast the "
                                          r"model to torch.bfloat16 .*\(torch.bfloat16, "
                                          r"torch.float32\)"):
        trl_mod._check_dtypes(args, {"w": bf16, "norm": torch.zeros(2)})


def test_bf16_autocast_is_warned_of_only_on_weights_all_float32(caplog):
    args = types.SimpleNamespace(fp16=False, bf16=True)
    with caplog.at_level("WARNING", logger="hotweights.integrations.trl"):
        trl_mod._check_dtypes(args, {"w": torch.zeros(2, dtype=torch.bfloat16),
                                     "norm": torch.zeros(2)})
        assert caplog.records == []
        trl_mod._check_dtypes(args, {"w": torch.zeros(2), "norm": torch.zeros(2)})
    assert "bf16=True on float32 weights" in caplog.text


@pytest.mark.parametrize("optim", ["galore_adamw_layerwise", "lomo", "schedule_free_adamw"])
def test_an_optimizer_that_writes_outside_its_step_is_refused_by_name(optim):
    args = types.SimpleNamespace(use_vllm=True, vllm_mode="server", optim=optim,
                                 vllm_server_base_url=None)
    with pytest.raises(ConfigError, match=rf"^SimpleNamespace\.optim='{optim}': "):
        trl_mod._check_args(args, types.SimpleNamespace(url="http://127.0.0.1:8000"), None)
    args.optim = "adamw_torch"
    trl_mod._check_args(args, types.SimpleNamespace(url="http://127.0.0.1:8000"), None)
    assert args.vllm_server_base_url == "http://127.0.0.1:8000"


def test_a_response_without_a_version_header_is_not_counted():
    # TRL's client also asks other routes (its server check, a proxy's error page)
    cls = trl_mod._client_for(types.SimpleNamespace(server_id="s1", cafile=None))
    client = cls.__new__(cls)  # (TRL's __init__ asks the server for its model)
    client._versions = []
    client._keep_version(types.SimpleNamespace(headers={}))
    assert client._versions == []
