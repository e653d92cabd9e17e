"""hotweights: train an LLM in place while vLLM serves it — one copy of the weights."""

from hotweights.errors import HotweightsError, LayoutError
from hotweights.layout import Layout, Piece, plan
from hotweights.views import ViewReport, build_hf_model, verify_shared

__all__ = [
    "HotweightsError",
    "Layout",
    "LayoutError",
    "Piece",
    "ViewReport",
    "build_hf_model",
    "plan",
    "verify_shared",
]
__version__ = "0.1.0"
