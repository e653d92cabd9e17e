"""The update state machine with a stub engine: every route in every state, in milliseconds."""

import asyncio

import pytest

from hotweights.protocol.version import parse_version
from hotweights.server.bodies import Abort, Begin, Commit, Receive, Refused, Renew
from hotweights.server.transaction import _KEPT_DIRTY, State, Transaction

SID = "s1"


class StubEngine:
    """Records what the transaction asks of the server; steps can block or fail."""

    def __init__(self):
        self.held = self.paused = False
        self.requests = True  # in flight: a pause waits for the engine step
        self.label = None
        self.resumes = 0
        self.block: dict[str, asyncio.Event] = {}  # step -> released when set
        self.fail: set[str] = set()

    async def _step(self, name):
        if name in self.block:
            await self.block[name].wait()
        if name in self.fail:
            raise RuntimeError(f"{name} failed")

    def hold(self):
        self.held = True

    def release(self):
        self.held = False

    def busy(self):
        return self.requests

    async def pause(self, mode):
        await self._step("pause")
        self.paused = True

    async def resume(self):
        self.resumes += 1
        self.paused = False

    async def after_update(self):
        await self._step("after_update")

    async def reset_caches(self):
        await self._step("reset_caches")

    async def discard(self):
        await self._step("discard")

    async def set_version(self, label):
        self.label = label


def run(test, engine_class=None):
    """Run `test(tx, engine)` on a fresh transaction (over a `StubEngine`, or one of
    `engine_class`) inside one event loop."""
    engine = (engine_class or StubEngine)()

    async def main():
        return await test(Transaction(engine, SID), engine)

    return asyncio.run(main())


def begin(holder="h1", **kw):
    return Begin(holder=holder, server_id=SID, **kw)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def into(state: State, tx: Transaction, engine: StubEngine, lease_s=60.0):
    """Bring `tx` into `state` with holder h1; returns the task still running, if any."""
    if state is State.IDLE:
        return None
    if state is State.DRAINING:
        engine.block["pause"] = asyncio.Event()
        task = asyncio.ensure_future(tx.begin(begin(lease_s=lease_s)))
        await settle()
        return task
    if state is State.STAGING:
        await tx.begin(begin(lease_s=lease_s, stage=True))
        return None
    await tx.begin(begin(lease_s=0.01 if state is State.EXPIRED else lease_s))
    if state is State.EXPIRED:
        await asyncio.sleep(0.05)
    if state is State.COMMITTING:
        engine.block["after_update"] = asyncio.Event()
        task = asyncio.ensure_future(tx.commit(Commit("h1", SID)))
        await settle()
        return task
    return None


@pytest.mark.parametrize("state", list(State))
def test_into_reaches_each_state(state):
    async def test(tx, engine):
        task = await into(state, tx, engine)
        assert tx.state is state
        if task:
            task.cancel()

    run(test)


# state -> route -> expected: a state after success, or the HTTP status of the refusal
TABLE = {
    State.IDLE: dict(begin_same=State.PAUSED, begin_other=State.PAUSED, renew=409,
                     commit=409, abort=409),
    State.DRAINING: dict(begin_same=State.PAUSED, begin_other=409, renew=409, commit=409,
                         abort=State.IDLE),
    State.PAUSED: dict(begin_same=State.PAUSED, begin_other=409, renew=State.PAUSED,
                       commit=State.IDLE, abort=State.IDLE),
    # begin_same is a begin without `stage`: not the update this holder began
    State.STAGING: dict(begin_same=409, begin_other=409, renew=State.STAGING,
                        commit=State.IDLE, abort=State.IDLE),
    # a commit holds the transaction: what arrives meanwhile runs after it, on idle
    State.COMMITTING: dict(begin_same=State.PAUSED, begin_other=State.PAUSED, renew=409,
                           commit=409, abort=409),
    State.EXPIRED: dict(begin_same=State.PAUSED, begin_other=State.PAUSED, renew=409,
                        commit=409, abort=409),
}


@pytest.mark.parametrize("route", ["begin_same", "begin_other", "renew", "commit", "abort"])
@pytest.mark.parametrize("state", list(State))
def test_every_route_in_every_state(state, route):
    expected = TABLE[state][route]

    async def test(tx, engine):
        pending = await into(state, tx, engine)
        call = {
            "begin_same": lambda: tx.begin(begin("h1")),
            "begin_other": lambda: tx.begin(begin("h2")),
            "renew": lambda: tx.renew(Renew("h1", SID, lease_s=30)),
            "commit": lambda: tx.commit(Commit("h1", SID)),
            "abort": lambda: tx.abort(Abort("h1", SID)),
        }[route]
        task = asyncio.ensure_future(call())
        await settle()
        for event in engine.block.values():  # let a blocked drain or commit finish
            event.set()
        try:
            out = await task
        except Refused as e:
            assert e.status == expected, (state, route, str(e))
        else:
            assert tx.state is expected, (state, route, out)
            assert "version" in out
        if pending is not None:
            try:
                await pending
            except Refused as e:  # a drain aborted under its begin
                assert (state, route) == (State.DRAINING, "abort") and e.status == 409
        if tx.state in (State.IDLE, State.STAGING):
            assert not engine.held and not engine.paused
        elif tx.state is State.PAUSED:
            assert engine.held and engine.paused

    run(test)


