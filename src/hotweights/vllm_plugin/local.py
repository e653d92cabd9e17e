"""Run a vLLM engine in this process and reach its live parameters (`hotweights layout`,
views without a server, tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def start_engine(model_dir: str | Path, **engine_args: Any):
    """A vLLM `LLM` running in this process, with the hotweights plugin loaded."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from hotweights.server.env import ACTIVE
    from hotweights.vllm_plugin import register

    os.environ[ACTIVE] = "1"  # our general plugin acts (register)

    register()
    from vllm import LLM

    args = dict(enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)
    args.update(engine_args)
    return LLM(str(model_dir), **args)


def live_params(llm) -> dict[str, torch.Tensor]:
    """vLLM's live parameters by name (the very tensors the engine computes with)."""
    out = llm.apply_model(lambda model: dict(model.named_parameters()))
    return out[0]


def stop_engine(llm) -> None:
    """Shut the engine down and free its distributed state, so another can start."""
    import gc

    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    llm.llm_engine.engine_core.shutdown()
    del llm
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


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
