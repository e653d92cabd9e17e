"""Bridge.update's client side: what it sends when begin fails, and the lease renewal."""

import contextlib
import threading
import time
import types

import pytest
import torch

from hotweights.bridge import client as bridge_module
from hotweights.bridge.client import Bridge
from hotweights.errors import CheckpointError, LayoutError, RemoteError, ServerError
from hotweights.protocol import process


class Recorder:
    """Stands in for the HTTP call: records (route, body, timeout); fails where told."""

    def __init__(self, fail: dict):
        self.calls: list[tuple[str, dict, float]] = []
        self.fail = fail

    def __call__(self, url, method, route, token, body=None, *, timeout=120, cafile=None):
        self.calls.append((route, body, timeout))
        if route in self.fail:
            raise self.fail[route]
        return {"version": "1@s"}


_SYNCED = types.SimpleNamespace(first_save=False)  # a stand-in sync's result


def _bridge() -> Bridge:
    b = Bridge.__new__(Bridge)  # no server: only the transaction's client side
    b.url, b._token, b.server_id, b.holder, b.version = "http://x", "t", "s", "h", "0@s"
    b.tensors, b.remote, b.cafile, b._leased = {}, None, None, threading.Lock()
    b._model, b.report, b.closed, b._versions = None, None, False, {}
    b._seq, b._numbered = 0, True
    return b


def _with_remote(monkeypatch, remote, rec=None, n: int = 0) -> Bridge:
    """A bridge with a model built and `remote` servers beside its own, which answers every
    request (`rec` records them) with version number `n`."""
    rec = rec or Recorder({})
    monkeypatch.setattr(bridge_module, "request", lambda *a, **k: {**rec(*a, **k), "n": n})
    b = _bridge()
    b.tensors, b.remote, b._model = {"w": torch.zeros(1)}, remote, object()
    return b


def _checkpointing(monkeypatch, rec=None, version: str = "0@s") -> Bridge:
    """A bridge with a model built, for `checkpoint()`: its server answers every request
    (`rec` records them) and serves `version`."""
    rec = rec or Recorder({})
    monkeypatch.setattr(bridge_module, "request", lambda *a, **k: {**rec(*a, **k), "n": 0})
    b = _bridge()
    b._model = types.SimpleNamespace(config=None)
    monkeypatch.setattr(b, "status", lambda: {"version": version})
    return b


@pytest.mark.parametrize("error", [ServerError("POST /hotweights/begin: no answer"),
                                   KeyboardInterrupt()])
def test_a_failed_or_interrupted_begin_is_aborted_clean(monkeypatch, error):
    rec = Recorder({"/hotweights/begin": error})
    monkeypatch.setattr(bridge_module, "request", rec)
    with pytest.raises(type(error)):
        with _bridge().update(lease_s=10):
            pytest.fail("the body must not run")
    (begin, body, timeout), (abort, abort_body, _) = rec.calls
    assert begin == "/hotweights/begin" and timeout == 40  # bounded by the lease, not 600 s
    assert body == dict(holder="h", server_id="s", mode="wait", lease_s=10,
                        process=process.identity(), seq=1)  # the server watches this process
    assert abort == "/hotweights/abort" and abort_body["dirty"] is False


def test_a_begin_sent_late_in_the_wait_for_the_lease_still_gets_its_drain_s_time(monkeypatch,
                                                                                caplog):
    # another holder kept the lease most of the wait: the begin that then gets it may
    # drain for lease_s on the server, and must not be given up (and aborted) after 1 s
    class Held(Recorder):
        def __call__(self, url, method, route, token, body=None, *, timeout=120, cafile=None):
            if route == "/hotweights/begin" and len(self.calls) < 3:
                self.calls.append((route, body, timeout))
                raise ServerError("held", status=409, detail={"holder": "other"})
            return super().__call__(url, method, route, token, body, timeout=timeout)

    rec = Held({})
    monkeypatch.setattr(bridge_module, "request", rec)
    now, waits = [0.0], iter([39.0, 0.5, 0.4])  # the clock after each refusal's sleep
    monkeypatch.setattr(bridge_module.time, "sleep", lambda s: now.append(now.pop() +
                                                                          next(waits)))
    monkeypatch.setattr(bridge_module.time, "monotonic", lambda: now[0])
    _bridge()._begin(timeout=40, mode="wait", lease_s=10)
    assert [c[2] for c in rec.calls] == [40, 20, 20, 20]  # lease_s + 10, not what was left
    assert caplog.text.count("still waiting for the update lease other holds") == 1


def test_the_body_runs_under_background_renewals_and_commits(monkeypatch):
    rec = Recorder({})
    monkeypatch.setattr(bridge_module, "request", rec)
    b = _bridge()
    b.tensors = {"w": torch.zeros(1)}
    with b.update(lease_s=0.3):
        deadline = time.monotonic() + 30  # renewed every 0.1 s (not a fixed sleep: loaded CI)
        while [c[0] for c in rec.calls].count("/hotweights/renew") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    routes = [c[0] for c in rec.calls]
    assert routes[0] == "/hotweights/begin" and routes[-1] == "/hotweights/commit"
    assert routes.count("/hotweights/renew") >= 2 and b.version == "1@s"
    assert all(c[1]["server_id"] == "s" for c in rec.calls)
    # a renewal stuck on a dead connection must not outlast the lease it renews
    assert {c[2] for c in rec.calls if c[0] == "/hotweights/renew"} == {1.0}
    b.renew(lease_s=30)
    assert rec.calls[-1][2] == 10


