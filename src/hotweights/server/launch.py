"""Start and stop a `hotweights serve` in the background (tests, benchmarks, the demo)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hotweights.errors import ServerError
from hotweights.protocol.http import opener, tls_context
from hotweights.server.serve import term_with_parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(model: str | os.PathLike, *, port: int, token: str, log: Path,
          vllm_args: tuple[str, ...] = (), env: dict[str, str] | None = None
          ) -> subprocess.Popen:
    """Start `hotweights serve` in the background (its own session), output to `log`, with
    this process's environment plus `env`.

    The server stops (SIGTERM: it cleans up) when the calling process dies, even killed.
    """
    env = {**os.environ, **(env or {}), "HF_HUB_OFFLINE": "1",
           "HOTWEIGHTS_TOKEN": token}  # the token not in argv: ps
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny models need little
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set by in-process engines (local.py)
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "hotweights", "serve", str(model), "--port", str(port),
             "--token-file", str(log.with_suffix(".token")), *vllm_args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=term_with_parent if sys.platform == "linux" else None)


def wait_ready(proc: subprocess.Popen, url: str, *, log: Path, timeout: float = 200,
               cafile: str | os.PathLike | None = None) -> None:
    """Wait until the server answers /health; ServerError with the log's tail otherwise.

    An https `url` is checked against `cafile` as every request is (`http.tls_context`).
    """
    probe = opener(url, tls_context(cafile) if url.startswith("https:") else None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise ServerError(f"{url}: server exited with {proc.returncode}; {log}:\n{tail}")
        try:
            with probe.open(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise ServerError(f"{url}: no answer on /health after {timeout:.0f} s (log: {log})")


def stop(proc: subprocess.Popen, timeout: float = 120) -> None:
    """SIGTERM the server (it removes its shared memory); wait until its whole session
    (vLLM's engine and workers too) is gone, so that its memory is free again."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _session_alive(proc) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _session_alive(proc):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _session_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader: a zombie still counts as a member
    try:
        os.killpg(proc.pid, 0)  # started with its own session: only processes we started
    except ProcessLookupError:
        return False
    return True
