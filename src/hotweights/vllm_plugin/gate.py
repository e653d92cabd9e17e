"""ASGI middleware in front of vLLM's API server.

Every response says which weight version served it (header `x-hotweights-version`). A
request that may reach the engine (/v1/..., and any POST outside /hotweights/) that
arrives during an update waits for the commit, and the routes see every request past the
gate, so a `wait` update can drain them and an `abort` update can
abort them all. vLLM ends the stream of a request aborted before its first token without
any finish reason; the gate adds `"finish_reason": "abort"` for such choices so clients
can tell an aborted request from an empty answer.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

from hotweights.protocol.version import VERSION_HEADER

_MAX_REQUEST_BYTES = 1 << 20  # what we keep of a request body to name its model/choices
_FINISHED = re.compile(rb'"finish_reason":\s*"')


class Gate:
    """State shared by the middleware and the routes of one API server."""

    def __init__(self) -> None:
        self.open = asyncio.Event()  # cleared while an update holds generation
        self.open.set()
        self.idle = asyncio.Event()  # set when no request is past the gate
        self.idle.set()
        self.live: set[_Exchange] = set()

    def mark_aborted(self) -> None:
        for exchange in self.live:
            exchange.aborted = True

    def _enter(self, exchange: _Exchange) -> None:
        self.live.add(exchange)
        self.idle.clear()

    def _leave(self, exchange: _Exchange) -> None:
        self.live.discard(exchange)
        if not self.live:
            self.idle.set()


class GateMiddleware:
    def __init__(self, app, gate: Gate, version):
        self.app, self.gate, self.version = app, gate, version

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):  # vLLM's --root-path: routed without it
            path = path[len(root):]
        if not (path.startswith("/v1/") or scope.get("method") == "POST"
                and not path.startswith("/hotweights/")):  # what may reach the engine
            exchange = _Exchange(scope["path"], self.version())
            return await self.app(scope, receive, exchange.send(send))
        gate = self.gate
        # past the gate once its body is all here: a client that trickles its body, or
        # never ends it, holds back no update (a `wait` would wait for it, an `abort` could
        # not abort it: it has not reached the engine)
        receive = await _whole_body(receive)
        while not gate.open.is_set():  # re-check: a new update may close it again
            await gate.open.wait()
        exchange = _Exchange(scope["path"], self.version())
        gate._enter(exchange)
        try:
            await self.app(scope, exchange.receive(receive), exchange.send(send))
        finally:
            gate._leave(exchange)


async def _whole_body(receive):
    """Read the request's messages up to its last body part (or the client's disconnect);
    a `receive` that gives them again, then the next messages (a disconnect)."""
    read = []
    while True:
        read.append(message := await receive())
        if message["type"] != "http.request" or not message.get("more_body", False):
            break

    async def again():
        return read.pop(0) if read else await receive()

    return again


class _Exchange:
    """One request/response: stamps the version, notes finished choices of a stream."""

    def __init__(self, path: str, version: int):
        self.path, self.version = path, str(version).encode()
        self.aborted = False
        self.streaming = False
        self.request = bytearray()
        self.finished: set[int] = set()  # choice indexes a finish_reason was sent for

    def receive(self, receive):
        async def receive_and_keep():
            message = await receive()
            if message["type"] == "http.request" and len(self.request) < _MAX_REQUEST_BYTES:
                self.request += message.get("body", b"")
            return message

        return receive_and_keep

    def send(self, send):
        async def send_with_version(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()),
                                      (VERSION_HEADER.encode(), self.version)]
                self.streaming = any(k.lower() == b"content-type"
                                     and v.startswith(b"text/event-stream")
                                     for k, v in message["headers"])
            elif message["type"] == "http.response.body" and self.streaming:
                body = message.get("body", b"")
                if _FINISHED.search(body):
                    self._note_finished(body)
                if self.aborted and b"data: [DONE]" in body and (notice := self._notice()):
                    await send({"type": "http.response.body", "body": notice,
                                "more_body": True})
            await send(message)

        return send_with_version

    def _note_finished(self, body: bytes) -> None:
        for event in body.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            try:
                choices = json.loads(event[6:]).get("choices") or ()
            except ValueError:
                continue
            self.finished.update(c.get("index", 0) for c in choices if c.get("finish_reason"))

    def _notice(self) -> bytes:
        """SSE events ending, with `abort`, every choice vLLM ended without a reason."""
        chat = self.path.endswith("/chat/completions")
        if not chat and not self.path.endswith("/completions"):
            return b""
        try:
            request = json.loads(self.request)
            n = int(request.get("n") or 1)
        except (ValueError, TypeError, AttributeError):
            return b""
        prompt = request.get("prompt")
        batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        choices = n * (len(prompt) if batch and not chat else 1)
        end = {"delta": {}} if chat else {"text": ""}
        events = [
            {"id": f"{'chatcmpl' if chat else 'cmpl'}-hotweights-abort",
             "object": "chat.completion.chunk" if chat else "text_completion",
             "created": int(time.time()), "model": request.get("model"),
             "choices": [{"index": i, **end, "logprobs": None, "finish_reason": "abort"}]}
            for i in range(choices) if i not in self.finished
        ]
        return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
