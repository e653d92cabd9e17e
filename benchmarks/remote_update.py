"""Benchmark: `RemoteGroup.update` of two real `hotweights serve --remote` vLLM CPU servers.

A random bf16 Llama of ~--size-mb MB (hidden 1024, intermediate 2816, 16 heads of 64, 4 k/v
heads; the layer count is derived from the size; a small local tokenizer, so the vocabulary
is tiny) is built once with `tiny.build` into --model-dir (reused when it exists). Two
servers are started on it (`hotweights serve MODEL --remote`, loopback, vLLM CPU) and the
trainer (this process) loads the checkpoint's tensors (safetensors, the checkpoint's names)
as a plain dict. The first `group.update` is the full sync every group starts with (timed
apart, not a scenario). Then, each on the trainer's tensors in place, a fresh change per run:

- (a) rows: the lowest bit flipped in every element of 1 % of the rows (at least one) of
  every 2-D tensor;
- (b) scattered: the lowest bit flipped in 1 % of the elements (at least one) of every
  tensor, at random;
- step: as (b), each element moved by one or two units in its last place instead (an
  optimizer step rounded to bf16: the xors' bit lengths spread; no ratio target, its pause
  held to the others');
- (c) full: the lowest bit flipped in every element of every tensor: everything changed, so
  the encoder sends every tensor dense (the real "full broadcast" of an update; the group's
  incremental path, not its first-sync path).

Each time is the whole `group.update` call (status; the fingerprints and the encode against
`group.reference.tensors` while both servers go on serving; the broadcast to both servers'
workers over the Gloo channel, which they stage while serving; commit on both while the
reference is refreshed), the best of --repeat runs (the machine is shared and noisy); bytes
are what each server received (headers + buffers: `result["bytes"]`); what left the trainer
is that times the channel's copies (Gloo broadcasts along a binomial tree: 2 copies for 2
servers), the key "trainer_copies". Each run's phases are printed too (a route: its slowest
server's request). The updates use --mode (default keep: the commit pauses generation and
resumes the in-flight streams on the new weights; wait would hold the commit until every
in-flight stream ends). After the last update both servers' `/hotweights/checksum` must be
equal (else the run fails).

Serving while updating, for each scenario's best (fastest) run (every run's is printed):

- paused: the worst server's `paused_ms` of that update (how long its generation stayed
  paused, pause to resume, by its own clock: only the commit pauses);
- client stall: while the scenarios run, one client thread per server streams greedy
  completions in a loop (POST /v1/completions, stream, 16 prompt tokens + 64 generated,
  every request with a timeout); the longest gap between consecutive streamed chunks of a
  server (across its streams: a gap between two streams holds the next one's first token)
  that overlaps the update's [start, end], the worst server. Information, not a target: the
  two servers share one CPU, and a token takes tens of ms anyway (the median gap before
  the updates is printed). While the clients run, each update is followed, before the
  next change, by a wait until both servers streamed again (as a training step would:
  the step after a `keep` commit recomputes every in-flight request's KV cache, seconds on
  the shared CPU, and an update begun meanwhile waits for it in its commit's pause: it
  would time the update before it) and then 1.5 s idle, so that the trainer's own work
  (the clients are threads of its process, on its CPU) does not fall into an update's
  gap. --no-clients: no clients, the
  keys are null.

Then one more scattered update (a fresh change) with `group.compress = "zstd"`: its bytes
sent and its encode side (fingerprints + pack: the encode inside it, then zstd) are printed;
compress goes back to None. `xor` is whether the servers decode xor-coded values (every channel).

trainer extra memory: the bytes of `group.reference.tensors` (the host copy of what the servers
hold) plus twice the staging budget `max_round_bytes` (two reused round buffers: one is
sent while the next round is packed into the other), over the model's bytes; the
encoder's per-tensor temporaries are not counted. The growth of this process's RSS over
the warm-up sync is printed too, for information.

partial trainable extra memory: the first group closed, a second group on the same servers
with `RemoteGroup(..., trainable=NAMES)`, NAMES the tensors of the model's last 2 layers
(from its config): a full warm-up update, then 1 % of those layers' elements changed,
scattered. Its extra memory is its `reference` (those layers only; fingerprints for the
rest, printed, not counted) plus the pages it touched of its two round buffers (the largest
round packed into each, not `max_round_bytes`), over the model's bytes. Where `RemoteGroup` has no
`trainable` option (or that run fails), the key is null and "skipped" says why.

The last line is one JSON object: {"model_bytes", "rows_bytes_sent",
"scattered_bytes_sent", "full_bytes_sent", "rows_s", "scattered_s", "full_s", "step_s",
"step_bytes_sent", "time_ratio_full_vs_rows", "time_ratio_full_vs_scattered",
"trainer_extra_memory_pct", "rows_paused_ms", "scattered_paused_ms", "step_paused_ms",
"full_paused_ms", "rows_client_stall_ms", "scattered_client_stall_ms",
"step_client_stall_ms", "full_client_stall_ms", "scattered_bytes_compressed",
"trainer_copies", "xor",
"partial_trainable_extra_memory_pct", "skipped"}. Targets: full / rows >= 10, full /
scattered >= 5, rows and scattered bytes sent <= 1.5 % of the model's, rows, scattered and
step paused <= 100 ms (full paused and the client stalls are reported), partial trainable
extra memory <= 20 %. Where the servers cannot start on this
machine (one dies: SIGILL, ...), the last line is {"model_bytes", "skipped": {"servers":
reason}} and the exit status 1.

Run:  .venv/bin/python benchmarks/remote_update.py [--size-mb 500] [--repeat 3]
      [--model-dir /tmp/hotweights-bench-remote/llama-500mb] [--logs DIR]
      [--mode keep] [--no-clients]
(the machine needs ~3x the model in memory: two servers and the trainer's two copies)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from _survive import Skips, reason
from hotweights.protocol.http import request
from hotweights.remote import codec, delta, packing, prefilter
from hotweights.remote import group as group_module
from hotweights.remote.channel import Channel
from hotweights.remote.group import ROUND_BYTES, RemoteGroup
from hotweights.server import launch
from hotweights.testing import tiny

TOKEN = "bench-token-1234"
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 1024, 2816, 16, 4, 64
VOCAB_GUESS = 300  # tiny's tokenizer; only used to pick the layer count
VLLM_ARGS = ("--remote", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "8")
PROMPT_TOKENS, MAX_TOKENS = 16, 64  # a client's request: under --max-model-len
CLIENT_TIMEOUT = 60.0  # s, each client request (connect, then every read)
SETTLE_S = 1.5  # s between an update and the next change, while the clients run


def layers_for(size_mb: float) -> int:
    kv = KV_HEADS * HEAD_DIM
    per_layer = 2 * (2 * HIDDEN * HIDDEN + 2 * kv * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN)
    rest = 2 * (2 * VOCAB_GUESS * HIDDEN + HIDDEN)
    return max(1, round((size_mb * 1e6 - rest) / per_layer))


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights |= load_file(f)
    return weights


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.int16)  # bf16


def change(weights: dict, how: str, g: torch.Generator) -> int:
    """Flip the lowest bit of the chosen elements (step: add one or two to their bits), in
    place; return the elements changed."""
    n = 0
    with torch.no_grad():
        for t in weights.values():
            if how == "rows":
                if t.dim() != 2:
                    continue
                rows = torch.randperm(t.shape[0], generator=g)[:max(1, t.shape[0] // 100)]
                t.view(torch.int16)[rows] ^= 1
                n += len(rows) * t.shape[1]
            elif how in ("scattered", "step"):
                b = bits(t)
                idx = torch.randperm(b.numel(), generator=g)[:max(1, b.numel() // 100)]
                if how == "step":
                    b[idx] += torch.randint(1, 3, idx.shape, generator=g).to(b.dtype)
                else:
                    b[idx] ^= 1
                n += len(idx)
            else:
                bits(t).bitwise_xor_(1)
                n += t.numel()
    return n


def time_phases(group: RemoteGroup) -> dict[str, float]:
    """Wrap the group's encode, send and remember steps; each update adds their seconds to
    the returned dict (the rest of an update: status requests and the commits)."""
    phases: dict[str, float] = {}

    def timed(name: str, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return run
    delta.encode = timed("encode", delta.encode)  # each tensor's (`encode_each` calls it)
    prefilter.fingerprints = timed("fingerprint", prefilter.fingerprints)
    group._send = timed("send", group._send)
    group.reference.remember = timed("remember", group.reference.remember)
    Channel.send = timed("broadcast", Channel.send)  # rounds and acknowledgement
    request = group_module.request

    def each(url, method, route, *a, **k):  # the slowest server's request, per route
        t0 = time.perf_counter()
        try:
            return request(url, method, route, *a, **k)
        finally:
            key = route.removeprefix("/hotweights/")
            phases[key] = max(phases.get(key, 0.0), time.perf_counter() - t0)
    group_module.request = each
    return phases


class Streamer(threading.Thread):
    """One client of one server: streams greedy completions in a loop until `stop`, and
    records when every streamed chunk arrived (perf_counter seconds). Every request has a
    timeout, and the thread is a daemon: it can never keep the benchmark from ending."""

    def __init__(self, url: str, model: str, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.body = json.dumps(dict(model=model, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0.0, ignore_eos=True, stream=True)).encode()
        self.chunks: list[float] = []
        self.requests, self.errors = 0, []

    def run(self) -> None:
        while not self.stop.is_set():
            req = urllib.request.Request(self.url + "/v1/completions", data=self.body,
                                         headers={"Content-Type": "application/json"})
            try:  # the timeout bounds each read: a stuck server fails the request
                with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT) as resp:
                    for line in resp:
                        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                            self.chunks.append(time.perf_counter())
                self.requests += 1
            except Exception as e:  # noqa: BLE001 - counted and printed, never fatal
                self.errors.append(repr(e))
                self.stop.wait(1.0)


def settle(clients: list[Streamer], since: float, timeout: float = 30.0) -> None:
    """Wait until every client streamed a chunk after `since` (the step after a `keep`
    commit recomputes every in-flight request's KV cache: seconds here; the next update's
    commit would wait for it in its pause), at most `timeout` s, then SETTLE_S more."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline and not all(
            c.chunks and c.chunks[-1] > since for c in clients):
        time.sleep(0.01)
    time.sleep(SETTLE_S)


