"""HTTP(S) to a hotweights server: one authenticated JSON request, and the status route.

Both ends agree on this: the bridge, `RemoteGroup` and `hotweights status` speak it, the
plugin's routes (`vllm_plugin.routes`) answer it. An https server's certificate and host
name are always checked (`tls_context`); a token about to cross the network in plain http
is warned about, once per host. A loopback server is reached directly, never through
the environment's proxy (`http_proxy`), and no answer's redirect is followed: the token
goes to the server named and nowhere else.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import logging
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from hotweights.errors import ConfigError, ServerError
from hotweights.protocol.tokens import find_token
from hotweights.protocol.urls import is_loopback, server_url

logger = logging.getLogger(__name__)

CA_FILE_ENV = "HOTWEIGHTS_CA_FILE"
_CA_HINT = f"pass the CA bundle that signed it: cafile= (CLI: --cafile) or {CA_FILE_ENV}"
_NAME_MISMATCH = (62, 64)  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_warned: set[str | None] = set()  # hosts told that their token travels in plain http


def server_status(url: str, token: str | None = None, *,
                  cafile: str | os.PathLike | None = None, timeout: float = 120) -> dict:
    """GET /hotweights/status of the server at `url` (token and cafile as for
    `Bridge.connect`)."""
    url = server_url(url)
    status = request(url, "GET", "/hotweights/status", find_token(url, token), cafile=cafile,
                     timeout=timeout)
    if not isinstance(status, dict) or not isinstance(status.get("version"), str):
        raise ServerError(f"{url}/hotweights/status: not a hotweights status (no 'version' "
                          f"string in {str(status)[:200]!r}): is it a `hotweights serve` of "
                          "this hotweights version?")
    return status


def request(url: str, method: str, route: str, token: str, body: dict | None = None, *,
            timeout: float = 120, cafile: str | os.PathLike | None = None) -> dict:
    """`method` `route` on the server at `url` with its bearer token; the JSON answer.

    Args:
        cafile: for an https `url`, the CA bundle (PEM) its certificate must chain to
            (default: see `tls_context`).

    Every failure is a `ServerError` naming the route: an HTTP error with the server's
    detail, an unreachable or silent server, a certificate not trusted or not naming the
    host, a connection that broke mid-answer. A CA bundle that cannot be loaded is a
    `ConfigError`, and so is a `url` that is not a server URL (`urls.server_url`).
    """
    url = server_url(url)
    parts = urllib.parse.urlsplit(url)
    context = tls_context(cafile) if parts.scheme == "https" else None
    if parts.scheme == "http":
        _warn_plain(url, parts.hostname)
    req = urllib.request.Request(
        url + route, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    deadline = _Deadline(timeout)
    try:
        with deadline:
            return _exchange(req, url, method, route, context, timeout, deadline)
    except ServerError as e:
        if not deadline.passed or e.status is not None:  # (a refusal read whole: its own)
            raise
        raise ServerError(f"{method} {route}: no answer from {url} within {timeout:.0f} s "
                          f"(its answer still coming: {e})") from None


MAX_ANSWER = 64 << 20  # bytes: a manifest of thousands of tensors takes a few MB


def _bounded(resp, method: str, route: str, url: str) -> bytes:
    """The answer's body; a `ServerError` past `MAX_ANSWER` bytes (not held in memory)."""
    answer = resp.read(MAX_ANSWER + 1)
    if len(answer) > MAX_ANSWER:
        raise ServerError(f"{method} {route}: {url} answered more than {MAX_ANSWER >> 20} MiB: "
                          "is it a `hotweights serve`?")
    if left := getattr(resp, "length", None):  # a read of so many bytes stops short where
        raise http.client.IncompleteRead(answer, left)  # the connection broke, silently
    return answer


