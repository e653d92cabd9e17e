"""protocol.http over https: a real local TLS server, certificates from a test CA."""

import contextlib
import http.server
import logging
import re
import socket
import ssl
import threading
import time
import urllib.request

import pytest

from hotweights.errors import ConfigError, ServerError
from hotweights.protocol import http as hw_http
from hotweights.protocol.http import request
from hotweights.protocol.urls import is_loopback, server_url


@pytest.fixture(autouse=True)
def no_ca_env(monkeypatch):
    for name in ("HOTWEIGHTS_CA_FILE", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hw_http, "_warned", set())  # each test sees its own first warnings


def test_https_with_the_ca_given_as_argument_or_variable(tls, json_server, monkeypatch):
    port = json_server(*tls.leaf("localhost", "127.0.0.1"))
    for url in (f"https://127.0.0.1:{port}", f"https://localhost:{port}"):
        assert request(url, "GET", "/hotweights/status", "tok", cafile=tls.ca) == {
            "route": "/hotweights/status", "auth": "Bearer tok"}
    monkeypatch.setenv("HOTWEIGHTS_CA_FILE", tls.ca)
    assert request(f"https://127.0.0.1:{port}", "GET", "/x", "tok")["route"] == "/x"
    monkeypatch.delenv("HOTWEIGHTS_CA_FILE")
    monkeypatch.setenv("SSL_CERT_FILE", tls.ca)  # the system's trust store, replaced
    assert request(f"https://127.0.0.1:{port}", "GET", "/y", "tok")["route"] == "/y"


def test_an_unknown_ca_fails_naming_the_url_and_the_option(tls, json_server):
    url = f"https://127.0.0.1:{json_server(*tls.leaf('127.0.0.1'))}"
    with pytest.raises(ServerError, match=rf"GET /x: {url}: TLS certificate not trusted "
                       r"\(unable to get local issuer certificate\); pass the CA bundle that "
                       r"signed it: cafile= \(CLI: --cafile\) or HOTWEIGHTS_CA_FILE"):
        request(url, "GET", "/x", "tok")


def test_a_certificate_for_another_host_fails_even_from_a_trusted_ca(tls, json_server):
    port = json_server(*tls.leaf("elsewhere.example"))
    with pytest.raises(ServerError, match=rf"https://127.0.0.1:{port}: its TLS certificate "
                       r"does not name this host \(IP address mismatch.*\); use a host name"):
        request(f"https://127.0.0.1:{port}", "GET", "/x", "tok", cafile=tls.ca)
    with pytest.raises(ServerError, match=r"does not name this host \(Hostname mismatch"):
        request(f"https://localhost:{port}", "GET", "/x", "tok", cafile=tls.ca)


def test_https_to_a_plain_http_server_says_what_is_wrong(tls, json_server):
    port = json_server()
    with pytest.raises(ServerError, match=r"TLS handshake failed .*does it serve https"):
        request(f"https://127.0.0.1:{port}", "GET", "/x", "tok", cafile=tls.ca)


@pytest.mark.parametrize("given_as", ["argument", "variable"])
def test_a_bad_ca_bundle_is_named(tmp_path, monkeypatch, given_as):
    bad = tmp_path / "not-pem.txt"
    bad.write_text("hello")
    for path, why in ((bad, "no certificate or crl found"),
                      (tmp_path / "missing.pem", "No such file")):
        if given_as == "variable":
            monkeypatch.setenv("HOTWEIGHTS_CA_FILE", str(path))
        prefix = (r"cafile= \(CLI: --cafile\) " if given_as == "argument" else
                  "HOTWEIGHTS_CA_FILE=")
        with pytest.raises(ConfigError, match=rf"{prefix}{path}: cannot load it as a CA "
                           rf"bundle \(.*{why}.*\); pass a PEM file"):
            request("https://127.0.0.1:1", "GET", "/x", "tok",
                    cafile=path if given_as == "argument" else None)


def test_token_over_plain_http_warns_once_per_remote_host(json_server, caplog):
    caplog.set_level(logging.WARNING, logger="hotweights.protocol.http")
    port = json_server()
    for host in ("127.0.0.1", "localhost"):  # loopback: never
        request(f"http://{host}:{port}", "GET", "/x", "tok")
    assert not caplog.records
    for url in ("http://10.255.255.1:9", "http://10.255.255.1:10", "http://10.255.255.2:9"):
        with pytest.raises(ServerError):  # warned before sending; unreachable here
            request(url, "GET", "/x", "tok", timeout=0.2)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned  # once per host, whatever the port
    assert warned[0].startswith("hotweights: the bearer token goes to http://10.255.255.1:9 "
                                "over plain http")
    assert "--ssl-keyfile/--ssl-certfile and use an https URL" in warned[0]
    assert "10.255.255.2" in warned[1]


