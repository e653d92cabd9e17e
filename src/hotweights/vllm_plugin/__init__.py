"""Everything that imports vLLM lives here, and is imported lazily (no other part imports
vLLM). May import any part but `cli`.

`register` is the `vllm.general_plugins` entry point: vLLM runs it in every process
(API server, engine core, workers) before the model loads, in every vLLM on a machine
where hotweights is installed. It acts only where HOTWEIGHTS_ACTIVE=1, which `hotweights
serve` and `local.start_engine` set: a plain `vllm serve` keeps vLLM's own CPU kernels.
"""

from __future__ import annotations

import logging
import os

from hotweights.server.env import ACTIVE, REMOTE_ENGINE, SERVER_ID

logger = logging.getLogger(__name__)

_done = False


def register() -> None:
    """vLLM general plugin: register the `hotweights` weight-transfer engine, and on CPU
    keep the live weights in a layout we can view."""
    global _done
    if _done:
        return
    if os.environ.get(ACTIVE) != "1":
        logger.debug("hotweights: plugin inert, this vLLM was not started by `hotweights "
                     "serve` (HOTWEIGHTS_ACTIVE is not 1)")
        return
    _done = True
    if os.environ.get(SERVER_ID):  # a server's processes (not a trainer's own engine)
        _log_beside_vllm()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.platforms import current_platform

    try:  # `hotweights serve --remote` selects it; the module loads only then
        WeightTransferEngineFactory.register_engine(
            REMOTE_ENGINE, "hotweights.vllm_plugin.remote_engine", "HotweightsEngine")
    except ValueError:  # registered already in this process
        pass

    if current_platform.is_cpu():
        from hotweights.vllm_plugin.cpu_keep_weights import install

        install()


class _VllmLog(logging.Handler):
    """Hands each record on as the `vllm` logger would its own, when it is emitted: at its
    level, to its handlers (vLLM sets them up, and replaces them, as its engine starts; a
    user's logging config may leave it none and pass its records to the root logger)."""

    def emit(self, record: logging.LogRecord) -> None:
        theirs = logging.getLogger("vllm")
        if record.levelno >= theirs.getEffectiveLevel():
            if not hasattr(record, "vllm_process_name"):  # (made before vLLM's record
                record.vllm_process_name = record.processName  # factory: its format's)
            theirs.handle(record)


def _log_beside_vllm() -> None:
    """hotweights' records in the server's log as vLLM's own are (its format, level and
    handlers, whatever configured them). Left to the root logger they were lost: an
    import in vLLM's API server (`model_hosting_container_standards`) sets it to ERROR."""
    ours = logging.getLogger("hotweights")
    if not any(isinstance(h, _VllmLog) for h in ours.handlers):
        ours.addHandler(_VllmLog())
        ours.setLevel(logging.DEBUG)  # (`_VllmLog` filters at vLLM's level)
        ours.propagate = False