def _exchange(req: urllib.request.Request, url: str, method: str, route: str,
              context: ssl.SSLContext | None, timeout: float, deadline: _Deadline) -> dict:
    """`request`'s exchange: the JSON answer, or a `ServerError` that says what failed."""
    parts = urllib.parse.urlsplit(url)
    try:
        with opener(url, context, deadline=deadline).open(req, timeout=timeout) as resp:
            answer = _bounded(resp, method, route, url)
        try:
            return json.loads(answer)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            raise ServerError(f"{method} {route}: {url} answered {_what(answer, resp.headers)}"
                              ", not JSON: is it a `hotweights serve`?") from None
    except urllib.error.HTTPError as e:
        fields = {}
        try:
            answer = _bounded(e, method, route, url)
            detail = _what(answer, e.headers, whole=True)
            with contextlib.suppress(ValueError, RecursionError):
                fields = json.loads(answer)
        except (OSError, http.client.HTTPException) as broke:  # cut off mid-body
            detail = f"(the answer broke off: {broke!r})"
        if e.code == 404:  # every hotweights serve has its routes (the remote ones: --remote)
            serve = "hotweights serve" + (" --remote" if "/remote/" in route else "")
            detail += (f" ({url} has no such route: is it a `{serve}`, not plain vLLM or "
                       "another service on that port?" + (
                           " A server's URL has no /v1: the OpenAI routes' prefix is not "
                           "part of it" if parts.path.rstrip("/").endswith("/v1") else "")
                       + ")")
        elif 300 <= e.code < 400:
            detail = (f"it redirects to {e.headers.get('Location')!r}, which hotweights does "
                      f"not follow (the token would go along): give the server's own URL")
        elif e.code == 401:
            detail += (" (the token is not this server's: `hotweights serve` writes its "
                       "token file, or takes --token / $HOTWEIGHTS_TOKEN, at each start)")
        raise ServerError(f"{method} {route}: HTTP {e.code}: {detail}", e.code,
                          fields if isinstance(fields, dict) else None) from None
    except urllib.error.URLError as e:
        raise ServerError(f"{method} {route}: {_unreachable(url, e.reason)}") from None
    except TimeoutError:
        raise ServerError(f"{method} {route}: no answer from {url} within {timeout:.0f} s") \
            from None
    except OSError as e:  # the connection broke mid-answer (the server died)
        hint = " (does it serve https? then use an https URL)" if (
            parts.scheme == "http" and isinstance(e, http.client.RemoteDisconnected)) else ""
        raise ServerError(f"{method} {route}: the connection to {url} broke: {e}{hint}") \
            from None
    except http.client.HTTPException as e:  # not HTTP (another service), or cut off
        raise ServerError(f"{method} {route}: {url} broke the HTTP exchange: {e!r} (is it a "
                          "`hotweights serve`, and did it stay up?)") from None


def opener(url: str, context: ssl.SSLContext | None = None, *, direct: bool = False,
           deadline: _Deadline | None = None) -> urllib.request.OpenerDirector:
    """What opens every request to the server at `url`: https checked with `context`, a
    redirect answered as the HTTPError it is (not followed, with the request's headers), the
    environment's proxy skipped for a loopback host (any host: `direct`), the connection
    cut at `deadline`."""
    handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
    if deadline is not None:
        handlers.append(_Bounded(deadline))
    if context is not None or deadline is not None:
        handlers.append(_BoundedHTTPS(deadline, context))
    if direct or is_loopback(urllib.parse.urlsplit(url).hostname):
        handlers.append(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener(*handlers)


class _Deadline:
    """The end of one request's whole exchange (None: no end). The socket timeout bounds
    each read on its own: a server or proxy that trickles its answer (or a proxy's tunnel,
    or a TLS handshake) would hold a request, a lease's renewal say, past it. At the
    deadline the connection is shut down (`passed`)."""

    def __init__(self, seconds: float | None):
        self.at = None if seconds is None else time.monotonic() + seconds
        self.passed = False
        self._timer: threading.Timer | None = None
        self._sock: socket.socket | None = None

    def watch(self, sock: socket.socket) -> None:
        """Shut the connection of `sock` down at the deadline: through a duplicate of its
        own, which a TLS wrap (that detaches `sock`) leaves alone."""
        if self.at is None or self._timer is not None:
            return
        self._sock = sock.dup()
        self._timer = threading.Timer(max(0.0, self.at - time.monotonic()), self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        self.passed = True
        with contextlib.suppress(OSError):  # (the peer closed it meanwhile)
            self._sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> _Deadline:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()  # (a cut under way ends before its socket is closed)
            self._sock.close()


def _watched(cls: type[http.client.HTTPConnection], deadline: _Deadline | None) -> type:
    """`cls`, its connection shut down at `deadline` from its first byte on, proxy
    tunnel and TLS handshake included (None: `cls` as it is)."""
    if deadline is None:
        return cls

    class Watched(cls):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            create = self._create_connection  # what `connect` makes its socket with

            def created(*a, **kw) -> socket.socket:
                sock = create(*a, **kw)
                deadline.watch(sock)
                return sock
            self._create_connection = created
    return Watched


class _Bounded(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_watched(http.client.HTTPConnection, self.deadline), req)


class _BoundedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline | None, context: ssl.SSLContext | None):
        super().__init__(context=context)
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(_watched(http.client.HTTPSConnection, self.deadline), req,
                            context=self._context)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_args) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