def start_clients(urls: list[str], model: str, vocab: int) -> list[Streamer]:
    """One streaming client per server, each with its own prompt; returns once each has
    received a first chunk (or raises, naming the server, after CLIENT_TIMEOUT)."""
    clients = [Streamer(u, model, [(7 * j + 3 * i + 1) % vocab for j in range(PROMPT_TOKENS)],
                        MAX_TOKENS) for i, u in enumerate(urls)]
    for c in clients:
        c.start()
    deadline = time.perf_counter() + CLIENT_TIMEOUT
    for c in clients:
        while len(c.chunks) < 2:
            if time.perf_counter() > deadline:
                stop_clients(clients)
                raise RuntimeError(f"{c.url}: no streamed completion within "
                                   f"{CLIENT_TIMEOUT:.0f} s ({c.errors[-1:] or 'no error'})")
            time.sleep(0.05)
    return clients


def stop_clients(clients: list[Streamer]) -> float:
    """Stop every client (each finishes its stream); returns when they were asked to."""
    stopped = time.perf_counter()
    for c in clients:
        c.stop.set()
    for c in clients:
        c.join(timeout=CLIENT_TIMEOUT + 5)
        if c.is_alive():
            print(f"warning: the client of {c.url} did not stop (a daemon: left behind)",
                  file=sys.stderr)
    return stopped


