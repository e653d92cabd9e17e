"""What this vLLM build can serve here with hotweights (demo, tests, benchmarks)."""

from __future__ import annotations


def unservable(arch: str) -> str | None:
    """Why this vLLM CPU build cannot serve the tiny model `arch` here, or None."""
    if arch == "qwen3_5":
        try:
            import vllm.model_executor.models.qwen3_5  # noqa: F401
        except (ImportError, RuntimeError, OSError) as e:  # torchvision: docs/qwen3_5.md
            return f"vLLM's Qwen3.5 module cannot be imported here ({e}); see docs/qwen3_5.md"
    return None