def test_no_warning_over_https(tls, json_server, caplog):
    caplog.set_level(logging.WARNING, logger="hotweights.protocol.http")
    with pytest.raises(ServerError):
        request("https://10.255.255.1:9", "GET", "/x", "tok", cafile=tls.ca, timeout=0.2)
    assert not caplog.records


def test_a_server_without_the_route_is_told_apart_from_a_hotweights_error():
    # what plain vLLM (FastAPI) answers for a route it lacks
    with _served(404, b'{"detail":"Not Found"}') as url:
        with pytest.raises(ServerError, match=r"GET /hotweights/status: HTTP 404: .*Not Found.*"
                                              r"no such route: is it a `hotweights serve`, not "
                                              r"plain vLLM"):
            request(url, "GET", "/hotweights/status", "t")
        with pytest.raises(ServerError, match=r"is it a `hotweights serve --remote`"):
            request(url, "GET", "/hotweights/remote/received", "t")
        with pytest.raises(ServerError, match=r"A server's URL has no /v1"):  # vLLM's base
            request(url + "/v1/", "GET", "/hotweights/status", "t")
    with _served(401, b'{"error":"missing or wrong bearer token"}') as url:
        with pytest.raises(ServerError, match=r"HTTP 401: .*wrong bearer token.* \(the token "
                           r"is not this server's"):
            request(url, "GET", "/hotweights/status", "t")
    with _served(409, b'{"error":"update lease held by h2","holder":"h2"}') as url:
        with pytest.raises(ServerError, match=r"HTTP 409: .*lease held by h2") as e:
            request(url, "GET", "/hotweights/status", "t")
    assert e.value.status == 409 and e.value.detail["holder"] == "h2"  # the refusal's fields
    with _served(500, b"[1]") as url:
        with pytest.raises(ServerError) as e:
            request(url, "GET", "/hotweights/status", "t")
    assert e.value.detail == {}
    with _served(200, b"{}") as url:  # then gone: nothing listens on the port
        pass
    with pytest.raises(ServerError, match=r"cannot reach .*refused \(is a `hotweights serve` "
                       r"running there\?\)"):
        request(url, "GET", "/hotweights/status", "t")


@pytest.mark.parametrize(("reply", "named"), [
    (b"SSH-2.0-OpenSSH_9.6\r\n", "BadStatusLine"),  # another service on the port
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"a\":", "IncompleteRead"),  # died
])
def test_a_broken_http_exchange_is_a_server_error_naming_the_route(reply, named):
    # http.client's errors are no OSError: a renewer or a rollback catching ServerError
    # would otherwise die of them
    listener = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = listener.accept()
        with conn:
            _read_request(conn)  # all of it: unread bytes at close would reset the
            conn.sendall(reply)  # connection before the client reads the reply
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(10)
            with contextlib.suppress(OSError):
                while conn.recv(65536):  # until the client closes
                    pass

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(ServerError, match=rf"POST /hotweights/renew: http://127.0.0.1:\d+ "
                                              rf"broke the HTTP exchange: {named}"):
            request(f"http://127.0.0.1:{listener.getsockname()[1]}", "POST",
                    "/hotweights/renew", "t", {}, timeout=10)
    finally:
        thread.join()
        listener.close()


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    while length and len(body) < int(length[1]):
        body += conn.recv(65536)


def test_a_url_with_a_password_is_refused_without_echoing_it():
    from hotweights.errors import ConfigError

    for url in ("http://user:s3cret@127.0.0.1:9", "http://user:s3cret@127.0.0.1:99999",
                "ftp://user:s3cret@host", "user:s3cret@host:8000", "http://user:s3cret@[::1"):
        with pytest.raises(ConfigError, match="USER:PASSWORD@") as e:
            request(url, "GET", "/hotweights/status", "t")
        assert "s3cret" not in str(e.value)