def stall_ms(chunks: list[float], stopped: float, start: float, end: float
             ) -> tuple[float, float] | None:
    """(the longest gap between consecutive chunks, of any stream of one server, that
    overlaps [start, end], and when it began after `start`), both in ms; a stream still
    silent when the clients stopped counts until then. None: no gap overlaps."""
    t = np.sort(np.asarray([*chunks, stopped]))
    a, b = t[:-1], t[1:]
    hit = np.flatnonzero((b >= start) & (a <= end))
    if not len(hit):
        return None
    i = hit[np.argmax((b - a)[hit])]
    return float(b[i] - a[i]) * 1e3, float(a[i] - start) * 1e3


def idle_gap_ms(chunks: list[float], stopped: float, windows: list[tuple[float, float]]
                ) -> float | None:
    """The longest gap between consecutive chunks that overlaps no update: what a stream
    stalls anyway (the gap between two streams holds the next one's first token)."""
    t = np.sort(np.asarray([*chunks, stopped]))
    a, b = t[:-1], t[1:]
    free = np.ones(len(a), dtype=bool)
    for start, end in windows:
        free &= ~((b >= start) & (a <= end))
    return float((b - a)[free].max()) * 1e3 if free.any() else None


def time_rounds(rounds: list[int], phases: dict[str, float]) -> None:
    """Wrap `packing.pack`: each round's staging bytes (its raw size: what the round buffer
    holds before any compression) go into `rounds`, the time spent packing (and
    compressing) into phases["pack"], and compressing alone into phases["zstd"]."""
    pack, compress = packing.pack, codec.zstd_compress

    def timed_pack(*a, **k):
        it = pack(*a, **k)  # checks its arguments now, as the original does

        def each():
            while True:
                t0 = time.perf_counter()
                try:
                    r = next(it)
                except StopIteration:
                    return
                finally:
                    phases["pack"] = phases.get("pack", 0.0) + time.perf_counter() - t0
                rounds.append(r.header.get("raw_nbytes", r.header["nbytes"]))
                yield r
        return each()

    def timed_compress(*a, **k):
        t0 = time.perf_counter()
        try:
            return compress(*a, **k)
        finally:
            phases["zstd"] = phases.get("zstd", 0.0) + time.perf_counter() - t0
    packing.pack = timed_pack  # the module `group` calls
    codec.zstd_compress = timed_compress  # (`packing` calls it through `codec`)


