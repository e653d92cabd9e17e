"""`hotweights demo` (cli.demo, cli.demo_rl) without a vLLM server: the demo's client runs
against a stand-in for the completions route, the rest is called directly."""

import http.server
import json
import queue
import threading
import types

import pytest

from conftest import JSONHandler
from hotweights.cli.main import main
from hotweights.errors import ConfigError


class _Completions(JSONHandler):
    """vLLM's /v1/completions as the demo's client sees it: the n-th request (from 0) gets
    the version `server.version(n)`, or the HTTP status `server.failing[n]`."""

    def do_POST(self):  # noqa: N802 - the stdlib's name
        from hotweights.protocol.version import VERSION_HEADER

        server = self.server
        server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        n = len(server.bodies) - 1
        if n in server.failing:
            self.send_error(server.failing[n])
            return
        version = server.version(n)
        if server.done is not None and n >= server.last_request:
            server.done.set()  # before it answers: the client stops after this one
        self.send_json({"choices": [{"text": f" {n}"}]},  # (version None: no header)
                       **({} if version is None else {VERSION_HEADER: f"{version}@s1"}))


@pytest.fixture
def completions():
    """completions(version=lambda n: n, failing={}, done=None, last_request=8) -> (url,
    server); it sets `done` once it answered request `last_request`."""
    servers = []

    def start(version=lambda n: n, failing=None, done=None, last_request=8):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
        server.version, server.failing, server.bodies = version, failing or {}, []
        server.done, server.last_request = done, last_request
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_the_demo_asks_the_served_model_for_a_greedy_completion_of_its_prompt(completions):
    from hotweights.cli.demo import PROMPT, TOKENS, _complete

    url, server = completions(version=lambda n: 7)
    assert _complete(url, "/tmp/m") == (" 0", 7)
    body, = server.bodies
    assert body == dict(model="/tmp/m", prompt=PROMPT, max_tokens=TOKENS, temperature=0.0)


@pytest.mark.parametrize(("last", "versions", "failed"), [
    (-1, [0, 2, 3, 4, 5, 6, 7, 8], 1), (0, [0], 0), (2, [0, 2], 1), (3, [0, 2, 3], 1)])
def test_the_demo_client_generates_until_it_saw_the_version_asked_for(last, versions, failed,
                                                                       completions):
    from hotweights.cli.demo import _generate

    done, ready, results = threading.Event(), threading.Event(), queue.Queue()
    url, _ = completions(failing={1: 503}, done=done)  # a failed request: counted, not fatal
    _generate(url, "m", ready, done, types.SimpleNamespace(value=last), results)
    got, errors = results.get_nowait()
    assert ready.is_set() and got == versions
    assert len(errors) == failed and all("HTTP Error 503" in e for e in errors), errors


def test_the_demo_client_counts_an_answer_it_cannot_read_and_goes_on(completions):
    from hotweights.cli.demo import _generate

    done, ready, results = threading.Event(), threading.Event(), queue.Queue()
    url, _ = completions(version=lambda n: None if n == 1 else n, done=done, last_request=2)
    _generate(url, "m", ready, done, types.SimpleNamespace(value=-1), results)
    got, errors = results.get_nowait()
    assert got == [0, 2] and len(errors) == 1, errors
    assert errors[0].startswith("HotweightsError: weight version None")


def _client(completions):
    """A started demo client against the stub; the stub's versions stay 0 until the demo
    says which one to wait for, then step by one a request."""
    from hotweights.cli.demo import _Client

    since = []  # the requests since the demo said it

    def version(n):
        if client.last.value >= 0:
            since.append(n)
        return len(since)
    url, _ = completions(version=version)
    client = _Client(url, "m")
    client.start()
    return client


def _waited_for(versions, last):
    """Versions 0, then 1..last once each: the client stopped on the first of `last`."""
    zeros = versions.count(0)
    return zeros >= 1 and versions == [0] * zeros + list(range(1, last + 1))


@pytest.mark.timeout(90)
def test_the_demo_client_stops_once_it_saw_the_trainer_s_last_version(completions):
    client = _client(completions)
    client.stop(5)
    assert _waited_for(client.versions, 5), client.versions
    assert client.errors == [] and not client.proc.is_alive()


@pytest.mark.timeout(90)
def test_the_demo_client_stopped_without_a_version_stops_at_once(completions):
    client = _client(completions)
    client.stop()
    assert client.versions and set(client.versions) == {0} and client.errors == []
    assert not client.proc.is_alive()


@pytest.mark.timeout(90)
def test_a_demo_client_that_ended_on_its_own_still_hands_over_what_it_got(completions):
    client = _client(completions)
    client.done.set()  # (it ends, its results queued, before stop() is called)
    client.proc.join(timeout=60)
    client.stop()
    assert client.versions and set(client.versions) == {0}


@pytest.mark.timeout(90)
def test_stopping_waits_for_the_trainer_s_version_unless_the_block_raised(completions):
    from hotweights.cli.demo import _stopping

    client = _client(completions)
    with _stopping(client, last=lambda: 3):
        pass
    assert _waited_for(client.versions, 3), client.versions
    client = _client(completions)
    with pytest.raises(RuntimeError, match="trainer failed"), _stopping(
            client, last=lambda: pytest.fail("the version asked of a bridge that failed")):
        raise RuntimeError("trainer failed")
    assert not client.proc.is_alive() and set(client.versions) == {0}
    client = _client(completions)
    with pytest.raises(RuntimeError, match="no version"), _stopping(
            client, last=lambda: (_ for _ in ()).throw(RuntimeError("no version"))):
        pass
    assert not client.proc.is_alive() and set(client.versions) == {0}