def test_this_server_s_lease_is_renewed_while_the_remotes_stage(monkeypatch):
    # require="all": this server stays paused until every remote staged the update
    class Remote:
        require = "all"

        def prepare(self, model, mode, lease_s, pause_ahead):
            deadline = time.monotonic() + 30  # a long encode and send, beyond the lease
            start = [c[0] for c in rec.calls].count("/hotweights/renew")
            while [c[0] for c in rec.calls].count("/hotweights/renew") < start + 2:
                assert time.monotonic() < deadline  # (polled, not a fixed sleep: loaded CI)
                time.sleep(0.05)
            return types.SimpleNamespace(floor=0)

        def commit(self, pending, n):
            self.committed = n

    rec = Recorder({})
    b = _with_remote(monkeypatch, Remote(), rec)
    with b.update(lease_s=0.3):
        pass
    routes = [c[0] for c in rec.calls]
    assert routes[0] == "/hotweights/begin" and routes[-1] == "/hotweights/commit"
    assert routes.count("/hotweights/renew") >= 2 and b.remote.committed == 1


def test_an_exception_in_the_body_aborts_dirty_and_is_reraised(monkeypatch):
    rec = Recorder({"/hotweights/abort": ServerError("gone")})  # abort failing is logged
    monkeypatch.setattr(bridge_module, "request", rec)
    with pytest.raises(ValueError, match="step failed"):
        with _bridge().update():
            raise ValueError("step failed")
    assert rec.calls[-1][0] == "/hotweights/abort" and rec.calls[-1][1]["dirty"] is True


def test_after_a_failed_body_the_version_is_the_dirty_one_served(monkeypatch):
    monkeypatch.setattr(bridge_module, "request", Recorder({}))  # abort answers "1@s"
    b = _bridge()
    with pytest.raises(ValueError):
        with b.update():
            raise ValueError("step failed")
    assert b.version == "1@s"  # what a checkpoint records, what TRL's version_lag reads


def test_after_a_failed_commit_the_version_is_read_from_the_server(monkeypatch):
    expired = ServerError("HTTP 409: the lease expired", 409)
    rec = Recorder({"/hotweights/commit": expired, "/hotweights/abort": expired})
    monkeypatch.setattr(bridge_module, "request", rec)
    monkeypatch.setattr(bridge_module, "server_status", lambda *a, **k: {
        "version": "2@s", "server_id": "s"})
    b = _bridge()
    b.tensors = {"w": torch.zeros(1)}
    with pytest.raises(ServerError, match="lease expired"):
        with b.update():
            pass
    assert b.version == "2@s"
    # a commit that got no answer: aborted (dirty: written), not left paused for the rest
    # of the lease; where it did land, the abort is refused, as above
    rec.fail = {"/hotweights/commit": ServerError("POST /hotweights/commit: no answer")}
    rec.calls.clear()
    with pytest.raises(ServerError, match="no answer"):
        with b.update():
            pass
    assert [(r, body.get("dirty")) for r, body, _ in rec.calls] == [
        ("/hotweights/begin", None), ("/hotweights/commit", None), ("/hotweights/abort", True)]
    assert b.version == "1@s"  # the abort's answer: the new, dirty version
    # this bridge's update still open on the server (its commit and abort both lost): the
    # next begin is refused naming it, and aborts it dirty, not clean
    rec.fail = {"/hotweights/begin": ServerError("HTTP 409: h already began an update in "
                                                 "mode 'wait'", 409, {"holder": "h"})}
    rec.calls.clear()
    with pytest.raises(ServerError, match="already began"):
        with b.update(mode="keep"):
            pytest.fail("the body must not run")
    assert [(r, body.get("dirty")) for r, body, _ in rec.calls] == [
        ("/hotweights/begin", None), ("/hotweights/abort", True)]


@pytest.mark.parametrize("raised", [False, True])
def test_a_body_s_device_work_lands_before_the_commit_or_the_abort(monkeypatch, raised):
    # an optimizer step's kernels may still be queued: not served half written
    rec = Recorder({})
    monkeypatch.setattr(bridge_module, "request", rec)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device: rec.calls.append(
        ("synchronize", device, None)))
    b = _bridge()
    b.tensors = {"w": types.SimpleNamespace(device=torch.device("cuda", 0))}
    with pytest.raises(KeyboardInterrupt) if raised else contextlib.nullcontext():
        with b.update():
            if raised:
                raise KeyboardInterrupt  # mid optimizer.step()
    assert [c[0] for c in rec.calls[-2:]] == [
        "synchronize", "/hotweights/abort" if raised else "/hotweights/commit"]


def test_connecting_to_a_remote_server_says_how_to_update_it(monkeypatch):
    monkeypatch.setattr(bridge_module, "request", lambda *a, **k: {
        "manifests": [], "version": "0@s", "server_id": "s", "remote": True})
    with pytest.raises(ServerError, match=r"http://127.0.0.1:8000 is a `hotweights serve "
                                          r"--remote`: it shares no memory, and a bridge "
                                          r"\(so `sync` or `diagnose --server`\) maps .*"
                                          r"update it with RemoteGroup.*checkpoint from that "
                                          r"server"):
        Bridge.connect("http://127.0.0.1:8000", token="t")


def test_the_model_dir_comes_from_this_machine_not_the_servers_word(tmp_path, monkeypatch):
    from hotweights.protocol import shm

    b = _bridge()
    monkeypatch.setattr(b, "status", lambda: {"server_id": "s"})
    b.manifests = [shm.Manifest(shm.FORMAT, "s", "/dev/shm/x", 1, (), model="org/model")]
    with pytest.raises(ServerError, match=r"'org/model', which is not a directory .*"
                       r"bridge.model\(config=\.\.\.\)"):
        b.model()  # a hub id: never fetched (or its code run) because the server said so
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    b.manifests = [shm.Manifest(shm.FORMAT, "s", "/dev/shm/x", 1, (), model=str(shared))]
    with pytest.raises(ServerError, match="another user owns or can write"):
        b.model(trust_remote_code=True)


