"""hotweights: train an LLM in place while vLLM serves it — one copy of the weights.

The public API is what `__all__` names. Each name is imported on first use (PEP 562), so
`import hotweights` (and `hotweights --help`) loads neither torch nor vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "Bridge": "hotweights.bridge.client",
    "CheckpointError": "hotweights.errors",
    "ConfigError": "hotweights.errors",
    "DeltaError": "hotweights.errors",
    "FingerprintError": "hotweights.errors",
    "HotweightsError": "hotweights.errors",
    "Layout": "hotweights.layout.plan",
    "LayoutError": "hotweights.errors",
    "LiveTensorError": "hotweights.errors",
    "ManifestError": "hotweights.errors",
    "Piece": "hotweights.layout.plan",
    "RemoteError": "hotweights.errors",
    "RemoteGroup": "hotweights.remote.group",
    "ServerError": "hotweights.errors",
    "UnsupportedModelError": "hotweights.errors",
    "ViewReport": "hotweights.layout.views",
    "SyncResult": "hotweights.checkpoint.result",
    "build_hf_model": "hotweights.layout.views",
    "diagnose": "hotweights.checkpoint.diagnosis",
    "plan": "hotweights.layout.plan",
    "recover": "hotweights.checkpoint.journal",
    "sync": "hotweights.checkpoint.incremental",
    "verify_shared": "hotweights.layout.views",
}
__all__ = [
    "Bridge",
    "CheckpointError",
    "ConfigError",
    "DeltaError",
    "FingerprintError",
    "HotweightsError",
    "Layout",
    "LayoutError",
    "LiveTensorError",
    "ManifestError",
    "Piece",
    "RemoteError",
    "RemoteGroup",
    "ServerError",
    "SyncResult",
    "UnsupportedModelError",
    "ViewReport",
    "build_hf_model",
    "diagnose",
    "plan",
    "recover",
    "sync",
    "verify_shared",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hotweights' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from hotweights.bridge.client import Bridge
    from hotweights.checkpoint.diagnosis import diagnose
    from hotweights.checkpoint.incremental import sync
    from hotweights.checkpoint.journal import recover
    from hotweights.checkpoint.result import SyncResult
    from hotweights.errors import (
        CheckpointError,
        ConfigError,
        DeltaError,
        FingerprintError,
        HotweightsError,
        LayoutError,
        LiveTensorError,
        ManifestError,
        RemoteError,
        ServerError,
        UnsupportedModelError,
    )
    from hotweights.layout.plan import Layout, Piece, plan
    from hotweights.layout.views import ViewReport, build_hf_model, verify_shared
    from hotweights.remote.group import RemoteGroup