@contextlib.contextmanager
def _served(status: int, body: bytes, content_type: str | None = None, *,
            headers: dict[str, str] | None = None, seen: list | None = None):
    """The URL of an HTTP server on localhost answering every GET with `status`, `body`
    and `headers`, while the block runs; each request's path and headers added to
    `seen`."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            if seen is not None:
                seen.append((self.path, dict(self.headers)))
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if content_type:
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status", [200, 404, 500])
def test_an_html_page_is_named_by_its_size_not_printed(status):
    page = b"<!DOCTYPE html><html><body>" + b"x" * 5000 + b"</body></html>"
    with _served(status, page, "text/html; charset=utf-8") as url:  # another web service
        with pytest.raises(ServerError, match=rf"an HTML page \({len(page)} bytes\)") as e:
            request(url, "GET", "/hotweights/status", "t")
    assert "<" not in str(e.value) and len(str(e.value)) < 300


def test_a_loopback_server_is_reached_past_the_environment_s_proxy(monkeypatch):
    """The token goes to the server named: a proxy set in the environment (clusters often
    set one) never sees a loopback request; another host's requests still go through it."""
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    proxied = []
    with _served(200, b'{"via": "proxy"}', "application/json", seen=proxied) as proxy, \
            _served(200, b'{"via": "server"}', "application/json") as url:
        monkeypatch.setenv("http_proxy", proxy)
        assert request(url, "GET", "/hotweights/status", "secret") == {"via": "server"}
        assert proxied == []
        assert request("http://10.255.255.1:8000", "GET", "/hotweights/status",
                       "t") == {"via": "proxy"}
        assert proxied[0][0] == "http://10.255.255.1:8000/hotweights/status"


def test_a_redirect_is_refused_naming_where_it_points_and_the_token_stays():
    elsewhere = []
    with _served(200, b"{}", "application/json", seen=elsewhere) as target, \
            _served(307, b"", headers={"Location": target + "/x"}) as url:
        with pytest.raises(ServerError, match=rf"GET /hotweights/status: HTTP 307: it "
                                              rf"redirects to '{target}/x', which hotweights "
                                              rf"does not follow \(the token would go along\)"):
            request(url, "GET", "/hotweights/status", "secret")
    assert elsewhere == []


@pytest.mark.parametrize(("a", "b", "same"), [
    ("http://localhost:8000", "http://127.0.0.1:8000/", True),
    ("http://[::1]:8000", "http://LOCALHOST.:8000", True),
    ("http://[::ffff:127.0.0.1]:8000", "http://127.0.0.1:8000", True),
    ("http://Gpu01", "http://gpu01:80", True),
    ("https://gpu01", "https://gpu01:443/", True),
    ("http://127.0.0.2:8000", "http://127.0.0.1:8000", False),  # another address: another
    ("http://gpu01:8000", "http://gpu01:8001", False),  # server may listen there
    ("https://gpu01:8000", "http://gpu01:8000", False),
    ("http://gpu01:8000/a", "http://gpu01:8000", False),
])
def test_two_spellings_of_one_server_url(a, b, same):
    from hotweights.protocol.urls import same_server

    assert same_server(a, b) is same and same_server(b, a) is same


@pytest.mark.timeout(30)  # (the old code waited for all 1000 bytes: 200 s)
@pytest.mark.parametrize("tls_on", [False, True])
def test_an_answer_trickled_slower_than_the_timeout_ends_at_the_timeout(tls_on, tls):
    # each read came within the timeout: bounded per read, a renewal could outlast a lease
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    context = None
    if tls_on:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*tls.leaf("127.0.0.1"))

    def answer():
        conn, _ = listener.accept()
        if context is not None:
            conn = context.wrap_socket(conn, server_side=True)
        with conn:
            _read_request(conn)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            with contextlib.suppress(OSError):
                while not stop.wait(0.2):
                    conn.sendall(b" ")  # a byte at a time, each well within the timeout

    thread = threading.Thread(target=answer)
    thread.start()
    url = f"{'https' if tls_on else 'http'}://127.0.0.1:{listener.getsockname()[1]}"
    began = time.monotonic()
    try:
        with pytest.raises(ServerError, match=rf"POST /hotweights/renew: no answer from "
                           rf"{url} within 1 s \(its answer still coming"):
            request(url, "POST", "/hotweights/renew", "t", {}, timeout=1.0,
                    cafile=tls.ca if tls_on else None)
        assert time.monotonic() - began < 10  # not the trickle's 200 s (loaded CI: margin)
    finally:
        stop.set()
        thread.join()
        listener.close()


@contextlib.contextmanager
def _trickling(first: bytes):
    """A server on localhost that reads a request (or a proxy's CONNECT), sends `first`,
    then a header line every 0.2 s until the block ends; its URL's port."""
    listener, stop = socket.create_server(("127.0.0.1", 0)), threading.Event()

    def answer():
        conn, _ = listener.accept()
        with conn:
            _read_request(conn)
            with contextlib.suppress(OSError):
                conn.sendall(first)
                while not stop.wait(0.2):
                    conn.sendall(b"X: y\r\n" if first.endswith(b"\r\n") else b" ")

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


