"""Checkpoint sync: write only what changed to safetensors shards, never a torn file.

May import `changes` and `errors`; never `remote`, `bridge`, `server` or `vllm_plugin`.
This file stays light (no torch): the CLI reads `MODES` from it for `--help`, and the
functions below are imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

MODES = ("auto", "reflink", "journal", "copy")  # how changed shards are written (incremental)

# public function -> the module that defines it
_EXPORTS = {
    "SyncResult": "hotweights.checkpoint.result",
    "diagnose": "hotweights.checkpoint.diagnosis",
    "finish": "hotweights.checkpoint.finisher",
    "recover": "hotweights.checkpoint.journal",
    "sync": "hotweights.checkpoint.incremental",
}
__all__ = ["MODES", "SyncResult", "diagnose", "finish", "recover", "sync"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hotweights.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from hotweights.checkpoint.diagnosis import diagnose
    from hotweights.checkpoint.finisher import finish
    from hotweights.checkpoint.incremental import sync
    from hotweights.checkpoint.journal import recover
    from hotweights.checkpoint.result import SyncResult