def test_a_demo_s_directory_holding_all_it_writes_is_reused(tmp_path):
    from hotweights.cli.demo import MARK, workdir_for

    used = tmp_path / "used"
    for name in ("llama", "qwen3", "checkpoint", "grpo"):
        (used / name).mkdir(parents=True)
    for name in (MARK, "server.log", "server.token"):
        (used / name).write_text("")
    assert workdir_for(str(used), "x") == used
    assert workdir_for(str(tmp_path / "a" / "b" / "c"), "x") == tmp_path / "a" / "b" / "c"
    assert (tmp_path / "a" / "b" / "c" / MARK).exists()


def test_a_demo_s_directory_under_a_file_names_what_failed(tmp_path):
    from hotweights.cli.demo import workdir_for

    (tmp_path / "afile").write_text("")
    bad = tmp_path / "afile" / "sub"
    with pytest.raises(ConfigError) as e:
        workdir_for(str(bad), "x")
    assert str(e.value) == f"--workdir {bad}: cannot write there: Not a directory ({bad})"


def test_the_first_checkpoint_is_a_fresh_copy_of_the_served_files(tmp_path):
    from hotweights.cli.demo import first_checkpoint

    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    ckpt = first_checkpoint(model, tmp_path)
    assert ckpt == tmp_path / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors"]
    (ckpt / "model.safetensors").write_bytes(b"trained")  # an earlier demo's: replaced
    (ckpt / "stale.bin").write_bytes(b"")
    assert first_checkpoint(model, tmp_path) == ckpt
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors"]
    assert (ckpt / "model.safetensors").read_bytes() == b"weights"


def test_the_demo_s_median_is_the_middle_value_in_ms():
    from hotweights.cli.demo import _p50_ms

    assert _p50_ms([0.003, 0.004, 0.001, 0.002]) == pytest.approx(3.0)
    assert _p50_ms([0.5]) == pytest.approx(500.0)


def test_demo_of_an_arch_the_server_cannot_serve_is_refused_before_building(tmp_path, capsys,
                                                                           monkeypatch):
    import importlib.util

    from hotweights.vllm_plugin import support

    if importlib.util.find_spec("vllm") is None:  # (refused for that first)
        pytest.skip("no vLLM here")
    monkeypatch.setattr(support, "unservable", lambda arch: f"no {arch} kernels here")
    assert main(["demo", "--arch", "qwen3", "--workdir", str(tmp_path / "w")]) == 1
    assert capsys.readouterr().err.endswith("error: --arch qwen3: no qwen3 kernels here\n")
    assert not (tmp_path / "w").exists()


def test_the_rl_reward_is_the_share_of_visible_characters_that_are_digits():
    from hotweights.cli.demo_rl import _reward, digit_share

    assert digit_share(" 12 ab\n") == 0.5  # spaces are not counted
    assert digit_share("") == digit_share(" \n") == 0.0
    assert _reward(["42", "ab", "4a"], prompts=["p"] * 3) == [1.0, 0.0, 0.5]


def _progress(tmp_path, every, steps=20):
    """The RL demo's progress callback on a recording stand-in for the bridge."""
    from hotweights.cli.console import make_console
    from hotweights.cli.demo_rl import _Progress

    saved = []
    bridge = types.SimpleNamespace(version="3@s1", checkpoint=lambda path: saved.append(
        path) or types.SimpleNamespace(bytes_written=12345))
    return _Progress(make_console(), bridge, tmp_path / "checkpoint", steps, every), saved


def test_the_rl_demo_logs_each_step_s_reward(tmp_path):
    progress, _ = _progress(tmp_path, every=0, steps=20)
    with progress:
        assert progress.bar.live.is_started
        progress.on_log(None, types.SimpleNamespace(global_step=1), None,
                        logs={"loss": 0.5, "reward": 0.25})
        progress.on_log(None, types.SimpleNamespace(global_step=1), None, logs={"loss": 0.7})
    assert not progress.bar.live.is_started
    task, = progress.bar.tasks
    assert progress.rewards == [0.25] and (task.completed, task.total) == (1, 20)
    assert task.description == "GRPO step 1: reward 0.25, version 3@s1"


@pytest.mark.parametrize(("every", "at"), [(5, [5, 10]), (0, []), (1, list(range(1, 11)))])
def test_the_rl_demo_checkpoints_every_k_steps(every, at, tmp_path, capsys):
    progress, saved = _progress(tmp_path, every)
    for step in range(1, 11):
        progress.on_step_end(None, types.SimpleNamespace(global_step=step), None)
    assert saved == [tmp_path / "checkpoint"] * len(at)
    out = capsys.readouterr().out
    assert [f"  step {s}: checkpoint, 12,345 bytes written" for s in at] == out.splitlines()


@pytest.mark.parametrize("module", ["trl", "datasets"])
def test_demo_rl_names_the_module_of_the_trl_extra_that_is_missing(module, capsys,
                                                                   monkeypatch):
    import builtins

    from hotweights.errors import install

    real = builtins.__import__

    def missing(name, *args, **kwargs):
        if name == module:
            raise ModuleNotFoundError(f"No module named '{module}'", name=module)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", missing)
    assert main(["demo", "--rl"]) == 1
    assert capsys.readouterr().err == ("error: hotweights demo --rl needs the trl extra, which "
                                       f"is not installed (no module '{module}'): "
                                       f"{install('trl')}\n")


def test_the_demos_silence_transformers_progress_bars():
    from transformers.utils import logging as hf_logging

    from hotweights.cli.demo import quiet_transformers

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        quiet_transformers()
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
