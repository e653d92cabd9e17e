"""Benchmark: how soon a trainer's update is served, hotweights vs. vLLM's reload route.

Servers run one at a time (127.0.0.1, free port), each started once and always stopped.
The trainer's "step" is an in-place edit of the last decoder layer (`p.add_(+-1e-3)`).

Models: a tiny llama (1 MB), a ~1 GB dense bf16 llama and a ~1 GB bf16 Qwen3-MoE (256
experts, 2 per token). On CPU a 1-token answer of the dense model costs about a second of
compute with or without any update, which hides what the update costs; the MoE model
holds as many weight bytes but computes as little per token as the tiny one, so its
numbers show how the update's cost depends on the bytes. The JSON's `large_*` figures are
the MoE model's; `reload_p50_ms` and `speedup_vs_reload` are the pair `speedup_model` names
(the MoE model's, else the dense model's: never one model's reload against the other's
hotweights); the dense rows are printed beside them.

- hotweights (`hotweights serve`): the step runs inside `with bridge.update():`; clock
  from the end of the step, just before the block commits, until a 1-token
  /v1/completions answer to a 3-token prompt carries the new `x-hotweights-version`.
- reload (a separate plain vLLM server: VLLM_PLUGINS="" so no hotweights plugin,
  VLLM_SERVER_DEV_MODE=1): the trainer edits its own HF copy; clock from the end of the
  step through `save_pretrained` (safetensors, HF names), POST /collective_rpc
  {"method": "reload_weights", "kwargs": {"weights_path": DIR}}, POST /reset_prefix_cache,
  until a 1-token completion is answered. Fewer repetitions (--reloads, default 5).
- trainer memory: in a fresh subprocess, RSS (and USS) growth over `Bridge.connect(...)` +
  `bridge.model()` on the ~1 GB MoE model, in % of its weight bytes (imports measured
  apart).

Prints a table (idle: p50 completion with no update; changed: completions whose logprob
moved, i.e. the update was served), then as the last line one JSON object: tiny_p50_ms,
tiny_p95_ms, large_p50_ms, large_p95_ms, size_ratio (large/tiny p50), reload_p50_ms,
speedup_vs_reload (reload/hotweights p50, `speedup_model`: "moe", or "dense" where the
MoE pair did not run), trainer_overhead_pct, skipped.

A run that cannot run on this machine (vLLM's own MoE kernels die of SIGILL on AVX-512 BF16
+ AMX CPUs: the plain server of `reload-moe` exits at start) is named in `skipped` with the
reason (and a line on stderr); its figures are null and the others are still measured. The
exit status is 1 only when something else than a reload baseline was skipped. See
docs/update_latency.md.

Run:  .venv/bin/python benchmarks/update_latency.py [--updates 50] [--reloads 5]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from _survive import Skips, died_of
from hotweights.server import launch, serve
from hotweights.testing import tiny

# The probe: the smallest request that shows the weights (its prefill is recomputed after
# every update: the commit resets the prefix cache).
PROMPT = [1, 5, 9]
SERVE_FLAGS = ["--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "8"]
# ~1.04 GB of bf16 weights each (head_dim >= 32: vLLM's CPU attention needs it).
DENSE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=11,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128)
MOE = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=2, head_dim=64, num_experts=256, num_experts_per_tok=2,
           moe_intermediate_size=640)


def http(url: str, route: str, body: dict) -> tuple[dict, dict | None]:
    """POST `body` as JSON; return (response headers, parsed JSON or None)."""
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read()
        return dict(resp.headers), json.loads(raw) if raw else None


def vllm_command(model_dir: Path, port: int) -> list[str]:
    """A plain vLLM OpenAI server on `model_dir` (the reload baseline)."""
    return [sys.executable, "-m", serve.ENTRY, "--model", str(model_dir), "--host",
            "127.0.0.1", "--port", str(port), *SERVE_FLAGS]


@contextlib.contextmanager
def running(name: str, model_dir: Path, args: argparse.Namespace,
            token: str | None = None) -> Iterator[str]:
    """A server on a free port, up once /health answers, always stopped; yields its URL.

    With a token: `hotweights serve`. Without: a plain vLLM server (no hotweights plugin,
    vLLM's dev routes on, for /collective_rpc).
    """
    port = launch.free_port()
    url, log = f"http://127.0.0.1:{port}", args.workdir / f"{name}.log"
    if token:
        proc = launch.spawn(model_dir, port=port, token=token, log=log,
                           vllm_args=tuple(SERVE_FLAGS))
    else:
        env = dict(os.environ, VLLM_PLUGINS="", VLLM_SERVER_DEV_MODE="1",
                   VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
        with open(log, "w") as out:
            proc = subprocess.Popen(vllm_command(model_dir, port), stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=serve.term_with_parent)  # (even if killed)
    try:
        launch.wait_ready(proc, url, log=log, timeout=args.start_timeout)
        yield url
    finally:
        launch.stop(proc)


def complete(url: str, model: str) -> tuple[str | None, float]:
    """One greedy 1-token completion: (x-hotweights-version or None, its logprob)."""
    headers, out = http(url, "/v1/completions", dict(
        model=model, prompt=PROMPT, max_tokens=1, temperature=0.0, logprobs=1))
    version = headers.get("x-hotweights-version")
    logprob = out["choices"][0]["logprobs"]["token_logprobs"][0]
    return version, logprob


def idle_ms(url: str, model: str, n: int = 5) -> float:
    """p50 of `n` completions without any update (compute alone)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        complete(url, model)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def edit(model, step: int) -> None:
    """The "optimizer step": an in-place edit of the last decoder layer."""
    import torch

    with torch.no_grad():
        for p in model.model.layers[-1].parameters():
            p.add_(1e-3 if step % 2 == 0 else -1e-3)


def hotweights_run(name: str, model_dir: Path, args: argparse.Namespace,
                   overhead: Skips | None = None) -> dict:
    """`hotweights serve` on `model_dir`: update latencies; with `overhead`, the trainer's
    memory too (None where it failed: named in `overhead`)."""
    from hotweights.bridge.client import Bridge

    token = secrets.token_urlsafe(16)
    with running(name, model_dir, args, token) as url:
        idle = idle_ms(url, str(model_dir))
        bridge = Bridge.connect(url, token=token)
        model = bridge.model(trainable=False)
        times, changed, last = [], 0, complete(url, str(model_dir))[1]
        for step in range(2 + args.updates):
            with bridge.update(mode="wait"):
                edit(model, step)
                start = time.perf_counter()  # end of the optimizer step; commit follows
            for _ in range(100):  # the first answer should carry it; bounded anyway
                version, logprob = complete(url, str(model_dir))
                if version == bridge.version:
                    break
            else:
                raise RuntimeError(f"version {bridge.version} never served")
            if step >= 2:
                times.append(1e3 * (time.perf_counter() - start))
                changed += logprob != last
            last = logprob
        result = dict(times=times, idle=idle, changed=changed)
        if overhead is not None:
            result["overhead"] = overhead.attempt("trainer-overhead", overhead_run, url, token,
                                                 model_dir)
    return result


def overhead_run(url: str, token: str, model_dir: Path) -> dict:
    """The trainer's memory over connect+model, measured in a fresh child process."""
    out = subprocess.run([sys.executable, __file__, "--overhead", url, str(model_dir)],
                         env=dict(os.environ, HOTWEIGHTS_TOKEN=token),
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the overhead child failed ({died_of(out.returncode)}):\n"
                           f"{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def reload_run(name: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """A plain vLLM server on `model_dir`: save_pretrained + reload_weights latencies."""
    ckpt = args.workdir / f"{name}-ckpt"
    with running(name, model_dir, args) as url:
        import torch  # once the server runs: a server that cannot start costs no imports
        from transformers import AutoModelForCausalLM

        idle = idle_ms(url, str(model_dir))
        trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        times, parts, changed = [], [], 0
        last = complete(url, str(model_dir))[1]
        for step in range(1 + args.reloads):
            edit(trainer, step)
            t0 = time.perf_counter()  # end of the optimizer step
            trainer.save_pretrained(ckpt)
            t1 = time.perf_counter()
            http(url, "/collective_rpc", dict(method="reload_weights",
                                                  kwargs=dict(weights_path=str(ckpt))))
            http(url, "/reset_prefix_cache", {})
            t2 = time.perf_counter()
            logprob = complete(url, str(model_dir))[1]
            t3 = time.perf_counter()
            if step >= 1:
                times.append(1e3 * (t3 - t0))
                parts.append((1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2)))
                changed += logprob != last
            last = logprob
    split = [statistics.median(p[i] for p in parts) for i in range(3)]
    return dict(times=times, idle=idle, changed=changed, split=split)


def overhead_child(url: str, model_dir: str) -> None:
    """Child mode: RSS/USS growth of Bridge.connect + bridge.model, one JSON line."""
    import gc

    import psutil

    proc = psutil.Process()
    start = proc.memory_full_info()
    from hotweights.bridge.client import Bridge

    kind = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")  # a trainer has
    gc.collect()  # its model code loaded: imports are measured apart
    before = proc.memory_full_info()
    bridge = Bridge.connect(url)
    model = bridge.model()
    gc.collect()
    after = proc.memory_full_info()
    print(json.dumps(dict(rss=after.rss - before.rss, uss=after.uss - before.uss,
                          imports_rss=before.rss - start.rss, params=len(list(model.parameters())),
                          weight_bytes=sum(t.numel() * t.element_size()
                                           for t in bridge.tensors.values()))))


def pct(times: list[float], q: int) -> float:
    return statistics.quantiles(times, n=100, method="inclusive")[q - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Servers run one at a time; the last stdout line is JSON.")
    parser.add_argument("--updates", type=int, default=50,
                        help="measured hotweights updates per model (default: %(default)s)")
    parser.add_argument("--reloads", type=int, default=5,
                        help="measured save+reload updates, large model (default: %(default)s)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hotweights-bench-latency"),
                        help="models (built once, reused), logs, checkpoint "
                        "(default: %(default)s)")
    parser.add_argument("--start-timeout", type=float, default=600,
                        help="seconds allowed for a server to start (default: %(default)s)")
    parser.add_argument("--overhead", nargs=2, metavar=("URL", "MODEL_DIR"),
                        help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args(argv)
    if min(args.updates, args.reloads) < 2:
        parser.error("--updates and --reloads need at least 2 (percentiles)")
    if args.overhead:
        overhead_child(*args.overhead)
        return 0

    args.workdir.mkdir(parents=True, exist_ok=True)
    tiny_dir = tiny.build("llama", args.workdir / "tiny")
    dense_dir = tiny.build("llama", args.workdir / "large", **DENSE)
    moe_dir = tiny.build("qwen3_moe", args.workdir / "large-moe", **MOE)
    mb = {d: sum(f.stat().st_size for f in d.glob("*.safetensors")) / 1e6
          for d in (tiny_dir, dense_dir, moe_dir)}
    skips = Skips()

    def attempt(name: str, run, model_dir: Path, **kw) -> dict | None:
        return skips.attempt(name, run, name, model_dir, args,
                             log=args.workdir / f"{name}.log", **kw)

    small = attempt("hotweights-tiny", hotweights_run, tiny_dir)
    large = attempt("hotweights-moe", hotweights_run, moe_dir, overhead=skips)
    reload = attempt("reload-moe", reload_run, moe_dir)
    dense = attempt("hotweights-dense", hotweights_run, dense_dir)
    dense_reload = attempt("reload-dense", reload_run, dense_dir)

    rows = [("hotweights-tiny", f"hotweights, tiny ({mb[tiny_dir]:.1f} MB)", small),
            ("hotweights-moe", f"hotweights, MoE ({mb[moe_dir]:.0f} MB)", large),
            ("reload-moe", f"save+reload_weights, MoE ({mb[moe_dir]:.0f} MB)", reload),
            ("hotweights-dense", f"hotweights, dense ({mb[dense_dir]:.0f} MB)", dense),
            ("reload-dense", f"save+reload_weights, dense ({mb[dense_dir]:.0f} MB)",
             dense_reload)]
    print(f"{'update path':<40}{'n':>4}{'p50 ms':>10}{'p95 ms':>10}{'idle ms':>10}"
          f"{'p50-idle':>10}{'changed':>9}")
    for name, label, r in rows:
        if r is None:
            print(f"{label:<40}  not run: {skips.reasons[name]}")
            continue
        p50 = pct(r["times"], 50)
        print(f"{label:<40}{len(r['times']):>4}{p50:>10.1f}{pct(r['times'], 95):>10.1f}"
              f"{r['idle']:>10.1f}{p50 - r['idle']:>10.1f}{r['changed']:>9}")
    for _, label, r in rows:
        if r is not None and "split" in r:
            save, rpc, answer = r["split"]
            print(f"{label} p50 split: save_pretrained {save:.0f} ms, reload_weights + "
                  f"reset_prefix_cache {rpc:.0f} ms, completion {answer:.0f} ms")
    ov = large and large["overhead"]
    if ov:
        print(f"trainer after connect+model ({ov['params']} params on "
              f"{ov['weight_bytes'] / 1e6:.0f} MB of weights): RSS +{ov['rss'] / 1e6:.1f} MB "
              f"({100 * ov['rss'] / ov['weight_bytes']:.2f} %), USS +{ov['uss'] / 1e6:.1f} MB "
              f"(imports before it: RSS +{ov['imports_rss'] / 1e6:.0f} MB)")

    def ms(r: dict | None, q: int = 50) -> float | None:  # None: that run was skipped
        return None if r is None else pct(r["times"], q)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    def rounded(x: float | None, digits: int = 2) -> float | None:
        return None if x is None else round(x, digits)

    tiny_p50, large_p50, dense_p50 = ms(small), ms(large), ms(dense)
    if dense_p50 is not None:
        print(f"dense: size ratio {rounded(ratio(dense_p50, tiny_p50))}, speedup vs reload "
              f"{rounded(ratio(ms(dense_reload), dense_p50))} (a CPU forward pass dominates)")
    # the speedup on the MoE model; on the dense one where the MoE pair could not run
    model, base, ours = next(((m, b, o) for m, b, o in (("moe", reload, large),
                                                          ("dense", dense_reload, dense))
                              if b is not None and o is not None), (None, None, None))
    if model == "dense":
        print("speedup vs reload: the dense model's (the MoE pair did not run)",
              file=sys.stderr)
    print(json.dumps(dict(
        tiny_p50_ms=rounded(tiny_p50), tiny_p95_ms=rounded(ms(small, 95)),
        large_p50_ms=rounded(large_p50), large_p95_ms=rounded(ms(large, 95)),
        size_ratio=rounded(ratio(large_p50, tiny_p50)), reload_p50_ms=rounded(ms(base)),
        speedup_vs_reload=rounded(ratio(ms(base), ms(ours))), speedup_model=model,
        trainer_overhead_pct=rounded(ov and 100 * ov["rss"] / ov["weight_bytes"], 3),
        skipped=skips.reasons)))
    # a baseline that cannot run here is no failure of hotweights; anything else is
    return 1 if any(not name.startswith("reload-") for name in skips.reasons) else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # (`finally`
    # stops the server it runs)
    sys.exit(main())
