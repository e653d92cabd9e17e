"""What a tensor-parallel worker holds of each HF tensor, and delta pieces cut down to it.

A worker at TP rank r holds, of every HF tensor, runs of indices on one dim (`layout.plan`'s
pieces: its row chunk of q / k / v / gate / up, its column chunk of o / down, its vocab
range; a norm whole). `Shard` names them and the parameter slabs that hold them; its *shard
tensor* is the held runs stacked on that dim, in order. `Shard.cut` translates one checked
delta piece (`delta_apply.checked`'s entry and views) from HF coordinates to the shard
tensor's, dropping what the worker does not hold: dense element ranges keep the held
elements (full blocks of the split dim through one strided copy), row runs along the split
dim are clipped to the held rows and along another dim keep the held columns, patch
indices are filtered and re-based. `Shard.write` writes cut pieces into the slabs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from hotweights.errors import LayoutError
from hotweights.layout.plan import Layout
from hotweights.layout.views import slab_of
from hotweights.remote import delta_apply
from hotweights.remote.delta import DENSE, PATCH, ROWS, _row_index, values_at

__all__ = ["Shard", "of", "whole"]

Checked = tuple[dict, tuple]  # (entry, views), as `delta_apply.checked` gives them


@dataclass(frozen=True, eq=False)
class Shard:
    """The runs of one HF tensor (of `shape`) that a worker holds on `dim`.

    Attributes:
        shape: the HF tensor's.
        dim: the dim it is split on (0 for a tensor held whole).
        runs: [(HF start, length)] on `dim`, increasing and disjoint; () if it holds none.
        dests: per run, the parameter slabs (views of the live weights) that hold it.
    """

    shape: tuple[int, ...]
    dim: int
    runs: tuple[tuple[int, int], ...]
    dests: tuple[tuple[torch.Tensor, ...], ...] = ()

    @property
    def whole(self) -> bool:
        return self.runs == ((0, self.shape[self.dim] if self.shape else 1),)

    @property
    def held(self) -> tuple[int, ...]:
        """The shard tensor's shape."""
        if not self.shape:  # a scalar (0-d) tensor: held whole
            return ()
        return (*self.shape[:self.dim], sum(n for _, n in self.runs), *self.shape[self.dim + 1:])

    def cut(self, e: dict, views: tuple) -> list[Checked]:
        """One checked piece of the HF tensor as pieces of the shard tensor (none if the
        worker holds none of it): fresh tensors or views of `views`, same kinds."""
        if self.whole:
            return [(e, views)]
        if not self.runs:
            return []
        if e["kind"] == DENSE:
            return self._dense(e, views[0])
        if e["kind"] == PATCH:
            return self._patch(e, *views)
        return self._rows(e, *views)

    def _geometry(self) -> tuple[int, int, int]:
        """(elements per block of the split dim and those after it, in the HF tensor and in
        the shard tensor; elements after the split dim)."""
        inner = math.prod(self.shape[self.dim + 1:])
        return self.shape[self.dim] * inner, self.held[self.dim] * inner, inner

    def _offsets(self) -> list[int]:
        return [sum(n for _, n in self.runs[:k]) for k in range(len(self.runs))]

    def _dense(self, e: dict, v: torch.Tensor) -> list[Checked]:
        block, sblock, inner = self._geometry()
        start, stop = e["start"], e["stop"]
        out: list[Checked] = []

        def partial(lo: int, hi: int) -> None:  # [lo, hi) inside one block
            o = lo // block
            for (a, n), at in zip(self.runs, self._offsets(), strict=True):
                x0, x1 = max(lo, o * block + a * inner), min(hi, o * block + (a + n) * inner)
                if x0 < x1:
                    y0 = o * sblock + at * inner + x0 - o * block - a * inner
                    out.append(({"name": e["name"], "kind": DENSE, "start": y0,
                                 "stop": y0 + x1 - x0}, (v[x0 - start:x1 - start],)))

        first, last = -(-start // block), stop // block  # the whole blocks [first, last)
        if first > last:
            partial(start, stop)
            return out
        if start < first * block:
            partial(start, first * block)
        if first < last:  # whole blocks: the held runs of each, in one strided copy
            m = v[first * block - start:last * block - start].view(last - first, -1, inner)
            held = torch.cat([m[:, a:a + n] for a, n in self.runs], 1).view(-1)
            out.append(({"name": e["name"], "kind": DENSE, "start": first * sblock,
                         "stop": last * sblock}, (held,)))
        if last * block < stop:
            partial(last * block, stop)
        return out

    def _patch(self, e: dict, idx: torch.Tensor, vals: torch.Tensor) -> list[Checked]:
        block, sblock, inner = self._geometry()
        lut = torch.full((self.shape[self.dim],), -1, dtype=torch.int64, device=idx.device)
        for (a, n), at in zip(self.runs, self._offsets(), strict=True):
            lut[a:a + n] = torch.arange(at, at + n, device=idx.device)
        idx = idx.to(torch.int64)
        o, rest = idx.div(block, rounding_mode="floor"), idx.remainder(block)
        j = lut[rest.div(inner, rounding_mode="floor")]
        keep = j >= 0
        if not bool(keep.any()):
            return []
        new = (o * sblock + j * inner + rest.remainder(inner))[keep]  # increasing still
        return [({"name": e["name"], "kind": PATCH}, (new, vals[keep]))]

    def _rows(self, e: dict, ranges: torch.Tensor, rows: torch.Tensor) -> list[Checked]:
        if self.dim:  # whole rows of a tensor split on another dim: the held columns
            held = torch.cat([rows.narrow(self.dim, a, n) for a, n in self.runs], self.dim)
            return [(e, (ranges, held))]
        starts, stops = ranges[:, 0], ranges[:, 1]
        pos = torch.cumsum(stops - starts, 0) - (stops - starts)  # each run's first row
        out_ranges, out_rows = [], []
        for (a, n), at in zip(self.runs, self._offsets(), strict=True):
            lo, hi = starts.clamp(min=a), stops.clamp(max=a + n)
            keep = lo < hi
            if bool(keep.any()):
                lo, hi, first = lo[keep], hi[keep], (pos + lo - starts)[keep]
                out_ranges.append(torch.stack([lo - a + at, hi - a + at], 1))
                src = torch.stack([first, first + hi - lo], 1)
                out_rows.append(rows.index_select(0, _row_index(src).to(rows.device)))
        if not out_ranges:
            return []
        return [({"name": e["name"], "kind": ROWS}, (torch.cat(out_ranges),
                                                      torch.cat(out_rows)))]

    @property
    def dtype(self) -> torch.dtype | None:
        """The slabs' dtype; None for a shard holding nothing."""
        return self.dests[0][0].dtype if self.runs else None

    def gather(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The live values at HF flat indices `idx` (int64) as `dtype`, 0 where this worker
        holds none: what xor-coded values decode against here (`Staged`: those elements are
        cut away before anything is kept)."""
        if not self.runs:
            return torch.zeros(len(idx), dtype=dtype)
        block, _, inner = self._geometry()
        idx = idx.to(self.dests[0][0].device)
        o, rest = idx.div(block, rounding_mode="floor"), idx.remainder(block)
        row, within = rest.div(inner, rounding_mode="floor"), rest.remainder(inner)
        out = torch.zeros(len(idx), dtype=dtype, device=idx.device)
        for (a, n), dests in zip(self.runs, self.dests, strict=True):  # each in its slab
            j = row - a
            held = (j >= 0) & (j < n)
            at = torch.where(held, o * (n * inner) + j * inner + within, 0)
            out = torch.where(held, values_at(dests[0].detach(), at).to(dtype), out)
        return out

    @property
    def target(self) -> torch.Tensor | None:
        """The one slab cut pieces are written straight into (one run, held by one
        contiguous slab), else None: `write` then goes through a shard-sized tensor."""
        if len(self.runs) == 1 and len(self.dests[0]) == 1 and self.dests[0][0].is_contiguous():
            return self.dests[0][0]
        return None

    def write(self, pieces: Iterable[Checked]) -> None:
        """Write cut pieces (any device) into the slabs: straight into a contiguous one,
        else through one shard-sized tensor on the slabs' device."""
        if not self.runs:
            return
        first = self.dests[0][0]
        if len(self.runs) == 1 and first.is_contiguous():
            target = first
        else:
            target = torch.cat([d[0] for d in self.dests], self.dim)
        for e, views in pieces:
            delta_apply.write(e, target, views)
        at = 0
        for (_, n), dests in zip(self.runs, self.dests, strict=True):
            for d in dests:
                if d is not target:
                    d.copy_(target.narrow(self.dim, at, n))
            at += n


def whole(t: torch.Tensor) -> Shard:
    """The shard of a tensor held whole by `t` (contiguous, of the HF shape)."""
    return Shard(tuple(t.shape), 0, ((0, t.shape[0] if t.dim() else 1),), ((t,),))


def of(layout: Layout, params: Mapping[str, torch.Tensor],
       shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Shard]:
    """HF name -> its `Shard` on the layout's rank, for each of `names` the layout maps.

    Args:
        layout: `layout.plan(...)` for this worker's parameters, tp_size and tp_rank.
        params: vLLM name -> the live parameter (its slabs become the dests).
        shapes: HF name -> shape, every name the plan knew (aliases included): one that no
            piece on this rank holds, and the layout does not list as missing, is a shard
            holding nothing (a rank of vocabulary padding only).
    Raises:
        LayoutError: an HF tensor whose pieces are split on two dims or overlap.
    """
    out: dict[str, Shard] = {}
    for hf_name, held in layout.inverse().items():
        dims = {p.hf_dim for _, p in held}
        if len(dims) > 1:
            raise LayoutError(f"{hf_name}: held split on dims {sorted(dims)}; one expected")
        by_run: dict[tuple[int, int], list[torch.Tensor]] = {}
        for vname, p in held:
            n = p.rows[1] - p.rows[0]
            by_run.setdefault((p.hf_start, n), []).append(slab_of(params[vname].detach(), p))
        runs = sorted(by_run)
        for (a, n), (b, _) in itertools.pairwise(runs):
            if a + n > b:
                raise LayoutError(f"{hf_name}: held runs [{a}, {a + n}) and [{b}, ...) "
                                  "overlap")
        out[hf_name] = Shard(held[0][1].hf_shape, dims.pop(), tuple(runs),
                             tuple(tuple(by_run[r]) for r in runs))
    for name in set(shapes) - set(out) - set(layout.missing):
        out[name] = Shard(tuple(shapes[name]), 0, ())
    return out