def test_commit_serves_a_new_clean_version():
    async def test(tx, engine):
        granted = await tx.begin(begin())
        assert granted["version"] == f"0@{SID}" and engine.held and engine.paused
        status = tx.status()
        assert status["state"] == "paused" and status["paused"] and status["holder"] == "h1"
        out = await tx.commit(Commit("h1", SID))
        assert out == {"version": f"1@{SID}", "n": 1, "dirty": False, "dirty_reason": None,
                       "paused_s": tx.status()["last_paused_s"]} and out["paused_s"] > 0
        assert engine.label == f"1@{SID}" and not engine.held and not engine.paused
        assert tx.status()["updates"] == 1 and tx.status()["last_update_s"] is not None

    run(test)


def test_status_while_draining_has_a_deadline_and_says_paused():
    async def test(tx, engine):
        task = await into(State.DRAINING, tx, engine, lease_s=30)
        status = tx.status()
        assert status["state"] == "draining" and status["paused"] is True  # requests held
        assert status["holder"] == "h1" and status["lease_expires"] > 0
        assert 0 < status["lease_left_s"] <= 30
        engine.block["pause"].set()
        await task

    run(test)


@pytest.mark.parametrize("dirty", [True, False])
def test_abort_with_and_without_dirty(dirty):
    async def test(tx, engine):
        await tx.begin(begin())
        out = await tx.abort(Abort("h1", SID, dirty=dirty))
        status = tx.status()
        assert status["state"] == "idle" and not engine.paused and not engine.held
        if dirty:  # may have written: a new version, served dirty
            assert out["version"] == f"1@{SID}" and status["dirty"]
            assert status["dirty_versions"] == [f"1@{SID}"]
            assert "aborted by h1" in status["dirty_reason"]
        else:
            assert out["version"] == f"0@{SID}" and not status["dirty"]

    run(test)


@pytest.mark.parametrize("step", ["after_update", "reset_caches"])
def test_a_failed_commit_step_serves_a_new_dirty_version_and_a_clean_commit_clears_it(step):
    async def test(tx, engine):
        await tx.begin(begin())
        engine.fail.add(step)
        out = await tx.commit(Commit("h1", SID))
        assert out["dirty"] and step in out["dirty_reason"] and out["version"] == f"1@{SID}"
        assert tx.state is State.IDLE and not engine.paused and not engine.held
        engine.fail.clear()
        await tx.begin(begin())
        out = await tx.commit(Commit("h1", SID))
        assert not out["dirty"] and tx.status()["dirty_versions"] == [f"1@{SID}"]

    run(test)


def test_lease_expiry_in_each_state():
    async def test(tx, engine):
        # idle: nothing to expire; paused: resume on a new dirty version
        await tx.begin(begin(lease_s=0.02))
        await asyncio.sleep(0.06)
        status = tx.status()
        assert status["state"] == "expired" and status["dirty"] and status["n"] == 1
        assert status["expired"]["holder"] == "h1" and not engine.paused and not engine.held
        # a drain longer than the lease: 503, serving again, nothing written, same version
        engine.block["pause"] = asyncio.Event()
        with pytest.raises(Refused, match="did not finish within lease_s=0.02 s; generation "
                           "resumed; update again with a longer lease, or mode=abort") as e:
            await tx.begin(begin(lease_s=0.02))
        assert e.value.status == 503 and tx.state is State.IDLE and tx.n == 1
        with pytest.raises(Refused, match=r"with a longer lease, or mode=keep \(freezes"):
            await tx.begin(begin(lease_s=0.02, mode="abort"))  # abort is the mode asked
        assert not engine.held
        del engine.block["pause"]
        # committing: a commit that outlasts the lease is not cut short
        await tx.begin(begin(lease_s=0.02))
        engine.block["after_update"] = asyncio.Event()
        commit = asyncio.ensure_future(tx.commit(Commit("h1", SID)))
        await asyncio.sleep(0.05)
        assert tx.state is State.COMMITTING
        engine.block["after_update"].set()
        assert (await commit)["dirty"] is False and tx.state is State.IDLE

    run(test)


def test_commit_after_expiry_names_the_expiry():
    async def test(tx, engine):
        await tx.begin(begin(lease_s=0.01))
        await asyncio.sleep(0.05)
        with pytest.raises(Refused, match=r"lease of h1 expired .* serves version 1@s1"):
            await tx.commit(Commit("h1", SID))
        assert tx.n == 1  # the expiry's version; the late commit changed nothing
        await tx.begin(begin())  # a clean update of h1's since: the expiry is not news
        await tx.commit(Commit("h1", SID))
        with pytest.raises(Refused, match=r"^no update in progress for h1$"):
            await tx.commit(Commit("h1", SID))  # a retried commit, say
        await tx.begin(begin(lease_s=0.01))  # expired again, then a lease that changes no
        await asyncio.sleep(0.05)  # version (an abort of nothing written)
        await tx.begin(begin())
        await tx.abort(Abort("h1", SID, dirty=False))
        with pytest.raises(Refused, match=r"^no update in progress for h1$"):
            await tx.renew(Renew("h1", SID, lease_s=1.0))

    run(test)


def test_renew_keeps_a_long_update_alive():
    async def test(tx, engine):
        await tx.begin(begin(lease_s=0.5))  # (a loaded machine stalls the loop for tens of ms)
        for _ in range(4):
            await asyncio.sleep(0.3)
            await tx.renew(Renew("h1", SID, lease_s=0.5))
        assert tx.state is State.PAUSED
        assert not (await tx.commit(Commit("h1", SID)))["dirty"]

    run(test)