@pytest.mark.timeout(30)
def test_a_proxy_s_tunnel_trickled_ends_at_the_timeout(monkeypatch, tls):
    # the deadline runs from the connection's first byte: a CONNECT's answer (and a TLS
    # handshake) inside it
    with _trickling(b"HTTP/1.1 200 Connection established\r\n") as port:
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{port}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        began = time.monotonic()
        with pytest.raises(ServerError, match=r"no answer from https://server.example:8000 "
                           r"within 1 s"):
            request("https://server.example:8000", "POST", "/hotweights/renew", "t", {},
                    timeout=1.0, cafile=tls.ca)
        assert time.monotonic() - began < 10  # not the test's 30 s (loaded CI: margin)


@pytest.mark.timeout(30)
def test_a_refusal_whose_body_trickles_keeps_its_status():
    # a 409 (the lease is gone) is no "no answer": a renewer must stop, not retry
    with _trickling(b"HTTP/1.1 409 Conflict\r\nContent-Length: 1000\r\n\r\n{") as port:
        with pytest.raises(ServerError, match="HTTP 409") as e:
            request(f"http://127.0.0.1:{port}", "POST", "/hotweights/renew", "t", {},
                    timeout=1.0)
    assert e.value.status == 409


def test_an_answer_past_the_bound_is_refused_not_read_whole(json_server, monkeypatch):
    monkeypatch.setattr(hw_http, "MAX_ANSWER", 1000)
    url = f"http://127.0.0.1:{json_server(answer={'x': 'y' * 5000})}"
    with pytest.raises(ServerError, match=rf"^GET /x: {url} answered more than 0 MiB: is it "):
        request(url, "GET", "/x", "tok")
    assert request(f"http://127.0.0.1:{json_server(answer={'x': 'y' * 900})}", "GET", "/x",
                   "tok") == {"x": "y" * 900}


def test_an_answer_of_exactly_the_bound_is_read(monkeypatch):
    body = b'{"x": "' + b"y" * 100 + b'"}'
    monkeypatch.setattr(hw_http, "MAX_ANSWER", len(body))
    with _served(200, body, "application/json") as url:
        assert request(url, "GET", "/x", "t") == {"x": "y" * 100}


def test_an_endless_answer_is_cut_at_the_bound_not_read_to_the_timeout(monkeypatch):
    # no Content-Length, a body that never ends: refused once the bound is passed
    monkeypatch.setattr(hw_http, "MAX_ANSWER", 1000)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\n\r\n[")
            try:
                while not stop.is_set():
                    conn.sendall(b"1," * 512)
            except OSError:
                pass

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(ServerError, match=rf"^GET /x: {url} answered more than 0 MiB"):
            request(url, "GET", "/x", "t", timeout=10)
    finally:
        stop.set()
        thread.join(10)
        listener.close()


def test_an_answer_nested_past_the_stack_is_a_server_error():
    body = b"[" * 200_000 + b"]" * 200_000
    with _served(200, body, "application/json") as url:
        with pytest.raises(ServerError, match=r"not JSON: is it a `hotweights serve`"):
            request(url, "GET", "/x", "t")


def test_a_cafile_given_as_argument_wins_over_the_variable(tls, json_server, monkeypatch,
                                                           tmp_path):
    port = json_server(*tls.leaf("127.0.0.1"))
    monkeypatch.setenv("HOTWEIGHTS_CA_FILE", str(tmp_path / "missing.pem"))
    assert request(f"https://127.0.0.1:{port}", "GET", "/x", "t",
                   cafile=tls.ca)["route"] == "/x"


def test_a_direct_opener_skips_the_environments_proxy_for_any_host(monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    for direct in (True, False):
        op = hw_http.opener("http://10.255.255.1:8000", direct=direct)
        proxied = [h.proxies.get("http") for h in op.handlers
                   if isinstance(h, urllib.request.ProxyHandler)]
        assert proxied == ([] if direct else ["http://127.0.0.1:9"]), direct


@pytest.mark.parametrize(("url", "why"), [
    ("http://h:1/#frag", "a query or fragment after it"),
    ("http://h:1/a\x00b", "a space or control character in it"),
    ("http://h:1/a\x7fb", "a space or control character in it"),
])
def test_more_urls_that_are_no_server_urls(url, why):
    with pytest.raises(ConfigError, match=why):
        server_url(url)


def test_localhost_with_its_root_dot_is_loopback():
    assert is_loopback("localhost.") and is_loopback("LOCALHOST")
    assert not is_loopback("localhost.example") and not is_loopback("10.0.0.1")
