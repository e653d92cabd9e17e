"""hotweights: train an LLM in place while vLLM serves it — one copy of the weights."""

from hotweights.bridge.client import Bridge
from hotweights.errors import (
    HotweightsError,
    LayoutError,
    ManifestError,
    RemoteError,
    ServerError,
)
from hotweights.layout.plan import Layout, Piece, plan
from hotweights.layout.views import ViewReport, build_hf_model, verify_shared
from hotweights.remote.group import RemoteGroup

__all__ = [
    "Bridge",
    "HotweightsError",
    "Layout",
    "LayoutError",
    "ManifestError",
    "Piece",
    "RemoteError",
    "RemoteGroup",
    "ServerError",
    "ViewReport",
    "build_hf_model",
    "plan",
    "verify_shared",
]
__version__ = "0.1.0"
