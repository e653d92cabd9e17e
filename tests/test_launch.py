"""server.launch: a background `hotweights serve` waited for and stopped (no vLLM: stand-in
processes and a stand-in /health)."""

import http.server
import signal
import subprocess
import sys
import threading

import pytest

from hotweights.errors import ServerError
from hotweights.server.launch import free_port, stop, wait_ready


def _child(code: str, log) -> subprocess.Popen:
    """A stand-in server process in its own session, as `spawn` starts one."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def test_waiting_for_a_server_that_exited_names_its_code_and_its_log_s_tail(tmp_path):
    log = tmp_path / "server.log"
    proc = _child("print('x' * 5000); print('error: the real cause'); raise SystemExit(3)",
                  log)
    proc.wait()
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError) as e:
        wait_ready(proc, url, log=log, timeout=10)
    assert str(e.value).startswith(f"{url}: server exited with 3; {log}:\n")
    assert str(e.value).endswith("error: the real cause\n")


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_server_that_answers_health_is_ready_and_stops_on_sigterm(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc = _child("import time; time.sleep(10)", tmp_path / "server.log")
    try:
        wait_ready(proc, f"http://127.0.0.1:{server.server_address[1]}",
                   log=tmp_path / "server.log", timeout=10)
    finally:
        stop(proc, timeout=10)
        server.shutdown()
        server.server_close()
    assert proc.returncode == -signal.SIGTERM  # asked to clean up, not killed


def test_a_server_that_ignores_sigterm_is_killed_once_the_timeout_is_over(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
             "signal.SIG_IGN); print('ready', flush=True); time.sleep(10)"],
            stdout=subprocess.PIPE, stderr=out, start_new_session=True)
    assert proc.stdout.readline() == b"ready\n"  # SIGTERM ignored from here on
    stop(proc, timeout=0.2)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


def test_an_https_server_is_ready_once_its_certificate_checks_against_the_cafile(
        tls, json_server, tmp_path, monkeypatch):
    for name in ("HOTWEIGHTS_CA_FILE", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)  # the CA only as the argument
    port = json_server(*tls.leaf("127.0.0.1"))
    proc = _child("import time; time.sleep(10)", tmp_path / "server.log")
    try:
        wait_ready(proc, f"https://127.0.0.1:{port}", log=tmp_path / "server.log", timeout=10,
                   cafile=tls.ca)
    finally:
        stop(proc, timeout=10)