def split_cpus(server_cpus: int) -> tuple[set[int], set[int]]:
    """(trainer's CPUs, servers' CPUs): the last `server_cpus` of this process's CPUs go to
    the servers (0: everyone shares every CPU)."""
    cpus = sorted(os.sched_getaffinity(0))
    if not server_cpus:
        return set(cpus), set(cpus)
    if server_cpus >= len(cpus):
        raise SystemExit(f"--server-cpus {server_cpus}: this process has only {len(cpus)} "
                         "CPUs; leave the trainer at least one (or 0: share them all)")
    return set(cpus[:-server_cpus]), set(cpus[-server_cpus:])


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def checksum(url: str) -> dict:
    return request(url, "GET", "/hotweights/checksum", TOKEN)


def worst(values) -> float | None:
    """The largest of `values` that is not None (None if none is)."""
    return max((v for v in values if v is not None), default=None)


def fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def check(urls: list[str], group: RemoteGroup, weights: dict) -> None:
    """Both servers hold the same weights, and the group's reference is the trainer's
    weights (every tensor, or those it keeps: `trainable`); else the run fails."""
    sums = {u: checksum(u) for u in urls}
    print("checksums: " + "; ".join(f"{u}: version {c['version']} {c['checksum']}"
                                      for u, c in sums.items()))
    a, b = sums.values()
    if (a["checksum"] != b["checksum"]  # version is "N@SERVER_ID"
            or str(a["version"]).split("@")[0] != str(b["version"]).split("@")[0]):
        raise SystemExit("FAILED: the two servers hold different weights")
    kept = set(weights) if group.reference.trainable is None else set(
        group.reference.trainable)
    held = group.reference.tensors
    if held is None or set(held) != kept or any(
            not torch.equal(bits(r), bits(weights[k])) for k, r in held.items()):
        raise SystemExit("FAILED: the group's reference is not the trainer's weights")