def test_the_same_holder_retrying_begin():
    async def test(tx, engine):
        first = await into(State.DRAINING, tx, engine)
        second = asyncio.ensure_future(tx.begin(begin()))  # a client that timed out, retried
        await settle()
        engine.block["pause"].set()
        a, b = await first, await second
        assert a["version"] == b["version"] and tx.state is State.PAUSED
        assert (await tx.begin(begin()))["lease_expires"] >= a["lease_expires"]  # re-armed
        with pytest.raises(Refused, match="already began an update in mode 'wait'"):
            await tx.begin(begin(mode="abort"))

    run(test)


def test_a_cancelled_begin_caller_leaves_the_drain_to_its_holder():
    async def test(tx, engine):
        task = await into(State.DRAINING, tx, engine)
        task.cancel()
        await settle()
        assert tx.state is State.DRAINING  # the holder can still retry or abort
        await tx.abort(Abort("h1", SID, dirty=False))
        assert tx.state is State.IDLE and not engine.held and tx.n == 0

    run(test)


def test_a_failing_drain_resumes():
    async def test(tx, engine):
        engine.fail.add("pause")
        with pytest.raises(RuntimeError, match="pause failed"):
            await tx.begin(begin())
        assert tx.state is State.IDLE and not engine.held and engine.resumes == 1

    run(test)


@pytest.mark.parametrize("route", ["begin", "renew", "commit", "abort"])
def test_a_restarted_server_refuses_the_old_server_id(route):
    async def test(tx, engine):
        await tx.begin(begin())
        call = {"begin": tx.begin(Begin("h1", "old")), "renew": tx.renew(Renew("h1", "old")),
                "commit": tx.commit(Commit("h1", "old")), "abort": tx.abort(Abort("h1", "old"))}
        for name, coro in call.items():
            if name != route:
                coro.close()
        with pytest.raises(Refused, match="server restarted .* reconnect") as e:
            await call[route]
        assert e.value.status == 409 and e.value.detail == {"server_id": SID}
        assert tx.state is State.PAUSED  # nothing changed

    run(test)


@pytest.mark.parametrize(("body", "message"), [
    ({"server_id": SID}, "field 'holder' is required"),
    ({"holder": "h", "server_id": SID, "lease_s": "soon"}, "field 'lease_s' must be a float"),
    ({"holder": "h", "server_id": SID, "lease_s": float("inf")}, "'lease_s' must be in"),
    ({"holder": "h", "server_id": SID, "lease_s": -1}, "'lease_s' must be in"),
    ({"holder": "h", "server_id": SID, "lease_s": 10**400},  # a float cannot hold it
     "field 'lease_s' is out of range, got a number of 401 digits"),
    ({"holder": "h", "server_id": SID, "mode": "later"}, "field 'mode' must be one of"),
    ({"holder": "h", "server_id": SID, "lease": 5}, r"unknown field\(s\) \['lease'\]"),
    ({"holder": "", "server_id": SID}, "'holder' must be 1 to 200 characters"),
    ({"holder": "h"}, "field 'server_id' is required"),
    ({"holder": "h", "server_id": SID, "lease_s": True}, "field 'lease_s' must be a float"),
    ([1, 2], "expected a JSON object, got list"),
    ({"holder": "h", "server_id": ""}, "'server_id' must be 1 to 200 characters"),
])
def test_bad_requests_are_400_naming_the_field(body, message):
    with pytest.raises(Refused, match=message) as e:
        Begin.from_json(body)
    assert e.value.status == 400


@pytest.mark.parametrize(("kind", "fields", "message"), [
    (Commit, {"n": -3}, r"field 'n' must be a version number \(>= 0"),
    (Commit, {"n": 10**400}, r"field 'n' must be a version number .*got a larger one$"),
    (Commit, {"n": 2**53}, r"field 'n' must be a version number .*below 2\*\*53"),
    (Receive, {"update": "u" * 201}, "field 'update' must be at most 200"),
    (Begin, {"process": "p" * 201}, "field 'process' must be at most 200 characters"),
])
def test_each_bad_field_is_named_alone(kind, fields, message):
    with pytest.raises(Refused, match=message) as e:
        kind.from_json({"holder": "h", "server_id": SID, **fields})
    assert e.value.status == 400


def test_request_types_are_frozen_and_typed():
    req = Begin.from_json({"holder": "h", "server_id": SID, "lease_s": 5})
    assert req == Begin("h", SID, "wait", 5.0)
    with pytest.raises(AttributeError):
        req.holder = "x"
    assert Abort.from_json({"holder": "h", "server_id": SID}).dirty is True
    with pytest.raises(Refused, match="field 'dirty' must be a bool"):
        Abort.from_json({"holder": "h", "server_id": SID, "dirty": "yes"})


def test_version_labels():
    assert parse_version("7@3f9a1c2b") == (7, "3f9a1c2b")
    for bad in ("7", "x@s", "7@", "\u00b2@3f9a1c2b", "\u0661\u0662@3f9a1c2b", "7@a b", "7@@",
                "7@3f9a1c2b\r\n", "7@ab, 7@ab", None):
        with pytest.raises(Exception, match="expected N@SERVER"):
            parse_version(bad)


def test_commit_to_a_given_version_number_and_abort_discards():
    async def test(tx, engine):
        discards = []
        engine.discard = lambda: asyncio.sleep(0, discards.append(tx.state))
        await tx.begin(begin())
        assert (await tx.commit(Commit("h1", SID, n=7)))["version"] == f"7@{SID}"
        await tx.begin(begin())
        with pytest.raises(Refused, match=r"field 'n' \(7\) must be above the version number "
                           r"served \(7\)"):
            await tx.commit(Commit("h1", SID, n=7))
        await tx.abort(Abort("h1", SID, dirty=False))
        assert discards == [State.PAUSED] and tx.version == f"7@{SID}"

    run(test)