def test_a_second_update_of_the_same_bridge_is_refused_and_ends_nothing(monkeypatch):
    # its begin would be refused (the lease is this bridge's), and its abort, in this
    # bridge's name, would end the first update: served clean, half written
    rec = Recorder({})
    monkeypatch.setattr(bridge_module, "request", rec)
    b = _bridge()
    b.tensors, b._model = {"w": torch.zeros(1)}, object()
    with b.update():
        for nested in (lambda: b.update().__enter__(),
                       lambda: b.checkpoint("/nonexistent", exclusive=True)):
            with pytest.raises(ServerError, match="this bridge is updating or reading the "
                               "server already .*: one at a time"):
                nested()
    assert [c[0] for c in rec.calls] == ["/hotweights/begin", "/hotweights/commit"]
    with b.update():  # free again
        pass


def test_a_server_that_restarted_is_named_before_a_model_is_built_on_its_old_memory(
        monkeypatch):
    b = _bridge()
    monkeypatch.setattr(b, "status", lambda: {"server_id": "t"})
    with pytest.raises(ServerError, match=r"http://x is server t now, not s: it restarted and "
                       r"the weights this bridge mapped are gone; reconnect"):
        b.model()


def test_remotes_need_the_model_before_the_pause_not_after_it(monkeypatch):
    rec = Recorder({})
    monkeypatch.setattr(bridge_module, "request", rec)
    b = _bridge()
    b.remote = types.SimpleNamespace(require="all")
    monkeypatch.setattr(b, "model", lambda **kw: (_ for _ in ()).throw(
        ServerError("not a directory on this machine")))
    with pytest.raises(ServerError, match="not a directory"):
        with b.update():
            pytest.fail("the body must not run")
    assert rec.calls == []  # never paused


def test_a_commit_interrupted_does_not_leave_the_server_paused(monkeypatch):
    class Remote:
        require = "all"

        def prepare(self, model, **kw):
            return types.SimpleNamespace(floor=0)

        def abort(self, pending):
            pass
    rec = Recorder({"/hotweights/commit": KeyboardInterrupt()})  # committed or not
    b = _with_remote(monkeypatch, Remote(), rec)
    with pytest.raises(KeyboardInterrupt):
        with b.update():
            pass
    assert rec.calls[-1][0] == "/hotweights/abort" and rec.calls[-1][1]["dirty"] is True


@pytest.mark.parametrize(("served", "kept"), [
    ("2@s", "2@s"),  # the expiry's dirty version, not the one before the step
    ("0@t", "0@s"),  # never a restarted server's: "0@t" numbers another start's weights
])
def test_a_failed_abort_reads_the_version_served(monkeypatch, served, kept):
    monkeypatch.setattr(bridge_module, "request", Recorder({
        "/hotweights/abort": ServerError("HTTP 409: the lease expired", 409)}))
    monkeypatch.setattr(bridge_module, "server_status", lambda *a, **k: {
        "version": served, "server_id": served.partition("@")[2]})
    b = _bridge()
    with pytest.raises(ValueError):
        with b.update():
            raise ValueError("step failed")
    assert b.version == kept


def test_a_failed_local_commit_is_the_error_raised_the_remotes_noted(monkeypatch):
    class Remote:
        require, n = "any", 0

        def floor(self):
            return 0

        def update(self, model, **kw):
            raise RemoteError("gpu01:8000 died")
    rec = Recorder({"/hotweights/commit": ServerError("HTTP 409: the lease expired", 409)})
    monkeypatch.setattr(bridge_module, "request", lambda *a, **k: {**rec(*a, **k), "n": 0})
    monkeypatch.setattr(bridge_module, "server_status", lambda *a, **k: {
        "version": "2@s", "server_id": "s"})
    b = _bridge()
    b.tensors, b.remote, b._model = {"w": torch.zeros(1)}, Remote(), object()
    with pytest.raises(ServerError, match="lease expired") as e:
        with b.update():
            pass
    assert e.value.__notes__ == ["the remote servers did not take version 1 either: "
                                 "gpu01:8000 died"]


def test_close_lets_go_of_the_mapping_and_the_remotes():
    closed = []
    b = _bridge()
    b.tensors, b._model = {"w": torch.zeros(1)}, object()
    b.remote = types.SimpleNamespace(close=lambda: closed.append(True))
    with b:
        pass
    assert b.tensors == {} and b._model is None and closed == [True]
    for use in (b.update().__enter__, b.model):  # refused before anything is paused
        with pytest.raises(ServerError, match="this bridge was closed; connect again"):
            use()


@pytest.mark.parametrize("restored", [True, False])
def test_a_step_a_remote_failed_is_undone_here_or_noted_on_the_remote_s_error(monkeypatch,
                                                                              restored):
    # require="all": the group's copy of the old weights put back: the old version, not
    # dirty; a restore that raises leaves the step's weights served here as a dirty version
    class Remote:
        require = "all"

        def prepare(self, model, **kw):
            raise RemoteError("gpu01:8000 refused the round")

        def restore(self, model):
            if not restored:
                raise RuntimeError("no copy")
            return True

    rec = Recorder({})
    b = _with_remote(monkeypatch, Remote(), rec)
    with pytest.raises(RemoteError, match="gpu01:8000 refused the round") as e:
        with b.update():
            pass
    assert getattr(e.value, "__notes__", None) == (None if restored else [
        "the step could not be undone here: RuntimeError('no copy')",
        "http://x serves the step's weights as a new, dirty version (the group holds no copy "
        "of the old ones here); the remote servers serve the old ones"])
    assert rec.calls[-1][0] == "/hotweights/abort"
    assert rec.calls[-1][1]["dirty"] is not restored


