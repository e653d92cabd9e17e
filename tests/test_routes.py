"""The /hotweights/* routes over HTTP, on a FastAPI app with a stub vLLM engine client."""

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

httpx = pytest.importorskip("httpx")  # both come with vLLM, whose API server the routes join
FastAPI = pytest.importorskip("fastapi").FastAPI

from hotweights.errors import ConfigError  # noqa: E402
from hotweights.remote.rendezvous import PROTOCOL  # noqa: E402
from hotweights.server.env import REMOTE_ENGINE  # noqa: E402
from hotweights.vllm_plugin.routes import HotweightsRoutes  # noqa: E402

SID = "3f9a1c2b"
TOKEN = "t0k"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class StubClient:
    """The part of vLLM's AsyncLLM the routes use."""

    def __init__(self):
        self.calls: list[str] = []
        self.args: dict[str, tuple] = {}  # method -> its last collective_rpc args
        self.label = None
        self.prefix_reset = True
        self.broken = False  # what the workers' apply says of their channel
        self.model_config = SimpleNamespace(model="/m", dtype=torch.float32, max_model_len=256,
                                            max_logprobs=20, logprobs_mode="processed_logprobs",
                                            get_vocab_size=lambda: 300)
        self.vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))

    async def pause_generation(self, mode, clear_cache):
        self.calls.append(f"pause:{mode}")

    async def resume_generation(self):
        self.calls.append("resume")

    async def reset_prefix_cache(self, reset_running_requests, reset_connector=False):
        assert reset_running_requests and reset_connector  # an offloaded tier's KV too
        self.calls.append("reset_prefix")
        return self.prefix_reset

    async def reset_encoder_cache(self):
        self.calls.append("reset_encoder")

    async def update_weight_version(self, label):
        self.label = label

    async def collective_rpc(self, method, args=()):
        self.calls.append(method)
        self.args[method] = args
        return [{"server_id": args[0]} if method == "hotweights_share" else
                {"rounds": 1, "bytes": 8} if method == "hotweights_remote_receive" else
                {"armed": bool(args and args[0]) and not self.broken, "broken": self.broken}
                if method == "hotweights_remote_apply" else
                {"w": "bfloat16"} if method == "hotweights_remote_dtypes" else
                {"broken": self.broken} if method == "hotweights_remote_discard" else None]


def serve(test, *, server_id=SID, args=None):
    """Run `test(client, stub)` against an app with the routes, inside one event loop."""

    async def main():
        routes = HotweightsRoutes()
        app = FastAPI()
        routes.attach_router(app)
        stub = StubClient()
        await routes.init_state(stub, None, args or type("Args", (), {})())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await test(client, stub)

    return asyncio.run(main())


