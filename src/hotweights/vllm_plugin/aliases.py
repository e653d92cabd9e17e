"""vLLM parameters that are views into another parameter's bytes (multi-head latent
attention's `W_UV` and `W_UK_T`, views of `kv_b_proj`): one copy of the weights under two
names. They are shared, and mapped, through the parameter that holds them."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def aliases(params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Alias name -> the name of the parameter whose bytes hold all of its own: a
    contiguous one of the same dtype and device (the first by name where two are the same
    view)."""
    spans = []  # (where, first element, last element + 1, not contiguous, name)
    for name, t in params.items():
        if t.numel():
            last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(),
                                                                       strict=True))
            where = (t.device, t.dtype, t.untyped_storage().data_ptr())
            spans.append((where, t.storage_offset(), last + 1, not t.is_contiguous(), name))
    out: dict[str, str] = {}
    holder = None  # the contiguous span that holds the ones after it, while they lie in it
    for where, lo, hi, loose, name in sorted(spans, key=lambda s: (str(s[0]), s[1], -s[2],
                                                                  s[3], s[4])):
        if holder is not None and holder[0] == where and lo >= holder[1] and hi <= holder[2]:
            out[name] = holder[3]
        elif not loose:
            holder = (where, lo, hi, name)
    return out


def owned(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`params` but for the aliases: each weight once, under the name that holds it."""
    alias_of = aliases(params)
    return {name: t for name, t in params.items() if name not in alias_of}


def rebased(alias: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`alias`, a view into `old`'s bytes, as the same view into `new` (`old`'s bytes
    moved: the same shape and layout elsewhere)."""
    return new.as_strided(alias.shape, alias.stride(),
                          new.storage_offset() + alias.storage_offset() - old.storage_offset())
