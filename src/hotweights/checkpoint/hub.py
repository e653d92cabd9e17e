"""Where a model named by hub id lies on this machine: its snapshot in the Hugging Face cache,
found offline (nothing is downloaded)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["local_dir"]


def local_dir(model: str, revision: str | None = None,
              cache_dir: str | None = None) -> str | None:
    """`model` itself when it is a directory, else the cached snapshot of hub id `model` at
    `revision` (default: the cache's ``main``) in `cache_dir` (vLLM's `--download-dir`;
    default: the Hugging Face cache), else None (not downloaded here yet)."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                 local_files_only=True)
    except Exception as e:  # not cached, not a hub id, no huggingface_hub: no snapshot
        logger.debug("hotweights: no local snapshot of %s (revision %s): %r", model, revision,
                     e)
        return None
