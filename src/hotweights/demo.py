"""`hotweights demo`: a tiny local model served by vLLM, trained in place while it serves."""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from rich.progress import Progress

from hotweights.cli import make_console

PROMPT = "The server generates,"
TARGET = " the trainer learns."


def _complete(url: str, model: str) -> tuple[str, int]:
    body = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0)
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        text = json.loads(resp.read())["choices"][0]["text"]
        return text, int(resp.headers["x-hotweights-version"])


class _Client(threading.Thread):
    """Keeps generating while the trainer updates the weights."""

    def __init__(self, url: str, model: str):
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.done = threading.Event()
        self.versions: list[int] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.versions.append(_complete(self.url, self.model)[1])
            except OSError as e:
                self.errors.append(str(e))


@contextlib.contextmanager
def _stopping(client: _Client):
    try:
        yield
    finally:
        client.done.set()
        client.join(timeout=120)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from hotweights import serve, tiny
    from hotweights.bridge import Bridge

    console = make_console()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hotweights-demo-"))
    with console.status(f"building a tiny random {args.arch} model in {workdir}"):
        model_dir = tiny.build(args.arch, workdir / args.arch)

    port, token, log = serve.free_port(), secrets.token_hex(16), workdir / "server.log"
    url, name = f"http://127.0.0.1:{port}", str(model_dir)
    t0 = time.perf_counter()
    proc = serve.spawn(model_dir, port=port, token=token, log=log,
                       vllm_args=("--max-model-len", "256", "--enforce-eager"))
    try:
        with console.status(f"starting `hotweights serve` at {url} (log: {log})"):
            serve.wait_ready(proc, url, log=log)
        console.print(f"vLLM serves {model_dir} at {url} ({time.perf_counter() - t0:.0f} s)")
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
        commit_s = []
        with Progress(console=console, transient=True) as progress, _stopping(client):
            task = progress.add_task("training the served weights in place", total=args.steps)
            for _ in range(args.steps):
                loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                started = time.perf_counter()
                with bridge.update(mode="wait"):
                    optimizer.step()  # writes the very bytes vLLM computes with
                commit_s.append(time.perf_counter() - started)
                optimizer.zero_grad(set_to_none=True)
                progress.advance(task)
        commit_s.sort()
        console.print(
            f"trained {args.steps} steps (loss {loss.item():.3f}); update "
            f"(pause, write, commit, resume) p50 {1000 * commit_s[len(commit_s) // 2]:.0f} ms; "
            f"meanwhile a client got {len(client.versions)} completions over versions "
            f"{min(client.versions, default=0)}..{max(client.versions, default=0)}, "
            f"{len(client.errors)} errors"
        )
        text, version = _complete(url, name)
        console.print(f"after   (version {version}): [bold]{PROMPT}[/bold]"
                      f"[green]{text!r}[/green]  (target {TARGET!r})")
    finally:
        with console.status("stopping the server"):
            serve.stop(proc)
    return 0