class RecordingEngine(StubEngine):
    """Also records the order of the steps an update asks for."""

    def __init__(self):
        super().__init__()
        self.steps = []

    async def pause(self, mode):
        self.steps.append(f"pause {mode}")
        await super().pause(mode)

    async def after_update(self):
        self.steps.append("apply" if self.paused else "apply while serving")
        await super().after_update()

    async def discard(self):
        self.steps.append("discard")
        await super().discard()


def run_recording(test):
    return run(test, RecordingEngine)


def test_a_staged_update_pauses_only_for_its_commit():
    async def test(tx, engine):
        granted = await tx.begin(begin(stage=True, mode="keep"))
        assert granted["version"] == f"0@{SID}" and granted["lease_expires"] > 0
        status = tx.status()
        assert status["state"] == "staging" and not status["paused"] and not engine.held
        await tx.renew(Renew("h1", SID, lease_s=30))
        out = await tx.commit(Commit("h1", SID, n=5))
        assert engine.steps == ["pause keep", "apply"]
        assert out["version"] == f"5@{SID}" and not out["dirty"] and out["paused_s"] > 0
        assert not engine.held and not engine.paused and engine.resumes == 1
        assert tx.status()["last_paused_s"] == out["paused_s"]

    run_recording(test)


def test_a_staged_update_aborted_or_expired_keeps_its_version_clean():
    async def test(tx, engine):
        await tx.begin(begin(stage=True))
        out = await tx.abort(Abort("h1", SID, dirty=True))  # nothing was written
        assert out == {"version": f"0@{SID}", "n": 0, "dirty": False}
        await tx.begin(begin(stage=True, lease_s=0.01))
        await asyncio.sleep(0.05)
        status = tx.status()
        assert status["state"] == "idle" and status["version"] == f"0@{SID}"
        assert not status["dirty"] and status["expired"]["holder"] == "h1"
        assert engine.steps == ["discard", "discard"] and engine.resumes == 0
        with pytest.raises(Refused, match=f"expired .*; the server dropped the staged update "
                           f"and serves version 0@{SID}$"):
            await tx.commit(Commit("h1", SID))

    run_recording(test)


def test_a_staged_commit_whose_drain_times_out_drops_the_update():
    async def test(tx, engine):
        await tx.begin(begin(stage=True, lease_s=0.05))
        engine.block["pause"] = asyncio.Event()  # a request that never finishes
        with pytest.raises(Refused, match="did not finish within lease_s=0.05 s; the staged "
                           "update was dropped, the server serves 0@.*; update again with a "
                           "longer lease, or mode=abort") as e:
            await tx.commit(Commit("h1", SID))
        assert e.value.status == 503
        status = tx.status()
        assert status["state"] == "idle" and status["n"] == 0 and not status["dirty"]
        assert engine.steps == ["pause wait", "discard"] and not engine.held
        del engine.block["pause"]
        engine.fail.add("pause")  # not a timeout: no lease would help
        await tx.begin(begin(stage=True))
        with pytest.raises(Refused, match=r"pausing failed \(RuntimeError\('pause failed'\)\); "
                           r"the staged update was dropped, the server serves 0@\w+; update "
                           r"again$"):
            await tx.commit(Commit("h1", SID))

    run_recording(test)


def test_a_renew_with_pause_starts_a_staged_commits_pause_ahead_of_it():
    async def test(tx, engine):
        await tx.begin(begin(stage=True, mode="keep"))
        engine.block["pause"] = asyncio.Event()  # the engine step in flight
        await tx.renew(Renew("h1", SID, lease_s=30, pause=True))
        await settle()
        assert engine.steps == ["pause keep"] and engine.held and not engine.paused
        assert tx.status()["state"] == "staging" and tx.status()["paused"]
        await tx.renew(Renew("h1", SID, lease_s=30, pause=True))  # a second hint: no-op
        committing = asyncio.ensure_future(tx.commit(Commit("h1", SID)))
        await settle()
        assert not committing.done()  # the commit waits for the pause the renew started
        engine.block["pause"].set()
        out = await committing
        assert engine.steps == ["pause keep", "apply"]  # paused once, applied while paused
        assert out["version"] == f"1@{SID}" and not out["dirty"] and out["paused_s"] > 0
        assert not engine.held and not engine.paused and engine.resumes == 1

    run_recording(test)


@pytest.mark.parametrize("end", ["abort", "expire"])
def test_a_staged_update_paused_ahead_then_aborted_or_expired_resumes_clean(end):
    async def test(tx, engine):
        await tx.begin(begin(stage=True, lease_s=30 if end == "abort" else 0.5))
        await tx.renew(Renew("h1", SID, lease_s=30 if end == "abort" else 0.5, pause=True))
        await settle()
        assert engine.paused and engine.held
        if end == "abort":
            out = await tx.abort(Abort("h1", SID, dirty=True))
            assert out == {"version": f"0@{SID}", "n": 0, "dirty": False}
        else:
            await asyncio.sleep(1.0)
        status = tx.status()
        assert status["state"] == "idle" and status["version"] == f"0@{SID}"
        assert not status["dirty"] and not status["paused"]
        assert engine.steps == ["pause wait", "discard"] and engine.resumes == 1
        assert not engine.held and not engine.paused

    run_recording(test)


