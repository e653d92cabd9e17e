"""Trainer side: attach to a running `hotweights serve`, train its weights in place."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from hotweights import shm
from hotweights.errors import ServerError
from hotweights.views import build_hf_model

logger = logging.getLogger(__name__)


class Bridge:
    """A connection to one hotweights server on this machine.

    Example:
        bridge = Bridge.connect("http://127.0.0.1:8000")  # token: see connect
        model = bridge.model(trainable=r"layers\\.")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        with bridge.update():
            optimizer.step()   # writes vLLM's weights; served from the commit on
    """

    def __init__(self, url: str, token: str, manifests: list[shm.Manifest], version: int):
        self.url, self._token = url.rstrip("/"), token
        self.manifests = manifests
        self.version = version
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.tensors = shm.attach(manifests[0])

    @classmethod
    def connect(cls, url: str, *, token: str | None = None) -> Bridge:
        """Fetch the server's manifest and map its shared weights (same machine).

        Args:
            url: the server, e.g. "http://127.0.0.1:8000".
            token: its access token (default: the HOTWEIGHTS_TOKEN environment variable,
                else the token file `hotweights serve` wrote for that port).
        """
        token = find_token(url, token)
        data = _request(url.rstrip("/"), "GET", "/hotweights/manifest", token)
        manifests = [shm.Manifest.from_dict(m, source=f"{url}/hotweights/manifest")
                     for m in data["manifests"]]
        if len(manifests) != 1:
            raise ServerError(f"{url}: {len(manifests)} workers; the bridge maps tp=1 servers")
        return cls(url, token, manifests, int(data["version"]))

    def model(self, **kwargs: Any) -> torch.nn.Module:
        """The HF model whose parameters are views into the server's weights.

        Keyword arguments go to `build_hf_model` (`trainable=`, `allow_missing=`,
        `trust_remote_code=` for a model whose code ships with it, ...); its report is
        kept in `bridge.report`.
        """
        model, self.report = build_hf_model(self.manifests[0].model, self.tensors, **kwargs)
        return model

    @contextlib.contextmanager
    def update(self, mode: str = "wait", *, lease_s: float = 60.0) -> Iterator[None]:
        """Pause the server, let the body write the weights, then commit (or abort).

        Args:
            mode: how the server treats in-flight requests while paused: "wait" (finish
                them first), "abort" (stop them) or "keep" (freeze them; resumed after).
            lease_s: the server resumes by itself, marking the weights dirty, if the
                update is not committed within this many seconds.
        """
        self._post("/hotweights/begin", holder=self.holder, mode=mode, lease_s=lease_s)
        try:
            yield
            device = next(iter(self.tensors.values())).device
            if device.type == "cuda":  # the server's stream is not ordered after ours
                torch.cuda.synchronize(device)
        except BaseException:
            try:
                self._post("/hotweights/abort", holder=self.holder, dirty=True)
            except ServerError as e:  # keep the body's exception; the lease will expire
                logger.error("abort after a failed update failed: %s", e)
            raise
        self.version = self._post("/hotweights/commit", holder=self.holder)["version"]

    def renew(self, lease_s: float = 60.0) -> None:
        """Extend the lease of a long update."""
        self._post("/hotweights/renew", holder=self.holder, lease_s=lease_s)

    def status(self) -> dict:
        return server_status(self.url, self._token)

    def _post(self, route: str, **body: Any) -> dict:
        return _request(self.url, "POST", route, self._token, body)


def server_status(url: str, token: str | None = None) -> dict:
    """GET /hotweights/status of the server at `url` (token as for `Bridge.connect`)."""
    url = url.rstrip("/")
    return _request(url, "GET", "/hotweights/status", find_token(url, token))


def find_token(url: str, token: str | None = None) -> str:
    """`token`, else $HOTWEIGHTS_TOKEN, else the file `hotweights serve` wrote for the port."""
    from hotweights.serve import token_path

    if token or (token := os.environ.get("HOTWEIGHTS_TOKEN")):
        return token
    path = token_path(urllib.parse.urlsplit(url).port or 80)
    if path.is_file():
        return path.read_text().strip()
    raise ServerError(f"{url}: no token: pass token=, set HOTWEIGHTS_TOKEN, or run the "
                      f"server on this machine as this user (it writes {path})")


def _request(url: str, method: str, route: str, token: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        url + route, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise ServerError(f"{method} {route}: HTTP {e.code}: {detail}") from None
    except urllib.error.URLError as e:
        raise ServerError(f"{method} {route}: cannot reach {url}: {e.reason}") from None
