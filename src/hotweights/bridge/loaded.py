"""Check a model of views against the checkpoint its server loaded.

The layout maps by names and shapes. A loader that reorders a tensor's contents but keeps
its name and shape (vLLM's Bloom and GPT-NeoX regroup a fused `query_key_value` per head;
some MoE kernels store gate and up swapped) would map as a view of the wrong order, which
no name or shape tells: the trainer would train, and the server serve, weights whose rows
mean other things. While the server still serves what it loaded (version 0), every view
must hold what the checkpoint holds for it; a spread of rows of each is compared.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator

import torch

from hotweights.checkpoint.names import reverted
from hotweights.checkpoint.source import Tensors, open_dir
from hotweights.errors import CheckpointError, LayoutError

logger = logging.getLogger(__name__)

_ROWS = 32  # rows compared per tensor (and experts, and rows of each)
_RUN = 256  # elements of each run compared of a large 1-D tensor
_WHOLE = 1 << 16  # a tensor of no more elements is compared whole
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _spread(n: int, m: int = _ROWS) -> torch.Tensor:
    """`m` indices below `n` at the middles of equal strides (the first and the last row
    are what most regroupings leave in place); all of them if `n <= m`."""
    if n <= m:
        return torch.arange(n)
    return torch.tensor([(2 * k + 1) * n // (2 * m) for k in range(m)])


def _sample(t: torch.Tensor) -> torch.Tensor:
    """A spread of `t`'s rows (of their rows on a second dim too, and runs of a long 1-D
    tensor), the same for every tensor of its shape; never more than a few rows' worth."""
    if t.numel() <= _WHOLE or t.dim() == 0:
        return t
    if t.dim() == 1:
        runs = _spread(t.shape[0] - _RUN, 8)[:, None] + torch.arange(_RUN)
        return t[runs.flatten().to(t.device)]
    rows = _spread(t.shape[0]).to(t.device)
    if t.dim() == 2:
        return t[rows]
    return t[rows[:, None], _spread(t.shape[1]).to(t.device)[None, :]]


def _differs(live: torch.Tensor, disk: torch.Tensor) -> bool:
    """Whether `live` is not `disk` as the server loads it (cast to the served dtype)."""
    want = disk.to(live.dtype).float()
    return not torch.allclose(live.float(), want, rtol=1e-2, atol=1e-6, equal_nan=True)


def _pairs(model: torch.nn.Module, disk: Tensors, wanted: set[str] | None
           ) -> Iterator[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """(parameter, checkpoint name, live, stored): each checkpoint tensor a parameter is
    saved as, under its own name or as transformers converts it on save (per-expert
    tensors of fused experts: a spread of the experts, converted alone)."""
    for name, param in model.named_parameters():
        if wanted is not None and name not in wanted:
            continue
        live = param.detach()
        if (stored := disk.get(name)) is not None and stored.shape == live.shape:
            yield name, name, live, stored
            continue
        experts = None
        if live.dim() == 3 and ".experts." in name:
            experts = _spread(live.shape[0], 8)
            live = live[experts.to(live.device)]
        try:
            saved = reverted({name: live}, model=model)
        except CheckpointError:
            continue
        for key, part in saved.items():
            if experts is not None:  # experts.K of the spread is experts.experts[K]
                key = _EXPERT.sub(lambda m, e=experts: f".experts.{int(e[int(m[1])])}.", key)
            if (stored := disk.get(key)) is not None and stored.shape == part.shape:
                yield name, key, part, stored


def check_loaded(model: torch.nn.Module, model_dir: str | os.PathLike,
                 names: Iterable[str] | None = None) -> int:
    """Raise if a parameter of `model` differs from the checkpoint tensor it is saved as.

    Only while the server serves what it loaded from `model_dir` is this meaningful.
    Parameters the checkpoint holds under no name or shape found here are not compared
    (a warning counts them).

    Args:
        model: the HF model of views (`build_hf_model`).
        model_dir: the safetensors checkpoint the server loaded.
        names: the parameters to check (default: all; leave out zeros of `allow_missing`).

    Returns:
        How many parameters were compared (0 when `model_dir` holds no safetensors that
        can be read here: nothing to compare with, a warning).

    Raises:
        LayoutError: naming the parameters that differ, the checkpoint, the architecture.
    """
    where = os.fspath(model_dir)
    try:
        disk = open_dir(model_dir, skip_unknown=True)  # the others are still compared
    except CheckpointError as e:
        logger.warning("views not compared with the checkpoint the server loaded: %s", e)
        return 0
    wanted = None if names is None else set(names)
    compared: set[str] = set()
    wrong: dict[str, str] = {}  # parameter -> the checkpoint tensor it differs from
    try:
        for name, key, live, stored in _pairs(model, disk, wanted):
            compared.add(name)
            if name not in wrong and _differs(_sample(live).cpu(), _sample(stored)):
                wrong[name] = key
    finally:
        disk.close()
    total = sum(1 for n, _ in model.named_parameters() if wanted is None or n in wanted)
    if wrong:
        raise LayoutError(_message(model, where, wrong, len(compared)))
    if len(compared) < total:
        logger.warning("views compared with %s: %d of %d parameters (the others are saved "
                       "under names or shapes not found there)", where, len(compared), total)
    else:
        logger.info("views compared with %s: %d parameters equal", where, len(compared))
    return len(compared)


def _message(model: torch.nn.Module, where: str, wrong: dict[str, str], compared: int) -> str:
    config = getattr(model, "config", None)  # any module: a transformers model has one
    arch = ", ".join(getattr(config, "architectures", None) or ["?"])
    named = ", ".join(f"{n} ({k})" if k != n else n for n, k in list(wrong.items())[:3])
    head = (f"{len(wrong)} of {compared} views compared hold other values than {where} "
            f"holds for them: {named}{f' and {len(wrong) - 3} more' if len(wrong) > 3 else ''}. ")
    regrouped = {n.rpartition(".")[0] for n in wrong if not _flat(model, n)}
    if len(wrong) == compared or any(_flat(model, n) and n.rpartition(".")[0] not in regrouped
                                     for n in wrong):  # a norm, a lone bias: not a loader's
        return head + ("The server does not serve this checkpoint as it is now: another "
                       "revision, weights loaded otherwise (--load-format dummy), or the "
                       "directory rewritten since the server loaded it. To build the model "
                       "all the same: bridge.model(check_loaded=False)")
    return head + (f"vLLM's loader of {arch} stores them in another order than the "
                   "checkpoint (same name and shape), which hotweights does not map: training "
                   "them would train the wrong rows. Only if the directory was rewritten since "
                   "the server loaded it: bridge.model(check_loaded=False)")


def _flat(model: torch.nn.Module, name: str) -> bool:
    """Whether a parameter has one dim (a norm or a bias: a loader regroups one only with
    its module's weight, as Bloom's does its query_key_value's)."""
    return model.get_parameter(name).dim() <= 1