def test_an_exclusive_checkpoint_holds_the_bridge_only_while_it_reads(monkeypatch, tmp_path):
    # the server resumes once the live bytes are read; the files are written after, while
    # the trainer's next update may go on
    import hotweights.checkpoint

    b = _checkpointing(monkeypatch)
    held = []

    def sync(model_dir, model, *, after_read, **kw):
        held.append(b._leased.locked())
        after_read()
        held.append(b._leased.locked())  # writing the files
        return _SYNCED
    monkeypatch.setattr(hotweights.checkpoint, "sync", sync)
    b.checkpoint(tmp_path / "ckpt", exclusive=True)
    assert held == [True, False] and not b._leased.locked()


def test_remotes_that_fail_their_commit_are_said_to_leave_this_server_at_the_new_version(
        monkeypatch):
    # require="all": staged on every remote while this server is paused, then committed
    class Remote:
        require, n = "all", 0

        def prepare(self, model, **kw):
            return types.SimpleNamespace(floor=0)

        def commit(self, pending, n):
            raise RemoteError(f"version {n} is served by no server; the commit failed on "
                              "gpu01:8000: the connection broke")
    b = _with_remote(monkeypatch, Remote())
    with pytest.raises(RemoteError, match=r"^http://x serves version 1; not every remote server "
                                          r"took it .*: version 1 is served by no "
                                          "server; the commit failed on gpu01:8000"):
        with b.update():
            pass


def test_an_update_of_a_model_whose_parameters_became_copies_is_refused(monkeypatch):
    # `.float()` or `.to(...)` of the model gives its parameters storages of their own: a
    # step on them would not reach the server, which would publish the old bytes anew
    rec = Recorder({})
    monkeypatch.setattr(bridge_module, "request", rec)
    served = torch.zeros(4, 4, dtype=torch.bfloat16)
    model = torch.nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)
    model.weight = torch.nn.Parameter(served)  # a view of the server's tensor
    b = _bridge()
    b.tensors, b._model = {"w": served}, model
    model.float()
    with pytest.raises(LayoutError, match=r"^update\(\): 1 trainable parameter\(s\) of the "
                       r"model `model\(\)` built are copies, .*\(e\.g\. weight\)"):
        with b.update():
            pytest.fail("the body must not run")
    assert rec.calls == [] and not b._leased.locked()


def test_writes_outside_an_update_are_named_at_the_next_one(monkeypatch, caplog):
    # outside `update()` the server computes with each write as it lands, under the
    # version it served: no new number, no prefix-cache reset
    monkeypatch.setattr(bridge_module, "request", Recorder({}))
    served = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    model = torch.nn.Linear(4, 4)
    model.weight, model.bias = (torch.nn.Parameter(served["w"]),
                                torch.nn.Parameter(served["b"]))  # views of the server's
    b = _bridge()
    b.tensors, b._model, b._versions = served, model, bridge_module._versions(model)
    with torch.no_grad():
        model.bias.add_(1.0)  # a step outside the update
    with caplog.at_level("WARNING", logger=bridge_module.__name__), b.update():
        torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
        with torch.no_grad():
            model.weight.add_(1.0)  # inside: this update's
    (warned,) = [r.getMessage() for r in caplog.records]
    assert warned.startswith("update(): the model `model()` built was written outside "
                             "`bridge.update()`") and "(bias or a view of the same" in warned
    assert "as version 0@s" in warned
    caplog.clear()
    with caplog.at_level("WARNING", logger=bridge_module.__name__), b.update():
        pass
    assert caplog.records == []  # the first update's writes were its own
    with torch.inference_mode():  # as `allow_missing` zeros may be made: no counter
        model.extra = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    with b.update():
        pass
    model.weight.data.add_(1.0)  # `.data` bypasses the counter: not seen (documented)
    with caplog.at_level("WARNING", logger=bridge_module.__name__), b.update():
        pass
    assert caplog.records == []


def test_a_checkpoint_never_writes_the_zeros_of_parameters_no_vllm_tensor_holds(tmp_path):
    b = _bridge()
    b._model = torch.nn.Linear(2, 2)
    b.report = types.SimpleNamespace(missing=("bias",), mapped=("weight",))
    with pytest.raises(CheckpointError, match=r"^checkpoint\(\): 1 parameter\(s\) of the "
                       r"model no vLLM tensor holds \(allow_missing=; zeros here, e\.g\. bias\)"):
        b.checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_an_exclusive_checkpoint_whose_renewals_cannot_start_resumes_the_server(
        monkeypatch, tmp_path):
    rec = Recorder({})
    monkeypatch.setattr(bridge_module, "request", lambda *a, **k: {**rec(*a, **k), "n": 0})
    monkeypatch.setattr(bridge_module.Renewer, "start", lambda self: (_ for _ in ()).throw(
        RuntimeError("can't start new thread")))
    b = _bridge()
    b._model = types.SimpleNamespace(config=None)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        b.checkpoint(tmp_path / "ckpt", exclusive=True)
    assert [route for route, _, _ in rec.calls] == ["/hotweights/begin", "/hotweights/abort"]
    assert not b._leased.locked()


