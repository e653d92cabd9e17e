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
        RemoteError: a server holds a tensor in a float narrower than the trainer's and
            another in another dtype (not one model served alike), naming both.
    """
    held = {url: (st["dtypes"].get("default"), st["dtypes"].get("others") or {})
            for url, st in status.items() if isinstance(st.get("dtypes"), dict)}  # (an
    casts = {}  # older server names none)
    for name, t in new.items():
        wants = {url: w for url, (default, others) in held.items()
                 if (w := _dtype(others.get(name, default))) is not None}
        narrower = {url: w for url, w in wants.items() if widens(w, t.dtype)}
        if not narrower:
            continue
        url, want = next(iter(narrower.items()))
        if other := next(((u, w) for u, w in wants.items() if w != want), None):
            raise RemoteError(f"`{name}`: {url} holds it in {want}, {other[0]} in {other[1]} "
                              f"(the trainer's is {t.dtype}): serve the model in one dtype on "
                              "every server")
        casts[name] = want
    return casts


class Cast(Mapping):
    """`tensors` read in the dtypes `casts` names (each a copy, made as it is read): the
    values a server holds that rounded them so as it loaded them."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], casts: Mapping[str, torch.dtype]):
        self.tensors, self.casts = tensors, casts

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        return t.to(self.casts[name]) if name in self.casts else t

    def __contains__(self, name: object) -> bool:  # (Mapping's would make the copy)
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def _dtype(name: object) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None
