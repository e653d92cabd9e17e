"""The ASGI gate in front of vLLM's /v1 routes, driven by a plain streaming ASGI app."""

import asyncio
import json

import pytest

from hotweights.protocol.version import VERSION_HEADER
from hotweights.vllm_plugin.gate import Gate, GateMiddleware


def _sse(*events: dict) -> list[bytes]:
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def _run(path: str, request: dict, chunks: list[bytes], abort: bool) -> tuple[dict, list]:
    """One request through the gate; `abort` marks it aborted mid-stream."""
    gate = Gate()

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        if abort:
            gate.mark_aborted()
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main():
        sent = []

        async def receive():
            return {"type": "http.request", "body": json.dumps(request).encode()}

        async def send(message):
            sent.append(message)

        await GateMiddleware(app, gate, lambda: 7)({"type": "http", "path": path}, receive,
                                                     send)
        assert gate.idle.is_set() and not gate.live
        return sent

    sent = asyncio.run(main())
    events = [json.loads(e[6:]) for m in sent[1:] for e in m.get("body", b"").split(b"\n\n")
              if e.startswith(b"data: {")]
    return dict(sent[0]["headers"]), events


def test_every_response_carries_the_version():
    headers, _ = _run("/v1/completions", {"model": "m", "prompt": "x"}, _sse(), abort=False)
    assert headers[VERSION_HEADER.encode()] == b"7"


def test_a_stream_aborted_before_its_first_token_says_abort():
    _, events = _run("/v1/completions", {"model": "m", "prompt": [1, 2, 3]}, _sse(),
                     abort=True)
    assert [c["finish_reason"] for e in events for c in e["choices"]] == ["abort"]
    assert events[0]["model"] == "m" and events[0]["object"] == "text_completion"


def test_chat_and_several_choices_get_one_end_each():
    chunks = _sse({"choices": [{"index": 1, "delta": {"content": "a"},
                                "finish_reason": "length"}]})
    _, events = _run("/v1/chat/completions", {"model": "m", "n": 3, "messages": []}, chunks,
                     abort=True)
    ends = {c["index"]: c for e in events for c in e["choices"] if c["finish_reason"]}
    assert {i: c["finish_reason"] for i, c in ends.items()} == {0: "abort", 1: "length",
                                                                 2: "abort"}
    assert ends[0]["delta"] == {} and events[-1]["object"] == "chat.completion.chunk"


