"""The `hotweights serve` runner: its vLLM environment, token file and child lifetime."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotweights.errors import ConfigError
from hotweights.protocol import shm
from hotweights.server import serve
from hotweights.server.launch import free_port

FAKE = Path(__file__).parent / "fixtures" / "fake_vllm_server.py"
# `hotweights serve` with vLLM replaced by tests/fixtures/fake_vllm_server.py.
RUNNER = """
import sys
from hotweights.cli.main import main
from hotweights.server import serve
serve.command = lambda args, extra: [sys.executable, {fake!r}, str(args.port), {mode!r}]
serve.require_vllm = lambda what: None  # the fake stands in for it
sys.exit(main(sys.argv[1:]))
"""


def test_vllm_plugins_adds_ours_to_what_vllm_would_load(monkeypatch):
    class EP:
        def __init__(self, name):
            self.name = name

    found = {"vllm.general_plugins": ["lora_filesystem_resolver", "hotweights"],
             "vllm.stat_logger_plugins": ["my_logger"], "vllm.endpoint_plugins": ["other"]}
    monkeypatch.setattr(serve, "entry_points",
                        lambda group: [EP(n) for n in found.get(group, [])])
    # unset: everything vLLM loads by default (endpoint plugins are opt-in) plus ours
    assert serve.vllm_plugins(None) == "hotweights,lora_filesystem_resolver,my_logger"
    assert serve.vllm_plugins("a,b") == "a,b,hotweights"
    assert serve.vllm_plugins("hotweights,a") == "hotweights,a"
    assert serve.vllm_plugins("") == "hotweights"


def test_vllm_plugins_keeps_vllms_own_installed_plugins():
    from importlib.metadata import entry_points

    names = serve.vllm_plugins(None).split(",")
    assert "hotweights" in names
    assert {ep.name for ep in entry_points(group="vllm.general_plugins")} <= set(names)


@pytest.mark.parametrize(("environ", "flags", "kv"), [
    ({}, [], str(serve.KV_CACHE_GIB)),
    ({"VLLM_CPU_KVCACHE_SPACE": "12"}, [], "12"),
    ({"VLLM_CPU_KVCACHE_SPACE": ""}, [], str(serve.KV_CACHE_GIB)),  # vLLM: "" is unset
    ({}, ["--gpu-memory-utilization", "0.5"], None),
    ({}, ["--gpu_memory_utilization=0.5"], None),
    ({}, ["--kv-cache-memory-bytes=2G"], None),
])
def test_server_env_sizes_the_kv_cache_unless_told(environ, flags, kv):
    env = serve.server_env(environ, ["--dtype", "bfloat16", *flags], token="t", server_id="s")
    assert env.get("VLLM_CPU_KVCACHE_SPACE") == kv
    assert env["HOTWEIGHTS_ACTIVE"] == "1" and env["HOTWEIGHTS_SERVER_ID"] == "s"
    assert env["HOTWEIGHTS_TOKEN"] == "t" and "hotweights" in env["VLLM_PLUGINS"].split(",")


@pytest.mark.parametrize(("environ", "thp"), [({}, "1"), ({"THP_MEM_ALLOC_ENABLE": "0"}, "0")])
def test_server_env_puts_the_weights_on_huge_pages_unless_told(environ, thp):
    assert serve.server_env(environ, [], token="t", server_id="s")["THP_MEM_ALLOC_ENABLE"] == thp


def test_help_says_the_memory_default(capsys):
    from hotweights.cli.main import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"sets VLLM_CPU_KVCACHE_SPACE={serve.KV_CACHE_GIB} (GiB" in out


@pytest.mark.parametrize(("host", "url"), [
    ("0.0.0.0", "http://127.0.0.1:8000"), ("::", "http://[::1]:8000"),
    ("::1", "http://[::1]:8000"), ("10.1.2.3", "http://10.1.2.3:8000"),
    ("gpu01", "http://gpu01:8000")])
def test_the_serving_line_names_a_url_this_machine_reaches(host, url):
    # what `hotweights status` and `Bridge.connect` take (a loopback URL finds the token
    # file); "http://:::8000" or "http://0.0.0.0:8000" did not
    from hotweights.protocol.urls import server_url

    assert serve._probe_url("http", host, 8000) == url == server_url(url)


def _runner(tmp_path, port, mode, token_file, *flags, **popen):
    (tmp_path / "config.json").write_text("{}")
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER.format(fake=str(FAKE), mode=mode), "serve",
         str(tmp_path), "--port", str(port), "--token-file", str(token_file), *flags],
        env=dict(os.environ, HOTWEIGHTS_TOKEN="ours"), text=True, **popen)


def test_token_file_written_once_answering_and_removed_at_exit(tmp_path):
    port, token_file = free_port(), tmp_path / "server.token"
    proc = _runner(tmp_path, port, "serve", token_file, stdout=subprocess.PIPE)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("hotweights: serving"):
                break
        assert lines[-1] == (f"hotweights: serving {tmp_path} at http://127.0.0.1:{port} "
                             f"(token in {token_file})\n"), lines
        assert token_file.read_text() == "ours\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        rest = proc.stdout.read()  # (through the same file: what it read ahead too)
    # the child's line, copied by another thread of the runner's, may come after its own
    assert "fake vLLM up\n" in lines + rest.splitlines(keepends=True)
    # the probe carried no token: over http, whatever held the port first would read it
    assert not any("was sent a token" in line for line in lines + rest.splitlines())
    assert proc.returncode == 0
    assert not token_file.exists()


@pytest.mark.parametrize(("mode", "host"), [("noisy", "127.0.0.1"), ("serve", "0.0.0.0")])
def test_a_stop_says_vllms_engine_dead_traceback_is_no_crash(tmp_path, mode, host):
    """(and plain http on every interface is said to carry the token in the clear)"""
    proc = _runner(tmp_path, free_port(), mode, tmp_path / "t", "--host", host,
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in proc.stdout:
            if line.startswith("hotweights: serving"):
                break
        proc.send_signal(signal.SIGINT)  # a terminal's Ctrl-C
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0
    note = "the EngineDeadError traceback above is vLLM's, logged as it stops"
    assert (note in err) == (mode == "noisy"), err
    clear = (f"hotweights: --host {host} without TLS: the token crosses the network in the "
             "clear with every request; on a network you do not trust, give --ssl-keyfile")
    assert (clear in err) == (host == "0.0.0.0"), err


def test_a_second_server_on_a_busy_port_leaves_the_first_ones_token(tmp_path):
    port, token_file = free_port(), tmp_path / "server.token"
    first = subprocess.Popen([sys.executable, str(FAKE), str(port), "serve"], text=True,
                             stdout=subprocess.PIPE,
                             env=dict(os.environ, HOTWEIGHTS_SERVER_ID="first"))
    try:
        assert first.stdout.readline() == "fake vLLM up\n"
        token_file.write_text("theirs\n")
        second = _runner(tmp_path, port, "serve", token_file, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
        out = second.communicate(timeout=60)[0]
        assert second.returncode == 1 and "hotweights: serving" not in out
        assert f"error: --port {port}: cannot listen on 127.0.0.1:{port}" in out
        assert token_file.read_text() == "theirs\n"
    finally:
        first.terminate()
        first.wait()


def test_vllm_memory_failure_is_one_line_naming_what_to_change(tmp_path):
    proc = _runner(tmp_path, free_port(), "memory", tmp_path / "t", stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "--gpu-memory-utilization" in last
    assert "VLLM_CPU_KVCACHE_SPACE" in last
    assert "less than desired CPU memory utilization" in err  # vLLM's own words, teed


def test_a_vllm_killed_by_a_signal_exits_as_a_shell_says_it(tmp_path):
    proc = _runner(tmp_path, free_port(), "killed", tmp_path / "t", stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL  # 137, not -9 read as 247


def test_python_dash_m_hotweights_runs():
    out = subprocess.run([sys.executable, "-m", "hotweights", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "serve" in out and "demo" in out


def test_demo_with_an_unknown_arch_is_one_line(capsys):
    from hotweights.cli.main import main

    with pytest.raises(SystemExit) as e:  # a usage error: --help lists the choices
        main(["demo", "--arch", "bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    from hotweights.testing.tiny import ARCHS

    assert err.splitlines()[-1] == ("hotweights demo: error: argument --arch: invalid choice: "
                                    f"'bogus' (choose from {', '.join(map(repr, ARCHS))})")


@pytest.mark.vllm
def test_demo_of_an_arch_this_machine_cannot_serve_is_one_line(capsys, tmp_path):
    from hotweights.cli.main import main
    from hotweights.vllm_plugin.support import unservable

    if not (reason := unservable("qwen3_5")):
        pytest.skip("this machine's vLLM serves Qwen3.5")
    assert main(["demo", "--arch", "qwen3_5", "--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err  # (transformers may warn about torchvision first)
    assert ("\n" + err).endswith(f"\nerror: --arch qwen3_5: {reason}\n")
    assert not any(tmp_path.iterdir())  # refused before building anything


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _descendants(pid: int) -> list[int]:
    out = [pid]
    for child in _children(pid):
        out += _descendants(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.vllm
@pytest.mark.timeout(480)  # a server start (~75 s, ~150 s loaded) and its shutdown
def test_killed_runner_takes_its_vllm_server_down(tiny_model, tmp_path):
    """SIGKILL `hotweights serve`: its vLLM server stops (and removes its shared weights)
    instead of living on, orphaned. Started with no memory setting at all: the runner's
    own KV cache default."""
    import json
    import urllib.request

    port, token_file, log = free_port(), tmp_path / "server.token", tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(HOTWEIGHTS_TOKEN="ours", HF_HUB_OFFLINE="1")
    with open(log, "w") as out:
        runner = subprocess.Popen(
            [sys.executable, "-m", "hotweights", "serve", str(tiny_model("llama")), "--port",
             str(port), "--token-file", str(token_file), "--max-model-len", "256",
             "--enforce-eager"], stdout=out, stderr=subprocess.STDOUT, env=env)
    vllm = None
    try:
        deadline = time.monotonic() + 200
        while not token_file.exists():  # written once the server answers
            assert runner.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        (vllm,) = _children(runner.pid)
        family = _descendants(vllm)  # the API server's engine core, workers
        req = urllib.request.Request(f"http://127.0.0.1:{port}/hotweights/status",
                                     headers={"Authorization": "Bearer ours"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            server_id = json.loads(resp.read())["server_id"]
        assert list(Path("/dev/shm").glob(f"hotweights-{server_id}-*"))

        runner.kill()
        runner.wait()
        deadline = time.monotonic() + 120
        shared = Path("/dev/shm").glob
        while time.monotonic() < deadline and any(map(_alive, family)):
            time.sleep(0.5)
        assert not [pid for pid in family if _alive(pid)], "vLLM outlived hotweights serve"
        assert not token_file.exists()  # the server removed it: no token left for the port
        # Its shared weights are gone, or at least no live process holds them: a process
        # killed before its exit handlers leaves the file to the next start's sweep.
        left = {str(p) for p in shared(f"hotweights-{server_id}-*")}
        assert left <= set(shm.sweep_stale())
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        if vllm is not None and _alive(vllm):
            os.killpg(vllm, signal.SIGKILL)  # its own session: processes this test started


def test_model_paths_are_expanded_for_vllm_and_the_recovery(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert serve.check_model("~/m") == str(tmp_path / "m")  # vLLM got "~/m" as is
    assert serve.check_model("org/name") == "org/name"  # a hub id: vLLM's to find
    (tmp_path / "w").mkdir()  # weights only: the config given apart, as vLLM takes it
    with pytest.raises(ConfigError, match=r"MODEL ~/w: no config\.json in it"):
        serve.check_model("~/w")
    assert serve.check_model("~/w", ["--hf-config-path", "./cfg"]) == str(tmp_path / "w")


def test_the_runner_acts_on_a_signal_the_kernel_gave_another_thread():
    """The kernel may give a process's SIGTERM to any thread that does not block it (the
    runner's tees); Python runs the handler in the main thread once that one runs Python:
    a wait blocked in the kernel would never see it (seen once: a runner that did not
    forward the SIGTERM of a test, and waited forever)."""
    import threading

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = threading.Thread(target=lambda: (time.sleep(0.3),
                                             os.kill(os.getpid(), signal.SIGTERM)))
    old = signal.signal(signal.SIGTERM, lambda *_: child.kill())  # as `forward` sends it on
    other.start()  # (before the main thread blocks it: the other one takes the signal)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        done = threading.Timer(20, child.kill)  # a wait that never sees the handler: ends
        done.start()
        started = time.monotonic()
        assert serve._wait(child) == -signal.SIGKILL
        assert time.monotonic() - started < 10
    finally:
        done.cancel()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        signal.signal(signal.SIGTERM, old)
        other.join()
        child.kill()
        child.wait()
