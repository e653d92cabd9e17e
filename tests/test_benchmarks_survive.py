"""Benchmarks go on when a part cannot run on this machine (benchmarks/_survive.py).

The crash is real but small: a "server" whose engine core process kills itself with SIGILL
(as vLLM's AMX MoE kernel does on AVX-512 BF16 + AMX CPUs), after which the server prints
vLLM's message and exits 1. No vLLM starts here.
"""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

# The engine core dies of SIGILL (no core file); the server says so, as vLLM does, and exits.
DYING_SERVER = """
import subprocess, sys
core = subprocess.run([sys.executable, "-c", "import os, resource, signal; "
                       "resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
                       "os.kill(os.getpid(), signal.SIGILL)"])
print("RuntimeError: Engine core initialization failed. See root cause above. "
      f"Failed core proc(s): {{'EngineCore_DP0': {core.returncode}}}", flush=True)
sys.exit(1)
"""
# A child that itself dies of SIGILL.
SIGILL_CHILD = ("import os, resource, signal; resource.setrlimit(resource.RLIMIT_CORE, (0, 0));"
                " os.kill(os.getpid(), signal.SIGILL)")


def figures(times: list[float], **extra) -> dict:
    return dict(times=times, idle=1.0, changed=len(times), **extra)


@pytest.mark.parametrize("text", [
    "Worker proc VllmWorker-0 died unexpectedly (exit code: -4), shutting down executor.",
    "RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {'EngineCore_DP0': -4}",
    "http://127.0.0.1:1234: server exited with -4; /tmp/x.log:",
    "Fatal Python error: Illegal instruction",
])
def test_crash_names_sigill(load_bench, text):
    survive = load_bench("_survive")
    assert survive.crash(text) == ("a process died of SIGILL (illegal instruction: "
                                   "a kernel this CPU cannot run)")


def test_crash_ignores_plain_exits(load_bench):
    survive = load_bench("_survive")
    assert survive.crash("server exited with 1; Failed core proc(s): {'EngineCore_DP0': 1}") \
        is None
    assert survive.died_of(1) == "exit 1"


def test_update_latency_reports_the_dead_baseline(load_bench, monkeypatch, tmp_path, capsys):
    bench = load_bench("update_latency")
    monkeypatch.setattr(bench, "tiny", SimpleNamespace(
        build=lambda arch, path, **kw: path.mkdir(parents=True, exist_ok=True) or path))
    monkeypatch.setattr(bench, "vllm_command",
                        lambda model_dir, port: [sys.executable, "-c", DYING_SERVER])

    def hotweights_run(name, model_dir, args, overhead=None):
        ms = {"hotweights-tiny": [10.0, 12.0], "hotweights-moe": [20.0, 22.0],
              "hotweights-dense": [100.0, 110.0]}[name]
        extra = {} if overhead is None else {"overhead": dict(
            rss=10, uss=5, imports_rss=100, params=3, weight_bytes=1000)}
        return figures(ms, **extra)

    real_reload = bench.reload_run

    def reload_run(name, model_dir, args):
        if name == "reload-moe":  # the real one: its plain vLLM server dies of SIGILL
            return real_reload(name, model_dir, args)
        return figures([400.0, 440.0], split=[1.0, 2.0, 3.0])

    monkeypatch.setattr(bench, "hotweights_run", hotweights_run)
    monkeypatch.setattr(bench, "reload_run", reload_run)
    rc = bench.main(["--updates", "2", "--reloads", "2", "--workdir", str(tmp_path),
                     "--start-timeout", "60"])
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert rc == 0  # a baseline that cannot run here fails nothing
    assert list(result["skipped"]) == ["reload-moe"]
    why = result["skipped"]["reload-moe"]
    assert why.startswith("ServerError: http://127.0.0.1:")
    assert "server exited with 1" in why and "died of SIGILL (illegal instruction" in why
    assert f"skipped reload-moe: {why}" in err.splitlines()
    assert f"not run: {why}" in out
    # the figures that ran are there; the speedup is the dense model's
    assert result["large_p50_ms"] == 21.0 and result["size_ratio"] == 1.91
    assert result["speedup_model"] == "dense" and result["reload_p50_ms"] == 420.0
    assert result["speedup_vs_reload"] == 4.0 and result["trainer_overhead_pct"] == 1.0


def test_update_latency_fails_when_hotweights_cannot_run(load_bench, monkeypatch, tmp_path,
                                                         capsys):
    bench = load_bench("update_latency")
    monkeypatch.setattr(bench, "tiny", SimpleNamespace(
        build=lambda arch, path, **kw: path.mkdir(parents=True, exist_ok=True) or path))

    def hotweights_run(name, model_dir, args, overhead=None):
        if name == "hotweights-moe":
            raise RuntimeError("version 3 never served")
        return figures([10.0, 12.0])

    monkeypatch.setattr(bench, "hotweights_run", hotweights_run)
    monkeypatch.setattr(bench, "reload_run", lambda *a: figures([40.0, 44.0], split=[1, 2, 3]))
    rc = bench.main(["--updates", "2", "--reloads", "2", "--workdir", str(tmp_path)])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1
    assert result["skipped"] == {"hotweights-moe": "RuntimeError: version 3 never served"}
    assert result["large_p50_ms"] is None and result["trainer_overhead_pct"] is None
    assert result["speedup_model"] == "dense" and result["speedup_vs_reload"] == 3.82


def test_views_skips_an_arch_whose_child_dies_of_sigill(load_bench, monkeypatch, tmp_path, capsys):
    views = load_bench("views")
    monkeypatch.setattr(views, "skip_reason", lambda arch: None)
    monkeypatch.setattr(views, "build_model", lambda arch, size, workdir: workdir)
    monkeypatch.setattr(views, "child_command",
                        lambda arch, args: [sys.executable, "-c", SIGILL_CHILD])
    rc = views.main(["--archs", "qwen3_moe", "--workdir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0
    assert json.loads(out.strip().splitlines()[-1]) == {"archs": {"qwen3_moe": {
        "skipped": "the child died of SIGILL (illegal instruction: a kernel this CPU "
                   "cannot run)"}}}
    assert "--- qwen3_moe failed (SIGILL" in err


def test_remote_update_names_servers_that_cannot_start(load_bench, monkeypatch, tmp_path, capsys):
    import torch

    bench = load_bench("remote_update")
    weights = {"model.embed_tokens.weight": torch.zeros(4, 2, dtype=torch.bfloat16)}

    def spawn(model, *, port, token, log, vllm_args, env):
        with open(log, "w") as out:
            return subprocess.Popen([sys.executable, "-c", DYING_SERVER], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    monkeypatch.setattr(bench, "tiny", SimpleNamespace(build=lambda *a, **kw: None))
    monkeypatch.setattr(bench, "load_weights", lambda model_dir: weights)
    monkeypatch.setattr(bench.launch, "spawn", spawn)
    monkeypatch.setattr(sys, "argv", ["remote_update.py", "--model-dir", str(tmp_path / "m"),
                                      "--server-cpus", "0"])  # 0: this process's CPUs kept
    threads = torch.get_num_threads()
    try:
        rc = bench.main()
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and result["model_bytes"] == 16
    assert "died of SIGILL" in result["skipped"]["servers"]
    assert "skipped servers: " in err