def trainable_memory(urls: list[str], weights: dict, model_dir: Path, g: torch.Generator,
                     rounds: list[int], args: argparse.Namespace) -> float:
    """A group that may change only the last 2 layers (`trainable`, the tensors' names): a
    full warm-up update, then 1 % of those layers' elements changed, scattered. Returns its
    extra memory in percent of the model: the reference it keeps plus the pages it touched
    of its two round buffers (the rounds go into them in turn)."""
    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    picked = range(max(0, n_layers - 2), n_layers)
    names = [k for k in weights if any(k.startswith(f"model.layers.{i}.") for i in picked)]
    model_bytes = sum(t.nbytes for t in weights.values())
    with RemoteGroup(urls, token=TOKEN, timeout=args.timeout, trainable=names) as group:
        warm = group.update(weights, mode=args.mode)
        n = change({k: weights[k] for k in names}, "scattered", g)
        rounds[:] = []
        out = group.update(weights, mode=args.mode)
        assert warm["full"] and not out["full"], (warm, out)
        ref = sum(t.nbytes for t in (group.reference.tensors or {}).values())
        largest = max(rounds[0::2], default=0) + max(rounds[1::2], default=0)
        prints = sum(p[2].nbytes for p in group.reference.frozen_prints.values())
        pct = 100 * (ref + largest) / model_bytes
        print(f"(trainable) layers {picked.start}..{picked.stop - 1} of {n_layers}: "
              f"{len(names)} tensors, {sum(weights[k].nbytes for k in names):,} B; "
              f"{n:,} elements changed, {out['bytes_sent']:,} B sent in {len(rounds)} "
              f"round(s), {out['seconds']:.3f} s; extra memory: reference {ref:,} B + "
              f"round buffers {largest:,} B = {pct:.1f} % of the model (fingerprints of "
              f"the rest: {prints:,} B, not counted)")
        check(urls, group, weights)
    return pct


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=500, help="model size, MB (10**6 bytes)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per scenario (best)")
    ap.add_argument("--model-dir", default=None, help="where the model is built (default: "
                    "/tmp/hotweights-bench-remote/llama-<size>mb)")
    ap.add_argument("--logs", default=None, help="server logs (default: the model dir's "
                    "parent)")
    ap.add_argument("--server-cpus", type=int, default=1, help="CPUs given to the servers, "
                    "taken from the end of this process's CPUs; the trainer keeps the rest "
                    "(0: all share all)")
    ap.add_argument("--timeout", type=float, default=120.0, help="RemoteGroup timeout, s")
    ap.add_argument("--mode", default="keep", choices=("wait", "abort", "keep"),
                    help="how the servers treat in-flight requests in the commit's pause "
                    "(keep: generation paused, resumed on the new weights; wait: held until "
                    "every in-flight stream ends, so a pause includes the rest of a client's "
                    "stream)")
    ap.add_argument("--no-clients", action="store_true", help="no streaming clients: the "
                    "client stall keys are null")
    args = ap.parse_args()
    started = time.perf_counter()
    root = Path("/tmp/hotweights-bench-remote")
    model_dir = Path(args.model_dir or root / f"llama-{args.size_mb:g}mb")
    logs = Path(args.logs) if args.logs else model_dir.parent
    logs.mkdir(parents=True, exist_ok=True)

    layers = layers_for(args.size_mb)
    t0 = time.perf_counter()
    tiny.build("llama", model_dir, hidden_size=HIDDEN, intermediate_size=INTER,
               num_hidden_layers=layers, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    weights = load_weights(model_dir)
    model_bytes = sum(t.nbytes for t in weights.values())
    vocab = weights["model.embed_tokens.weight"].shape[0]
    print(f"model: {model_bytes:,} bytes bf16, {len(weights)} tensors (hidden {HIDDEN}, "
          f"intermediate {INTER}, {layers} layers, vocab {vocab}) in {model_dir} "
          f"(built/loaded in {time.perf_counter() - t0:.0f} s)  repeat: {args.repeat}  "
          f"threads: {torch.get_num_threads()}")

    # Both servers from this (the main) thread: a server stops when the thread that spawned
    # it ends. Spawn both, then wait for each.
    servers, clients = [], None
    trainer_cpus, server_cpus = split_cpus(args.server_cpus)
    try:
        t0 = time.perf_counter()
        # the servers stand for other machines: their own CPUs, not the trainer's
        os.sched_setaffinity(0, server_cpus)  # inherited by the servers' processes
        bind = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(server_cpus)))}
        for i in range(2):
            port = launch.free_port()
            log = logs / f"server{i}.log"
            servers.append((f"http://127.0.0.1:{port}", log, launch.spawn(
                model_dir, port=port, token=TOKEN, log=log, vllm_args=VLLM_ARGS, env=bind)))
        os.sched_setaffinity(0, trainer_cpus)
        torch.set_num_threads(len(trainer_cpus))
        print(f"CPUs: trainer {sorted(trainer_cpus)} ({torch.get_num_threads()} torch "
              f"threads), servers {sorted(server_cpus)}")
        for url, log, proc in servers:
            try:
                launch.wait_ready(proc, url, log=log, timeout=900)
            except Exception as e:  # noqa: BLE001 - named with why, as the last line's JSON
                skips = Skips()
                skips.add("servers", reason(e, log))
                print(json.dumps({"model_bytes": model_bytes, "skipped": skips.reasons}))
                return 1
        urls = [u for u, _, _ in servers]
        print(f"servers: {', '.join(urls)} ready in {time.perf_counter() - t0:.0f} s "
              f"(logs: {', '.join(str(lg) for _, lg, _ in servers)})")

        skips = Skips()
        model = str(model_dir)
        with RemoteGroup(urls, token=TOKEN, timeout=args.timeout) as group:
            rss0 = rss()
            warm = group.update(weights, mode=args.mode)
            assert warm["full"], warm
            rss_growth = rss() - rss0
            xor = bool(group.links) and all(link.xor for link in group.links)
            print(f"warm-up full sync (not a scenario): {warm['seconds']:.2f} s, "
                  f"{warm['bytes_sent']:,} B sent; trainer RSS +{rss_growth / 1e6:,.0f} MB; "
                  f"xor-coded values: {xor}; mode: {args.mode}")

            phases = time_phases(group)
            rounds: list[int] = []
            time_rounds(rounds, phases)
            if not args.no_clients:
                clients = skips.attempt("client_stall", start_clients, urls, model, vocab)
                if clients:
                    time.sleep(2 * SETTLE_S)  # a baseline: gaps with no update
                    idle = {c.url: np.median(np.diff(c.chunks)) * 1e3 for c in clients}
                    print(f"clients: one per server, streaming {PROMPT_TOKENS} + {MAX_TOKENS} "
                          "tokens in a loop; gap between chunks before the updates: " +
                          ", ".join(f"{u} {ms:.0f} ms (median)" for u, ms in idle.items()))
            else:
                skips.add("client_stall", "--no-clients")
            g = torch.Generator().manual_seed(0)
            rows = {}
            for how in ("rows", "scattered", "step", "full"):
                secs, sent, split, paused, windows = [], [], [], [], []
                for _ in range(args.repeat):
                    n = change(weights, how, g)
                    phases.clear()
                    t0 = time.perf_counter()
                    out = group.update(weights, mode=args.mode)
                    windows.append((t0, time.perf_counter()))
                    if clients:  # the servers stream again, then the trainer's next
                        settle(clients, windows[-1][1])  # change (its CPU) after the stall
                    split.append(dict(phases, rest=out["seconds"] - phases["send"]))
                    assert not out["full"] and len(out["servers"]) == 2, out
                    secs.append(out["seconds"])
                    sent.append(max(out["bytes"].values()))
                    copies = out["bytes_sent"] / sent[-1]
                    paused.append(out.get("paused_ms") or {})
                best = secs.index(min(secs))
                rows[how] = dict(s=min(secs), bytes=sent[best], elements=n, best=best,
                                 windows=windows,
                                 paused=worst(paused[best].values()))
                print(f"({how:9}) {n:>12,} elements changed  best {min(secs):7.3f} s  "
                      f"(runs {', '.join(f'{s:.3f}' for s in secs)})  "
                      f"{rows[how]['bytes']:>13,} B sent = "
                      f"{rows[how]['bytes'] / model_bytes:7.2%} of the model  "
                      f"{model_bytes / min(secs) / 1e9:6.2f} GB/s of weights")
                print(f"{'':12}best run: " + ", ".join(
                    f"{k} {v:.3f} s" for k, v in split[best].items()) +
                    " (send: from the begins until both servers staged it, incl. the "
                    "fingerprints, taken while the begins travel, and broadcast: rounds and "
                    "acknowledgement, with pack inside it: reading the rounds, the encode "
                    "inside that, as the servers stage the rounds before; rest: status + "
                    "commits, remember beside the commits; a route: its slowest request)")
                worst_run = secs.index(max(secs))
                if worst_run != best:
                    print(f"{'':12}slowest run: " + ", ".join(
                        f"{k} {v:.3f} s" for k, v in split[worst_run].items()))
                print(f"{'':12}paused (ms, each server, by its own clock): " + "; ".join(
                    f"run {i + 1}: " + ", ".join(fmt_ms(v) for v in p.values())
                    for i, p in enumerate(paused)))

            # one more scattered update, compressed: its bytes, not timed against a target
            n = change(weights, "scattered", g)
            group.compress, rounds[:] = "zstd", []
            phases.clear()
            t0 = time.perf_counter()
            try:
                zout = group.update(weights, mode=args.mode)
            finally:
                group.compress = None
            zwindow = (t0, time.perf_counter())
            if clients:
                time.sleep(SETTLE_S)
            encode_s = phases.get("fingerprint", 0.0) + phases["pack"]
            print(f"(scattered, zstd) {n:,} elements changed  {zout['seconds']:.3f} s  "
                  f"{max(zout['bytes'].values()):,} B to each server = "
                  f"{max(zout['bytes'].values()) / model_bytes:.2%} of the model "
                  f"({max(zout['bytes'].values()) / rows['scattered']['bytes']:.0%} of "
                  f"uncompressed); encode side {encode_s:.3f} s: fingerprints "
                  f"{phases.get('fingerprint', 0.0):.3f} + pack {phases['pack']:.3f} (of which "
                  f"encode {phases.get('encode', 0.0):.3f}, zstd {phases.get('zstd', 0.0):.3f}) s")

            stalls = {how: None for how in rows}
            if clients:
                stopped = stop_clients(clients)
                for how, r in rows.items():
                    each = [[stall_ms(c.chunks, stopped, a, b) for c in clients]
                            for a, b in r["windows"]]
                    stalls[how] = worst(s and s[0] for s in each[r["best"]])
                    print(f"({how:9}) client stall (ms, each server: the longest gap between "
                          "chunks over the update, from +ms after its start): " + "; ".join(
                              f"run {i + 1} ({(b - a) * 1e3:.0f} ms): " + ", ".join(
                                  "-" if s is None else f"{s[0]:.1f} from {s[1]:+.0f}"
                                  for s in e)
                              for i, (e, (a, b)) in enumerate(zip(each, r["windows"],
                                                                  strict=True))))
                windows = [w for r in rows.values() for w in r["windows"]] + [zwindow]
                print("clients: " + "; ".join(
                    f"{c.url} {c.requests} streams, {len(c.chunks)} chunks, "
                    f"{len(c.errors)} errors{(' (' + c.errors[-1] + ')') if c.errors else ''}, "
                    f"longest gap outside the updates "
                    f"{fmt_ms(idle_gap_ms(c.chunks, stopped, windows))} ms" for c in clients))
                clients = None

            ref_bytes = sum(t.nbytes for t in (group.reference.tensors or {}).values())
            extra = ref_bytes + 2 * group.max_round_bytes
            check(urls, group, weights)

        partial = None
        if "trainable" not in inspect.signature(RemoteGroup).parameters:
            skips.add("partial_trainable_extra_memory_pct",
                      "RemoteGroup has no `trainable` option in this checkout")
        else:
            partial = skips.attempt("partial_trainable_extra_memory_pct", trainable_memory,
                                    urls, weights, model_dir, g, rounds, args)

        out = {"model_bytes": model_bytes,
               "rows_bytes_sent": rows["rows"]["bytes"],
               "scattered_bytes_sent": rows["scattered"]["bytes"],
               "full_bytes_sent": rows["full"]["bytes"],
               "rows_s": rows["rows"]["s"], "scattered_s": rows["scattered"]["s"],
               "full_s": rows["full"]["s"], "step_s": rows["step"]["s"],
               "step_bytes_sent": rows["step"]["bytes"],
               "time_ratio_full_vs_rows": rows["full"]["s"] / rows["rows"]["s"],
               "time_ratio_full_vs_scattered": rows["full"]["s"] / rows["scattered"]["s"],
               "trainer_extra_memory_pct": 100 * extra / model_bytes,
               **{f"{how}_paused_ms": r["paused"] for how, r in rows.items()},
               **{f"{how}_client_stall_ms": stalls[how] for how in rows},
               "scattered_bytes_compressed": max(zout["bytes"].values()),
               "trainer_copies": copies,
               "xor": xor,
               "partial_trainable_extra_memory_pct": partial,
               "skipped": skips.reasons}

        def target(ok: bool) -> str:
            return "met" if ok else "MISSED"
        print(f"trainer extra memory: reference {ref_bytes:,} B + staging 2 x "
              f"{group.max_round_bytes:,} B (default {ROUND_BYTES:,}) = "
              f"{out['trainer_extra_memory_pct']:.1f} % of the model")
        print("targets:")
        print(f"  {'full / rows':<24}{out['time_ratio_full_vs_rows']:7.2f} x   >= 10 x    "
              f"{target(out['time_ratio_full_vs_rows'] >= 10)}")
        print(f"  {'full / scattered':<24}{out['time_ratio_full_vs_scattered']:7.2f} x   "
              f">= 5 x     {target(out['time_ratio_full_vs_scattered'] >= 5)}")
        for how in ("rows", "scattered"):  # docs/remote.md's: bytes sent, of the model's
            pct = 100 * out[f"{how}_bytes_sent"] / out["model_bytes"]
            print(f"  {how + ' bytes sent':<24}{pct:7.2f} %   <= 1.5 %    "
                  f"{target(pct <= 1.5)}")
        for how in rows:
            ms = out[f"{how}_paused_ms"]
            print(f"  {how + ' paused':<24}{fmt_ms(ms):>7} ms  " + (
                "reported" if how == "full" else
                f"<= 100 ms  {target(ms is not None and ms <= 100)}"))
        for how in rows:
            print(f"  {how + ' client stall':<24}{fmt_ms(out[f'{how}_client_stall_ms']):>7} ms  "
                  "reported")
        pct = out["partial_trainable_extra_memory_pct"]
        print(f"  {'partial trainable memory':<24}{'-' if pct is None else f'{pct:.1f}':>7} %   "
              f"<= 20 %     {'skipped' if pct is None else target(pct <= 20)}")
        print(f"total {time.perf_counter() - started:.0f} s")
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in out.items()}))
    finally:
        if clients:
            stop_clients(clients)
        for _, _, proc in servers:
            launch.stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
