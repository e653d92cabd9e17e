"""A trainer's weights in the dtypes its `--remote` servers hold them in.

A float32 trainer updates servers that serve its model in bf16 (vLLM's ``dtype="auto"``
serves a float32 checkpoint so) as vLLM's loader loads a checkpoint: each float32 value
rounded to the nearest bf16 (``Tensor.to``). A tensor a server keeps in float32 (GDN's
``A_log``, some routers) stays float32. The trainer then encodes, sends and remembers
exactly what the servers hold, so the next update's delta is taken against it.

Each server names the dtype it holds each tensor in (``dtypes`` in its status: the
model's served dtype and the tensors held in another one). A server that does not says
nothing here: it takes what it is sent, in its own dtype or a float it widens exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hotweights.errors import RemoteError
from hotweights.remote.delta_apply import widens


def narrowed_to(status: Mapping[str, dict], new: Mapping[str, torch.Tensor]
                ) -> dict[str, torch.dtype]:
    """Name -> the narrower float every server of `status` holds that tensor of `new` in;
    the tensors the servers hold in their own dtype (or a wider float) are left out.

    Raises:
        RemoteError: two servers hold a tensor in different floats narrower than the
            trainer's (not one model served alike), naming both.
    """
    casts: dict[str, tuple[torch.dtype, str]] = {}
    for url, st in status.items():
        held = st.get("dtypes")
        if not isinstance(held, dict):  # an older server
            continue
        default, others = held.get("default"), held.get("others") or {}
        for name, t in new.items():
            want = _dtype(others.get(name, default))
            if want is None or not widens(want, t.dtype):
                continue
            if name in casts and casts[name][0] != want:
                other, where = casts[name]
                raise RemoteError(f"`{name}`: {where} holds it in {other}, {url} in {want}: "
                                  "serve the model in one dtype on every server")
            casts[name] = (want, url)
    return {name: dtype for name, (dtype, _) in casts.items()}


def cast(new: Mapping[str, torch.Tensor], casts: Mapping[str, torch.dtype]
         ) -> dict[str, torch.Tensor]:
    """`new` with each tensor named in `casts` rounded to its dtype (a copy of it)."""
    return {k: t.to(casts[k]) if k in casts else t for k, t in new.items()}


def _dtype(name: object) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None