def _what(answer: bytes, headers, whole: bool = False) -> str:
    """An answer's body for an error message: up to 500 characters of text (`whole`; else
    its kind and size), an HTML page by its size only."""
    text, kind = answer.decode(errors="replace"), headers.get("Content-Type") or ""
    if "html" in kind.lower() or text.lstrip()[:15].lower().startswith(("<!doctype html",
                                                                         "<html")):
        return f"an HTML page ({len(answer)} bytes)"
    return text[:500] if whole else f"{len(answer)} bytes" + (f" of {kind}" if kind else "")


def tls_context(cafile: str | os.PathLike | None = None) -> ssl.SSLContext:
    """The TLS settings of every https request: the server's certificate must chain to
    `cafile`, else to $HOTWEIGHTS_CA_FILE, else to the system's trust store (which
    SSL_CERT_FILE / SSL_CERT_DIR replace), and name the URL's host.

    Raises:
        ConfigError: the CA bundle cannot be read or holds no certificate.
    """
    if cafile is not None:
        return _context(os.fspath(cafile), "cafile= (CLI: --cafile) ")
    if os.environ.get(CA_FILE_ENV):
        return _context(os.environ[CA_FILE_ENV], f"{CA_FILE_ENV}=")
    # Keyed by the variables OpenSSL reads: loading a trust store takes ~0.1 s.
    return _default_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=8)
def _context(cafile: str, given_as: str) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=cafile)
    except OSError as e:  # ssl.SSLError too: not PEM, or no certificate in it
        raise ConfigError(f"{given_as}{cafile}: cannot load it as a CA bundle "
                          f"({e.strerror or e}); pass a PEM file of CA certificates") from None


@functools.lru_cache(maxsize=4)
def _default_context(_cert_file: str | None, _cert_dir: str | None) -> ssl.SSLContext:
    return ssl.create_default_context()


def _unreachable(url: str, reason: object) -> str:
    if isinstance(reason, ssl.SSLCertVerificationError):
        if reason.verify_code in _NAME_MISMATCH:
            return (f"{url}: its TLS certificate does not name this host "
                    f"({reason.verify_message}); use a host name or address it lists")
        return f"{url}: TLS certificate not trusted ({reason.verify_message}); {_CA_HINT}"
    if isinstance(reason, ssl.SSLError):
        return (f"{url}: TLS handshake failed ({reason}); does it serve https "
                "(hotweights serve --ssl-keyfile/--ssl-certfile)?")
    hint = (" (is a `hotweights serve` running there?)"
            if isinstance(reason, ConnectionRefusedError) else "")
    return f"cannot reach {url}: {reason}{hint}"


def _warn_plain(url: str, host: str | None) -> None:
    if host in _warned or is_loopback(host):
        return
    _warned.add(host)
    logger.warning("hotweights: the bearer token goes to %s over plain http: anyone on the "
                   "way can read it and take over the server's updates; serve with "
                   "--ssl-keyfile/--ssl-certfile and use an https URL (docs/remote.md#tls)",
                   url)