@pytest.mark.parametrize("abort", [False, True])
def test_a_finished_stream_gets_nothing_added(abort):
    chunks = _sse({"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]})
    _, events = _run("/v1/completions", {"model": "m", "prompt": "x"}, chunks, abort=abort)
    assert [c["finish_reason"] for e in events for c in e["choices"]] == ["stop"]


@pytest.mark.parametrize(("method", "path", "gated"), [
    ("POST", "/v1/completions", True), ("GET", "/v1/models", True),
    ("POST", "/inference/v1/generate", True), ("POST", "/pooling", True),
    ("POST", "/hotweights/commit", False), ("GET", "/health", False),
    ("GET", "/metrics", False),
])
@pytest.mark.parametrize("root", ["", "/api"])  # vLLM's --root-path: in the scope's path
def test_what_may_reach_the_engine_waits_for_the_commit(method, path, gated, root):
    gate = Gate()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main() -> bool:
        gate.open.clear()  # an update is in progress

        async def receive():
            return {"type": "http.request", "body": b""}

        async def send(message):
            pass

        call = GateMiddleware(app, gate, lambda: 0)({"type": "http", "method": method,
                                                     "path": root + path, "root_path": root},
                                                    receive, send)
        try:
            await asyncio.wait_for(call, 0.2)
            return False
        except TimeoutError:
            return True

    assert asyncio.run(main()) is gated


def test_a_request_is_past_the_gate_once_its_body_is_all_here():
    """A client trickling its body (or never ending it) holds no update back: `wait`
    waits for `idle`, and `abort` cannot abort what has not reached the engine."""
    gate = Gate()
    read = []

    async def app(scope, receive, send):
        assert not gate.idle.is_set()  # counted while vLLM has it
        while (message := await receive())["more_body"]:
            read.append(message["body"])
        read.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main():
        parts: asyncio.Queue = asyncio.Queue()
        await parts.put({"type": "http.request", "body": b'{"model":', "more_body": True})

        async def send(message):
            pass

        call = asyncio.ensure_future(GateMiddleware(app, gate, lambda: 0)(
            {"type": "http", "method": "POST", "path": "/v1/completions"}, parts.get, send))
        await asyncio.sleep(0.05)
        assert gate.idle.is_set() and not read  # the rest of the body still to come
        await parts.put({"type": "http.request", "body": b' "m"}', "more_body": False})
        await asyncio.wait_for(call, 5)
        assert gate.idle.is_set()

    asyncio.run(main())
    assert b"".join(read) == b'{"model": "m"}'


def _ok_app(started=None, finish=None, fail=False):
    async def app(scope, receive, send):
        if started is not None:
            started.set()
        if finish is not None:
            await finish.wait()
        if fail:
            raise RuntimeError("app failed")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


async def _recv():
    return {"type": "http.request", "body": b""}


async def _send(m):
    pass


def _scope(path="/v1/completions", method="POST"):
    return {"type": "http", "method": method, "path": path}


def test_a_request_woken_as_the_gate_closes_again_waits_again():
    async def main():
        gate = Gate()
        gate.open.clear()
        middleware = GateMiddleware(_ok_app(), gate, lambda: 0)
        call = asyncio.ensure_future(middleware(_scope(), _recv, _send))
        await asyncio.sleep(0.01)
        gate.open.set()
        gate.open.clear()  # the next update closes it before the waiter runs
        await asyncio.sleep(0.05)
        assert not call.done() and gate.idle.is_set()
        gate.open.set()
        await asyncio.wait_for(call, 5)
    asyncio.run(main())


def test_idle_only_once_the_last_request_leaves():
    async def main():
        gate = Gate()
        f1, f2 = asyncio.Event(), asyncio.Event()
        mw1 = GateMiddleware(_ok_app(finish=f1), gate, lambda: 0)
        mw2 = GateMiddleware(_ok_app(finish=f2), gate, lambda: 0)
        c1 = asyncio.ensure_future(mw1(_scope(), _recv, _send))
        c2 = asyncio.ensure_future(mw2(_scope(), _recv, _send))
        await asyncio.sleep(0.02)
        f1.set()
        await c1
        assert not gate.idle.is_set() and len(gate.live) == 1
        f2.set()
        await c2
        assert gate.idle.is_set()
    asyncio.run(main())


def test_a_failing_app_still_leaves_the_gate():
    async def main():
        gate = Gate()
        with pytest.raises(RuntimeError):
            await GateMiddleware(_ok_app(fail=True), gate, lambda: 0)(_scope(), _recv, _send)
        assert gate.idle.is_set() and not gate.live
    asyncio.run(main())


def test_ungated_responses_carry_the_version_too():
    async def main():
        sent = []
        async def send(m):
            sent.append(m)
        await GateMiddleware(_ok_app(), Gate(), lambda: 3)(_scope("/health", "GET"), _recv, send)
        return dict(sent[0]["headers"])
    assert asyncio.run(main())[VERSION_HEADER.encode()] == b"3"


def test_the_app_sees_the_disconnect_after_the_whole_body():
    got = []
    async def app(scope, receive, send):
        got.append(await receive())
        got.append(await receive())
    async def main():
        msgs = [{"type": "http.request", "body": b"x", "more_body": False},
                {"type": "http.disconnect"}]
        async def receive():
            return msgs.pop(0)
        await GateMiddleware(app, Gate(), lambda: 0)(_scope(), receive, _send)
    asyncio.run(main())
    assert [m["type"] for m in got] == ["http.request", "http.disconnect"]


def test_a_stream_not_aborted_gets_no_abort_notice():
    _, events = _run("/v1/completions", {"model": "m", "prompt": "x"}, _sse(), abort=False)
    assert events == []


@pytest.mark.parametrize(("prompt", "ends"), [(["a", "b"], 4), ([[1, 2], [3]], 4), ([1, 2], 2)])
def test_a_batched_prompt_gets_one_end_per_prompt_and_choice(prompt, ends):
    _, events = _run("/v1/completions", {"model": "m", "n": 2, "prompt": prompt}, _sse(),
                     abort=True)
    assert sorted(c["index"] for e in events for c in e["choices"]) == list(range(ends))


def test_the_gate_keeps_at_most_a_mebibyte_of_a_body_and_the_app_gets_it_all():
    chunk, parts = b"x" * (256 << 10), 12  # 3 MiB
    got, kept = [], []

    async def app(scope, receive, send):
        while (m := await receive())["more_body"]:
            got.append(m["body"])
        got.append(m["body"])
        kept.extend(len(e.request) for e in gate.live)

    async def main():
        msgs = [{"type": "http.request", "body": chunk, "more_body": i < parts - 1}
                for i in range(parts)]

        async def receive():
            return msgs.pop(0)
        await GateMiddleware(app, gate, lambda: 0)(_scope(), receive, _send)

    gate = Gate()
    asyncio.run(main())
    assert b"".join(got) == chunk * parts
    assert kept and kept[0] <= (1 << 20) + len(chunk)  # (the part that crossed the cap)


def test_an_abort_marks_every_request_past_the_gate():
    async def main():
        gate, finish = Gate(), asyncio.Event()
        calls = [asyncio.ensure_future(GateMiddleware(_ok_app(finish=finish), gate, lambda: 0)(
            _scope(), _recv, _send)) for _ in range(3)]
        await asyncio.sleep(0.02)
        gate.mark_aborted()
        aborted = [e.aborted for e in gate.live]
        finish.set()
        await asyncio.gather(*calls)
        return aborted

    assert asyncio.run(main()) == [True, True, True]


def test_a_root_path_not_in_the_scope_s_path_is_not_cut_from_it():
    # (a server whose routing leaves --root-path out of the path: /v1/... all the same)
    gate = Gate()

    async def main() -> bool:
        gate.open.clear()  # an update is in progress
        call = GateMiddleware(_ok_app(), gate, lambda: 0)(
            {"type": "http", "method": "GET", "path": "/v1/models", "root_path": "/api"},
            _recv, _send)
        try:
            await asyncio.wait_for(call, 0.2)
            return False
        except TimeoutError:
            return True

    assert asyncio.run(main()) is True  # it waits for the commit


def test_the_abort_notice_goes_out_before_the_stream_s_end():
    gate = Gate()

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        gate.mark_aborted()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main():
        sent = []

        async def receive():
            return {"type": "http.request", "body": b'{"model": "m", "prompt": "x"}'}

        async def send(message):
            sent.append(message)

        await GateMiddleware(app, gate, lambda: 7)(_scope(), receive, send)
        return sent[1:]

    bodies = asyncio.run(main())
    assert b'"finish_reason": "abort"' in bodies[0]["body"]
    assert [m["more_body"] for m in bodies] == [True, True, False]  # one response, all sent


def test_a_choice_streaming_beside_one_that_finished_still_gets_its_abort_end():
    chunks = _sse({"choices": [
        {"index": 0, "delta": {"content": "a"}, "finish_reason": None},
        {"index": 1, "delta": {"content": "b"}, "finish_reason": "length"}]})
    _, events = _run("/v1/chat/completions", {"model": "m", "n": 2, "messages": []}, chunks,
                     abort=True)
    ends = {c["index"]: c["finish_reason"] for e in events for c in e["choices"]
            if c["finish_reason"]}
    assert ends == {0: "abort", 1: "length"}


def test_a_request_with_n_null_gets_one_abort_end():
    _, events = _run("/v1/completions", {"model": "m", "n": None, "prompt": "x"}, _sse(),
                     abort=True)
    assert [c["finish_reason"] for e in events for c in e["choices"]] == ["abort"]


@pytest.mark.parametrize("request_body", [["not", "an", "object"], "text"])
def test_an_aborted_stream_of_a_request_that_is_no_json_object_gets_nothing_added(
        request_body):
    _, events = _run("/v1/completions", request_body, _sse(), abort=True)
    assert events == []


def test_an_aborted_stream_of_another_route_gets_nothing_added():
    # the notice is shaped as a completion's or a chat completion's chunk
    _, events = _run("/v1/responses", {"model": "m", "input": "x"}, _sse(), abort=True)
    assert events == []


# an SSE comment, or the tail of an event a previous chunk began
@pytest.mark.parametrize("first", [b": ping\n\n", b'ex": 0}]}\n\n'])
def test_a_finish_after_a_comment_or_an_event_s_tail_in_the_same_chunk_is_noted(first):
    finished = _sse({"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]})
    chunks = [first + finished[0], *finished[1:]]
    _, events = _run("/v1/completions", {"model": "m", "prompt": "x"}, chunks, abort=True)
    assert [c["finish_reason"] for e in events for c in e["choices"]] == ["stop"]
