"""`hotweights serve --ssl-keyfile/--ssl-certfile`: files checked before vLLM, passed through."""

import contextlib
import http.server
import os
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hotweights.cli.main import _parser
from hotweights.errors import ConfigError
from hotweights.server import serve
from hotweights.server import tls as server_tls


def test_both_files_are_passed_to_vllm_exactly(tls):
    cert, key = tls.leaf("localhost")
    args, extra = _parser().parse_known_args(
        ["serve", "m", "--ssl_keyfile", key, f"--ssl-certfile={cert}", "--ssl-ca-certs", "x"])
    cmd = serve.command(args, extra)
    assert cmd[-6:] == ["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ca-certs", "x"]
    assert server_tls.check_files(key, cert)
    plain, extra = _parser().parse_known_args(["serve", "m"])
    assert "--ssl-keyfile" not in serve.command(plain, extra)
    assert not server_tls.check_files(None, None)


@pytest.mark.parametrize(("given", "message"), [
    ({"keyfile": "K"}, "--ssl-keyfile without --ssl-certfile: https needs both"),
    ({"certfile": "C"}, "--ssl-certfile without --ssl-keyfile: https needs both"),
])
def test_one_file_alone_is_refused(given, message):
    with pytest.raises(ConfigError, match=message):
        server_tls.check_files(given.get("keyfile"), given.get("certfile"))


def test_unreadable_or_wrong_files_are_named(tls, tmp_path):
    cert, key = tls.leaf("localhost")
    missing = tmp_path / "missing.key"
    with pytest.raises(ConfigError, match=rf"--ssl-keyfile {missing}: cannot read it "
                       r"\(No such file or directory\)"):
        server_tls.check_files(str(missing), cert)
    with pytest.raises(ConfigError, match=rf"--ssl-certfile {tmp_path}: cannot read it "
                       r"\(Is a directory\)"):
        server_tls.check_files(key, str(tmp_path))
    if os.geteuid() != 0:  # root reads any file
        private = tmp_path / "private.key"
        private.write_text("x")
        private.chmod(0)
        with pytest.raises(ConfigError, match=r"private.key: cannot read it \(Permission"):
            server_tls.check_files(str(private), cert)
    _, other_key = tls.leaf("elsewhere.example")
    with pytest.raises(ConfigError, match=rf"--ssl-certfile {cert}, --ssl-keyfile "
                       rf"{other_key}: not a PEM certificate chain and its private key"):
        server_tls.check_files(other_key, cert)
    with pytest.raises(ConfigError, match="not a PEM certificate chain"):
        server_tls.check_files(key, key)


def test_an_encrypted_key_is_refused_without_a_prompt(tls, tmp_path):
    from cryptography.hazmat.primitives import serialization

    cert, key = tls.leaf("localhost")
    loaded = serialization.load_pem_private_key(open(key, "rb").read(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(loaded.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(ConfigError, match=rf"--ssl-keyfile {encrypted}: the key is "
                       "encrypted and vLLM takes no password; decrypt it"):
        server_tls.check_files(str(encrypted), cert)


def test_the_runner_refuses_bad_files_before_starting_anything(tmp_path):
    missing = tmp_path / "missing.pem"
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run(
        [sys.executable, "-m", "hotweights", "serve", str(tmp_path), "--ssl-keyfile",
         str(missing), "--ssl-certfile", str(missing)], capture_output=True, text=True,
        timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"error: --ssl-keyfile {missing}: cannot read it "
                                  "(No such file or directory)")


def test_the_probe_trusts_exactly_the_servers_certificate(tls, tmp_path):
    cert, key = tls.leaf("server.example")  # not the name the probe dials
    other, other_key = tls.leaf("another.example")  # same CA: not enough
    chain = tmp_path / "fullchain.pem"  # the certificate, then the CA that issued it
    chain.write_text(Path(cert).read_text() + Path(tls.ca).read_text())
    with _serving(cert, key) as url:
        for trusted in (cert, str(chain)):
            with urllib.request.urlopen(url, context=server_tls.probe_context(trusted),
                                        timeout=10) as r:
                assert r.read() == b"ok"
        with pytest.raises(urllib.error.URLError, match="certificate verify failed"):
            urllib.request.urlopen(url, context=server_tls.probe_context(other), timeout=10)
    with _serving(other, other_key) as url:  # an impostor whose certificate the CA signed
        with pytest.raises(urllib.error.URLError, match="certificate verify failed"):
            urllib.request.urlopen(url, context=server_tls.probe_context(str(chain)),
                                   timeout=10)


@contextlib.contextmanager
def _serving(cert: str, key: str):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def test_the_probe_refuses_a_certfile_with_no_certificate_in_it(tls):
    _, key = tls.leaf("localhost")
    with pytest.raises(ConfigError, match=rf"--ssl-certfile {key}: no PEM certificate in it"):
        server_tls.probe_context(key)
