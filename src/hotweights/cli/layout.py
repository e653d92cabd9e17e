"""`hotweights layout MODEL_DIR`: the vLLM -> HF parameter map as a table."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.table import Table

from hotweights.cli.console import LOG_FORMAT, make_console
from hotweights.errors import LayoutError


def _model_dir(path: str) -> Path:
    model_dir = Path(path)
    if not (model_dir / "config.json").is_file():
        raise LayoutError(f"{model_dir}: not a model directory (no config.json)")
    return model_dir


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def run(args: argparse.Namespace) -> int:
    from hotweights.layout.plan import load_config, plan, text_config

    trust = args.trust_remote_code
    config = load_config(_model_dir(args.model_dir), trust_remote_code=trust)  # fail fast
    console = make_console()
    from hotweights.vllm_plugin.local import hf_context, live_params, start_engine, stop_engine

    # nothing is generated: a short context within the model's, and no tokenizer where
    # the directory has none (vLLM's multimodal processors want one where there is)
    text = text_config(config)
    length = min(256, getattr(text, "max_position_embeddings", None) or 256)
    tokenizer = any((Path(args.model_dir) / name).exists() for name in _TOKENIZER_FILES)
    with console.status(f"loading {args.model_dir} in vLLM"), _quiet(not args.verbose):
        try:
            llm = start_engine(args.model_dir, model_impl=args.model_impl, dtype=args.dtype,
                               trust_remote_code=trust, skip_tokenizer_init=not tokenizer,
                               max_model_len=length, environ={} if args.verbose else
                               {"VLLM_LOGGING_LEVEL": "ERROR"})
        except Exception as e:  # a field vLLM refuses, ...: named, no trace
            raise LayoutError(f"{args.model_dir}: vLLM cannot load it ({type(e).__name__}: "
                              f"{e}); --verbose shows vLLM's log") from e
        try:
            live = live_params(llm)
            params = {n: (tuple(t.shape), t.dtype) for n, t in live.items()}
            with hf_context(llm):
                layout = plan(config, live, strict=False, trust_remote_code=trust)
                same, values = _values(config, live, layout, args.model_dir, trust)
        finally:  # the environment put back too: a server started later logs as usual
            stop_engine(llm)

    table = Table(title=f"vLLM -> HF parameters of {args.model_dir}")
    for col in ("vLLM parameter", "shape", "dtype", "HF parameter", "rows (dim)", "HF shape"):
        table.add_column(col, no_wrap=True)
    for vname, (shape, dtype) in params.items():
        pieces = layout.pieces.get(vname, ())
        if not pieces:
            table.add_row(vname, str(shape), str(dtype).removeprefix("torch."),
                          "[red]UNMAPPED[/red]", "", "")
        for i, p in enumerate(pieces):
            head = (vname, str(shape), str(dtype).removeprefix("torch.")) if i == 0 \
                else ("", "", "")
            table.add_row(*head, p.hf_name, f"{p.rows[0]}:{p.rows[1]} ({p.dim})",
                          str(p.hf_shape) + (" (transposed)" if p.transposed else ""))
    console.print(table)
    for name in layout.missing:
        console.print(f"[red]HF parameter with no vLLM source:[/red] {name}")
    ok = not layout.missing and not layout.unused
    console.print(
        f"{len(layout.inverse())} HF parameters mapped ({layout.num_mapped} pieces) from "
        f"{len(params)} vLLM parameters; "
        f"{len(layout.unused)} vLLM unmapped, {len(layout.missing)} HF missing"
    )
    console.print(values if same else f"[red]{values}[/red]")
    return 0 if ok and same else 1


@contextmanager
def _quiet(on: bool) -> Iterator[None]:
    """While vLLM loads, its start-up output off the terminal: all of fd 2 and sys.stderr
    (its log, its C++ warnings, its loading bar) dropped, Python's warnings ignored;
    hotweights' own log still shows. `on` False (--verbose): all of it shows."""
    if not on:
        yield
        return
    sys.stderr.flush()
    log, stderr = logging.getLogger("hotweights"), sys.stderr
    with open(os.devnull, "w") as dropped, open(os.dup(2), "w") as terminal, \
            warnings.catch_warnings():
        own = logging.StreamHandler(terminal)
        own.setFormatter(logging.Formatter(LOG_FORMAT))
        warnings.simplefilter("ignore")
        try:
            os.dup2(dropped.fileno(), 2)
            sys.stderr = dropped  # also where rich's status on a terminal proxies it
            log.addHandler(own)
            log.propagate = False
            yield
        except BaseException as e:  # vLLM's frames freed now: what their objects write as
            seen = set()  # they go (a loading bar's last line) is dropped too
            while e is not None and id(e) not in seen:
                seen.add(id(e))
                traceback.clear_frames(e.__traceback__)
                e = e.__cause__ or e.__context__
            raise
        finally:
            log.removeHandler(own)
            log.propagate = True
            sys.stderr = stderr
            os.dup2(terminal.fileno(), 2)


def _values(config, live: dict, layout, model_dir: str, trust: bool) -> tuple[bool, str]:
    """What the views over the just-loaded weights hold against the checkpoint: a loader
    that reorders a tensor keeping its name and shape maps by names and shapes all the
    same (`bridge.loaded.check_loaded`)."""
    from hotweights.bridge.loaded import check_loaded
    from hotweights.layout.views import build_hf_model

    try:
        model, report = build_hf_model(config, live, allow_missing=True, layout=layout,
                                       trust_remote_code=trust)
        n = check_loaded(model, model_dir, report.mapped)
    except LayoutError as e:
        return False, f"values: {e}"
    return True, f"values: {n} HF parameters hold what the checkpoint holds (rows compared)"
