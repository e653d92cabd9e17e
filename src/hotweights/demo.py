"""`hotweights demo`: zero-copy views over a running vLLM engine, on a tiny local model."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from rich.progress import Progress

from hotweights.cli import make_console

PROMPT = "The server generates,"
TARGET = " the trainer learns."


def run(args: argparse.Namespace) -> int:
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch

    from hotweights import build_hf_model, plan, tiny, verify_shared
    from hotweights.vllm_plugin.local import live_params, start_engine, stop_engine

    console = make_console()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hotweights-demo-"))
    t0 = time.perf_counter()
    with console.status(f"building a tiny random {args.arch} model in {workdir}"):
        model_dir = tiny.build(args.arch, workdir / args.arch)
    with console.status("starting vLLM on it (in this process)"):
        llm = start_engine(model_dir)
    console.print(f"vLLM is serving {model_dir} ({time.perf_counter() - t0:.1f} s)")

    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=8, temperature=0.0)

    def complete() -> str:
        return llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text

    console.print(f"before: [bold]{PROMPT}[/bold][cyan]{complete()!r}[/cyan]")

    t = time.perf_counter()
    params = live_params(llm)
    layout = plan(model_dir, params)
    model, report = build_hf_model(model_dir, params, layout=layout)
    shared = verify_shared(model, params, layout)
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    console.print(
        f"HF model on views: {len(report.mapped)} parameters, {shared} share vLLM's memory, "
        f"{report.bytes_copied} of {weight_bytes:,} weight bytes copied "
        f"({time.perf_counter() - t:.2f} s)"
    )

    tok = llm.get_tokenizer()
    prompt_ids = tok(PROMPT)["input_ids"]
    ids = torch.tensor([prompt_ids + tok(TARGET)["input_ids"]])
    labels = ids.clone()
    labels[:, : len(prompt_ids)] = -100  # learn the continuation only
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    t = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("training on vLLM's weights, in place", total=args.steps)
        for _ in range(args.steps):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()  # writes straight into the tensors vLLM computes with
            optimizer.zero_grad(set_to_none=True)
            progress.advance(task)
    llm.reset_prefix_cache()  # cached KV of the prompt was computed with the old weights
    console.print(f"trained {args.steps} steps, loss {loss.item():.3f} "
                  f"({time.perf_counter() - t:.1f} s)")
    console.print(f"after:  [bold]{PROMPT}[/bold][green]{complete()!r}[/green]  "
                  f"(target {TARGET!r})")
    stop_engine(llm)
    return 0