@pytest.fixture(autouse=True)
def env(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_SERVER_ID", SID)
    monkeypatch.setenv("HOTWEIGHTS_TOKEN", TOKEN)


def body(**kw):
    return {"holder": "h1", "server_id": SID, **kw}


JOIN = body(master_addr="10.0.0.1", master_port=29500, rank_offset=1, world_size=2,
            token="chan-token", timeout=5.0, protocol=PROTOCOL)  # one remote server's channel


def test_an_update_over_http():
    async def test(client, stub):
        r = await client.get("/hotweights/manifest", headers=AUTH)
        assert r.json() == {"manifests": [{"server_id": SID}], "version": f"0@{SID}",
                            "server_id": SID, "remote": False}
        assert stub.label == f"0@{SID}"
        r = await client.post("/hotweights/begin", json=body(lease_s=30), headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == f"0@{SID}"
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["state"] == "paused" and status["paused"] and status["holder"] == "h1"
        r = await client.post("/hotweights/commit", json=body(), headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == f"1@{SID}"
        assert stub.label == f"1@{SID}"
        r = await client.post("/v1/completions", json={})  # the gate stamps every response
        assert r.headers["x-hotweights-version"] == f"1@{SID}"

    serve(test)


def test_the_scheduler_is_paused_through_the_engine_core_where_vllm_has_it():
    # vLLM 0.32's `pause_generation` sleeps 20 ms after pausing: the engine core's own
    # pause is called instead, where there is one
    class Core:
        def __init__(self, calls: list[str]):
            self.calls = calls

        async def pause_scheduler_async(self, mode, clear_cache):
            self.calls.append(f"core_pause:{mode}:{clear_cache}")

    async def test(client, stub):
        await client.post("/hotweights/begin", json=body(mode="keep"), headers=AUTH)
        assert stub.calls[-1] == "pause:keep"  # the stub has no engine core
        await client.post("/hotweights/commit", json=body(), headers=AUTH)
        stub.engine_core = Core(stub.calls)
        await client.post("/hotweights/begin", json=body(mode="keep"), headers=AUTH)
        assert stub.calls[-1] == "core_pause:keep:False"
        assert stub.calls.count("pause:keep") == 1

    serve(test)


def test_the_checksum_waits_for_an_update_to_end_instead_of_hashing_meanwhile(monkeypatch):
    from hotweights.vllm_plugin import routes as routes_module

    monkeypatch.setattr(routes_module, "_CHECKSUM_WAIT_S", 0.3)

    async def test(client, stub):
        await client.post("/hotweights/begin", json=body(), headers=AUTH)  # paused
        r = await client.get("/hotweights/checksum", headers=AUTH)
        assert r.status_code == 503 and "an update has been in progress" in r.json()["error"]
        assert "hotweights_checksum" not in stub.calls  # not hashed while it writes
        monkeypatch.setattr(routes_module, "_CHECKSUM_WAIT_S", 30)  # (read per request)
        checksum = asyncio.ensure_future(client.get("/hotweights/checksum", headers=AUTH))
        await asyncio.sleep(0.1)
        await client.post("/hotweights/commit", json=body(), headers=AUTH)
        r = await checksum
        assert r.status_code == 200 and r.json()["version"] == f"1@{SID}"
        assert stub.calls.count("hotweights_checksum") == 1

    serve(test)


def test_a_checksum_that_updates_keep_outrunning_gives_up(monkeypatch):
    # every hash stalls generation: one commit landing during each must not loop forever
    from hotweights.vllm_plugin import routes as routes_module

    monkeypatch.setattr(routes_module, "_CHECKSUM_WAIT_S", 3.0)

    async def test(client, stub):
        rpc = stub.collective_rpc

        async def hash_while_an_update_lands(method, args=()):
            if method == "hotweights_checksum":
                await client.post("/hotweights/begin", json=body(), headers=AUTH)
                await client.post("/hotweights/commit", json=body(), headers=AUTH)
                await asyncio.sleep(0.05)
            return await rpc(method, args)

        stub.collective_rpc = hash_while_an_update_lands
        r = await client.get("/hotweights/checksum", headers=AUTH)
        assert r.status_code == 503 and "updates kept landing" in r.json()["error"]
        assert 2 <= stub.calls.count("hotweights_checksum") <= 100  # tried again, and ended

    serve(test)


def test_server_info_answers_what_a_trainer_reads_behind_the_token():
    async def test(client, stub):
        assert (await client.get("/hotweights/server_info")).status_code == 401
        r = await client.get("/hotweights/server_info", headers=AUTH)
        assert r.json() == {"model_config": {
            "model": "/m", "dtype": "float32", "max_model_len": 256, "max_logprobs": 20,
            "logprobs_mode": "processed_logprobs", "vocab_size": 300},
            "weight_transfer_config": None}

    serve(test)


def test_commit_resets_prefix_and_encoder_caches():
    async def test(client, stub):
        await client.post("/hotweights/begin", json=body(), headers=AUTH)
        await client.post("/hotweights/commit", json=body(), headers=AUTH)
        i = stub.calls.index("hotweights_after_update")
        assert stub.calls[i:] == ["hotweights_after_update", "reset_prefix", "reset_encoder",
                                  "resume"]

    serve(test)


def test_a_cache_that_does_not_reset_makes_the_commit_a_500_with_a_dirty_version():
    async def test(client, stub):
        stub.prefix_reset = False
        await client.post("/hotweights/begin", json=body(), headers=AUTH)
        r = await client.post("/hotweights/commit", json=body(), headers=AUTH)
        assert r.status_code == 500 and r.json()["dirty"] is True
        assert "reset_caches failed" in r.json()["error"] and r.json()["version"] == f"1@{SID}"
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["state"] == "idle" and status["dirty_versions"] == [f"1@{SID}"]

    serve(test)


@pytest.mark.parametrize("header", ["Bearer t0k", "bearer t0k", "BEARER  t0k"])
def test_the_bearer_scheme_is_case_insensitive(header):
    async def test(client, stub):
        r = await client.get("/hotweights/status", headers={"Authorization": header})
        assert r.status_code == 200

    serve(test)


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic t0k", "t0k", "Bearer"])
def test_wrong_or_missing_tokens_are_401_on_every_route(header):
    async def test(client, stub):
        headers = {"Authorization": header} if header else {}
        for route in ("manifest", "status"):
            assert (await client.get(f"/hotweights/{route}", headers=headers)).status_code == 401
        for route in ("begin", "renew", "commit", "abort"):
            r = await client.post(f"/hotweights/{route}", json=body(), headers=headers)
            assert r.status_code == 401, route
        assert "pause:wait" not in stub.calls

    serve(test)


@pytest.mark.parametrize(("route", "payload", "message"), [
    ("begin", "not json", "not JSON"),
    ("begin", {"server_id": SID}, "field 'holder' is required"),
    ("begin", body(lease_s="soon"), "field 'lease_s' must be a float"),
    ("begin", body(mode="later"), "field 'mode' must be one of"),
    ("renew", body(lease_s=0), "'lease_s' must be in"),
    ("commit", {"holder": "h1"}, "field 'server_id' is required"),
    ("abort", body(dirty="yes"), "field 'dirty' must be a bool"),
    ("begin", body(lease=3), "unknown field"),
])
def test_bad_bodies_are_400_naming_the_field(route, payload, message):
    async def test(client, stub):
        kw = {"content": payload} if isinstance(payload, str) else {"json": payload}
        r = await client.post(f"/hotweights/{route}", headers=AUTH, **kw)
        assert r.status_code == 400 and message in r.json()["error"]
        assert "pause:wait" not in stub.calls

    serve(test)


def test_a_trainer_of_a_previous_server_start_gets_409_restarted():
    async def test(client, stub):
        r = await client.post("/hotweights/begin", json=body(server_id="old"), headers=AUTH)
        assert r.status_code == 409 and "restarted" in r.json()["error"]
        assert r.json()["server_id"] == SID

    serve(test)


def test_a_second_trainer_gets_409_naming_the_holder():
    async def test(client, stub):
        await client.post("/hotweights/begin", json=body(), headers=AUTH)
        r = await client.post("/hotweights/begin", json=body(holder="h2"), headers=AUTH)
        assert r.status_code == 409 and r.json()["holder"] == "h1"

    serve(test)


def test_without_a_server_id_the_plugin_adds_nothing(monkeypatch):
    monkeypatch.delenv("HOTWEIGHTS_SERVER_ID")

    async def main():
        routes, app = HotweightsRoutes(), FastAPI()
        routes.attach_router(app)
        await routes.init_state(StubClient(), None, None)  # no token needed, no error
        assert not [r for r in app.routes if getattr(r, "path", "").startswith("/hotweights")]
        assert app.user_middleware == [] and routes.tx is None

    asyncio.run(main())


@pytest.mark.parametrize("flag", ["api_server_count", "data_parallel_size"])
def test_split_servers_are_refused(flag):
    args = type("Args", (), {flag: 2})()
    with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')} > 1"):
        serve(lambda client, stub: asyncio.sleep(0), args=args)


def test_status_json_is_plain():
    async def test(client, stub):
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        json.dumps(status)
        assert status["server_id"] == SID and status["version"] == f"0@{SID}"
        assert status["lease_expires"] is None and status["dirty"] is False

    serve(test)


def test_a_remote_server_stages_on_receive_applies_on_commit_and_discards_on_abort(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        assert "hotweights_share" not in stub.calls  # nothing shared: updates come remotely
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["remote"] is True and status["workers"] == 1
        assert status["channel_ranks"] == 1 and status["device"] == "cpu"  # a Gloo channel
        assert status["protocol"] == PROTOCOL
        assert status["dtypes"] == {"default": "bfloat16", "others": {}}  # the workers'
        info = (await client.get("/hotweights/server_info", headers=AUTH)).json()
        assert info["weight_transfer_config"] == {"backend": REMOTE_ENGINE}
        r = await client.post("/hotweights/remote/receive", json=body(), headers=AUTH)
        assert r.status_code == 409 and "no update in progress for h1" in r.json()["error"]
        r = await client.post("/hotweights/remote/join", json=body(master_addr="10.0.0.1"),
                              headers=AUTH)
        assert r.status_code == 400 and "field 'master_port' is required" in r.json()["error"]
        join = body(master_addr="10.0.0.1", master_port=29500, rank_offset=1, world_size=3,
                    token="chan-token", timeout=5.0)
        r = await client.post("/hotweights/remote/join", json=join, headers=AUTH)
        assert r.status_code == 400 and "the trainer speaks channel protocol < 3, this " \
            f"server {PROTOCOL}: run the same hotweights version" in r.json()["error"]
        r = await client.post("/hotweights/remote/join", json={**join, "protocol": 2},
                              headers=AUTH)
        assert r.status_code == 400 and "channel protocol 2" in r.json()["error"]
        for bad in ({"timeout": 0.0}, {"timeout": -5.0}, {"timeout": 1e12},
                    {"master_port": 70000}, {"rank_offset": 3}):  # the channel kept
            r = await client.post("/hotweights/remote/join", json={
                **join, "protocol": PROTOCOL, **bad}, headers=AUTH)
            assert r.status_code == 400 and f"field '{next(iter(bad))}' must be" in \
                r.json()["error"]
        assert "init_weight_transfer_engine" not in stub.calls  # refused before the workers
        join["protocol"] = PROTOCOL
        r = await client.post("/hotweights/remote/join", json=join, headers=AUTH)
        assert r.status_code == 200 and r.json() == {"workers": 1, "version": f"0@{SID}",
                                                      "xor": False, "channel_ranks": 1}
        await client.post("/hotweights/begin", json=body(), headers=AUTH)
        r = await client.post("/hotweights/remote/join", json=join, headers=AUTH)
        assert r.status_code == 409 and "join between updates" in r.json()["error"]
        for bad in ({"wait_s": -1.0}, {"wait_s": 1e9}, {"update": "u" * 201}):
            r = await client.post("/hotweights/remote/receive", json=body(**bad), headers=AUTH)
            assert r.status_code == 400 and f"field '{next(iter(bad))}' must be" in \
                r.json()["error"]
        await client.post("/hotweights/remote/receive", json=body(), headers=AUTH)
        assert stub.args["hotweights_remote_receive"] == (None, None)  # not announced
        await client.post("/hotweights/remote/receive", json=body(update="u7", wait_s=90),
                          headers=AUTH)
        assert stub.args["hotweights_remote_receive"] == ("u7", 90.0)  # the workers wait
        r = await client.post("/hotweights/commit", json=body(n=4), headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == f"4@{SID}"
        i = max(i for i, c in enumerate(stub.calls) if c == "hotweights_remote_receive")
        # the commit applies and resets the caches (at once: both while paused)
        assert set(stub.calls[i + 1:i + 4]) == {"hotweights_remote_apply", "reset_prefix",
                                                "reset_encoder"}
        await client.post("/hotweights/begin", json=body(), headers=AUTH)
        r = await client.post("/hotweights/abort", json=body(dirty=False), headers=AUTH)
        assert r.json()["version"] == f"4@{SID}" and stub.calls[-2:] == [
            "hotweights_remote_discard", "resume"]

    serve(test)


def test_a_remote_commit_arms_the_next_update_whose_receive_then_needs_no_engine_request(
        monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)

        async def update(n: int, update: str, next_update: str) -> int:
            """One update; how many receive requests reached the engine."""
            before = stub.calls.count("hotweights_remote_receive")
            await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
            r = await client.post("/hotweights/remote/receive", json=body(update=update),
                                  headers=AUTH)
            assert r.status_code == 200
            r = await client.post("/hotweights/commit", json=body(
                n=n, next_update=next_update), headers=AUTH)
            assert r.status_code == 200 and r.json()["version"] == f"{n}@{SID}"
            assert stub.args["hotweights_remote_apply"] == (next_update or None,)
            return stub.calls.count("hotweights_remote_receive") - before

        assert await update(1, "u1", "u2") == 1  # not armed yet
        assert (await client.get("/hotweights/status", headers=AUTH)).json()["armed"]
        assert await update(2, "u2", "u3") == 0  # the workers wait for u2 since commit 1
        assert await update(3, "other", "u4") == 1  # another id: asked for (the wait dropped)
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        await client.post("/hotweights/abort", json=body(dirty=False), headers=AUTH)
        assert await update(4, "u4", "") == 1  # an abort drops the armed wait
        assert await update(5, "u5", "") == 1  # a commit without next_update arms nothing
        assert not (await client.get("/hotweights/status", headers=AUTH)).json()["armed"]
        r = await client.post("/hotweights/commit", json=body(next_update="x" * 201),
                              headers=AUTH)
        assert r.status_code == 400 and "field 'next_update'" in r.json()["error"]

    serve(test)


def test_another_trainer_s_commit_during_the_holder_s_leaves_its_next_update_alone(
        monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        go, paused, pause = asyncio.Event(), asyncio.Event(), stub.pause_generation

        async def slow_pause(mode, clear_cache):  # the engine step in flight ends
            paused.set()
            await go.wait()
            await pause(mode, clear_cache)
        stub.pause_generation = slow_pause
        mine = asyncio.ensure_future(client.post("/hotweights/commit", json=body(
            next_update="mine"), headers=AUTH))
        await asyncio.wait_for(paused.wait(), 30)  # the holder's commit waits for the pause
        theirs = [asyncio.ensure_future(client.post(f"/hotweights/{route}", json={
            **body(**extra), "holder": "h2"}, headers=AUTH)) for route, extra in (
            ("commit", {"next_update": "theirs"}), ("remote/receive", {}))]
        await asyncio.sleep(0.05)  # they wait for the holder's commit
        go.set()
        assert (await mine).status_code == 200
        assert stub.args["hotweights_remote_apply"] == ("mine",)  # not h2's next update
        for r in await asyncio.gather(*theirs):
            assert r.status_code == 409 and "no update in progress for h2" in r.json()["error"]
        assert "hotweights_remote_receive" not in stub.calls

    serve(test)


def test_a_remote_server_whose_channel_broke_reports_none_so_the_trainer_opens_a_new_one(
        monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        joined = (await client.get("/hotweights/status", headers=AUTH)).json()["channel"]
        assert joined
        stub.broken = True  # its acknowledgement failed after the trainer's had ended
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        await client.post("/hotweights/remote/receive", json=body(update="u1"), headers=AUTH)
        r = await client.post("/hotweights/commit", json=body(n=1, next_update="u2"),
                              headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == f"1@{SID}"  # it stands
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["channel"] is None and not status["armed"]
        stub.broken = False
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        assert (await client.get("/hotweights/status", headers=AUTH)).json()["channel"] == joined
        stub.broken = True  # a dropped receive left behind (its trainer's host gone)
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        await client.post("/hotweights/remote/receive", json=body(update="u3"), headers=AUTH)
        await client.post("/hotweights/abort", json=body(dirty=False), headers=AUTH)
        assert (await client.get("/hotweights/status", headers=AUTH)).json()["channel"] is None

    serve(test)


def test_a_remote_commit_waits_for_the_receive_in_flight_and_a_failed_one_applies_nothing(
        monkeypatch, caplog):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        received, rpc, failing = asyncio.Event(), stub.collective_rpc, []

        async def slow(method, args=()):
            if method == "hotweights_remote_receive":
                await received.wait()
                if failing:
                    raise RuntimeError("channel rank 1: round 1/1 failed: the sender is gone")
            return await rpc(method, args)
        stub.collective_rpc = slow

        async def update(n):
            await client.post("/hotweights/begin", json=body(), headers=AUTH)
            receive = asyncio.ensure_future(client.post(
                "/hotweights/remote/receive", json=body(update="u", wait_s=5.0), headers=AUTH))
            await asyncio.sleep(0.05)
            commit = asyncio.ensure_future(client.post("/hotweights/commit", json=body(n=n),
                                                       headers=AUTH))
            await asyncio.sleep(0.05)
            assert not commit.done() and "hotweights_remote_apply" not in stub.calls[-3:]
            received.set()
            return await receive, await commit

        receive, commit = await update(2)
        assert receive.status_code == 200 and commit.status_code == 200
        assert stub.calls.index("hotweights_remote_receive") < stub.calls.index(
            "hotweights_remote_apply")
        received.clear()
        failing.append(True)
        applied = stub.calls.count("hotweights_remote_apply")
        receive, commit = await update(3)
        assert receive.status_code == 502 and commit.status_code == 503
        assert commit.json() == {"error": "the update was not applied (the update's receive "
                                 "failed: Refused('hotweights_remote_receive failed on a "
                                 "worker: channel rank 1: round 1/1 failed: the sender is "
                                 f"gone')); the server serves 2@{SID}, unchanged; update "
                                 "again", "n": 2}
        assert stub.calls.count("hotweights_remote_apply") == applied  # nothing applied
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["version"] == f"2@{SID}" and not status["dirty"]
        assert status["state"] == "idle"

    serve(test)


@pytest.mark.parametrize("workers", [["failed"], ["failed", "applied"]])
def test_a_staged_update_no_worker_applied_keeps_the_version(monkeypatch, workers):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        rpc = stub.collective_rpc

        async def apply(method, args=()):
            if method != "hotweights_remote_apply":
                return await rpc(method, args)
            stub.calls.append(method)
            return [{"applied": False, "error": "RemoteError('round 2/3: digest mismatch')"}
                    if w == "failed" else {"applied": True, "armed": False, "broken": False}
                    for w in workers]
        stub.collective_rpc = apply
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        r = await client.post("/hotweights/commit", json=body(n=5), headers=AUTH)
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        if workers == ["failed"]:  # nothing written anywhere: the old weights, old version
            assert r.status_code == 503 and "the workers' receive failed: RemoteError(" \
                "'round 2/3: digest mismatch')" in r.json()["error"]
            assert status["version"] == f"0@{SID}" and not status["dirty"]
        else:  # some workers wrote: a new version, dirty
            assert r.status_code == 500 and r.json()["dirty"]
            assert status["version"] == f"5@{SID}" and status["dirty"]

    serve(test)


def test_a_worker_error_on_receive_is_a_502_naming_it(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        async def fail(method, args=()):
            raise RuntimeError("channel 1.2.3.4:5 rank 1: round 2/3 failed: the sender is gone")
        await client.post("/hotweights/begin", json=body(), headers=AUTH)
        stub.collective_rpc = fail
        r = await client.post("/hotweights/remote/receive", json=body(), headers=AUTH)
        assert r.status_code == 502
        assert r.json()["error"] == ("hotweights_remote_receive failed on a worker: channel "
                                     "1.2.3.4:5 rank 1: round 2/3 failed: the sender is gone")

    serve(test)


def test_a_remote_server_stages_while_serving_and_pauses_only_to_apply(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        r = await client.post("/hotweights/begin", json=body(stage=True, mode="keep"),
                              headers=AUTH)
        assert r.status_code == 200
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["state"] == "staging" and not status["paused"]
        await client.post("/hotweights/remote/receive", json=body(update="u", wait_s=5.0),
                          headers=AUTH)
        assert not any(c.startswith("pause") for c in stub.calls)  # received while serving
        r = await client.post("/hotweights/commit", json=body(n=3), headers=AUTH)
        assert r.status_code == 200 and r.json()["paused_s"] > 0
        i = stub.calls.index("hotweights_remote_receive")
        assert stub.calls[i + 1] == "pause:keep" and stub.calls[-1] == "resume"
        assert "hotweights_remote_apply" in stub.calls[i + 2:]
        calls = len(stub.calls)
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        r = await client.post("/hotweights/abort", json=body(), headers=AUTH)  # dirty=True
        assert r.json() == {"version": f"3@{SID}", "n": 3, "dirty": False}
        assert stub.calls[calls:] == ["hotweights_remote_discard"]  # never paused

    serve(test)


def test_a_commit_without_a_receive_of_an_update_the_workers_wait_for_applies_nothing(
        monkeypatch):
    # the workers armed for the next update (the last commit's next_update): an apply would
    # join their wait for it, forever, the server paused in its commit
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        await client.post("/hotweights/remote/receive", json=body(update="u1", wait_s=5.0),
                          headers=AUTH)
        r = await client.post("/hotweights/commit", json=body(n=1, next_update="u2"),
                              headers=AUTH)
        assert r.status_code == 200 and stub.args["hotweights_remote_apply"] == ("u2",)
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        calls = len(stub.calls)
        r = await client.post("/hotweights/commit", json=body(n=2), headers=AUTH)  # no receive
        assert r.status_code == 503 and "no receive of the update before its commit" in \
            r.json()["error"]
        assert "hotweights_remote_discard" in stub.calls[calls:]
        assert "hotweights_remote_apply" not in stub.calls[calls:]
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert (status["state"], status["n"]) == ("idle", 1)

    serve(test)


def test_stage_is_refused_on_a_local_server():
    async def test(client, stub):
        r = await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        assert r.status_code == 400 and "field 'stage' needs a `hotweights serve --remote`" \
            in r.json()["error"]
        assert (await client.get("/hotweights/status", headers=AUTH)).json()["state"] == "idle"

    serve(test)


def test_the_dtypes_a_remote_status_names_do_not_depend_on_the_workers_order():
    # each worker names every tensor; one that keeps a slab in float32 says so (a pipeline
    # stage that does not hold it names the served dtype)
    from hotweights.vllm_plugin.routes import _dtypes
    holds = {"x": "bfloat16", "a_log": "float32", "ids": "int64"}
    other = {"x": "bfloat16", "a_log": "bfloat16", "ids": "int64"}
    for workers in ([holds, other], [other, holds]):
        assert _dtypes(workers) == {"default": "bfloat16",
                                    "others": {"a_log": "float32", "ids": "int64"}}
    assert _dtypes([]) == {"default": None, "others": {}}


def test_an_abort_as_the_drain_ends_leaves_the_engine_resumed_not_paused():
    # the holder's abort in the loop's turn that ends the last request: the abort resumed
    # first, then the drain's wait woke and paused the scheduler, for good (the gate open,
    # the transaction idle, every request queued in vLLM)
    from hotweights.server.bodies import Abort, Begin, Refused
    from hotweights.server.transaction import Transaction
    from hotweights.vllm_plugin.gate import Gate
    from hotweights.vllm_plugin.routes import VllmEngine

    calls = []

    class Core:
        async def pause_scheduler_async(self, mode, clear_cache):
            calls.append("pause")
            await asyncio.sleep(0.05)

    class Client:
        engine_core = Core()

        async def resume_generation(self):
            calls.append("resume")

        async def update_weight_version(self, label):
            pass

    async def main():
        gate = Gate()
        tx = Transaction(VllmEngine(Client(), gate), SID)
        request = object()
        gate._enter(request)  # one request in flight: the drain waits for it
        begin = asyncio.ensure_future(tx.begin(Begin("h", SID, mode="wait", lease_s=30)))
        for _ in range(5):
            await asyncio.sleep(0)
        abort = asyncio.ensure_future(tx.abort(Abort("h", SID, dirty=False)))
        gate._leave(request)  # in the same turn
        await abort
        with pytest.raises(Refused, match="aborted its begin"):
            await begin
        await asyncio.sleep(0.1)
        return tx.state.value, gate.open.is_set()

    assert asyncio.run(main()) == ("idle", True)
    assert calls[-1] == "resume" and "pause" not in calls[calls.index("resume"):]


def test_an_engine_that_fails_a_begin_is_named_in_json_and_the_server_resumes(caplog):
    async def test(client, stub):
        async def dead(mode, clear_cache):
            raise RuntimeError("EngineCore died")
        stub.pause_generation = dead
        r = await client.post("/hotweights/begin", json=body(mode="keep"), headers=AUTH)
        assert r.status_code == 500 and r.json() == {
            "error": "/hotweights/begin failed on the server: RuntimeError('EngineCore died')"}
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["state"] == "idle" and stub.calls[-1] == "resume"

    serve(test)


def test_a_late_receive_of_the_holder_s_earlier_update_leaves_the_next_one_alone(monkeypatch):
    # it would start a receive of its update in the workers, dropping the next one's
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        await client.post("/hotweights/begin", json=body(stage=True, seq=1), headers=AUTH)
        await client.post("/hotweights/remote/receive", json=body(update="u1", seq=1),
                          headers=AUTH)
        await client.post("/hotweights/commit", json=body(n=1, next_update="u2", seq=1),
                          headers=AUTH)
        await client.post("/hotweights/begin", json=body(stage=True, seq=2), headers=AUTH)
        calls = stub.calls.count("hotweights_remote_receive")
        r = await client.post("/hotweights/remote/receive", json=body(update="u1", seq=1),
                              headers=AUTH)
        assert r.status_code == 409 and "arrived late" in r.json()["error"]
        assert stub.calls.count("hotweights_remote_receive") == calls
        assert (await client.get("/hotweights/status", headers=AUTH)).json()["armed"]
        r = await client.post("/hotweights/remote/receive", json=body(update="u2", seq=2),
                              headers=AUTH)
        assert r.status_code == 200 and r.json()["armed"]  # the workers' wait taken
        r = await client.post("/hotweights/commit", json=body(n=2, seq=2), headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == f"2@{SID}"

    serve(test)


def test_the_checksum_and_the_remote_routes_refuse_a_wrong_token_401(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for route in ("checksum", "remote/received"):
                r = await client.get(f"/hotweights/{route}", headers=headers)
                assert r.status_code == 401, route
            for route, payload in (("remote/join", JOIN), ("remote/receive", body())):
                r = await client.post(f"/hotweights/{route}", json=payload, headers=headers)
                assert r.status_code == 401, route
        assert not {"hotweights_checksum", "hotweights_remote_received",
                    "init_weight_transfer_engine"} & set(stub.calls)

    serve(test)


def test_a_staged_update_leaves_the_checksum_answered_at_once(monkeypatch):
    # staging has not touched the served weights: nothing to wait for
    from hotweights.vllm_plugin import routes as routes_module

    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")
    monkeypatch.setattr(routes_module, "_CHECKSUM_WAIT_S", 0.3)

    async def test(client, stub):
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        r = await client.get("/hotweights/checksum", headers=AUTH)
        assert r.status_code == 200 and r.json() == {"version": f"0@{SID}", "checksum": [None]}

    serve(test)


def test_a_remote_status_names_the_checkpoint_loaded_only_until_the_first_commit(monkeypatch):
    from hotweights.vllm_plugin import routes as routes_module

    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")
    monkeypatch.setattr(routes_module, "_loaded", lambda *args: "digest-of-the-load")

    async def test(client, stub):
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["checkpoint"] == "digest-of-the-load"
        await client.post("/hotweights/begin", json=body(), headers=AUTH)
        await client.post("/hotweights/commit", json=body(), headers=AUTH)
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["version"] == f"1@{SID}" and status["checkpoint"] is None

    serve(test)


def test_a_local_server_has_no_channel_rank_and_no_remote_routes():
    async def test(client, stub):
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["remote"] is False and status["channel_ranks"] == 0
        r = await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        assert r.status_code == 404
        assert "init_weight_transfer_engine" not in stub.calls

    serve(test)


def test_hotweights_remote_0_is_a_local_server(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "0")  # what `hotweights serve` sets without --remote

    async def test(client, stub):
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert status["remote"] is False and "hotweights_share" in stub.calls

    serve(test)


def test_a_server_started_without_a_token_refuses_to_start(monkeypatch):
    monkeypatch.delenv("HOTWEIGHTS_TOKEN")
    with pytest.raises(ConfigError, match="HOTWEIGHTS_TOKEN is not set"):
        serve(lambda client, stub: asyncio.sleep(0))


def test_next_update_is_refused_on_a_local_server():
    async def test(client, stub):
        await client.post("/hotweights/begin", json=body(), headers=AUTH)
        r = await client.post("/hotweights/commit", json=body(next_update="u2"), headers=AUTH)
        assert r.status_code == 400 and "field 'next_update' needs a `hotweights serve " \
            "--remote` server" in r.json()["error"]
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert (status["state"], status["n"]) == ("paused", 0)  # still the holder's

    serve(test)


def test_a_join_takes_its_fields_bounds_inclusively_and_needs_a_channel_token(monkeypatch):
    from hotweights.server.bodies import MAX_LEASE_S

    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        for bad, message in (({"token": ""}, "field 'token' is required"),
                             ({"max_round_bytes": 63}, "field 'max_round_bytes' must be >= 64"),
                             ({"protocol": PROTOCOL + 1}, f"channel protocol {PROTOCOL + 1}")):
            r = await client.post("/hotweights/remote/join", json={**JOIN, **bad}, headers=AUTH)
            assert r.status_code == 400 and message in r.json()["error"], bad
        assert "init_weight_transfer_engine" not in stub.calls
        for edge in ({"max_round_bytes": 64}, {"timeout": MAX_LEASE_S},
                     {"master_port": 65535}, {"rank_offset": 2, "world_size": 3}):
            r = await client.post("/hotweights/remote/join", json={**JOIN, **edge}, headers=AUTH)
            assert r.status_code == 200, edge

    serve(test)


def test_a_join_is_taken_after_an_expired_lease(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        await client.post("/hotweights/begin", json=body(lease_s=0.05), headers=AUTH)
        for _ in range(40):
            await asyncio.sleep(0.05)
            status = (await client.get("/hotweights/status", headers=AUTH)).json()
            if status["state"] == "expired":
                break
        assert status["state"] == "expired"
        r = await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        assert r.status_code == 200

    serve(test)


def test_a_status_names_the_channel_joined_by_address_and_a_hash_of_its_token(monkeypatch):
    from hotweights.remote.rendezvous import channel_id

    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        first = (await client.get("/hotweights/status", headers=AUTH)).json()["channel"]
        assert first == channel_id("10.0.0.1", 29500, "chan-token") and "chan-token" not in first
        await client.post("/hotweights/remote/join", json={**JOIN, "token": "another"},
                          headers=AUTH)
        second = (await client.get("/hotweights/status", headers=AUTH)).json()["channel"]
        assert second == channel_id("10.0.0.1", 29500, "another") != first  # a new channel

    serve(test)


def test_a_new_join_drops_the_armed_wait_for_the_next_update(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        await client.post("/hotweights/remote/receive", json=body(update="u1"), headers=AUTH)
        await client.post("/hotweights/commit", json=body(next_update="u2"), headers=AUTH)
        assert (await client.get("/hotweights/status", headers=AUTH)).json()["armed"]
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        assert not (await client.get("/hotweights/status", headers=AUTH)).json()["armed"]
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        calls = stub.calls.count("hotweights_remote_receive")
        r = await client.post("/hotweights/remote/receive", json=body(update="u2"),
                              headers=AUTH)
        assert r.status_code == 200 and "armed" not in r.json()  # asked of the workers
        assert stub.calls.count("hotweights_remote_receive") == calls + 1

    serve(test)


def test_a_broken_channel_stays_reported_through_an_abort_until_a_new_join(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        stub.broken = True
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        await client.post("/hotweights/remote/receive", json=body(update="u1"), headers=AUTH)
        await client.post("/hotweights/commit", json=body(), headers=AUTH)
        stub.broken = False  # a discard that finds nothing left behind
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        await client.post("/hotweights/abort", json=body(dirty=False), headers=AUTH)
        assert (await client.get("/hotweights/status", headers=AUTH)).json()["channel"] is None

    serve(test)


def test_a_single_worker_joins_without_a_relay(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    # the relay hands the first worker's rounds on to the others: one worker needs none
    async def test(client, stub):
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        (info,) = stub.args["init_weight_transfer_engine"]
        assert info["rank_offset"] == 1 and "relay_port" not in info

    serve(test)


def test_with_two_workers_a_join_relays_and_every_worker_must_arm_or_decode_xor(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")
    one = StubClient.collective_rpc
    second = {"hotweights_remote_decodes_xor": False,
              "hotweights_remote_apply": {"armed": False, "broken": True}}

    async def two_workers(self, method, args=()):  # the second worker's answer after the first's
        (first,) = await one(self, method, args)
        return [first, second.get(method, first)]
    monkeypatch.setattr(StubClient, "collective_rpc", two_workers)

    async def test(client, stub):
        first = {"hotweights_remote_decodes_xor": True}
        rpc = stub.collective_rpc

        async def answers(method, args=()):
            out = await rpc(method, args)
            return [first.get(method, out[0]), *out[1:]]
        stub.collective_rpc = answers
        r = await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        assert r.status_code == 200 and r.json()["workers"] == 2
        assert r.json()["xor"] is False  # one worker cannot decode it
        (info,) = stub.args["init_weight_transfer_engine"]
        assert info["relay_port"] > 0 and len(info["relay_token"]) == 32
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        await client.post("/hotweights/remote/receive", json=body(update="u1"), headers=AUTH)
        r = await client.post("/hotweights/commit", json=body(next_update="u2"), headers=AUTH)
        assert r.status_code == 200
        status = (await client.get("/hotweights/status", headers=AUTH)).json()
        assert not status["armed"]  # the second worker does not wait for u2
        assert status["channel"] is None  # the second worker's channel broke

    serve(test)


def test_a_failed_receive_s_commit_frees_the_workers_staging(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        rpc = stub.collective_rpc

        async def failing(method, args=()):
            if method == "hotweights_remote_receive":
                stub.calls.append(method)
                raise RuntimeError("round 1/1 failed: the sender is gone")
            return await rpc(method, args)
        stub.collective_rpc = failing
        await client.post("/hotweights/begin", json=body(stage=True), headers=AUTH)
        r = await client.post("/hotweights/remote/receive", json=body(), headers=AUTH)
        assert r.status_code == 502
        calls = len(stub.calls)
        r = await client.post("/hotweights/commit", json=body(), headers=AUTH)
        assert r.status_code == 503 and "the update's receive failed" in r.json()["error"]
        assert "hotweights_remote_discard" in stub.calls[calls:]
        assert "hotweights_remote_apply" not in stub.calls[calls:]

    serve(test)


class _Client:
    """The engine client calls a `VllmEngine` pause and resume make, in order."""

    def __init__(self, gate=None):
        self.calls: list[str] = []
        self.gate, self.go = gate, asyncio.Event()
        self.go.set()
        self.request_states: dict = {}
        self.output_processor = self  # where vLLM keeps the requests it runs

    async def pause_generation(self, mode, clear_cache):
        self.calls.append("pause")
        await self.go.wait()
        self.calls.append("paused")

    async def resume_generation(self):
        self.calls.append("resume")

    async def abort(self, ids, internal):
        self.calls.append(f"abort:{','.join(ids)}")
        for i in ids:  # their responses end
            self.gate._leave(self.request_states.pop(i))


def test_a_pause_whose_drain_outlived_a_resume_is_not_sent():
    # the drain's wait woke after the abort's resume: a pause then would hold the engine
    # paused with the gate open
    from hotweights.vllm_plugin.gate import Gate
    from hotweights.vllm_plugin.routes import VllmEngine

    async def main():
        gate, client = Gate(), _Client()
        engine, request = VllmEngine(client, gate), object()
        gate._enter(request)
        pause = asyncio.ensure_future(engine.pause("wait"))
        await asyncio.sleep(0)
        await engine.resume()
        gate._leave(request)
        with pytest.raises(asyncio.CancelledError):
            await pause
        return client.calls

    assert asyncio.run(main()) == ["resume"]


def test_a_resume_waits_for_the_pause_in_flight():
    from hotweights.vllm_plugin.gate import Gate
    from hotweights.vllm_plugin.routes import VllmEngine

    async def main():
        client = _Client()
        engine = VllmEngine(client, Gate())
        client.go.clear()  # the scheduler's pause takes a while
        pause = asyncio.ensure_future(engine.pause("keep"))
        await asyncio.sleep(0.01)
        resume = asyncio.ensure_future(engine.resume())
        await asyncio.sleep(0.01)
        assert not resume.done()
        client.go.set()
        await asyncio.gather(pause, resume)
        return client.calls

    assert asyncio.run(main()) == ["pause", "paused", "resume"]


def test_an_abort_pause_aborts_every_request_past_the_gate_until_none_is_left():
    # also those that reached the engine after the pause: vLLM would run them on the new
    # weights
    from hotweights.vllm_plugin.gate import Gate
    from hotweights.vllm_plugin.routes import VllmEngine

    async def main():
        gate = Gate()
        client = _Client(gate)
        engine = VllmEngine(client, gate)
        for i in ("r1", "r2"):
            client.request_states[i] = type("Exchange", (), {"aborted": False})()
            gate._enter(client.request_states[i])
        exchanges = list(client.request_states.values())
        await asyncio.wait_for(engine.pause("abort"), 5)
        assert all(e.aborted for e in exchanges)  # their streams get a finish reason
        return client.calls, gate.idle.is_set()

    assert asyncio.run(main()) == (["pause", "paused", "abort:r1,r2"], True)


async def _started():
    """The routes of a server on a stub client, for tests that call their handlers."""
    routes, stub = HotweightsRoutes(), StubClient()
    routes.attach_router(FastAPI())
    await routes.init_state(stub, None, type("Args", (), {})())
    return routes, stub


def test_a_receive_whose_caller_went_away_goes_on_for_the_commit(monkeypatch):
    # the workers' receive runs on: cancelling it would leave the trainer's rounds unread
    from hotweights.server.bodies import Begin, Receive

    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def main():
        routes, stub = await _started()
        go, rpc = asyncio.Event(), stub.collective_rpc

        async def slow(method, args=()):
            if method == "hotweights_remote_receive":
                await go.wait()
            return await rpc(method, args)
        stub.collective_rpc = slow
        await routes.tx.begin(Begin("h1", SID, stage=True))
        caller = asyncio.ensure_future(routes._receive(Receive("h1", SID, update="u1")))
        await asyncio.sleep(0.01)
        caller.cancel()  # the trainer's HTTP request went away
        await asyncio.sleep(0.01)
        receiving = routes.tx.engine.receiving
        assert receiving is not None and not receiving.cancelled()
        go.set()
        await receiving
        return stub.calls.count("hotweights_remote_receive")

    assert asyncio.run(main()) == 1


def test_a_join_that_fails_on_the_workers_is_a_502_and_leaves_no_channel(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        await client.post("/hotweights/remote/join", json=JOIN, headers=AUTH)
        rpc = stub.collective_rpc

        async def failing(method, args=()):
            if method == "init_weight_transfer_engine":
                raise RuntimeError("connect to 10.0.0.1:29501 timed out")
            return await rpc(method, args)
        stub.collective_rpc = failing
        r = await client.post("/hotweights/remote/join", json={**JOIN, "master_port": 29501},
                              headers=AUTH)
        assert r.status_code == 502 and "init_weight_transfer_engine failed on a worker: " \
            "connect to 10.0.0.1:29501 timed out" in r.json()["error"]
        assert (await client.get("/hotweights/status", headers=AUTH)).json()["channel"] is None

    serve(test)


def test_a_join_from_a_trainer_of_a_previous_server_start_gets_409_restarted(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        r = await client.post("/hotweights/remote/join", json={**JOIN, "server_id": "old"},
                              headers=AUTH)
        assert r.status_code == 409 and "restarted" in r.json()["error"]
        assert "init_weight_transfer_engine" not in stub.calls

    serve(test)


def test_received_answers_each_worker_s_bytes_and_a_worker_error_as_a_502(monkeypatch):
    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def test(client, stub):
        rpc = stub.collective_rpc
        counts = {"trainer": 10, "relay": 0, "staged": 8, "peak_staging": 12}

        async def received(method, args=()):
            if method == "hotweights_remote_received":
                if not counts:
                    raise RuntimeError("the worker died")
                return [counts]
            return await rpc(method, args)
        stub.collective_rpc = received
        r = await client.get("/hotweights/remote/received", headers=AUTH)
        assert r.json() == {"trainer_bytes": [10], "relay_bytes": [0], "staged_bytes": [8],
                            "peak_staging_bytes": [12]}
        counts.clear()
        r = await client.get("/hotweights/remote/received", headers=AUTH)
        assert r.status_code == 502 and r.json()["error"] == (
            "hotweights_remote_received failed on a worker: the worker died")

    serve(test)


def test_a_local_status_counts_the_workers_that_shared_their_weights(monkeypatch):
    one = StubClient.collective_rpc

    async def two_workers(self, method, args=()):
        return 2 * await one(self, method, args)
    monkeypatch.setattr(StubClient, "collective_rpc", two_workers)

    async def test(client, stub):
        manifests = (await client.get("/hotweights/manifest", headers=AUTH)).json()["manifests"]
        assert len(manifests) == 2
        assert (await client.get("/hotweights/status", headers=AUTH)).json()["workers"] == 2

    serve(test)


def test_a_receive_cancelled_on_the_engine_s_side_applies_nothing(monkeypatch):
    # (vLLM cancels the futures of its RPCs as it shuts its engine down)
    from hotweights.server.bodies import Begin, Commit, Receive, Refused

    monkeypatch.setenv("HOTWEIGHTS_REMOTE", "1")

    async def main():
        routes, stub = await _started()
        rpc = stub.collective_rpc

        async def cancelled(method, args=()):
            if method == "hotweights_remote_receive":
                raise asyncio.CancelledError
            return await rpc(method, args)
        stub.collective_rpc = cancelled
        await routes.tx.begin(Begin("h1", SID, stage=True))
        with pytest.raises(asyncio.CancelledError):
            await routes._receive(Receive("h1", SID, update="u1"))
        with pytest.raises(Refused, match="the update's receive failed: CancelledError"):
            await routes.tx.commit(Commit("h1", SID))
        return stub.calls

    calls = asyncio.run(main())
    assert "hotweights_remote_apply" not in calls and "hotweights_remote_discard" in calls
