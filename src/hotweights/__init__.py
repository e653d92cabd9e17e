"""hotweights: train an LLM in place while vLLM serves it — one copy of the weights."""

from hotweights.bridge import Bridge
from hotweights.errors import (
    HotweightsError,
    LayoutError,
    ManifestError,
    RemoteError,
    ServerError,
)
from hotweights.layout import Layout, Piece, plan
from hotweights.remote.group import RemoteGroup
from hotweights.views import ViewReport, build_hf_model, verify_shared

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