@pytest.mark.parametrize("end", ["commit", "abort"])
def test_in_abort_mode_a_pause_ahead_freezes_the_requests_and_only_the_commit_ends_them(end):
    # the update may still fail after the hint (a worker refuses its last round): the
    # requests in flight must not have been ended for it
    async def test(tx, engine):
        await tx.begin(begin(stage=True, mode="abort"))
        await tx.renew(Renew("h1", SID, lease_s=30, pause=True))
        await settle()
        assert engine.steps == ["pause keep"] and engine.paused
        if end == "commit":
            out = await tx.commit(Commit("h1", SID))
            assert engine.steps == ["pause keep", "pause abort", "apply"]
            assert out["version"] == f"1@{SID}" and not out["dirty"] and out["paused_s"] > 0
        else:
            await tx.abort(Abort("h1", SID, dirty=False))
            assert engine.steps == ["pause keep", "discard"]
            assert tx.status()["version"] == f"0@{SID}" and not tx.status()["dirty"]
        assert not engine.held and not engine.paused and engine.resumes == 1

    run_recording(test)


def test_a_pause_ahead_that_times_out_is_reported_by_the_commit():
    async def test(tx, engine):
        await tx.begin(begin(stage=True, lease_s=0.05))  # the drain's bound
        engine.block["pause"] = asyncio.Event()  # a request that never finishes
        await tx.renew(Renew("h1", SID, lease_s=30, pause=True))
        await asyncio.sleep(0.1)
        with pytest.raises(Refused, match="did not finish within lease_s=0.05 s; the staged "
                           "update was dropped") as e:
            await tx.commit(Commit("h1", SID))
        assert e.value.status == 503 and not engine.held
        assert engine.steps == ["pause wait", "discard"] and tx.status()["n"] == 0

    run_recording(test)


@pytest.mark.parametrize("staged", [True, False])
def test_a_renew_with_pause_on_an_idle_engine_or_outside_staging_changes_nothing(staged):
    async def test(tx, engine):
        engine.requests = not staged  # idle: the commit's pause takes no wait
        await tx.begin(begin(stage=staged))  # else paused by its begin
        await tx.renew(Renew("h1", SID, lease_s=30, pause=True))
        await settle()
        assert engine.steps == ([] if staged else ["pause wait"])
        assert tx.status()["paused"] is not staged
        await tx.commit(Commit("h1", SID))
        assert engine.steps == ["pause wait", "apply"]

    run_recording(test)


@pytest.mark.parametrize("dirty", [True, False])
def test_a_drain_that_ends_as_its_holder_aborts_leaves_the_server_idle(dirty):
    """The abort lands in the loop tick where the drain's pause completes: the begin is
    refused, not granted, and the server is not paused again under nobody's lease. The
    trainer wrote nothing (its begin had not returned): the version stays, clean."""
    async def test(tx, engine):
        task = await into(State.DRAINING, tx, engine)
        engine.block["pause"].set()  # the drain completes...
        await asyncio.sleep(0)
        out = await tx.abort(Abort("h1", SID, dirty=dirty))  # ...and the abort lands
        with pytest.raises(Refused, match="h1 aborted its begin"):
            await task
        await settle()
        assert (tx.state, tx.holder, tx.lease.expires) == (State.IDLE, None, None)
        assert not engine.held and not engine.paused
        assert out["n"] == tx.n == 0 and not tx.dirty
        await tx.begin(begin("h2"))  # another trainer goes on at once

    run(test)


@pytest.mark.parametrize("how", ["cancelled", "a step raises CancelledError"])
def test_a_commit_cut_short_serves_a_dirty_version_and_resumes(how):
    async def test(tx, engine):
        await tx.begin(begin())
        if how == "cancelled":  # a server shutting down, a client gone
            engine.block["after_update"] = asyncio.Event()
            task = asyncio.ensure_future(tx.commit(Commit("h1", SID)))
            await settle()
            task.cancel()
        else:
            async def cancelled():
                raise asyncio.CancelledError
            engine.after_update = cancelled
            task = asyncio.ensure_future(tx.commit(Commit("h1", SID)))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tx.state is State.IDLE and not engine.held and tx.n == 1
        assert tx.dirty and "commit by h1" in tx.versions.dirty_reason

    run(test)


def test_a_staged_commit_cancelled_while_it_pauses_drops_the_update_and_resumes():
    async def test(tx, engine):
        await tx.begin(begin(stage=True, lease_s=0.2))
        engine.block["pause"] = asyncio.Event()
        task = asyncio.ensure_future(tx.commit(Commit("h1", SID)))
        await settle()
        assert engine.held  # the commit's pause waits for the engine step
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (tx.state, tx.holder) == (State.IDLE, None) and not engine.held
        assert tx.n == 0 and not tx.dirty  # a staged update wrote nothing
        assert engine.steps[-1] == "discard"

    run_recording(test)


def test_an_expiry_whose_resume_fails_still_says_the_lease_expired():
    async def test(tx, engine):
        async def broken():
            raise RuntimeError("resume failed")
        engine.resume = broken
        await tx.begin(begin(lease_s=0.01))
        await asyncio.sleep(0.05)
        assert tx.state is State.EXPIRED and tx.expired["holder"] == "h1"
        assert not engine.held  # let in all the same
        with pytest.raises(Refused, match="the lease of h1 expired"):
            await tx.commit(Commit("h1", SID))

    run(test)


