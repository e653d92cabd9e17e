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
- (c) full: the lowest bit flipped in every element of every tensor: everything changed, so
  the encoder sends every tensor dense (the real "full broadcast" of an update; the group's
  incremental path, not its first-sync path).

Each time is the whole `group.update` call (status; the fingerprints and the encode against
`group.reference` while both servers pause; the broadcast to both servers' workers over the
Gloo channel; commit on both while the reference is refreshed), the best of --repeat runs
(the machine is shared and noisy); bytes are the bytes the channel sent (headers + buffers,
counted once for the broadcast). Each run's phases are printed too (a route: its slowest
server's request). After the last update both servers' `/hotweights/checksum` must be equal
(else the run fails).

trainer extra memory: the bytes of `group.reference` (the host copy of what the servers
hold) plus the staging budget `max_round_bytes` (one reused round buffer), over the model's
bytes; the encoder's per-tensor temporaries are not counted. The growth of this process's
RSS over the warm-up sync is printed too, for information.

The last line is one JSON object: {"model_bytes", "rows_bytes_sent",
"scattered_bytes_sent", "full_bytes_sent", "rows_s", "scattered_s", "full_s",
"time_ratio_full_vs_rows", "time_ratio_full_vs_scattered", "trainer_extra_memory_pct",
"skipped"}. Targets: full / rows >= 10, full / scattered >= 5. Where the servers cannot
start on this machine (one dies: SIGILL, ...), the last line is {"model_bytes", "skipped":
{"servers": reason}} and the exit status 1.

Run:  .venv/bin/python benchmarks/remote_update.py [--size-mb 500] [--repeat 3]
      [--model-dir /tmp/hotweights-bench-remote/llama-500mb] [--logs DIR]
