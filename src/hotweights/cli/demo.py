"""`hotweights demo`: a tiny local model served by vLLM, trained in place while it serves."""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import queue
import secrets
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.progress import Progress

from hotweights.cli.console import make_console
from hotweights.errors import ConfigError
from hotweights.protocol.http import opener
from hotweights.protocol.version import VERSION_HEADER, parse_version

PROMPT = "The server generates,"
TOKENS = 8  # a completion's, greedy
TARGET = " the trainer learns."


def _complete(url: str, model: str) -> tuple[str, int]:
    body = dict(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0.0)
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with opener(url).open(req, timeout=120) as resp:
        text = json.loads(resp.read())["choices"][0]["text"]
        return text, parse_version(resp.headers[VERSION_HEADER])[0]


def _generate(url: str, model: str, ready, done, last, results) -> None:
    versions, errors = [], []
    while not done.is_set() and not 0 <= last.value <= (versions[-1] if versions else -1):
        try:
            versions.append(_complete(url, model)[1])
        except Exception as e:  # (refused, a 503, a cut answer, no version header): counted
            errors.append(f"{type(e).__name__}: {e}")
            done.wait(0.05)  # not a tight loop while the server is away
        ready.set()
    results.put((versions, errors))


class _Client:
    """Keeps generating while the trainer updates the weights, in a process of its own
    (as a real client would be: a thread here would fight the trainer for the GIL)."""

    def __init__(self, url: str, model: str):
        ctx = multiprocessing.get_context("spawn")
        self.ready, self.done, self.results = ctx.Event(), ctx.Event(), ctx.Queue()
        self.last = ctx.Value("q", -1)  # the version to see served before it stops
        self.proc = ctx.Process(target=_generate, daemon=True, args=(
            url, model, self.ready, self.done, self.last, self.results))
        self.versions: list[int] = []
        self.errors: list[str] = []

    def start(self) -> None:
        self.proc.start()
        self.ready.wait(timeout=120)  # its first answer: it generates from now on

    def stop(self, last: int | None = None) -> None:
        """Stop generating; with `last`, once a completion came from that version (30 s at
        most): the summary then spans every version the trainer made."""
        if last is not None and self.proc.is_alive():
            self.last.value = last
            with contextlib.suppress(queue.Empty):
                self.versions, self.errors = self.results.get(timeout=30)
                self.proc.join(timeout=30)
                return
        self.done.set()
        if self.proc.is_alive() or not self.results.empty():
            self.versions, self.errors = self.results.get(timeout=120)
        self.proc.join(timeout=30)


@contextlib.contextmanager
def _stopping(client: _Client, last: Callable[[], int] | None = None):
    """Stop `client` after the block: once it saw the version `last()` says, unless the
    block raised."""
    try:
        yield
        at = last() if last else None
    except BaseException:
        client.stop()
        raise
    client.stop(at)


@contextlib.contextmanager
def serving(console, model_dir: Path, workdir: Path,
            *vllm_args: str) -> Iterator[tuple[str, str]]:
    """`hotweights serve` on the demo's model in the background: (url, token) once it
    answers; stopped at the end."""
    from hotweights.server import launch

    port, token, log = launch.free_port(), secrets.token_hex(16), workdir / "server.log"
    url, started = f"http://127.0.0.1:{port}", time.perf_counter()
    proc = launch.spawn(model_dir, port=port, token=token, log=log, vllm_args=vllm_args)
    try:
        with console.status(f"starting `hotweights serve` at {url} (log: {log})"):
            launch.wait_ready(proc, url, log=log)
        console.print(f"vLLM serves {model_dir} at {url} "
                      f"({time.perf_counter() - started:.0f} s)")
        yield url, token
    finally:
        with console.status("stopping the server"):
            launch.stop(proc)


