"""Benchmark: TRL's GRPO weight sync against hotweights', same config, same model.

One GRPO config (batch 4: one prompt, 4 generations; 8 completion tokens; beta 0; TRL's
AdamW; importance-sampling correction on), one random Llama built here
(`hotweights.testing.tiny`: 0.5 GB in bf16 by default, `--hidden 1024` 0.22 GB, `--small`
3 MB), four ways to run it, each in a subprocess of its own (memory figures must not mix;
in-process vLLM engines cannot coexist), one at a time.

The default size takes ~30 minutes on a 2-core AVX2 CPU, where torch's bf16 GEMMs run
single-threaded and ~20x slower than fp32 (no AVX-512 BF16 or AMX): a step of the 0.5 GB
model takes over a minute there (`--hidden 1024`: ~10 minutes). CPUs with bf16 units run
it much faster.

- trl: TRL's colocate path, `trl.GRPOTrainer(model=DIR, args=GRPOConfig(use_vllm=True,
  vllm_mode="colocate", use_cpu=True))`: an in-process vLLM `LLM` beside the trainer's own
  copy, every weight copied into vLLM through `load_weights` before each generation.
  vLLM CPU repacks its linear weights, which `load_weights` cannot refill; the child runs
  with HOTWEIGHTS_ACTIVE=1, so hotweights' vLLM plugin keeps them unpacked. TRL's `LLM`
  gets `enforce_eager=True` added (as the server below has): no torch.compile start-up.
  TRL passes it no dtype: vLLM's "auto" serves float32 weights in bf16. TRL's trainer
  loads the model in the run's dtype (`model_init_kwargs`; its own default is float32
  master weights, which would make TRL's memory larger by more than the copy).
- hw: hotweights colocate, `hotweights.integrations.trl.GRPOTrainer(model=DIR,
  args=GRPOConfig(use_vllm=True, vllm_mode="colocate"))`: the trainer's parameters are
  views of the in-process engine's. Where this hotweights has no colocate mode, the run
  is reported as not run, with the reason.
- trls: TRL's server mode as far as it runs on a CPU: `trl.GRPOTrainer(model=DIR,
  args=GRPOConfig(vllm_mode="server"))` generating from the same `hotweights serve` as hws,
  the trainer holding its own copy; TRL's sync (`update_named_params`, every parameter)
  copies each one into the served tensors inside one update, where TRL would broadcast it
  over NCCL (which has no CPU backend). The memory baseline for hws: the same server
  processes, and the second copy.
- hws: hotweights server mode, `hotweights serve DIR --dtype D --logprobs-mode
  processed_logprobs` and `GRPOTrainer(bridge=Bridge.connect(url))`: the trainer's
  parameters are views of the server's shared memory; each optimizer step runs inside
  `bridge.update()`. The trainer uses one torch thread (vLLM's CPU worker keeps its
  OpenMP threads spinning on the cores it binds, see `hotweights demo`); in-process modes
  use the threads vLLM sets, the trainer and the engine taking turns.

Runs: each mode in bf16 at the full size (trainer bf16 autocast), TRL and hw again in bf16
at a 4x smaller model (half the hidden and MLP widths: TRL's sync grows with the bytes)
and in float32 at that smaller size with `bf16=False` (the gap then is vLLM's dtype
alone). Each run trains `--warmup` + `--steps` optimizer steps; figures are over the last
`--steps` (medians, the gap a mean).

Measured, per run:
- sync s/step: what a step costs to make its update visible to vLLM, beyond the
  optimizer's own arithmetic: the time in `trainer.vllm_generation.sync_weights` (TRL
  calls it before each generation; TRL: the copy into vLLM; hotweights: nothing to move)
  plus the time the optimizer step's wrappers add around the optimizer's own step
  (hotweights server: `bridge.update()`: pause, commit, resume; TRL: ~0). The optimizer's
  own step is timed by torch's global optimizer step hooks.
- step s: TRL's `step_time` metric (generation, sync, forward, backward: TRL's
  `training_step`) plus the optimizer step with its wrappers, so every mode's sync is in.
- peak GB (1e9 bytes): the largest sum, sampled every 0.2 s, of the proportional set size
  (`/proc/PID/smaps_rollup` Pss) of the run's processes: the trainer's and all of its
  descendants (trls, hws: the server's API and engine processes). Shared pages (the served
  weights in /dev/shm) count once.
- logprob gap: TRL's `sampling/sampling_logp_difference/mean`, the trainer's logprobs of
  the sampled tokens against vLLM's.

The issue's targets are printed beside the figures, never asserted: sync_speedup >= 20,
memory saved (trl_peak - hw_peak, trls_peak - hws_peak: each against TRL's same mode)
>= 0.9 x model_bytes,
hw_logprob_gap_fp32 <= 1e-4, bf16 gaps no worse than TRL's.

A human table goes to stderr; the last stdout line is one JSON object: model_bytes,
trl_sync_s, hw_sync_s, hws_sync_s, sync_speedup (trl_sync_s / hw_sync_s, or / hws_sync_s
where hw did not run: `speedup_mode` says which), trl_sync_s_small, hw_sync_s_small,
trl_step_s, hw_step_s, hws_step_s, trl_peak_gb, hw_peak_gb, hws_peak_gb, trl_logprob_gap,
hw_logprob_gap, hws_logprob_gap, trl_logprob_gap_fp32, hw_logprob_gap_fp32, trls_sync_s,
trls_step_s, trls_peak_gb, trls_logprob_gap, skipped
(run name -> why). A run that cannot run is named in `skipped` and its figures are null;
the exit status is 1 only when a trl, trls or hws run did not run.

Run:  nice .venv/bin/python benchmarks/trl_grpo.py [--small] [--steps 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _survive import Skips, died_of, reason
from hotweights.server.serve import term_with_parent

GAP = "sampling/sampling_logp_difference/mean"
PROMPTS = ["the quick brown", "a model of", "one copy of", "weights in place"]
# (run name, mode, size, dtype); a mode's later runs follow its first
RUNS = (("trl", "trl", "full", "bfloat16"), ("hw", "hw", "full", "bfloat16"),
        ("trls", "trls", "full", "bfloat16"), ("hws", "hws", "full", "bfloat16"),
        ("trl_small", "trl", "small", "bfloat16"),
        ("hw_small", "hw", "small", "bfloat16"), ("trl_fp32", "trl", "small", "float32"),
        ("hw_fp32", "hw", "small", "float32"))
MODE_NAMES = {"trl": "TRL colocate", "hw": "hotweights colocate",
              "trls": "TRL server (sync by copy)", "hws": "hotweights server"}


def shape(hidden: int, layers: int) -> dict[str, int]:
    """`tiny.build` overrides of a Llama of `hidden` width and `layers` decoder layers
    (head_dim 64 as vLLM's CPU attention wants, MLP ~8/3 wide, ~1/4 as many kv heads)."""
    if hidden % 128 or hidden < 128:
        raise ValueError(f"--hidden {hidden}: a multiple of 128 (head_dim 64, and the 4x "
                         "smaller model halves it)")
    if layers < 1:
        raise ValueError(f"--layers {layers}: at least 1")
    heads = hidden // 64
    kv = max(d for d in range(1, heads + 1) if heads % d == 0 and d <= max(1, heads // 4))
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=64, intermediate_size=hidden * 8 // 3 // 64 * 64,
                max_position_embeddings=512)


# --- in the run's subprocess ------------------------------------------------------------

class PssSampler(threading.Thread):
    """The largest total PSS of process `root` and its descendants, sampled every
    `interval` seconds until `stop()`; `at_peak`: each process's share then."""

    def __init__(self, root: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.root, self.interval, self.peak = root, interval, 0
        self.at_peak: dict[str, int] = {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self._sample()
            self._done.wait(self.interval)

    def _sample(self) -> None:
        shares = tree_pss(self.root)
        if (total := sum(shares.values())) > self.peak:
            self.peak, self.at_peak = total, shares

    def stop(self) -> int:
        self._done.set()
        self.join()
        self._sample()
        return self.peak


def tree_pss(root: int) -> dict[str, int]:
    """"PID NAME" -> Pss bytes, for `root` and every process descended from it."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat.split(" (", 1)[1].rsplit(")", 1)  # the name may hold ")"
        children.setdefault(int(rest.split()[1]), []).append(int(entry.name))
        names[int(entry.name)] = name
    shares, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss = next(int(line.split()[1]) * 1024 for line in f
                           if line.startswith("Pss:"))
        except (OSError, StopIteration):
            continue  # gone meanwhile, or a kernel thread
        shares[f"{pid} {names.get(pid, '?')}"] = pss
    return shares


class Timers:
    """Per-step times: `sync_weights`, the optimizer's own step (torch's global step
    hooks) and the step with whatever wraps it (the trainer's `create_optimizer`)."""

    def __init__(self) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.sync: list[float] = []
        self.inner: list[float] = []
        self.outer: list[float] = []
        self._t0 = 0.0
        register_optimizer_step_pre_hook(self._pre)
        register_optimizer_step_post_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.inner.append(time.perf_counter() - self._t0)

    def timed(self, fn, into: list[float]):
        def timed(*args: Any, **kwargs: Any):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into.append(time.perf_counter() - t0)
        timed.bench_timed = True
        return timed

    def trainer_class(self, base: type) -> type:
        """`base` whose optimizer's step (with the trainer's own wrapping) is timed."""
        timers = self

        def create_optimizer(self, model=None):
            optimizer = base.create_optimizer(self, model)
            if not getattr(optimizer.step, "bench_timed", False):
                optimizer.step = timers.timed(optimizer.step, timers.outer)
            return optimizer
        return type(f"Timed{base.__name__}", (base,), {"create_optimizer": create_optimizer})

    def watch(self, trainer: Any) -> None:
        generation = getattr(trainer, "vllm_generation", None)
        if generation is not None:
            generation.sync_weights = self.timed(generation.sync_weights, self.sync)


def _reward(completion_ids, **_: Any) -> list[float]:
    """The share of completion tokens below 30."""
    return [sum(t < 30 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _config(args: argparse.Namespace, vllm_mode: str, **more: Any):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(args.out.with_suffix(".trainer")), use_vllm=True, vllm_mode=vllm_mode,
        per_device_train_batch_size=args.batch, num_generations=4,
        max_completion_length=args.completion_tokens,
        max_steps=args.warmup + args.steps, logging_steps=1, report_to="none",
        use_cpu=True, bf16=args.dtype == "bfloat16", save_strategy="no", seed=0,
        disable_tqdm=True, beta=0.0, vllm_importance_sampling_correction=True,
        vllm_max_model_length=256, **more)


def _train(trainer_cls: type, timers: Timers, args: argparse.Namespace, vllm_mode: str,
           result: dict, config: dict | None = None, **kwargs: Any) -> Any:
    from datasets import Dataset

    result["stage"] = "trainer"  # a failure from here on is the mode's, not the size's
    trainer = timers.trainer_class(trainer_cls)(
        reward_funcs=_reward, args=_config(args, vllm_mode, **(config or {})),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 16}), **kwargs)
    result["stage"] = "train"
    timers.watch(trainer)
    trainer.train()
    return trainer


def _trl(timers: Timers, args: argparse.Namespace, result: dict) -> Any:
    import functools

    import trl
    from trl.generation import vllm_generation

    vllm_generation.LLM = functools.partial(vllm_generation.LLM, enforce_eager=True)
    return _train(trl.GRPOTrainer, timers, args, "colocate", result, model=str(args.model),
                  config=_like_for_like(args))


def _like_for_like(args: argparse.Namespace) -> dict[str, Any]:
    """TRL loads a model by path in float32 unless told (float32 master weights: 2 bytes
    more per parameter for the weights, the gradients and each Adam moment than the bf16
    parameters hotweights trains): the run's dtype instead, so that memory differs by the
    copy alone."""
    return {"model_init_kwargs": {"dtype": args.dtype}}


def _hw(timers: Timers, args: argparse.Namespace, result: dict) -> Any:
    from hotweights.integrations import trl as integration

    return _train(integration.GRPOTrainer, timers, args, "colocate", result,
                  model=str(args.model))


@contextlib.contextmanager
def _server(args: argparse.Namespace, result: dict) -> Iterator[Any]:
    """A `hotweights serve` on the model, and a Bridge to it."""
    import secrets

    import torch

    from hotweights.bridge.client import Bridge
    from hotweights.server import launch

    torch.set_num_threads(1)  # beside the server's spinning OpenMP threads (module doc)
    token, port = secrets.token_hex(16), launch.free_port()
    log, url = args.out.with_suffix(".server.log"), f"http://127.0.0.1:{port}"
    result["server_log"] = str(log)
    proc = launch.spawn(args.model, port=port, token=token, log=log, vllm_args=(
        "--dtype", args.dtype, "--max-model-len", "256", "--enforce-eager",
        "--max-num-seqs", "8", "--logprobs-mode", "processed_logprobs"))
    try:
        launch.wait_ready(proc, url, log=log, timeout=args.start_timeout)
        yield Bridge.connect(url, token=token)
    finally:
        launch.stop(proc)


def _hws(timers: Timers, args: argparse.Namespace, result: dict) -> Any:
    from hotweights.integrations import trl as integration

    with _server(args, result) as bridge:
        return _train(integration.GRPOTrainer, timers, args, "server", result, bridge=bridge)


def _trls(timers: Timers, args: argparse.Namespace, result: dict) -> Any:
    import trl
    from trl.generation import vllm_generation

    from hotweights.integrations.trl import _client_for

    with _server(args, result) as bridge:
        class CopyingClient(_client_for(bridge)):
            """TRL's server-mode sync, every parameter sent to the server, as a copy into
            the served tensors (NCCL, TRL's transport, has no CPU backend)."""

            served: dict[str, Any] | None = None

            def update_named_params(self, metadata, named_params) -> None:
                if self.served is None:
                    self.served = dict(bridge.model().named_parameters(remove_duplicate=False))
                with bridge.update():
                    for name, tensor in named_params:
                        self.served[name].data.copy_(tensor)

            def reset_prefix_cache(self) -> None:
                """The commit reset it."""

        vllm_generation.VLLMClient = CopyingClient
        return _train(trl.GRPOTrainer, timers, args, "server", result, model=str(args.model),
                      config={"vllm_server_base_url": bridge.url, **_like_for_like(args)})


def child(args: argparse.Namespace) -> int:
    """One run in this process: train, write the raw figures (or why not) to `args.out`."""
    sampler = PssSampler(os.getpid())
    sampler.start()
    result: dict[str, Any] = {"stage": "setup"}
    try:
        timers = Timers()
        runs = {"trl": _trl, "hw": _hw, "trls": _trls, "hws": _hws}
        trainer = runs[args.child](timers, args, result)
        result.update(sync=timers.sync, inner=timers.inner, outer=timers.outer,
                      log=[{k: v for k, v in entry.items() if isinstance(v, int | float)}
                           for entry in trainer.state.log_history])
    except Exception as e:  # noqa: BLE001 - the parent reports it as not run, and goes on
        log = result.get("server_log")
        result["error"] = reason(e, Path(log) if log else None)
        import traceback

        traceback.print_exc()
    result["peak_bytes"] = sampler.stop()
    result["peak_by_process"] = sampler.at_peak
    args.out.write_text(json.dumps(result))
    return 0


# --- in the parent ----------------------------------------------------------------------

def figures(result: dict, warmup: int) -> dict[str, float | None]:
    """A run's figures from its raw times and TRL's log: sync_s, step_s (medians over the
    steps after `warmup`), gap (mean), peak_gb."""
    steps = [e for e in result["log"] if "step_time" in e][warmup:]
    sync, inner, outer = (result[k][warmup:] for k in ("sync", "inner", "outer"))
    n = min(len(steps), len(inner), len(outer))
    sync = (sync + [0.0] * n)[:n]  # a mode may never call sync_weights
    gaps = [e[GAP] for e in steps if GAP in e]
    return dict(
        sync_s=statistics.median(sync[i] + outer[i] - inner[i] for i in range(n)) if n else None,
        step_s=statistics.median(steps[i]["step_time"] + outer[i] for i in range(n)) if n else None,
        gap=statistics.fmean(gaps) if gaps else None,
        peak_gb=result["peak_bytes"] / 1e9)


class ModeFailed(Exception):
    """A run that did not run; the message says why (no exception name in front)."""


def run(name: str, mode: str, model_dir: Path, dtype: str, args: argparse.Namespace,
        failed_setup: dict[str, str]) -> dict:
    """`name` in a subprocess of its own; its figures, or ModeFailed saying why not."""
    if mode in failed_setup:  # a trainer that cannot be built fails at every size
        raise ModeFailed(f"not tried, {mode} failed before training: {failed_setup[mode]}")
    out, log = args.workdir / f"{name}.json", args.workdir / f"{name}.log"
    out.unlink(missing_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, in every mode alike
    if mode == "trl":  # hotweights' plugin keeps vLLM CPU's weights refillable (doc)
        env.update(HOTWEIGHTS_ACTIVE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode,
           "--model", str(model_dir), "--dtype", dtype, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--out", str(out), "--batch", str(args.batch),
           "--completion-tokens", str(args.completion_tokens),
           "--start-timeout", str(args.start_timeout)]
    t0 = time.perf_counter()
    print(f"{name}: {MODE_NAMES[mode]}, {dtype}, {model_dir.name} (log: {log})",
          file=sys.stderr, flush=True)
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  preexec_fn=term_with_parent,  # it dies with us
                                  timeout=args.run_timeout).returncode
        except subprocess.TimeoutExpired:
            raise ModeFailed(f"no result after {args.run_timeout:.0f} s") from None
    if not out.exists():
        raise ModeFailed(f"the run died ({died_of(code)}) before it reported (log: {log})")
    result = json.loads(out.read_text())
    if "error" in result:
        if result["stage"] in ("setup", "trainer"):
            failed_setup[mode] = result["error"]
        raise ModeFailed(f"{result['error']} (log: {log})")
    shares = sorted(result["peak_by_process"].items(), key=lambda kv: -kv[1])
    print(f"{name}: done in {time.perf_counter() - t0:.0f} s; at the peak, "
          f"{result['peak_bytes'] / 1e9:.2f} GB: "
          + ", ".join(f"{who} {pss / 1e9:.2f}" for who, pss in shares if pss > 20e6),
          file=sys.stderr, flush=True)
    return figures(result, args.warmup)


def weight_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is no mapping
                piece = f.get_slice(key)
                numel = 1
                for d in piece.get_shape():
                    numel *= d
                total += numel * {"BF16": 2, "F16": 2, "F32": 4}[piece.get_dtype()]
    return total


def report(runs: dict[str, dict | None], model_bytes: int,
           skipped: dict[str, str]) -> dict[str, Any]:
    """The JSON line's object from the runs' figures (None: the run did not run)."""
    def get(name: str, key: str) -> float | None:
        r = runs.get(name)
        return None if r is None else r[key]

    trl, hw, hws = (get(m, "sync_s") for m in ("trl", "hw", "hws"))
    mode, ours = ("hw", hw) if hw is not None else ("hws", hws) if hws is not None \
        else (None, None)
    return dict(
        model_bytes=model_bytes, trl_sync_s=trl, hw_sync_s=hw, hws_sync_s=hws,
        sync_speedup=trl / ours if trl is not None and ours else None, speedup_mode=mode,
        trl_sync_s_small=get("trl_small", "sync_s"), hw_sync_s_small=get("hw_small", "sync_s"),
        trl_step_s=get("trl", "step_s"), hw_step_s=get("hw", "step_s"),
        hws_step_s=get("hws", "step_s"), trl_peak_gb=get("trl", "peak_gb"),
        hw_peak_gb=get("hw", "peak_gb"), hws_peak_gb=get("hws", "peak_gb"),
        trl_logprob_gap=get("trl", "gap"), hw_logprob_gap=get("hw", "gap"),
        hws_logprob_gap=get("hws", "gap"), trls_sync_s=get("trls", "sync_s"),
        trls_step_s=get("trls", "step_s"), trls_peak_gb=get("trls", "peak_gb"),
        trls_logprob_gap=get("trls", "gap"), trl_logprob_gap_fp32=get("trl_fp32", "gap"),
        hw_logprob_gap_fp32=get("hw_fp32", "gap"), skipped=skipped)


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _verdict(met: bool | None) -> str:
    return "" if met is None else ": met" if met else ": NOT met"


def table(out: dict[str, Any], sizes: dict[str, str]) -> str:
    """The human table and the targets, for stderr."""
    rows = [(f"sync s/step ({sizes['full']})", "sync_s"),
            (f"sync s/step ({sizes['small']})", "sync_s_small"),
            ("step s (TRL step_time + optimizer)", "step_s"),
            ("peak GB (PSS, all processes)", "peak_gb"),
            ("logprob gap, bf16", "logprob_gap"),
            (f"logprob gap, fp32 weights ({sizes['small']})", "logprob_gap_fp32")]
    lines = [f"{'':<44}" + "".join(f"{m:>12}" for m in MODE_NAMES)]
    for label, key in rows:
        cells = "".join(f"{_fmt(out.get(f'{m}_{key}')):>12}" for m in MODE_NAMES)
        lines.append(f"{label:<44}{cells}")
    for m in ("trl", "hw"):
        full, small = out[f"{m}_sync_s"], out[f"{m}_sync_s_small"]
        if full is not None and small:
            lines.append(f"{m} sync, 4x the bytes: x{full / small:.2f}")
    mb = out["model_bytes"] / 1e9
    lines.append(f"model: {mb:.3f} GB of bf16 weights")
    speedup = out["sync_speedup"]
    lines.append(f"sync_speedup {_fmt(speedup, '.1f')} (trl / {out['speedup_mode'] or '-'}), "
                 f"target >= 20{_verdict(None if speedup is None else speedup >= 20)}")
    for theirs, m in (("trl", "hw"), ("trls", "hws")):
        saved = None if None in (out[f"{theirs}_peak_gb"], out[f"{m}_peak_gb"]) \
            else out[f"{theirs}_peak_gb"] - out[f"{m}_peak_gb"]
        met = None if saved is None else saved >= 0.9 * mb
        lines.append(f"memory saved {theirs} - {m}: {_fmt(saved, '.3f')} GB, target >= "
                     f"{0.9 * mb:.3f} GB (0.9 x model){_verdict(met)}")
    gap = out["hw_logprob_gap_fp32"]
    lines.append(f"hw fp32 logprob gap {_fmt(gap, '.2e')}, target <= 1e-4"
                 f"{_verdict(None if gap is None else gap <= 1e-4)}")
    for m in ("hw", "hws"):
        ours, theirs = out[f"{m}_logprob_gap"], out["trl_logprob_gap"]
        lines.append(f"{m} bf16 logprob gap {_fmt(ours, '.2e')}, target <= TRL's "
                     f"{_fmt(theirs, '.2e')}"
                     f"{_verdict(None if None in (ours, theirs) else ours <= theirs)}")
    for name, why in out["skipped"].items():
        lines.append(f"not run: {name}: {why}")
    return "\n".join(lines)


def _rounded(x: Any) -> Any:
    return float(f"{x:.4g}") if isinstance(x, float) else x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Runs go one at a time; the last stdout line is JSON.")
    parser.add_argument("--small", action="store_true",
                        help="a quick run: --hidden 256 --layers 2 (~4 MB of weights)")
    parser.add_argument("--hidden", type=int, default=1536,
                        help="hidden size of the full model, a multiple of 128 (default: "
                        "%(default)s: 0.5 GB in bf16 with 10 layers; 1024: 0.22 GB)")
    parser.add_argument("--layers", type=int, default=10,
                        help="decoder layers (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=2,
                        help="measured optimizer steps per run (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="optimizer steps before them (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4,
                        help="completions per step, 4 per prompt (default: %(default)s)")
    parser.add_argument("--completion-tokens", type=int, default=8,
                        help="tokens per completion (default: %(default)s)")
    parser.add_argument("--modes", default=",".join(MODE_NAMES),
                        help="modes to run (default: %(default)s)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hotweights-bench-trl-grpo"),
                        help="models (built once, reused), logs (default: %(default)s)")
    parser.add_argument("--start-timeout", type=float, default=600,
                        help="seconds allowed for a server to start (default: %(default)s)")
    parser.add_argument("--run-timeout", type=float, default=1800,
                        help="seconds allowed for one run (default: %(default)s)")
    parser.add_argument("--child", choices=tuple(MODE_NAMES), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps >= 1 and --warmup >= 0")
    if args.batch < 4 or args.batch % 4:
        parser.error(f"--batch {args.batch}: a multiple of 4 (the generations per prompt)")
    if args.child:
        return child(args)
    if args.small:
        args.hidden, args.layers = 256, 2
    modes = set(args.modes.split(","))
    if not modes or not modes <= set(MODE_NAMES):
        parser.error(f"--modes {args.modes}: a comma-separated subset of "
                     + ",".join(MODE_NAMES))
    try:
        sizes = {"full": shape(args.hidden, args.layers),
                 "small": shape(args.hidden // 2, args.layers)}
    except ValueError as e:
        parser.error(str(e))

    from hotweights.testing import tiny

    args.workdir.mkdir(parents=True, exist_ok=True)
    dirs: dict[tuple[str, str], Path] = {}
    for size, dtype in {(size, dtype) for _, _, size, dtype in RUNS}:
        s = sizes[size]
        dirs[size, dtype] = args.workdir / f"llama-{dtype}-h{s['hidden_size']}-l{args.layers}"
    skips, failed_setup, runs = Skips(), {}, {}
    for key in sorted(dirs, key=lambda k: (k[0] != "full", k[1])):
        print(f"building {dirs[key]}", file=sys.stderr, flush=True)
        tiny.build("llama", dirs[key], dtype=key[1], **sizes[key[0]])
    model_bytes = weight_bytes(dirs["full", "bfloat16"])
    for name, mode, size, dtype in RUNS:
        if mode in modes:
            try:
                runs[name] = run(name, mode, dirs[size, dtype], dtype, args, failed_setup)
            except ModeFailed as e:
                skips.add(name, str(e))
            except Exception as e:  # noqa: BLE001 - named and reported; the others go on
                skips.add(name, reason(e, args.workdir / f"{name}.log"))
    labels = {size: f"{weight_bytes(dirs[size, 'bfloat16']) / 1e6:.0f} MB bf16"
              for size in sizes}
    out = {k: _rounded(v) for k, v in report(runs, model_bytes, skips.reasons).items()}
    print(table(out, labels), file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 1 if any(not name.startswith("hw") or name.startswith("hws")
                    for name in skips.reasons) else 0


if __name__ == "__main__":
    sys.exit(main())
