"""`hotweights serve` + `Bridge`: a real vLLM CPU API server, trained in place over HTTP."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from hotweights.bridge.client import Bridge
from hotweights.errors import LayoutError, ServerError
from hotweights.protocol.tokens import token_path
from hotweights.protocol.version import parse_version
from hotweights.server import launch

pytestmark = pytest.mark.vllm

TOKEN = "test-token"
PROMPT = [1, 5, 9, 20, 33, 7, 101, 250, 64, 3]
TOL = 0.05  # bf16: vLLM's CPU kernels round differently from HF's eager ops
LOAD_TOL = 0.2  # the same over 6 generated tokens in batches of up to 8 requests


def _http(url, route, *, token=TOKEN, body=None, method=None):
    req = urllib.request.Request(
        url + route, method=method or ("GET" if body is None else "POST"),
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")


class Server:
    def __init__(self, model_dir: Path, tmp: Path, *extra: str, port: int | None = None,
                 wait: bool = True, cafile: str | None = None, cores: str | None = None):
        """`cores`: the CPU cores its worker is bound to (``VLLM_CPU_OMP_THREADS_BIND``;
        vLLM's default binds every server's to the same ones)."""
        self.port = port or launch.free_port()
        self.cafile = cafile  # https: extra has --ssl-keyfile/--ssl-certfile
        self.url = f"{'https' if cafile else 'http'}://127.0.0.1:{self.port}"
        self.model_dir = str(model_dir)
        self.log = tmp / "server.log"
        self.proc = launch.spawn(model_dir, port=self.port, token=TOKEN, log=self.log,
                                 vllm_args=("--max-model-len", "256", "--enforce-eager",
                                            "--max-num-seqs", "8", *extra),
                                 env=cores and {"VLLM_CPU_OMP_THREADS_BIND": cores})
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until it answers; stopped if it does not (starting several at once: spawn
        them all with wait=False from this thread, the servers' parent, then wait)."""
        try:
            # 400 s: up to three start at once on two cores (one alone: 20-150 s)
            launch.wait_ready(self.proc, self.url, log=self.log, cafile=self.cafile,
                              timeout=400)
        except BaseException:
            launch.stop(self.proc)
            raise

    def logprobs(self) -> tuple[dict[int, float], str]:
        status, headers, out = _http(self.url, "/v1/completions", token=None, body=dict(
            model=self.model_dir, prompt=PROMPT, max_tokens=1, temperature=0.0, logprobs=5,
            return_tokens_as_token_ids=True))
        assert status == 200, out
        top = out["choices"][0]["logprobs"]["top_logprobs"][0]
        return ({int(t.removeprefix("token_id:")): lp for t, lp in top.items()},
                headers["x-hotweights-version"])

    def stop(self) -> None:
        launch.stop(self.proc)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = Server(tiny_model("llama"), tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


def _view_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1].float(), -1)


