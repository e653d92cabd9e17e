"""benchmarks/trl_grpo.py's arithmetic, without vLLM: model shapes, per-run figures from
raw times and TRL's log, the JSON object (keys, nulls, the speedup's fallback), PSS."""

import os
import subprocess
import sys
import time

import pytest

KEYS = {"model_bytes", "trl_sync_s", "hw_sync_s", "hws_sync_s", "sync_speedup",
        "speedup_mode", "trl_sync_s_small", "hw_sync_s_small", "trl_step_s", "hw_step_s",
        "hws_step_s", "trl_peak_gb", "hw_peak_gb", "hws_peak_gb", "trl_logprob_gap",
        "hw_logprob_gap", "hws_logprob_gap", "trl_logprob_gap_fp32", "hw_logprob_gap_fp32",
        "trls_sync_s", "trls_step_s", "trls_peak_gb", "trls_logprob_gap", "skipped"}


@pytest.fixture
def bench(load_bench):
    return load_bench("trl_grpo")


def test_default_model_is_half_a_gigabyte_and_the_small_one_a_quarter(bench):
    def params(s, vocab=300):
        q, kv = s["num_attention_heads"] * 64, s["num_key_value_heads"] * 64
        layer = 2 * s["hidden_size"] * (q + kv) + 3 * s["hidden_size"] * s["intermediate_size"]
        return s["num_hidden_layers"] * layer + 2 * vocab * s["hidden_size"]

    full, small = bench.shape(1536, 10), bench.shape(768, 10)
    assert full["head_dim"] == 64 and full["num_attention_heads"] % full["num_key_value_heads"] == 0
    assert 0.45e9 < 2 * params(full) < 0.55e9
    assert 3.8 < params(full) / params(small) < 4.1
    with pytest.raises(ValueError, match="--hidden 200"):
        bench.shape(200, 2)


def test_figures_skip_the_warmup_and_add_what_wraps_the_step(bench):
    log = [{"step_time": 1.0 + i, bench.GAP: 0.1 * i} for i in range(4)] + [{"train_loss": 0.0}]
    result = dict(log=log, sync=[9.0, 0.5, 0.5, 0.5], inner=[0.2] * 4,
                  outer=[0.2, 0.3, 0.3, 0.3], peak_bytes=2_000_000_000)
    f = bench.figures(result, warmup=1)
    assert f["sync_s"] == pytest.approx(0.6)
    assert f["step_s"] == pytest.approx(3.3)  # median of 2.3, 3.3, 4.3
    assert f["gap"] == pytest.approx(0.2)
    assert f["peak_gb"] == 2.0
    # no sync_weights calls at all (a mode whose sync is the optimizer's wrapper)
    assert bench.figures(dict(result, sync=[]), warmup=1)["sync_s"] == pytest.approx(0.1)


def test_report_has_the_keys_and_falls_back_to_the_server_mode(bench):
    runs = {"trl": dict(sync_s=2.0, step_s=5.0, gap=0.01, peak_gb=3.0), "hw": None,
            "hws": dict(sync_s=0.02, step_s=4.0, gap=0.005, peak_gb=2.0),
            "trls": dict(sync_s=0.5, step_s=4.5, gap=0.01, peak_gb=2.3),
            "trl_fp32": dict(sync_s=1.0, step_s=1.0, gap=0.02, peak_gb=1.0)}
    out = bench.report(runs, 500_000_000, {"hw": "ConfigError: no colocate"})
    assert set(out) == KEYS
    assert out["sync_speedup"] == pytest.approx(100.0) and out["speedup_mode"] == "hws"
    assert out["hw_sync_s"] is None and out["hw_logprob_gap_fp32"] is None
    assert out["trl_logprob_gap_fp32"] == 0.02
    text = bench.table(out, {"full": "500 MB bf16", "small": "125 MB bf16"})
    assert "not run: hw: ConfigError: no colocate" in text
    # each hotweights mode against TRL's same mode
    assert "memory saved trls - hws: 0.300 GB, target >= 0.450 GB (0.9 x model): NOT met" \
        in text
    assert "target >= 20: met" in text


def test_pss_counts_children(bench):
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 << 20); "
                              "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 60  # the child starts and fills its buffer
        while (own := sum(bench.tree_pss(child.pid).values())) <= 150 << 20:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert own > 150 << 20
        mine = bench.tree_pss(os.getpid())
        assert any(name.startswith(f"{child.pid} ") for name in mine)
        assert sum(mine.values()) >= own
    finally:
        child.kill()
        child.wait()