def test_a_cache_reset_that_fails_on_an_abort_is_logged(caplog):
    async def test(tx, engine):
        await tx.begin(begin())
        engine.fail.add("reset_caches")
        await tx.abort(Abort("h1", SID))
        assert tx.dirty and "could not reset the caches" in caplog.text

    run(test)


def test_a_cancelled_drain_unwinding_late_leaves_the_same_holder_s_next_begin_alone():
    """An abort cancels h1's drain; the engine's pause takes a moment to unwind, and h1's
    next begin (every update of one Bridge has one holder) starts its own drain meanwhile.
    The first drain's end must not resume the second's: that begin would be told "aborted"
    and vLLM left paused under no lease."""
    class SlowUnwind(StubEngine):
        calls = 0

        async def pause(self, mode):
            self.calls += 1
            first = self.calls == 1
            try:
                await self.block["pause"].wait()
            except asyncio.CancelledError:
                if first:
                    await asyncio.sleep(0.05)  # an RPC's cleanup
                raise
            self.paused = True

    engine = SlowUnwind()

    async def main():
        tx = Transaction(engine, SID)
        engine.block["pause"] = asyncio.Event()
        first = asyncio.ensure_future(tx.begin(begin()))
        await settle()
        await tx.abort(Abort("h1", SID, dirty=False))
        second = asyncio.ensure_future(tx.begin(begin()))
        await asyncio.sleep(0.1)  # the first drain has unwound
        assert (tx.state, tx.holder, engine.held) == (State.DRAINING, "h1", True)
        engine.block["pause"].set()
        with pytest.raises(Refused, match="h1 aborted its begin"):
            await first
        await second  # granted
        assert (tx.state, engine.paused, engine.held) == (State.PAUSED, True, True)
        await tx.commit(Commit("h1", SID))
        assert (tx.state, engine.paused, engine.held) == (State.IDLE, False, False)

    asyncio.run(main())


def test_a_reader_s_lease_ends_clean_however_it_ends():
    async def test(tx, engine):
        await tx.begin(begin(read=True, mode="keep"))
        with pytest.raises(Refused, match="began to read the weights .* not to update them"):
            await tx.commit(Commit("h1", SID))
        assert tx.state is State.PAUSED  # still its lease: it aborts
        await tx.abort(Abort("h1", SID, dirty=True))  # a reader wrote nothing
        assert (tx.n, tx.dirty, tx.state) == (0, False, State.IDLE)
        await tx.begin(begin(read=True, lease_s=0.01))
        await asyncio.sleep(0.05)  # its lease ran out (a killed `hotweights sync --server`)
        assert (tx.n, tx.dirty, engine.held) == (0, False, False)
        assert tx.expired["dirty"] is False
        with pytest.raises(Refused, match=r"serves version 0@s1$"):  # not "marked dirty"
            await tx.renew(Renew("h1", SID))
        await tx.begin(begin())  # the next holder writes: its abort is dirty
        with pytest.raises(Refused, match="in mode 'wait' .*, not 'wait' read"):
            await tx.begin(begin(read=True))
        await tx.abort(Abort("h1", SID))
        assert (tx.n, tx.dirty) == (1, True)

    run(test)


@pytest.mark.parametrize("read", [False, True])
def test_a_lease_ends_when_its_holder_s_process_exits(read, caplog):
    running = {"a:b:7:70"}  # the processes beside the server

    def watch(ident):
        return (lambda: ident not in running) if ident in running else None

    async def main():
        engine = StubEngine()
        tx = Transaction(engine, SID, watch=watch, poll_s=0.01)
        await tx.begin(begin(process="a:b:7:70", read=read))
        await asyncio.sleep(0.05)
        assert tx.state is State.PAUSED  # running: the lease holds
        with pytest.raises(Refused, match=r"h1 already began an update from another "
                           r"process \(a:b:7:70\)"):  # the same holder name, elsewhere
            await tx.begin(begin(process="a:b:8:80", read=read))
        running.clear()  # killed
        await asyncio.sleep(0.05)
        assert tx.state is (State.IDLE if read else State.EXPIRED) and not engine.held
        assert (tx.n, tx.dirty) == ((0, False) if read else (1, True))
        assert "the process of h1 (pid 7) exited" in caplog.text
        if not read:
            assert tx.versions.dirty_reason == "the process of h1 (pid 7) exited"
        await tx.begin(begin("h2", process="a:c:8:80"))  # not beside the server (another
        # machine, pid namespace, or exited): not watched, the lease runs its course
        await asyncio.sleep(0.05)
        assert (tx.state, tx.holder) == (State.PAUSED, "h2")

    asyncio.run(main())


def test_a_holder_that_dies_in_its_begin_s_drain_ends_it_clean(caplog):
    running = {"a:b:7:70"}

    def watch(ident):
        return (lambda: ident not in running) if ident in running else None

    async def main():
        engine = StubEngine()
        engine.block["pause"] = asyncio.Event()  # requests in flight: the drain waits
        tx = Transaction(engine, SID, watch=watch, poll_s=0.01)
        task = asyncio.ensure_future(tx.begin(begin(process="a:b:7:70", lease_s=600)))
        await asyncio.sleep(0.05)
        assert tx.state is State.DRAINING
        running.clear()  # killed: its begin never returned, nothing was written
        await asyncio.sleep(0.05)
        assert (tx.state, tx.n, tx.dirty, engine.held) == (State.IDLE, 0, False, False)
        assert "the process of h1 (pid 7) exited in its begin; resuming" in caplog.text
        with pytest.raises(Refused, match="aborted its begin"):
            await task

    asyncio.run(main())


