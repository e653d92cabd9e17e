"""Benchmark: an HF model built on views of vLLM's live weights, per architecture.

For each architecture a tiny random model is built locally, served by an in-process vLLM
engine (CPU), and `build_hf_model` turns the engine's live parameters into a transformers
model. Measured per architecture:

- mapped: HF parameters that are views into vLLM tensors (`ViewReport.mapped`);
- bytes_copied: bytes of HF parameters whose storage is no vLLM parameter's storage,
  counted independently of `ViewReport.bytes_copied` (both must agree; expected 0),
  and `verify_shared` must pass;
- build_s: wall time of `build_hf_model` (which plans, too);
- overhead_pct: peak process RSS during the build (the kernel's high-water mark, VmHWM,
  reset just before it: nothing samples while the build is timed) minus RSS before it, as a
  percentage of the weight bytes (sum of numel * element_size of vLLM's parameters).

Every architecture runs in its own subprocess (vLLM's Transformers backend patches
transformers classes in-process, and RSS is per process). The parent prints a table, then
as its last line one JSON object: {"archs": {arch: {"mapped", "bytes_copied",
"overhead_pct", "build_s"} | {"skipped": reason} | {"error": message}}}. An arch is skipped
when this build cannot serve it here, when its engine refuses this machine
(`UnsupportedModelError`) or when its child dies of SIGILL (a vLLM kernel this CPU cannot
run); the other archs still run, and only errors make the exit status 1.

Run:  .venv/bin/python benchmarks/views.py [--archs llama qwen3] [--size small|medium|large]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import _survive
from hotweights.testing import tiny

ARCHS = ("llama", "llama_tied", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_next",
         "transformers_backend")  # the default run; --archs takes any of `CHOICES`
CHOICES = (*tiny.ARCHS, "transformers_backend")
# Config overrides per --size. "large" (~300 MB of bf16 weights) makes the fixed cost of
# creating a transformers model object (~2 MiB of Python objects) negligible, as it is for
# real models; "medium" is ~50 MB.
SIZES = {
    "small": {},
    "medium": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "large": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64),
}
MOE = {"small": {},
       "medium": dict(moe_intermediate_size=256, num_experts=8,
                      shared_expert_intermediate_size=512),
       "large": dict(moe_intermediate_size=512, num_experts=8,
                     shared_expert_intermediate_size=1024)}
RESULT_KEYS = ("mapped", "bytes_copied", "overhead_pct", "build_s")


def skip_reason(arch: str) -> str | None:
    """Why `arch` cannot be benchmarked in this build, or None."""
    from hotweights.vllm_plugin.support import unservable

    return None if arch == "transformers_backend" else unservable(arch)


def reset_peak_rss() -> None:
    """Set the kernel's peak RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """This process's peak RSS since `reset_peak_rss`, in bytes: kept by the kernel, so a
    timed block runs without a sampling thread taking the GIL beside it."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def build_model(arch: str, size: str, workdir: Path) -> Path:
    """The tiny model `arch` serves, built under `workdir` (or reused from there)."""
    model_arch = "llama" if arch == "transformers_backend" else arch
    moe = MOE[size] if model_arch in ("qwen3_moe", "qwen3_next") else {}
    if model_arch == "qwen3_moe":  # it has no shared expert
        moe = {k: v for k, v in moe.items() if not k.startswith("shared")}
    overrides = SIZES[size] | moe
    if model_arch in tiny.MLA_ARCHS and "num_attention_heads" in overrides:  # transformers'
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]  # MLA: as many
    return tiny.build(model_arch, workdir / size / model_arch, **overrides)