def test_an_exclusive_checkpoint_interrupted_before_its_renewals_leaves_no_pause(
        monkeypatch, tmp_path):
    # a Ctrl-C between begin and the try that releases: the server would stay paused until
    # its lease ran out, then serve a new dirty version; nothing runs between them now
    class Interrupted(bridge_module.Renewer):
        def __init__(self, *args):
            raise KeyboardInterrupt

    rec = Recorder({})
    monkeypatch.setattr(bridge_module, "request", lambda *a, **k: {**rec(*a, **k), "n": 0})
    monkeypatch.setattr(bridge_module, "Renewer", Interrupted)
    b = _bridge()
    b._model = types.SimpleNamespace(config=None)
    with pytest.raises(KeyboardInterrupt):
        b.checkpoint(tmp_path / "ckpt", exclusive=True)
    assert "/hotweights/begin" not in [route for route, _, _ in rec.calls]
    assert not b._leased.locked()


def test_a_checkpoint_records_the_version_the_server_serves(monkeypatch, tmp_path):
    # a commit whose answer was lost, and whose status read failed too, left the bridge
    # the version before: the sidecars must not name it for the new weights
    import hotweights.checkpoint

    b = _bridge()
    b._model = types.SimpleNamespace(config=None)
    monkeypatch.setattr(b, "status", lambda timeout: {"version": "1@s", "server_id": "s"})
    recorded = []
    monkeypatch.setattr(hotweights.checkpoint, "sync",
                        lambda model_dir, model, *, version, **kw: recorded.append(version)
                        or _SYNCED)
    b.checkpoint(tmp_path / "ckpt")
    assert recorded == ["1@s"]

    def unreachable(timeout):
        raise ServerError("GET /hotweights/status: no answer")
    monkeypatch.setattr(b, "status", unreachable)  # the live weights are still here
    b.version = "2@s"
    b.checkpoint(tmp_path / "ckpt")
    assert recorded == ["1@s", "2@s"]


