"""Run a vLLM engine in this process and reach its live parameters (`hotweights layout`,
views without a server, tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

_environ: dict[str, str] | None = None  # os.environ before the engine here started
_environ_set: dict[str, str] | None = None  # and once it had started


def start_engine(model_dir: str | Path, *, environ: Mapping[str, str] | None = None,
                 **engine_args: Any):
    """A vLLM `LLM` running in this process, with the hotweights plugin loaded; `environ`:
    variables set for it where they are not set already (VLLM_LOGGING_LEVEL, say).

    `stop_engine` (or a failed start) puts `os.environ` back as it was: the setup here
    changes it (vLLM's LD_PRELOAD and its own settings, this engine's), and every process
    started after, a vLLM server among them, would inherit that."""
    global _environ
    if _environ is None:  # (not an environment this module set up already)
        _environ = dict(os.environ)
    try:
        for k, v in (environ or {}).items():
            os.environ.setdefault(k, v)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from hotweights.server.env import ACTIVE
        from hotweights.vllm_plugin import register

        os.environ[ACTIVE] = "1"  # our general plugin acts (register)

        register()
        from vllm import LLM

        args = dict(enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)
        args.update(engine_args)
        llm = LLM(str(model_dir), **args)
        global _environ_set
        _environ_set = dict(os.environ)
        return llm
    except BaseException:
        _put_back()
        raise


def live_params(llm) -> dict[str, torch.Tensor]:
    """vLLM's live parameters by name (the very tensors the engine computes with), but for
    views of another's bytes (`aliases`: written through it)."""
    from hotweights.vllm_plugin.aliases import owned

    return owned(llm.apply_model(lambda model: dict(model.named_parameters()))[0])


def stop_engine(llm) -> None:
    """Shut the engine down and free its distributed state, so another can start."""
    import gc

    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    try:
        llm.llm_engine.engine_core.shutdown()
        del llm
        destroy_model_parallel()
        destroy_distributed_environment()
        gc.collect()
    finally:  # the environment put back also when a step of the shutdown failed
        _put_back()


def restore_environ(before: dict[str, str], after: dict[str, str] | None = None) -> None:
    """Undo in `os.environ` what changed from `before` to `after` (default: now), where a
    variable still holds `after`'s value: what the program set since stays."""
    after = dict(os.environ) if after is None else after
    for name in set(before) | set(after):
        if before.get(name) == after.get(name) or os.environ.get(name) != after.get(name):
            continue
        if name in before:
            os.environ[name] = before[name]
        else:
            del os.environ[name]


def _put_back() -> None:
    global _environ, _environ_set
    if _environ is not None:
        restore_environ(_environ, _environ_set)
        _environ = _environ_set = None


@contextlib.contextmanager
def hf_context(llm) -> Iterator[None]:
    """Build HF models inside this when a vLLM engine runs in the same process.

    vLLM's Transformers backend decorates the HF model classes it serves, in place, for
    its compiler; instances of those classes then need vLLM's current config to be set.
    With `enforce_eager` they run HF's own forward unchanged.
    """
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(llm.llm_engine.vllm_config):
        yield