def _sign_step(model, lr: float) -> None:
    """A sign-SGD step on the views: in place, in the server's memory."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad.sign())


def test_routes_refuse_a_missing_or_wrong_token(server):
    for token in (None, "wrong"):
        for route, body in [("/hotweights/manifest", None), ("/hotweights/status", None),
                            ("/hotweights/begin", {}), ("/hotweights/commit", {})]:
            status, _, _ = _http(server.url, route, token=token, body=body)
            assert status == 401, (route, token)
    assert _http(server.url, "/hotweights/status")[2]["paused"] is False


@pytest.mark.parametrize("lease_s", ["inf", -1, "soon"])
def test_bad_lease_is_refused_before_pausing(server, lease_s):
    server_id = _http(server.url, "/hotweights/status")[2]["server_id"]
    status, _, out = _http(server.url, "/hotweights/begin",
                           body=dict(holder="t", server_id=server_id, lease_s=lease_s))
    assert status == 400 and "field 'lease_s' must be" in out["error"]
    assert _http(server.url, "/hotweights/status")[2]["paused"] is False


def test_weights_live_in_private_shared_memory(server):
    bridge = Bridge.connect(server.url, token=TOKEN)
    path = bridge.manifests[0].path
    assert path.startswith("/dev/shm/hotweights-") and os.stat(path).st_mode & 0o777 == 0o600


def test_bridge_update_is_served_with_a_new_version(server):
    bridge = Bridge.connect(server.url, token=TOKEN)
    model = bridge.model(trainable=r"layers\.0\.")
    before, version = server.logprobs()
    assert version == bridge.version
    ids = torch.tensor([PROMPT])
    model(ids, labels=ids).loss.backward()
    with bridge.update(mode="wait"):
        _sign_step(model, 0.01)
    after, served_version = server.logprobs()
    assert served_version == bridge.version
    assert parse_version(served_version) == (parse_version(version)[0] + 1, bridge.server_id)
    assert after != before
    ours = _view_logprobs(model)
    for token, logprob in after.items():
        assert abs(ours[token].item() - logprob) < TOL, token
    status = bridge.status()
    assert status["version"] == bridge.version and status["state"] == "idle"
    assert status["dirty"] is False and status["paused"] is False and status["updates"] >= 1


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_5"])
def any_server(request, server, tiny_model, tmp_path_factory, servable):
    """The llama server above, or a server of another architecture (one per module)."""
    if request.param == "llama":
        yield server
        return
    servable(request.param)
    srv = Server(tiny_model(request.param), tmp_path_factory.mktemp(request.param))
    yield srv
    srv.stop()


def _greedy(server, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    status, _, out = _http(server.url, "/v1/completions", token=None, body=dict(
        model=server.model_dir, prompt=prompt, max_tokens=n, temperature=0.0, logprobs=1,
        return_tokens_as_token_ids=True))
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], lp["token_logprobs"]


@pytest.mark.timeout(480)  # its qwen3 case starts a server (~75 s, ~150 s loaded)
def test_k_training_steps_are_served_exactly(any_server):
    bridge = Bridge.connect(any_server.url, token=TOKEN)
    model = bridge.model(trainable=True)
    prompts = [PROMPT, PROMPT[3:8]]
    before = [_greedy(any_server, p, 8) for p in prompts]
    ids = torch.tensor([PROMPT])
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        with bridge.update(mode="wait"):
            _sign_step(model, 0.005)
    after = [_greedy(any_server, p, 8) for p in prompts]
    assert after != before  # the steps changed what is served
    with torch.no_grad():
        for prompt, (tokens, logprobs) in zip(prompts, after, strict=True):
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            ours = torch.log_softmax(logits.float(), -1)
            served = torch.tensor(tokens)
            # bf16: vLLM's CPU kernels round differently from HF's eager ops; over 8 greedy
            # tokens logprobs agree within LOAD_TOL, and each served token is the view
            # model's argmax unless the two best are closer than that.
            assert (ours.gather(1, served[:, None])[:, 0] - torch.tensor(logprobs)).abs().max() \
                < LOAD_TOL
            best = ours.max(-1).values
            assert ((best - ours.gather(1, served[:, None])[:, 0]) < LOAD_TOL).all()
    assert any_server.logprobs()[1] == bridge.version


def test_bridge_checkpoint_writes_only_what_changed(server, tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file

    import hotweights.checkpoint

    ckpt = tmp_path / "ckpt"
    shutil.copytree(server.model_dir, ckpt)
    bridge = Bridge.connect(server.url, token=TOKEN)
    model = bridge.model()
    bridge.checkpoint(ckpt)  # whatever earlier tests trained; sidecars written
    name = "model.layers.1.mlp.down_proj.weight"
    row = model.get_parameter(name)[2]
    old = row.detach().clone()
    with bridge.update():
        with torch.no_grad():
            row.add_(0.5)
    try:
        # Named: only the stepped tensor is hashed, though every parameter is a view into
        # the server's shared tensors (only bytes it shares are hashed with it).
        result = bridge.checkpoint(ckpt, changed=[name], mode="journal")  # pages only
        size = model.get_parameter(name).numel() * 2
        assert result.bytes_hashed == size and result.bytes_trusted > 0
        assert result.version == bridge.version and result.tensors_changed == 1
        assert row.numel() * 2 <= result.bytes_written <= 64 << 10
        disk = load_file(ckpt / "model.safetensors")
        for n, t in model.state_dict().items():
            assert torch.equal(disk.get(n, disk["model.embed_tokens.weight"]), t), n
        # Another process: the lease holds trainers off while it reads, then the server
        # resumes at the same version, clean.
        other = Bridge.connect(server.url, token=TOKEN)
        again = other.checkpoint(tmp_path / "first", exclusive=True)
        assert again.first_save and again.version == bridge.version
        status = bridge.status()
        assert status["state"] == "idle" and status["version"] == bridge.version
        assert status["dirty"] is False
        # While another holds the lease, the trainer's step waits for it, then goes on.
        other._begin(mode="keep", lease_s=30)
        threading.Timer(1.0, other._abort, kwargs=dict(dirty=False)).start()
        with bridge.update():
            pass
        assert bridge.status()["version"] == bridge.version != again.version
        # Another writer's sync, or what a crashed one left, is waited for and finished
        # before the server is paused, not while it is.
        calls, recover, post = [], hotweights.checkpoint.recover, Bridge._post
        monkeypatch.setattr(hotweights.checkpoint, "recover", lambda d: calls.append(
            "recover") or recover(d))
        monkeypatch.setattr(Bridge, "_post", lambda self, route, **kw: calls.append(
            route) or post(self, route, **kw))
        other.checkpoint(ckpt, exclusive=True)
        monkeypatch.undo()
        assert calls.index("recover") < calls.index("/hotweights/begin")
    finally:
        with bridge.update():
            with torch.no_grad():
                row.copy_(old)


def test_sync_and_diagnose_commands_against_the_server(server, capsys, tmp_path):
    import shutil

    from hotweights.cli.main import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(server.model_dir, ckpt)
    args = ["--model-dir", str(ckpt), "--server", server.url, "--token", TOKEN]
    assert main(["sync", *args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    version = _http(server.url, "/hotweights/status")[2]["version"]
    assert result["version"] == version and not result["missing_on_disk"]
    assert main(["sync", *args, "--json", "--changed", "model.layers.1.*"]) == 0
    named = json.loads(capsys.readouterr().out)
    layer = sum(t.nbytes for n, t in Bridge.connect(server.url, token=TOKEN).model()
                .state_dict().items() if n.startswith("model.layers.1."))
    assert named["bytes_hashed"] == layer and named["bytes_trusted"] > 0
    assert named["bytes_written"] == 0 and named["bytes_compared"] == 0
    assert main(["diagnose", *args]) == 0  # the sidecars now describe the live weights
    out = capsys.readouterr().out
    assert "matched" in out and "fresh" in out
    with pytest.raises(SystemExit) as usage:  # the server's version is the one recorded
        main(["sync", *args, "--version", "v9"])
    assert usage.value.code == 2 and "--weight-version goes with --from" in capsys.readouterr().err
    assert main(["sync", *args[:2], "--server", server.url, "--token", "wrong"]) == 1
    assert "401" in capsys.readouterr().err
    status = _http(server.url, "/hotweights/status")[2]
    assert status["state"] == "idle" and status["version"] == version


def test_status_command_and_token_file(server, capsys, monkeypatch, tmp_path):
    from hotweights.cli.main import main

    monkeypatch.delenv("HOTWEIGHTS_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no token file for this port yet
    assert main(["status", server.url]) == 1
    assert "no token" in capsys.readouterr().err
    token_file = token_path(server.port)
    token_file.parent.mkdir(parents=True)
    token_file.write_text(TOKEN + "\n")  # what `hotweights serve --port` writes
    assert main(["status", server.url]) == 0
    out = capsys.readouterr().out
    assert "weight version" in out and "serving" in out
    assert main(["status", server.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["paused"] is False
    assert main(["status", server.url, "--token", "wrong"]) == 1
    assert "HTTP 401" in capsys.readouterr().err


@pytest.mark.timeout(480)  # starts a server of its own (~75 s, ~150 s loaded)
def test_tls_end_to_end(tiny_model, tmp_path, tls, capsys, monkeypatch):
    """serve --ssl-keyfile/--ssl-certfile: the runner says https, clients check the CA."""
    from hotweights.cli.main import main

    cert, key = tls.leaf("localhost", "127.0.0.1")
    srv = Server(tiny_model("llama"), tmp_path, "--ssl-keyfile", key, "--ssl-certfile", cert,
                 cafile=tls.ca)
    try:
        deadline = time.monotonic() + 60  # the line comes once the runner's probe answers
        while f"at {srv.url} (token in " not in srv.log.read_text():
            assert time.monotonic() < deadline, srv.log.read_text()[-2000:]
            time.sleep(0.2)
        monkeypatch.setenv("HOTWEIGHTS_TOKEN", TOKEN)
        monkeypatch.delenv("HOTWEIGHTS_CA_FILE", raising=False)
        assert main(["status", srv.url, "--cafile", tls.ca]) == 0
        assert "weight version" in capsys.readouterr().out
        assert main(["status", srv.url]) == 1
        assert f"{srv.url}: TLS certificate not trusted" in capsys.readouterr().err
        assert main(["status", srv.url.replace("https:", "http:")]) == 1
        assert "use an https URL" in capsys.readouterr().err
        monkeypatch.setenv("HOTWEIGHTS_CA_FILE", tls.ca)
        assert main(["status", srv.url, "--json"]) == 0
        version = json.loads(capsys.readouterr().out)["version"]
        bridge = Bridge.connect(srv.url, cafile=tls.ca)
        with bridge.update():  # the update's POSTs over https too
            pass
        assert bridge.status()["version"] != version
    finally:
        srv.stop()


def test_metrics_expose_version_and_update_latency(server):
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    version = _http(server.url, "/hotweights/status")[2]["version"]
    assert f"hotweights_weight_version {float(parse_version(version)[0])}" in text
    assert "hotweights_update_seconds_count" in text and "hotweights_commit_seconds" in text


def test_a_second_trainer_gets_409_naming_the_holder_and_its_update_waits(server):
    first, second = Bridge.connect(server.url, token=TOKEN), Bridge.connect(server.url, token=TOKEN)
    second.holder = "other-trainer"
    done = threading.Event()

    def step() -> None:
        with second.update():
            done.set()
    with first.update():
        with pytest.raises(ServerError, match=rf"POST /hotweights/begin: HTTP 409: .*"
                           rf"held by {first.holder}") as e:
            second._post("/hotweights/begin", mode="wait", lease_s=10)
        assert e.value.detail["holder"] == first.holder
        waiting = threading.Thread(target=step)
        waiting.start()
        assert not done.wait(1.0)
    waiting.join(60)
    assert done.is_set() and first.status()["holder"] is None


def test_exception_in_update_aborts_resumes_and_serves_a_new_dirty_version(server, tmp_path,
                                                                          caplog):
    bridge = Bridge.connect(server.url, token=TOKEN)
    n, _ = parse_version(bridge.version)
    with pytest.raises(RuntimeError, match="boom"):
        with bridge.update():
            raise RuntimeError("boom")
    status = bridge.status()
    assert status["dirty"] is True and status["paused"] is False
    dirty = f"{n + 1}@{bridge.server_id}"  # the body may have written half an update
    assert status["version"] == dirty and dirty in status["dirty_versions"]
    assert server.logprobs()[1] == dirty  # serving again, under the dirty version
    for exclusive in (False, True):  # a checkpoint of them says so
        result = bridge.checkpoint(tmp_path / "ck", exclusive=exclusive)
        assert result.version == dirty and result.dirty == status["dirty_reason"]
    assert f"the server serves dirty version {dirty}" in caplog.text
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        # the first save: a directory that serves (the served model's files beside it)
        assert (tmp_path / "ck" / name).read_bytes() == Path(server.model_dir, name).read_bytes()
    with bridge.update():  # a clean commit vouches for the weights again
        pass
    assert bridge.status()["dirty"] is False
    assert bridge.checkpoint(tmp_path / "ck").dirty is None


def test_a_step_longer_than_the_lease_is_kept_alive_by_renewal(server):
    bridge = Bridge.connect(server.url, token=TOKEN)
    with bridge.update(lease_s=3.0):
        time.sleep(5)  # the lease is renewed every 1 s in the background
    status = bridge.status()
    assert status["dirty"] is False and status["version"] == bridge.version


def test_killed_trainer_lease_expires_and_server_resumes(server, tmp_path):
    code = (
        "import os, signal; from hotweights.bridge.client import Bridge\n"
        f"b = Bridge.connect({server.url!r}, token={TOKEN!r})\n"
        "b.holder = 'doomed'\n"
        "b._post('/hotweights/begin', mode='wait', lease_s=10)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert _http(server.url, "/hotweights/status")[2]["holder"] == "doomed"
    deadline = time.time() + 60
    while time.time() < deadline:
        status = _http(server.url, "/hotweights/status")[2]
        if status["holder"] is None:
            break
        time.sleep(0.5)
    assert status["holder"] is None and status["paused"] is False and status["dirty"] is True
    assert status["state"] == "expired" and status["expired"]["holder"] == "doomed"
    assert server.logprobs()[1] == status["version"] == status["expired"]["version"]


def test_a_killed_holder_s_lease_ends_once_its_process_is_gone(server):
    # no wait for the lease (600 s): the server watches the holder's process; a reader's
    # (an exclusive checkpoint's) ends clean, a trainer's dirty
    before = _http(server.url, "/hotweights/status")[2]
    for holder, body in (("reader", "mode='keep', read=True"), ("writer", "mode='wait'")):
        code = ("import os, signal; from hotweights.bridge.client import Bridge\n"
                f"b = Bridge.connect({server.url!r}, token={TOKEN!r})\n"
                f"b.holder = {holder!r}\n"
                f"b._begin({body}, lease_s=600)\n"
                "os.kill(os.getpid(), signal.SIGKILL)\n")
        began = time.time()
        assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == \
            -signal.SIGKILL
        while (status := _http(server.url, "/hotweights/status")[2])["holder"] is not None:
            assert time.time() < began + 60, status
            time.sleep(0.2)
        assert status["paused"] is False and status["expired"]["holder"] == holder
        assert f"the process of {holder} (pid " in status["expired"]["why"]
        if holder == "reader":
            assert (status["version"], status["dirty"]) == (before["version"], before["dirty"])
    assert status["dirty"] is True and status["version"] != before["version"]
    assert server.logprobs()[1] == status["version"]
    log = server.log.read_text()  # said in the server's log (vLLM's format), not lost
    assert re.search(r"WARNING .*\] hotweights: the process of reader \(pid \d+\) exited; "
                     r"resuming \(it only read the weights\)", log), log[-3000:]
    assert re.search(r"the process of writer \(pid \d+\) exited; resuming, weights marked "
                     r"dirty", log)


class _StreamingClient(threading.Thread):
    """Streams greedy completions in a loop; records what each response was served with."""

    def __init__(self, url: str, model: str, prompt: list[int]):
        super().__init__(daemon=True)
        self.url, self.model, self.prompt = url, model, prompt
        self.stop = threading.Event()
        self.responses: list[dict] = []
        self.errors: list[str] = []

    def run(self) -> None:
        body = json.dumps(dict(model=self.model, prompt=self.prompt, max_tokens=6,
                               temperature=0.0, logprobs=1, stream=True,
                               return_tokens_as_token_ids=True)).encode()
        while not self.stop.is_set():
            req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    version = parse_version(resp.headers["x-hotweights-version"])[0]
                    tokens, logprobs, finish = [], [], None
                    for line in resp:
                        line = line.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        choice = json.loads(line[6:])["choices"][0]
                        chosen = choice["logprobs"] or {"tokens": [], "token_logprobs": []}
                        for tok, lp in zip(chosen["tokens"], chosen["token_logprobs"],
                                           strict=True):
                            tokens.append(int(tok.removeprefix("token_id:")))
                            logprobs.append(lp)
                        finish = choice.get("finish_reason") or finish
                self.responses.append(dict(version=version, tokens=tokens,
                                           logprobs=logprobs, finish=finish))
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.errors.append(repr(e))


@contextlib.contextmanager
def streaming(server: Server, n: int):
    """`n` clients streaming from `server` (prompts of 3.. tokens) while the body runs."""
    clients = [_StreamingClient(server.url, server.model_dir, PROMPT[: 3 + i])
               for i in range(n)]
    for client in clients:
        client.start()
    try:
        yield clients
    finally:
        for client in clients:
            client.stop.set()
        for client in clients:
            client.join(timeout=120)


def assert_streams_ended_well(clients, mode: str) -> list[dict]:
    """No client saw an error, the responses span versions, each ended as `mode` lets it;
    the responses."""
    responses = [r for c in clients for r in c.responses]
    assert [e for c in clients for e in c.errors] == []
    assert len({r["version"] for r in responses}) > 1, "no update happened under load"
    finished = {"length", "stop"} | ({"abort"} if mode == "abort" else set())
    assert {r["finish"] for r in responses} <= finished  # aborted streams say so
    return responses


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_updates_under_load_are_consistent(server, mode):
    bridge = Bridge.connect(server.url, token=TOKEN)
    model = bridge.model(trainable=False)
    norm = model.get_parameter("model.norm.weight")
    base = norm.detach().clone()
    snapshots = {parse_version(bridge.version)[0]: base}
    with streaming(server, 8) as clients:
        for _ in range(20):
            time.sleep(0.05)
            with bridge.update(mode=mode):
                with torch.no_grad():  # scale the logits: neighbouring versions differ 4x
                    norm.copy_(base * (2.0 if parse_version(bridge.version)[0] % 2 == 0
                                       else 0.5))
            snapshots[parse_version(bridge.version)[0]] = norm.detach().clone()
    responses = assert_streams_ended_well(clients, mode)
    if mode == "abort":
        assert any(r["finish"] == "abort" for r in responses)
    if mode == "keep":  # frozen requests resume on the new weights (no single version)
        return
    assert_served_as_claimed(model, norm, clients, snapshots)
    with torch.no_grad():
        norm.copy_(snapshots[parse_version(bridge.version)[0]])


def assert_served_as_claimed(model, param, clients, snapshots: dict) -> None:
    """Each streamed response's tokens fit the weights of the version its header names (with
    `param` set to `snapshots[N]`) within LOAD_TOL, and no neighbouring version fits better.
    The clients must be stopped (`model` may be the server's own weights)."""

    def error(response: dict, prompt: list[int], version: int) -> float:
        param.copy_(snapshots[version])
        ids = torch.tensor([prompt + response["tokens"]])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        ours = torch.log_softmax(logits, -1).gather(
            1, torch.tensor(response["tokens"])[:, None])[:, 0]
        return (ours - torch.tensor(response["logprobs"])).abs().max().item()

    with torch.no_grad():
        for client in clients:
            for response in client.responses:
                if not response["tokens"]:  # aborted before its first token
                    continue
                version = response["version"]
                claimed = error(response, client.prompt, version)
                # bf16 batched kernels vs HF eager ops drift over a few generated tokens
                assert claimed < LOAD_TOL, (version, claimed)
                for other in (version - 1, version + 1):  # and no neighbour fits better
                    if other in snapshots:
                        assert claimed < error(response, client.prompt, other), (version, other)


@pytest.mark.timeout(480)  # starts a server of its own (~75 s, ~150 s loaded)
def test_custom_remote_code_model_through_the_transformers_backend(custom_model, tmp_path):
    custom = Server(custom_model, tmp_path, "--model-impl", "transformers",
                    "--trust-remote-code")
    try:
        bridge = Bridge.connect(custom.url, token=TOKEN)
        with pytest.raises(LayoutError, match=r"(?s)tiny_custom: cannot read .*trust_remote_code"):
            bridge.model()  # the model's own code runs only when the trainer says so
        model = bridge.model(trainable=r"layers\.1\.", trust_remote_code=True)
        assert type(model).__name__ == "TinyCustomForCausalLM"
        assert bridge.report.missing == () and bridge.report.unused == ()
        before, _ = custom.logprobs()
        ids = torch.tensor([PROMPT])
        model(ids, labels=ids).loss.backward()
        with bridge.update():
            _sign_step(model, 0.01)
        after, version = custom.logprobs()
        assert version == f"1@{bridge.server_id}" and after != before
        ours = _view_logprobs(model)
        for token, logprob in after.items():
            assert abs(ours[token].item() - logprob) < TOL, token
    finally:
        custom.stop()


def test_the_trainer_maps_only_the_servers_own_file(server, tmp_path):
    import dataclasses

    from hotweights.errors import ManifestError
    from hotweights.protocol import shm

    manifest = Bridge.connect(server.url, token=TOKEN).manifests[0]
    link = Path(manifest.path).with_name(f"hotweights-{manifest.server_id}-999999999")
    link.symlink_to(manifest.path)
    try:
        for path, why in [(str(link), "link"), ("/etc/passwd", "not a shared-weights file"),
                          (str(tmp_path / Path(manifest.path).name), "not a shared-weights")]:
            with pytest.raises(ManifestError, match=why):
                shm.attach(dataclasses.replace(manifest, path=path))
    finally:
        link.unlink()
    assert manifest.path not in shm.sweep_stale()  # the server holds its lock
    assert Path(manifest.path).exists()


@pytest.mark.timeout(480)  # restarts the server (~75 s, ~150 s loaded)
def test_a_trainer_of_a_restarted_server_is_told_to_reconnect(server, tmp_path):
    bridge = Bridge.connect(server.url, token=TOKEN)
    path = bridge.manifests[0].path
    server.stop()
    assert not Path(path).exists()  # stopping removes the shared weights
    again = Server(Path(server.model_dir), tmp_path, port=server.port)  # same port, token
    try:
        with pytest.raises(ServerError, match=r"HTTP 409: .*restarted.*reconnect"):
            with bridge.update():  # its writes would go to the dead file: refused
                pytest.fail("the body must not run")
        fresh = Bridge.connect(again.url, token=TOKEN)
        assert fresh.server_id != bridge.server_id and fresh.version == f"0@{fresh.server_id}"
        assert fresh.version != bridge.version  # versions never repeat across restarts
        assert again.logprobs()[1] == fresh.version
        assert fresh.status()["state"] == "idle"
    finally:
        again.stop()
