"""vLLM loads every installed general plugin: ours must act only where hotweights started
the engine (HOTWEIGHTS_ACTIVE=1), and leave a plain vLLM to its own CPU kernels."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

# A plain in-process vLLM engine (no hotweights call), printing how the first attention
# layer's qkv_proj computes after load: on its `weight` itself (F.linear) or on a copy
# packed into vLLM's CPU GEMM kernel, and what it left in `weight`.
ENGINE = """
import json, sys
import torch
from vllm import LLM
llm = LLM(sys.argv[1], enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)
qkv = llm.apply_model(lambda m: m.model.layers[0].self_attn.qkv_proj)[0]
print("QKV", json.dumps(dict(shape=list(qkv.weight.shape), name=qkv.cpu_linear.__qualname__,
                             plain=qkv.cpu_linear is torch.nn.functional.linear)))
"""


def _qkv(model_dir, **env) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("VLLM_PLUGINS", "HOTWEIGHTS_ACTIVE", "HOTWEIGHTS_SERVER_ID")}
    out = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model_dir)], capture_output=True, text=True,
        timeout=400, env=dict(base, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                              VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", **env))
    lines = [line for line in out.stdout.splitlines() if line.startswith("QKV ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("QKV "))


@pytest.mark.timeout(600)  # two engine starts, one after the other
def test_plain_vllm_keeps_its_own_kernels_and_hotweights_keeps_the_weights(tiny_model):
    model_dir = tiny_model("llama")
    cfg = json.loads((model_dir / "config.json").read_text())
    rows = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    plain_vllm = _qkv(model_dir)
    # vLLM's own CPU dispatch: oneDNN/SGL on a packed copy (`weight` then emptied to [0]),
    # or, where neither is available, its own torch fallback: a lambda, not F.linear
    assert plain_vllm["name"].startswith("dispatch_cpu_unquantized_gemm.<locals>")
    assert not plain_vllm["plain"]
    assert _qkv(model_dir, HOTWEIGHTS_ACTIVE="1") == dict(
        shape=[rows, cfg["hidden_size"]], name="linear", plain=True)


def test_an_in_process_engine_s_variables_hold_for_its_start_only(monkeypatch):
    # `start_engine` sets what its engine needs (HOTWEIGHTS_ACTIVE, `environ=` where unset);
    # a failed start (as `stop_engine`) puts os.environ back: later servers inherit none
    import vllm

    from hotweights.vllm_plugin.local import start_engine
    seen = {}

    def no_engine(model, **kwargs):
        seen.update(os.environ)
        raise RuntimeError("no engine in this test")
    monkeypatch.setattr(vllm, "LLM", no_engine)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.delenv("HOTWEIGHTS_ACTIVE", raising=False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="no engine"):
        start_engine("m", environ={"VLLM_LOGGING_LEVEL": "ERROR", "HOTWEIGHTS_TEST_VAR": "1"})
    assert (seen["VLLM_LOGGING_LEVEL"], seen["HOTWEIGHTS_TEST_VAR"]) == ("WARNING", "1")
    assert seen["HOTWEIGHTS_ACTIVE"] == "1"
    assert dict(os.environ) == before


LOGS = """
import logging, sys
from hotweights import vllm_plugin
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
vllm_plugin.register()
log = logging.getLogger("hotweights.server.transaction")
log.warning("hotweights: before vLLM set its logging up")
log.info("hotweights: an info before")
if sys.argv[1] == "user":  # the user's logging: vLLM's left alone, records to the root
    logging.basicConfig(level=logging.INFO, format="USER %(name)s %(message)s")
configure_logging(LoggingConfig(configure_logging=sys.argv[1] != "user"))
import model_hosting_container_standards  # (sets the root logger to ERROR)
log.warning("hotweights: after")
log.info("hotweights: an info after")
log.debug("hotweights: a debug after")
"""


@pytest.mark.parametrize("how", ["server", "user", "trainer"])
def test_a_server_s_log_has_hotweights_lines_as_vllm_s_own(how):
    env = {k: v for k, v in os.environ.items() if k != "HOTWEIGHTS_SERVER_ID"}
    env.update(HOTWEIGHTS_ACTIVE="1", VLLM_LOGGING_LEVEL="INFO", VLLM_PLUGINS="")
    if how != "trainer":  # a trainer's own engine: its logging is the trainer's (the root's)
        env["HOTWEIGHTS_SERVER_ID"] = "s"
    out = subprocess.run([sys.executable, "-c", LOGS, how], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text, rows = out.stdout + out.stderr, (out.stdout + out.stderr).splitlines()
    assert "a debug after" not in text and "an info before" not in text
    if how == "trainer":
        assert "hotweights: an info after" not in text
        return
    assert "hotweights: before vLLM set its logging up" in out.stderr  # (stderr, bare)
    if how == "user":  # as vLLM's own records: to the root logger's handler
        assert "USER hotweights.server.transaction hotweights: after" in rows
        assert "USER hotweights.server.transaction hotweights: an info after" in rows
        return
    for level, line in ("WARNING", "hotweights: after"), ("INFO", "hotweights: an info after"):
        assert [r for r in rows if level in r and r.endswith(line) and "pid=" in r], text