def quiet_transformers() -> None:
    """No transformers progress bars (saving the tiny model): the demo's own say it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


MARK = ".hotweights-demo"  # in a directory a demo works in: another may reuse it
_WRITES = ("checkpoint", "server.log", "server.token", "grpo")  # a demo's, beside its model


def workdir_for(path: str | None, prefix: str) -> Path:
    """Where a demo writes its model, `checkpoint/`, `server.log` (and `grpo/`), replacing
    what those hold: `path` (made where missing) if it is empty or an earlier demo's (it
    holds `MARK` and nothing a demo does not write), else a new temporary directory. It is
    marked as a demo's.

    Raises:
        ConfigError: `path` holds other files, or cannot be written.
    """
    from hotweights.testing.tiny import ARCHS

    out = Path(path) if path else Path(tempfile.mkdtemp(prefix=prefix))
    try:
        out.mkdir(parents=True, exist_ok=True)
        names = {p.name for p in out.iterdir()}
        if names and (MARK not in names or names - {MARK, *ARCHS, *_WRITES}):
            raise ConfigError(
                f"--workdir {out}: not empty, and no demo's: the demo writes its model, "
                "checkpoint/, server.log (and grpo/) there, replacing what they hold; give "
                "a new or empty directory, or one an earlier demo used")
        (out / MARK).touch()
    except OSError as e:
        raise ConfigError(f"--workdir {out}: cannot write there: "
                          f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}"
                          ) from e
    return out


def first_checkpoint(model_dir: Path, workdir: Path) -> Path:
    """A copy of the served files: the step-0 checkpoint the demo syncs into."""
    ckpt = workdir / "checkpoint"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.copytree(model_dir, ckpt)
    return ckpt


def _p50_ms(values: list[float]) -> float:
    return 1000 * sorted(values)[len(values) // 2]


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from hotweights.bridge.client import Bridge
    from hotweights.server.serve import require_vllm
    from hotweights.testing import tiny
    from hotweights.vllm_plugin.support import unservable

    require_vllm("hotweights demo")
    if reason := unservable(args.arch):
        raise ConfigError(f"--arch {args.arch}: {reason}")
    console = make_console()
    # vLLM's CPU worker binds its OpenMP threads to cores and keeps them spinning between
    # steps: trainer threads beyond the free cores would stall on them (10-100x here).
    # The tiny model needs one. A real trainer: give it cores vLLM does not bind.
    torch.set_num_threads(1)
    quiet_transformers()
    workdir = workdir_for(args.workdir, "hotweights-demo-")
    with console.status(f"building a tiny random {args.arch} model in {workdir}"):
        model_dir = tiny.build(args.arch, workdir / args.arch)

    name = str(model_dir)
    with serving(console, model_dir, workdir, "--max-model-len", "256",
                 "--enforce-eager") as (url, token):
        text, version = _complete(url, name)
        console.print(f"before  (version {version}): [bold]{PROMPT}[/bold][cyan]{text!r}[/cyan]")

        t = time.perf_counter()
        bridge = Bridge.connect(url, token=token)
        model = bridge.model()
        weight_bytes = sum(e.nbytes for e in bridge.manifests[0].tensors)
        console.print(f"trainer: HF model on the server's shared memory, "
                      f"{len(bridge.report.mapped)} parameters, {bridge.report.bytes_copied} "
                      f"of {weight_bytes:,} weight bytes copied ({time.perf_counter() - t:.2f} s)")

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt_ids = tok(PROMPT)["input_ids"]
        ids = torch.tensor([prompt_ids + tok(TARGET)["input_ids"]])
        labels = ids.clone()
        labels[:, : len(prompt_ids)] = -100  # learn the continuation only
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

        client = _Client(url, name)
        client.start()
        update_s, pause_s, commit_s = [], [], []
        with Progress(console=console, transient=True) as progress, \
                _stopping(client, last=lambda: parse_version(bridge.version)[0]):
            task = progress.add_task("training the served weights in place", total=args.steps)
            for _ in range(args.steps):
                loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                started = time.perf_counter()
                with bridge.update(mode="wait"):
                    optimizer.step()  # writes the very bytes vLLM computes with
                update_s.append(time.perf_counter() - started)
                status = bridge.status()
                pause_s.append(status["last_pause_s"])
                commit_s.append(status["last_commit_s"])
                optimizer.zero_grad(set_to_none=True)
                progress.advance(task)
        console.print(
            f"trained {args.steps} steps (loss {loss.item():.3f}); update p50 "
            f"{_p50_ms(update_s):.0f} ms = pause {_p50_ms(pause_s):.0f} ms (in-flight "
            f"requests finish first) + optimizer step + commit {_p50_ms(commit_s):.0f} ms; "
            f"meanwhile a client got {len(client.versions)} completions over versions "
            f"{min(client.versions, default=0)}..{max(client.versions, default=0)}, "
            f"{len(client.errors)} errors"
        )
        text, version = _complete(url, name)
        console.print(f"after   (version {version}): [bold]{PROMPT}[/bold]"
                      f"[green]{text!r}[/green]  (target {TARGET!r})")
        ckpt = first_checkpoint(model_dir, workdir)
        with console.status(f"checkpointing version {bridge.version} into {ckpt}"):
            result = bridge.checkpoint(ckpt)
        size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        hows = ", ".join(sorted(set(result.writes.values()))) or "nothing written"
        why = (": AdamW moved every weight" if result.tensors_changed == result.tensors_synced
               else "")
        console.print(f"checkpoint: version {result.version} into {ckpt} in "
                      f"{result.seconds:.2f} s, {result.bytes_written:,} of {size:,} bytes "
                      f"written ({result.bytes_written / size:.0%}: the shards that changed, "
                      f"{hows}{why})")
    console.print(f"kept in {workdir}: the model, the checkpoint, the server's log")
    return 0