def run_one(arch: str, size: str, workdir: Path) -> dict:
    """Serve one tiny model, build the HF model on its live weights, and measure."""
    import psutil

    from hotweights import build_hf_model, plan, verify_shared
    from hotweights.errors import UnsupportedModelError
    from hotweights.layout.plan import hf_params
    from hotweights.vllm_plugin.local import hf_context, live_params, start_engine, stop_engine

    model_dir = build_model(arch, size, workdir)
    impl = "transformers" if arch == "transformers_backend" else "auto"
    try:
        llm = start_engine(model_dir, model_impl=impl)
    except UnsupportedModelError as e:  # this machine's kernels: not this arch's fault
        return {"skipped": f"the engine did not start here: {_survive.reason(e)}"}
    try:
        params = live_params(llm)
        weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
        gc.collect()
        rss_before = psutil.Process().memory_info().rss
        with hf_context(llm):
            reset_peak_rss()
            start = time.perf_counter()
            model, report = build_hf_model(model_dir, params)  # plans, too
            build_s = time.perf_counter() - start
            peak = peak_rss()
        layout = plan(model_dir, params, strict=False, hf_shapes=hf_params(model))
        if verify_shared(model, params, layout) != layout.num_mapped:
            raise RuntimeError("verify_shared did not check every mapped parameter")
        vllm_storages = {p.untyped_storage().data_ptr() for p in params.values()}
        copied = sum(p.numel() * p.element_size() for p in model.parameters()
                     if p.untyped_storage().data_ptr() not in vllm_storages)
        if copied != report.bytes_copied:
            raise RuntimeError(f"{copied} bytes are not vLLM's, the report says "
                               f"{report.bytes_copied}")
    finally:
        stop_engine(llm)
    return dict(mapped=len(report.mapped), bytes_copied=copied,
                overhead_pct=round(100 * (peak - rss_before) / weight_bytes, 3),
                build_s=round(build_s, 3), weight_bytes=weight_bytes)


def child_command(arch: str, args: argparse.Namespace) -> list[str]:
    return [sys.executable, __file__, "--one", arch, "--size", args.size,
            "--workdir", str(args.workdir)]


def spawn(arch: str, args: argparse.Namespace) -> dict:
    """Run `arch` in a child process; its result, {"skipped": ...} when it died of SIGILL,
    or {"error": ...} with stderr shown."""
    try:  # here, so the child's RSS never held a build
        build_model(arch, args.size, args.workdir)
    except Exception as e:  # noqa: BLE001 - reported per arch, the others still run
        return {"error": f"building the model failed: {e}"}
    try:
        proc = subprocess.run(child_command(arch, args), capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(lines[-1])
    tail = proc.stderr.strip().splitlines()[-30:]
    died = _survive.died_of(proc.returncode)
    print(f"--- {arch} failed ({died}); stderr tail:", *tail, sep="\n", file=sys.stderr)
    if proc.returncode == -signal.SIGILL:
        return {"skipped": f"the child died of {died}"}
    return {"error": tail[-1] if tail else f"{died}, no result line"}


def print_table(results: dict[str, dict]) -> None:
    head = ("arch", "mapped", "bytes copied", "build s", "overhead %", "weight MB")
    print(f"{head[0]:<22}" + "".join(f"{h:>14}" for h in head[1:]))
    for arch, r in results.items():
        if "mapped" not in r:
            note = r.get("skipped") or f"ERROR: {r.get('error')}"
            print(f"{arch:<22}  {note}")
            continue
        cells = (r["mapped"], r["bytes_copied"], f"{r['build_s']:.3f}",
                 f"{r['overhead_pct']:.2f}", f"{r['weight_bytes'] / 1e6:.1f}")
        print(f"{arch:<22}" + "".join(f"{c:>14}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Each arch runs in its own subprocess; the last stdout line is JSON.",
    )
    parser.add_argument("--archs", nargs="+", choices=CHOICES, default=list(ARCHS),
                        metavar="ARCH", help=f"what to run, of {', '.join(CHOICES)} "
                        f"(default: {', '.join(ARCHS)})")
    parser.add_argument("--size", choices=tuple(SIZES), default="large",
                        help="small: tiny.build defaults; medium: 8 layers, hidden 512; "
                        "large (default): 12 layers, hidden 1024, ~300 MB")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hotweights-bench"),
                        help="where models are built and reused (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=900,
                        help="seconds allowed per arch (default: %(default)s)")
    parser.add_argument("--one", choices=CHOICES, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args(argv)

    if args.one:
        reason = skip_reason(args.one)
        result = {"skipped": reason} if reason else run_one(args.one, args.size, args.workdir)
        print(json.dumps(result), flush=True)
        return 0

    results = {}
    for arch in args.archs:
        reason = skip_reason(arch)
        results[arch] = {"skipped": reason} if reason else spawn(arch, args)
    print_table(results)
    summary = {arch: {k: r[k] for k in RESULT_KEYS} if "mapped" in r else r
               for arch, r in results.items()}
    print(json.dumps({"archs": summary}))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