def test_a_killed_trainer_s_lease_ends_within_a_poll():
    import subprocess
    import sys
    import time

    from hotweights.protocol import process

    if not process.identity():
        pytest.skip("no /proc here: the holder's process cannot be watched")
    code = "from hotweights.protocol import process; print(process.identity(), flush=True)"
    child = subprocess.Popen([sys.executable, "-c", code + "; import time; time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    ident = child.stdout.readline().strip()
    assert process.watch(ident) is not None
    here, start = ident.rsplit(":", 1)
    for other in (ident.replace(":", "x", 1), f"{here}:{int(start) + 1}", "", "a:b:c"):
        assert process.watch(other) is None  # another boot, start time, or none

    async def main():
        tx = Transaction(StubEngine(), SID, poll_s=0.05)  # the real /proc check
        await tx.begin(begin(process=ident, lease_s=60))
        await asyncio.sleep(0.2)
        assert tx.state is State.PAUSED
        child.kill()  # a zombie until reaped: exited all the same
        deadline = time.monotonic() + 30  # the kill lands when a loaded machine gets to it
        while tx.state is not State.EXPIRED:
            assert time.monotonic() < deadline, tx.status()
            await asyncio.sleep(0.05)
        assert tx.dirty

    try:
        asyncio.run(main())
    finally:
        child.kill()
        child.wait()


def test_an_error_reading_proc_is_not_taken_for_an_exit(monkeypatch):
    import builtins

    from hotweights.protocol import process

    if not (ident := process.identity()):
        pytest.skip("no /proc here")
    exited = process.watch(ident)
    real = builtins.open

    def full(path, *a, **kw):  # a full descriptor table
        if str(path).startswith("/proc/"):
            raise OSError(24, "Too many open files")
        return real(path, *a, **kw)
    monkeypatch.setattr(builtins, "open", full)
    assert exited() is False and process.identity() == ""


# Pinned down by a mutation review: each fails where the behaviour it names is lost.

def test_an_expiry_whose_engine_resume_awaits_still_resumes():
    async def test(tx, engine):
        done = []
        async def slow_resume():
            await asyncio.sleep(0.01)  # an RPC to the workers
            engine.paused = False
            done.append(True)
        engine.resume = slow_resume
        await tx.begin(begin(lease_s=0.01))
        await asyncio.sleep(0.5)
        assert done == [True] and not engine.paused and tx.state is State.EXPIRED
    run(test)


def test_a_stale_watcher_does_not_end_the_same_holder_s_next_lease():
    running = {"a:b:7:70", "a:b:8:80"}
    def watch(ident):
        return (lambda: ident not in running) if ident in running else None
    async def main():
        engine = StubEngine()
        tx = Transaction(engine, SID, watch=watch, poll_s=0.05)
        await tx.begin(begin(process="a:b:7:70"))
        await tx.commit(Commit("h1", SID))
        running.discard("a:b:7:70")  # the first trainer exits after its commit
        await tx.begin(begin(process="a:b:8:80"))  # the next one, same holder name
        await asyncio.sleep(0.2)
        assert tx.state is State.PAUSED and tx.holder == "h1" and tx.n == 1
    asyncio.run(main())


def test_an_expiry_for_another_holder_changes_nothing():
    async def test(tx, engine):
        await tx.begin(begin("h2"))
        await tx.expire("h1")
        assert (tx.state, tx.holder, tx.n) == (State.PAUSED, "h2", 0)
    run(test)


def test_an_expired_lease_resets_the_caches():
    async def test(tx, engine):
        resets = []
        async def reset():
            resets.append(tx.state)
        engine.reset_caches = reset
        await tx.begin(begin(lease_s=0.01))
        await asyncio.sleep(0.5)
        assert tx.state is State.EXPIRED and resets == [State.PAUSED]
    run(test)


def test_an_expiry_while_a_pause_ahead_waits_cancels_that_pause():
    async def test(tx, engine):
        await tx.begin(begin(stage=True, lease_s=5))  # the drain's bound
        engine.block["pause"] = asyncio.Event()
        await tx.renew(Renew("h1", SID, lease_s=0.05, pause=True))
        await asyncio.sleep(0.5)
        assert tx.state is State.IDLE
        engine.block["pause"].set()
        await settle()
        assert not engine.paused and not engine.held
    run_recording(test)


def test_a_staged_begin_after_an_expiry_clears_the_expiry_news():
    async def test(tx, engine):
        await tx.begin(begin(lease_s=0.01))
        await asyncio.sleep(0.5)
        await tx.begin(begin(stage=True))
        await tx.commit(Commit("h1", SID))
        with pytest.raises(Refused, match="no update in progress for h1"):
            await tx.renew(Renew("h1", SID, lease_s=5))
    run(test)


def test_dirty_versions_keep_only_the_last_ones():
    async def test(tx, engine):
        for _ in range(_KEPT_DIRTY + 5):
            await tx.begin(begin())
            await tx.abort(Abort("h1", SID, dirty=True))
        labels = tx.status()["dirty_versions"]
        assert len(labels) == _KEPT_DIRTY and labels[-1] == f"{tx.n}@{SID}"
    run(test)


def test_a_begin_retried_restarts_the_lease_from_now():
    async def test(tx, engine):
        first = await tx.begin(begin(lease_s=1.0))
        await asyncio.sleep(0.6)
        again = await tx.begin(begin(lease_s=1.0))
        assert again["lease_expires"] > first["lease_expires"]
        await asyncio.sleep(0.6)  # 1.2 s since the first begin, 0.6 since the retry
        assert tx.state is State.PAUSED and tx.n == 0
    run(test)


def test_a_request_of_the_holder_s_earlier_update_that_arrives_late_is_refused():
    # (one whose HTTP call the trainer gave up on, delivered after its next update began)
    async def test(tx, engine):
        await tx.begin(begin(stage=True, mode="keep", seq=4))
        late = {"renew": lambda: tx.renew(Renew("h1", SID, seq=3)),
                "commit": lambda: tx.commit(Commit("h1", SID, seq=3)),
                "abort": lambda: tx.abort(Abort("h1", SID, seq=3)),
                "begin": lambda: tx.begin(begin(stage=True, mode="keep", seq=3))}
        for what, call in late.items():
            with pytest.raises(Refused, match=f"{what} of h1's update 3, but the lease is of "
                               "its update 4: a request that arrived late") as e:
                await call()
            assert e.value.status == 409
        with pytest.raises(Refused, match="commit of h1's update 5"):  # none began it here
            await tx.commit(Commit("h1", SID, seq=5))
        assert tx.state is State.STAGING and engine.steps == []  # nothing done
        await tx.renew(Renew("h1", SID))  # unnumbered: not checked
        await tx.begin(begin(stage=True, mode="keep", seq=6))  # the holder's next update
        # takes the lease its last left (its abort got no answer)
        with pytest.raises(Refused, match="update 4, but the lease is of its update 6"):
            await tx.renew(Renew("h1", SID, seq=4))
        await tx.abort(Abort("h1", SID, seq=7, dirty=False))  # a later one clears it
        assert tx.state is State.IDLE
        await tx.begin(begin(stage=True, mode="keep", seq=8))
        assert (await tx.commit(Commit("h1", SID, seq=8, n=3)))["n"] == 3

    run_recording(test)


def test_a_begin_of_an_update_whose_lease_ended_that_arrives_late_is_refused(monkeypatch):
    # it would take a lease no client holds (a pause, for a begin not staged, until the
    # lease ends, then a dirty version)
    from hotweights.server import transaction

    async def test(tx, engine):
        await tx.begin(begin(stage=True, mode="keep", seq=4))
        await tx.commit(Commit("h1", SID, seq=4, n=1))
        for seq in (4, 3):
            with pytest.raises(Refused, match=f"begin of h1's update {seq}, but its update 4 "
                               "ended: a request that arrived late") as e:
                await tx.begin(begin(seq=seq))
            assert e.value.status == 409 and tx.state is State.IDLE
        await tx.begin(begin(seq=0))  # unnumbered: not checked
        await tx.abort(Abort("h1", SID, dirty=False))
        await tx.begin(begin("h2", mode="keep", stage=True, seq=4))  # another holder's
        await tx.abort(Abort("h2", SID, seq=5, dirty=False))  # (a later one ends it: its
        await tx.begin(begin("h2", mode="keep", stage=True, seq=5))  # number is free)
        await tx.abort(Abort("h2", SID, seq=5, dirty=False))
        with pytest.raises(Refused, match="its update 5 ended"):
            await tx.begin(begin("h2", mode="keep", stage=True, seq=5))
        await tx.begin(begin(stage=True, mode="keep", seq=5))  # h1's next
        await tx.abort(Abort("h1", SID, seq=5, dirty=False))
        monkeypatch.setattr(transaction, "_KEPT_ENDED", 2)  # the oldest forgotten first
        await tx.begin(begin("h3", mode="keep", stage=True, seq=1))
        await tx.abort(Abort("h3", SID, seq=1, dirty=False))
        assert list(tx._ended) == ["h1", "h3"]

    run_recording(test)


def test_seq_is_a_whole_number_below_2_53():
    assert Renew.from_json({"holder": "h", "server_id": SID, "seq": 7}).seq == 7
    for bad, match in ((-1, r"must be in \[0, 2\*\*53\), got -1"), (2**53, "got 9007"),
                       (10**30, "a larger number"), ("1", "must be a int")):
        with pytest.raises(Refused, match=match):
            Renew.from_json({"holder": "h", "server_id": SID, "seq": bad})


@pytest.mark.parametrize(("kind", "fields"), [
    (Begin, {"holder": "h" * 200, "server_id": "s" * 200, "process": "p" * 200,
             "lease_s": 24 * 3600}),
    (Commit, {"n": 2**53 - 1, "next_update": "u" * 200, "seq": 2**53 - 1}),
    (Receive, {"update": "u" * 200, "wait_s": 24 * 3600}),
])
def test_each_field_at_its_limit_is_taken(kind, fields):
    body = {"holder": "h", "server_id": SID, **fields}
    assert {k: getattr(kind.from_json(body), k) for k in fields} == fields


@pytest.mark.parametrize(("kind", "fields", "message"), [
    (Commit, {"n": True}, "field 'n' must be a int, got True"),
    (Renew, {"seq": False}, "field 'seq' must be a int, got False"),
    (Renew, {"seq": -10**30}, r"must be in \[0, 2\*\*53\), got a larger number"),
    (Commit, {"n": -10**30}, r"field 'n' must be a version number .*got a larger one$"),
])
def test_a_bool_is_no_number_and_a_huge_negative_one_is_not_spelled_out(kind, fields, message):
    with pytest.raises(Refused, match=message) as e:
        kind.from_json({"holder": "h", "server_id": SID, **fields})
    assert e.value.status == 400