(the machine needs ~3x the model in memory: two servers and the trainer's two copies)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from _survive import Skips, reason
from hotweights.protocol.http import request
from hotweights.remote import delta, prefilter
from hotweights.remote import group as group_module
from hotweights.remote.channel import Channel
from hotweights.remote.group import ROUND_BYTES, RemoteGroup
from hotweights.server import launch
from hotweights.testing import tiny

TOKEN = "bench-token-1234"
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 1024, 2816, 16, 4, 64
VOCAB_GUESS = 300  # tiny's tokenizer; only used to pick the layer count
VLLM_ARGS = ("--remote", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "8")


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
    """Flip the lowest bit of the chosen elements, in place; return the elements changed."""
    n = 0
    with torch.no_grad():
        for t in weights.values():
            if how == "rows":
                if t.dim() != 2:
                    continue
                rows = torch.randperm(t.shape[0], generator=g)[:max(1, t.shape[0] // 100)]
                t.view(torch.int16)[rows] ^= 1
                n += len(rows) * t.shape[1]
            elif how == "scattered":
                b = bits(t)
                idx = torch.randperm(b.numel(), generator=g)[:max(1, b.numel() // 100)]
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
    delta.encode_all = timed("encode", delta.encode_all)  # the module `group` calls
    prefilter.fingerprints = timed("fingerprint", prefilter.fingerprints)
    group._send = timed("send", group._send)
    group._remember = timed("remember", group._remember)
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
    servers = []
    trainer_cpus, server_cpus = split_cpus(args.server_cpus)
    try:
        t0 = time.perf_counter()
        # the servers stand for other machines: their own CPUs, not the trainer's
        os.sched_setaffinity(0, server_cpus)  # inherited by the servers' processes
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(server_cpus)))
        for i in range(2):
            port = launch.free_port()
            log = logs / f"server{i}.log"
            servers.append((f"http://127.0.0.1:{port}", log, launch.spawn(
                model_dir, port=port, token=TOKEN, log=log, vllm_args=VLLM_ARGS)))
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

        with RemoteGroup(urls, token=TOKEN, timeout=args.timeout) as group:
            rss0 = rss()
            warm = group.update(weights)
            assert warm["full"], warm
            rss_growth = rss() - rss0
            print(f"warm-up full sync (not a scenario): {warm['seconds']:.2f} s, "
                  f"{warm['bytes_sent']:,} B sent; trainer RSS +{rss_growth / 1e6:,.0f} MB")

            phases = time_phases(group)
            g = torch.Generator().manual_seed(0)
            rows = {}
            for how in ("rows", "scattered", "full"):
                secs, sent, split = [], [], []
                for _ in range(args.repeat):
                    n = change(weights, how, g)
                    phases.clear()
                    out = group.update(weights)
                    # the encode (fingerprints first) runs inside send, beside the begins
                    split.append(dict(phases, send=phases["send"] - phases["encode"]
                                      - phases.get("fingerprint", 0.0),
                                      rest=out["seconds"] - phases["send"]))
                    assert not out["full"] and len(out["servers"]) == 2, out
                    secs.append(out["seconds"])
                    sent.append(out["bytes_sent"])
                rows[how] = dict(s=min(secs), bytes=sent[secs.index(min(secs))], elements=n)
                print(f"({how:9}) {n:>12,} elements changed  best {min(secs):7.3f} s  "
                      f"(runs {', '.join(f'{s:.3f}' for s in secs)})  "
                      f"{rows[how]['bytes']:>13,} B sent = "
                      f"{rows[how]['bytes'] / model_bytes:7.2%} of the model  "
                      f"{model_bytes / min(secs) / 1e9:6.2f} GB/s of weights")
                print(f"{'':12}best run: " + ", ".join(
                    f"{k} {v:.3f} s" for k, v in split[secs.index(min(secs))].items()) +
                    " (send: after the encode, until both servers staged it, incl. "
                    "broadcast: rounds and acknowledgement; rest: status + commits, remember "
                    "beside the commits; a route: its slowest request)")

            ref_bytes = sum(t.nbytes for t in (group.reference or {}).values())
            extra = ref_bytes + group.max_round_bytes
            sums = {u: checksum(u) for u in urls}
            print("checksums: " + "; ".join(f"{u}: version {c['version']} {c['checksum']}"
                                              for u, c in sums.items()))
            a, b = sums.values()
            if (a["checksum"] != b["checksum"]  # version is "N@SERVER_ID"
                    or str(a["version"]).split("@")[0] != str(b["version"]).split("@")[0]):
                raise SystemExit("FAILED: the two servers hold different weights")
            if group.reference is None or any(
                    not torch.equal(bits(group.reference[k]), bits(t))
                    for k, t in weights.items()):
                raise SystemExit("FAILED: the group's reference is not the trainer's weights")

        out = {"model_bytes": model_bytes,
               "rows_bytes_sent": rows["rows"]["bytes"],
               "scattered_bytes_sent": rows["scattered"]["bytes"],
               "full_bytes_sent": rows["full"]["bytes"],
               "rows_s": rows["rows"]["s"], "scattered_s": rows["scattered"]["s"],
               "full_s": rows["full"]["s"],
               "time_ratio_full_vs_rows": rows["full"]["s"] / rows["rows"]["s"],
               "time_ratio_full_vs_scattered": rows["full"]["s"] / rows["scattered"]["s"],
               "trainer_extra_memory_pct": 100 * extra / model_bytes, "skipped": {}}

        def target(ok: bool) -> str:
            return "met" if ok else "MISSED"
        print(f"trainer extra memory: reference {ref_bytes:,} B + staging "
              f"{group.max_round_bytes:,} B (default {ROUND_BYTES:,}) = "
              f"{out['trainer_extra_memory_pct']:.1f} % of the model")
        print("targets:")
        print(f"  full / rows       {out['time_ratio_full_vs_rows']:7.2f}x  >= 10x  "
              f"{target(out['time_ratio_full_vs_rows'] >= 10)}")
        print(f"  full / scattered  {out['time_ratio_full_vs_scattered']:7.2f}x  >= 5x   "
              f"{target(out['time_ratio_full_vs_scattered'] >= 5)}")
        print(f"total {time.perf_counter() - started:.0f} s")
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in out.items()}))
    finally:
        for _, _, proc in servers:
            launch.stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
