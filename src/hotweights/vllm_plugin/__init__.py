"""Everything that imports vLLM lives here, and is imported lazily.

`register` is the `vllm.general_plugins` entry point: vLLM runs it in every process
(API server, engine core, workers) before the model loads.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_done = False


def register() -> None:
    """vLLM general plugin: on CPU, keep the live weights in a layout we can view."""
    global _done
    if _done:
        return
    _done = True
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from hotweights.vllm_plugin.cpu_keep_weights import install

        install()
