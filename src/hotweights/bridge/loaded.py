"""Check a model of views against the checkpoint its server loaded.

The layout maps by names and shapes. A loader that reorders a tensor's contents but keeps
its name and shape (vLLM's Bloom and GPT-NeoX regroup a fused `query_key_value` per head)
would map as a view of the wrong order, which no name or shape tells: the trainer would
train, and the server serve, weights whose rows mean other things. While the server still
serves what it loaded (version 0), every view must hold what the checkpoint holds for its
name; a few rows of each are compared.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch

from hotweights.checkpoint.source import open_dir
from hotweights.errors import CheckpointError, LayoutError

logger = logging.getLogger(__name__)

_ROWS = 8  # rows compared per tensor, evenly spread (first and last among them)
_WHOLE = 1 << 16  # a tensor of no more elements is compared whole


def _spread(n: int) -> list[int]:
    return sorted({round(i * (n - 1) / (_ROWS - 1)) for i in range(_ROWS)})


def _samples(t: torch.Tensor) -> list[tuple]:
    """Indices into `t` that together read a spread of its rows (and of their columns on
    a third dim: an expert's rows), never more than a few rows' worth."""
    if t.numel() <= _WHOLE or t.dim() == 0:
        return [()]
    if t.dim() == 1:
        return [(torch.tensor(_spread(t.shape[0])),)]
    if t.dim() == 2:
        return [(i,) for i in _spread(t.shape[0])]
    return [(i, j) for i in _spread(t.shape[0]) for j in _spread(t.shape[1])]


def _differs(live: torch.Tensor, disk: torch.Tensor) -> bool:
    """Whether `live` is not `disk` as the server loads it (cast to the served dtype)."""
    want = disk.to(live.dtype).float()
    return not torch.allclose(live.float(), want, rtol=1e-2, atol=1e-6, equal_nan=True)


def check_loaded(model: torch.nn.Module, model_dir: str | os.PathLike,
                 names: Iterable[str] | None = None) -> int:
    """Raise if a parameter of `model` differs from the checkpoint tensor of its name.

    Only while the server serves what it loaded from `model_dir` is this meaningful.
    Parameters whose name or shape the checkpoint does not have (transformers converts
    them on load: fused experts) are not checked.

    Args:
        model: the HF model of views (`build_hf_model`).
        model_dir: the safetensors checkpoint the server loaded.
        names: the parameters to check (default: all; leave out zeros of `allow_missing`).

    Returns:
        How many parameters were compared (0 when `model_dir` holds no safetensors that
        can be read here: nothing to compare with, logged).

    Raises:
        LayoutError: naming the parameters that differ, the checkpoint, the architecture.
    """
    try:
        disk = open_dir(model_dir)
    except CheckpointError as e:
        logger.info("views not compared with the checkpoint: %s", e)
        return 0
    wanted = None if names is None else set(names)
    checked, wrong = 0, []
    try:
        for name, param in model.named_parameters():
            stored = disk.get(name)
            if (wanted is not None and name not in wanted or stored is None
                    or tuple(stored.shape) != tuple(param.shape)):
                continue
            live = param.detach()
            if any(_differs(live[i].cpu(), stored[i]) for i in _samples(live)):
                wrong.append(name)
            checked += 1
    finally:
        disk.close()
    if wrong:
        arch = ", ".join(getattr(model.config, "architectures", None) or ["?"])
        raise LayoutError(
            f"{len(wrong)} view(s) hold other values than {os.fspath(model_dir)} holds for "
            f"them: {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}. vLLM's loader of "
            f"{arch} stores them in another order than the checkpoint (same name and shape), "
            "which hotweights does not map: training them would train the wrong rows. If the "
            "server's weights or the checkpoint changed since it loaded, pass "
            "check_loaded=False")
    logger.info("views compared with %s: %d parameters equal", os.fspath(model_dir), checked)
    return checked