def test_an_update_waits_while_another_holds_the_lease(monkeypatch):
    # an exclusive checkpoint reading the weights, say: the step goes on after it
    refusals = [ServerError("POST /hotweights/begin: HTTP 409: update lease held by cp", 409,
                            {"error": "update lease held by cp", "holder": "cp"})] * 2
    calls = []

    def request(url, method, route, token, body=None, *, timeout=120, cafile=None):
        calls.append(route)
        if route == "/hotweights/begin" and refusals:
            raise refusals.pop()
        return {"version": "1@s", "n": 0}
    monkeypatch.setattr(bridge_module, "request", request)
    b = _bridge()
    b.tensors = {"w": torch.zeros(1)}
    with b.update():
        pass
    assert calls == ["/hotweights/begin"] * 3 + ["/hotweights/commit"]
    # not for ever: up to lease_s + 30 s, then the refusal
    clock = iter(range(0, 1000, 20))
    monkeypatch.setattr(bridge_module.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(bridge_module.time, "sleep", lambda s: None)
    refusals[:] = [ServerError("held", 409, {"holder": "cp"})] * 10
    with pytest.raises(ServerError, match="held"):
        with b.update(lease_s=10):
            pytest.fail("the body must not run")
    assert len(refusals) == 8  # at 0 and 20 s (the deadline: 40 s)
    # nor for a refusal of this holder's own, or of a restarted server
    refusals[:] = [ServerError("restarted", 409, {"server_id": "s2"})]
    with pytest.raises(ServerError, match="restarted"):
        with b.update():
            pass


def test_an_exclusive_checkpoint_that_lost_its_lease_while_reading_says_so(monkeypatch,
                                                                          tmp_path):
    # the lease expired (renewals refused or unanswered): a trainer may have stepped while
    # the bytes were read, and the files may mix two versions
    import hotweights.checkpoint

    rec = Recorder({"/hotweights/abort": ServerError("HTTP 409: no lease held", 409)})
    monkeypatch.setattr(bridge_module, "request", lambda *a, **k: {**rec(*a, **k), "n": 0})
    b = _bridge()
    b._model = types.SimpleNamespace(config=None)
    monkeypatch.setattr(b, "status", lambda **kw: {"version": "0@s", "server_id": "s"})
    monkeypatch.setattr(hotweights.checkpoint, "sync",
                        lambda model_dir, model, *, after_read, **kw: after_read() or _SYNCED)
    with pytest.raises(CheckpointError, match=r"^checkpoint\(exclusive=True\): the update "
                       r"lease was lost while the weights were read \(.*no lease held\): a "
                       r"trainer may have written them meanwhile, and .*ckpt may mix two "
                       "versions; checkpoint again"):
        b.checkpoint(tmp_path / "ckpt", exclusive=True)
    assert not b._leased.locked()


def test_an_error_of_any_kind_on_the_remotes_says_this_server_serves_the_step(monkeypatch):
    # require="any": this server committed n; an error of the encode (out of memory) on the
    # remotes' side leaves it serving n all the same, and says so (a trainer goes on)
    class Remote:
        require, n = "any", 0

        def floor(self):
            return 0

        def update(self, model, **kw):
            raise RuntimeError("CUDA out of memory")
    b = _with_remote(monkeypatch, Remote())
    with pytest.raises(RemoteError, match=r"^http://x serves version 1; the remote servers "
                       r"did not take it .*RuntimeError\('CUDA out of memory'\)") as e:
        with b.update():
            pass
    assert e.value.served == 1 and isinstance(e.value.__cause__, RuntimeError)


def test_a_first_save_whose_tokenizer_copy_fails_warns_and_keeps_the_weights(tmp_path,
                                                                              monkeypatch,
                                                                              caplog):
    served, ckpt = tmp_path / "served", tmp_path / "ckpt"
    served.mkdir(), ckpt.mkdir()
    (served / "tokenizer.json").write_text("{}")
    (served / "generation_config.json").write_text("{}")
    b = _bridge()
    b.manifests = [types.SimpleNamespace(model=str(served))]
    real = bridge_module.shutil.copyfile

    def full(src, dst):  # the disk fills on the tokenizer
        if "tokenizer" in str(src):
            with open(dst, "w") as f:
                f.write("{")
            raise OSError(28, "No space left on device")
        return real(src, dst)
    monkeypatch.setattr(bridge_module.shutil, "copyfile", full)
    result = types.SimpleNamespace(first_save=True)
    assert b._saved(result, ckpt, None) is result
    assert sorted(p.name for p in ckpt.iterdir()) == ["generation_config.json"]  # no .tmp
    assert "tokenizer.json not copied beside the weights" in caplog.text


def test_an_older_server_that_knows_no_process_read_or_seq_field_is_begun_without(
        monkeypatch):
    new = {"process", "read", "seq"}

    class Older(Recorder):
        def __call__(self, url, method, route, token, body=None, *, timeout=120, cafile=None):
            if body.keys() & new:
                self.calls.append((route, body, timeout))
                raise ServerError(f"POST {route}: HTTP 400: unknown field(s) "
                                  f"{sorted(body.keys() & new)}", 400, {})
            return super().__call__(url, method, route, token, body, timeout=timeout)

    rec = Older({})
    monkeypatch.setattr(bridge_module, "request", rec)
    b = _bridge()
    b._begin(mode="keep", lease_s=10, read=True)
    b.renew(10)  # the update's later requests are unnumbered too
    (_, first, _), (_, second, _), (_, renewed, _) = rec.calls
    assert first["read"] is True and first["seq"] == 1
    assert second == dict(holder="h", server_id="s", mode="keep", lease_s=10)
    assert renewed == dict(holder="h", server_id="s", lease_s=10)


def test_every_request_of_an_update_carries_its_number_one_above_the_last(monkeypatch):
    # the server refuses a request of an earlier update that arrives late (`Body.seq`)
    rec = Recorder({})
    monkeypatch.setattr(bridge_module, "request", rec)
    b = _bridge()
    for _ in range(2):
        with b.update(lease_s=10):
            b.renew(10)
    with pytest.raises(ServerError):
        with b.update(lease_s=10):
            raise ServerError("the step failed")
    assert [(route, body["seq"]) for route, body, _ in rec.calls] == [
        ("/hotweights/begin", 1), ("/hotweights/renew", 1), ("/hotweights/commit", 1),
        ("/hotweights/begin", 2), ("/hotweights/renew", 2), ("/hotweights/commit", 2),
        ("/hotweights/begin", 3), ("/hotweights/abort", 3)]


def test_remote_code_runs_only_from_files_others_cannot_write(tmp_path):
    from hotweights.errors import ServerError

    (tmp_path / "config.json").write_text("{}")
    code = tmp_path / "modeling_x.py"
    code.write_text("")
    code.chmod(0o644)
    tmp_path.chmod(0o755)
    (tmp_path / "configuration_x.py").symlink_to(tmp_path / "gone.py")  # a cut download's
    assert bridge_module._local_model_dir(str(tmp_path), True) == str(tmp_path)
    for mode in (0o666, 0o664):  # anyone, or its group, may put code in it
        code.chmod(mode)
        with pytest.raises(ServerError, match=rf"^{code}: trust_remote_code would run code "
                                              "from a file that another user owns or can write"):
            bridge_module._local_model_dir(str(tmp_path), True)
    assert bridge_module._local_model_dir(str(tmp_path), False) == str(tmp_path)


def test_an_older_server_that_knows_no_seq_is_begun_without_it_when_no_other_field_is_new(
        monkeypatch):
    # where /proc does not say who this process is, the begin holds no `process`: `seq`
    # alone is what the older server refuses
    class Older(Recorder):
        def __call__(self, url, method, route, token, body=None, *, timeout=120, cafile=None):
            if "seq" in body:
                self.calls.append((route, body, timeout))
                raise ServerError(f"POST {route}: HTTP 400: unknown field(s) ['seq']", 400, {})
            return super().__call__(url, method, route, token, body, timeout=timeout)

    rec = Older({})
    monkeypatch.setattr(bridge_module, "request", rec)
    monkeypatch.setattr(bridge_module.process, "identity", lambda: "")
    _bridge()._begin(mode="wait", lease_s=10)
    assert [body for _, body, _ in rec.calls] == [
        dict(holder="h", server_id="s", mode="wait", lease_s=10, seq=1),
        dict(holder="h", server_id="s", mode="wait", lease_s=10)]


def test_an_unknown_field_refusal_left_once_the_new_fields_are_dropped_is_raised(monkeypatch):
    # nothing more to drop: retrying would ask the same for ever
    class Refusing(Recorder):
        def __call__(self, url, method, route, token, body=None, *, timeout=120, cafile=None):
            if route == "/hotweights/begin" and len(self.calls) > 4:
                raise RuntimeError("begun again and again")
            return super().__call__(url, method, route, token, body, timeout=timeout)

    rec = Refusing({"/hotweights/begin": ServerError(
        "POST /hotweights/begin: HTTP 400: unknown field(s) ['mode']", 400, {})})
    monkeypatch.setattr(bridge_module, "request", rec)
    with pytest.raises(ServerError, match=r"unknown field\(s\) \['mode'\]"):
        _bridge()._begin(mode="wait", lease_s=10)
    assert [route for route, _, _ in rec.calls] == [
        "/hotweights/begin", "/hotweights/begin", "/hotweights/abort"]


def test_a_begin_refused_at_the_deadline_of_the_wait_for_the_lease_is_not_sent_again(
        monkeypatch):
    rec = Recorder({"/hotweights/begin": ServerError("held", 409, {"holder": "other"})})
    monkeypatch.setattr(bridge_module, "request", rec)
    now, clock = [0.0], iter([10.0, 20.0, 30.0])  # the clock after each refusal's sleep
    monkeypatch.setattr(bridge_module.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(bridge_module.time, "sleep", lambda s: now.__setitem__(0, next(clock)))
    with pytest.raises(ServerError, match="held"):
        _bridge()._begin(timeout=10, mode="wait", lease_s=10)
    assert [route for route, _, _ in rec.calls] == [
        "/hotweights/begin", "/hotweights/begin", "/hotweights/abort"]  # at 0 and 10 s


def test_an_older_server_that_says_no_vocab_size_is_not_refused():
    from hotweights.testing import tiny

    config = tiny.make_config("llama", 1)
    for info in ({}, {"model_config": None}, {"model_config": {}}):
        bridge_module._check_vocab(config, info)
    with pytest.raises(LayoutError, match=rf"the config says {config.vocab_size}, the server "
                                          rf"loaded {config.vocab_size + 1}"):
        bridge_module._check_vocab(config, {"model_config": {
            "vocab_size": config.vocab_size + 1}})


def test_connecting_to_a_server_with_no_worker_or_another_s_manifest_is_refused(monkeypatch):
    from hotweights.protocol import shm

    answer = {"manifests": [], "version": "0@s", "server_id": "s"}
    monkeypatch.setattr(bridge_module, "request", lambda *a, **k: answer)
    with pytest.raises(ServerError, match=r"^http://127\.0\.0\.1:8000: 0 workers; the bridge "
                                          r"maps tp=1 servers"):
        Bridge.connect("http://127.0.0.1:8000", token="t")
    answer["manifests"] = [shm.Manifest(shm.FORMAT, "s", "/dev/shm/x", 1, ()).to_dict()]
    answer["server_id"] = "t"  # restarted between the manifest and its answer, say
    with pytest.raises(ServerError, match=r"manifest of server s, but the server says it is "
                                          r"'t'"):
        Bridge.connect("http://127.0.0.1:8000", token="t")


def test_an_exclusive_checkpoint_takes_a_read_lease_and_ends_it_clean_once(monkeypatch,
                                                                           tmp_path):
    import hotweights.checkpoint

    rec = Recorder({})
    b = _checkpointing(monkeypatch, rec)
    monkeypatch.setattr(hotweights.checkpoint, "sync",
                        lambda model_dir, model, *, after_read, **kw: after_read() or _SYNCED)
    b.checkpoint(tmp_path / "ckpt", exclusive=True)
    (begin, body, _), (abort, abort_body, _) = rec.calls  # released once, when read
    assert begin == "/hotweights/begin" and (body["mode"], body["read"]) == ("keep", True)
    assert abort == "/hotweights/abort" and abort_body["dirty"] is False  # nothing written


def test_only_a_first_save_gets_the_serving_files_and_never_over_the_checkpoint_s(tmp_path):
    served, ckpt = tmp_path / "served", tmp_path / "ckpt"
    served.mkdir(), ckpt.mkdir()
    (served / "tokenizer.json").write_text("served")
    (served / "generation_config.json").write_text("{}")
    (ckpt / "tokenizer.json").write_text("mine")
    b = _bridge()
    b.manifests = [types.SimpleNamespace(model=str(served))]
    b._saved(types.SimpleNamespace(first_save=False), ckpt, None)  # a sync: as it was
    assert sorted(p.name for p in ckpt.iterdir()) == ["tokenizer.json"]
    b._saved(types.SimpleNamespace(first_save=True), ckpt, None)
    assert (ckpt / "tokenizer.json").read_text() == "mine"
    assert (ckpt / "generation_config.json").read_text() == "{}"


def test_a_checkpoint_of_a_dirty_version_carries_the_server_s_reason(tmp_path, caplog):
    from hotweights.checkpoint.result import SyncResult

    result = SyncResult("auto", "3@s", 1, 1, (), 0, 0, 0, (), (), 0.0)
    b = _bridge()
    b.manifests = [types.SimpleNamespace(model="org/model")]
    status = {"version": "3@s", "dirty": True, "dirty_reason": "lease of h expired"}
    assert b._saved(result, tmp_path, status).dirty == "lease of h expired"
    assert "serves dirty version 3@s (lease of h expired)" in caplog.text
    assert b._saved(result, tmp_path, {"version": "3@s", "dirty": False}) is result


def test_a_config_that_says_no_vocab_size_is_not_refused():
    bridge_module._check_vocab(types.SimpleNamespace(), {"model_config": {"vocab_size": 300}})


@pytest.mark.parametrize("require", ["any", "all"])
def test_the_version_of_an_update_with_remotes_is_above_this_server_s_and_theirs(monkeypatch,
                                                                                require):
    # this server began at 5 (an earlier update the remotes missed), theirs are at 2: every
    # server then serves 6, above both
    class Remote:
        n = 2

        def floor(self):
            return 2

        def prepare(self, model, **kw):
            return types.SimpleNamespace(floor=2)

        def update(self, model, *, n, **kw):
            self.served = n

        def commit(self, pending, n):
            self.served = n

    rec = Recorder({})
    b = _with_remote(monkeypatch, Remote(), rec, n=5)
    b.remote.require = require
    with b.update():
        pass
    assert rec.calls[-1][0] == "/hotweights/commit" and rec.calls[-1][1]["n"] == 6
    assert b.remote.served == 6


def test_remotes_that_do_not_say_their_version_are_updated_above_the_group_s_last(monkeypatch):
    # require="any": the floor read before the pause failed; this server commits all the
    # same, at a number above the last the group served
    class Remote:
        require, n = "any", 7

        def floor(self):
            raise RemoteError("no remote server answered")

        def update(self, model, *, n, **kw):
            self.served = n

    rec = Recorder({})
    b = _with_remote(monkeypatch, Remote(), rec)
    with b.update():
        pass
    assert rec.calls[-1][1]["n"] == 8 and b.remote.served == 8


def test_a_commit_interrupted_drops_what_the_remotes_staged(monkeypatch):
    class Remote:
        require, pending = "all", types.SimpleNamespace(floor=0)

        def prepare(self, model, **kw):
            return self.pending

        def abort(self, pending):
            self.aborted = pending

    rec = Recorder({"/hotweights/commit": KeyboardInterrupt()})
    b = _with_remote(monkeypatch, Remote(), rec)
    with pytest.raises(KeyboardInterrupt):
        with b.update():
            pass
    assert b.remote.aborted is b.remote.pending


def test_the_zeros_allow_missing_made_are_no_copies_an_update_refuses(monkeypatch):
    # `bridge.model(allow_missing=...)` builds them as tensors of their own, by design
    rec = Recorder({})
    monkeypatch.setattr(bridge_module, "request", rec)
    served = torch.zeros(4, 4)
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(served)  # a view of the server's tensor; the bias not
    b = _bridge()
    b.tensors, b._model = {"w": served}, model
    b.report = types.SimpleNamespace(missing=("bias",), mapped=("weight",))
    with b.update():
        pass
    assert [c[0] for c in rec.calls] == ["/hotweights/begin", "/hotweights/commit"]


def test_writes_outside_an_update_are_named_once(monkeypatch, caplog, tmp_path):
    # a checkpoint names them first: the next update does not name them again
    import hotweights.checkpoint

    monkeypatch.setattr(bridge_module, "request", Recorder({}))
    served = {"w": torch.zeros(2, 2)}
    model = torch.nn.Linear(2, 2, bias=False)
    model.weight = torch.nn.Parameter(served["w"])  # a view of the server's
    model.config = None
    b = _bridge()
    b.tensors, b._model, b._versions = served, model, bridge_module._versions(model)
    monkeypatch.setattr(b, "status", lambda timeout: {"version": "0@s", "server_id": "s"})
    monkeypatch.setattr(hotweights.checkpoint, "sync", lambda *a, **kw: _SYNCED)
    with torch.no_grad():
        model.weight.add_(1.0)  # a step outside the update
    with caplog.at_level("WARNING", logger=bridge_module.__name__):
        b.checkpoint(tmp_path / "ckpt")
        with b.update():
            pass
    (warned,) = [r.getMessage() for r in caplog.records]
    assert warned.startswith("checkpoint(): the model `model()` built was written outside")


def test_a_checkpoint_inside_an_update_does_not_name_the_update_s_writes(monkeypatch, caplog,
                                                                         tmp_path):
    import hotweights.checkpoint

    monkeypatch.setattr(bridge_module, "request", Recorder({}))
    served = {"w": torch.zeros(2, 2)}
    model = torch.nn.Linear(2, 2, bias=False)
    model.weight, model.config = torch.nn.Parameter(served["w"]), None
    b = _bridge()
    b.tensors, b._model, b._versions = served, model, bridge_module._versions(model)
    monkeypatch.setattr(b, "status", lambda timeout: {"version": "0@s", "server_id": "s"})
    monkeypatch.setattr(hotweights.checkpoint, "sync", lambda *a, **kw: _SYNCED)
    with caplog.at_level("WARNING", logger=bridge_module.__name__), b.update():
        with torch.no_grad():
            model.weight.add_(1.0)  # this update's
        b.checkpoint(tmp_path / "ckpt")
    assert caplog.records == []


def test_an_exclusive_checkpoint_finishes_a_crashed_sync_before_it_pauses_the_server(
        monkeypatch, tmp_path):
    import hotweights.checkpoint

    calls = []
    monkeypatch.setattr(bridge_module, "request", lambda url, method, route, *a, **k: (
        calls.append(route) or {"version": "0@s", "n": 0}))
    monkeypatch.setattr(hotweights.checkpoint, "recover", lambda d: calls.append(("recover", d)))
    monkeypatch.setattr(hotweights.checkpoint, "sync", lambda *a, **kw: _SYNCED)
    b = _bridge()
    b._model = types.SimpleNamespace(config=None)
    monkeypatch.setattr(b, "status", lambda: {"version": "0@s"})
    b.checkpoint(tmp_path, exclusive=True)
    assert calls[:2] == [("recover", tmp_path), "/hotweights/begin"]


def test_an_exclusive_checkpoint_records_the_version_it_read(monkeypatch, tmp_path):
    # another trainer's updates moved the server on since this bridge's last answer
    import hotweights.checkpoint

    b = _checkpointing(monkeypatch, version="5@s")
    recorded = []
    monkeypatch.setattr(hotweights.checkpoint, "sync", lambda model_dir, model, *, version,
                        **kw: recorded.append(version) or _SYNCED)
    b.checkpoint(tmp_path / "ckpt", exclusive=True)
    assert recorded == ["5@s"]


def test_an_exclusive_checkpoint_stops_renewing_its_lease_once_read(monkeypatch, tmp_path):
    # a renewal after the abort would be refused, and only logged: no thread outlives the read
    import hotweights.checkpoint

    renewers = []

    class Tracked(bridge_module.Renewer):
        def start(self):
            renewers.append(self)
            super().start()

    monkeypatch.setattr(bridge_module, "Renewer", Tracked)
    b = _checkpointing(monkeypatch)
    monkeypatch.setattr(hotweights.checkpoint, "sync",
                        lambda model_dir, model, *, after_read, **kw: after_read() or _SYNCED)
    b.checkpoint(tmp_path / "ckpt", exclusive=True)
    assert len(renewers) == 1 and not renewers[0].is_alive()
