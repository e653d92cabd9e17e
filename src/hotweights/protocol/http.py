"""HTTP to a hotweights server: one authenticated JSON request, and the status route.

Both ends agree on this: the bridge, `RemoteGroup` and `hotweights status` speak it, the
plugin's routes (`vllm_plugin.routes`) answer it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from hotweights.errors import ServerError
from hotweights.protocol.tokens import find_token


def server_status(url: str, token: str | None = None) -> dict:
    """GET /hotweights/status of the server at `url` (token as for `Bridge.connect`)."""
    url = url.rstrip("/")
    return request(url, "GET", "/hotweights/status", find_token(url, token))


def request(url: str, method: str, route: str, token: str, body: dict | None = None, *,
            timeout: float = 120) -> dict:
    """`method` `route` on the server at `url` with its bearer token; the JSON answer.

    Every failure is a `ServerError` naming the route: an HTTP error with the server's
    detail, an unreachable or silent server, a connection that broke mid-answer.
    """
    req = urllib.request.Request(
        url + route, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise ServerError(f"{method} {route}: HTTP {e.code}: {detail}") from None
    except urllib.error.URLError as e:
        raise ServerError(f"{method} {route}: cannot reach {url}: {e.reason}") from None
    except TimeoutError:
        raise ServerError(f"{method} {route}: no answer from {url} within {timeout:.0f} s") \
            from None
    except OSError as e:  # the connection broke mid-answer (the server died)
        raise ServerError(f"{method} {route}: the connection to {url} broke: {e}") from None
