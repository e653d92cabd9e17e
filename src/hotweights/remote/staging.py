"""A receiver's staging of one update: every round checked and held until the commit.

`Staged` is the `stage` callback a receiver hands to `Channel.receive`. It checks each
round against the model's tensor specs (HF names, dtype, shape: meta tensors are enough)
and keeps a copy of what the worker needs of it in host memory (pinned for a CUDA worker:
never a second copy of the update on the device), so nothing reaches the weights before
the commit, and an update refused or cut off half way is dropped whole. Given `shards`
(`remote.shards`: what this worker's parameters hold of each HF tensor), it keeps of each
piece only the part of the worker's TP shard, in the shard tensor's coordinates. At the
commit, `apply_in_place` writes those tensor by tensor into the parameters (a piece's data
reaches the device only while it is written); `patches()` turns the pieces of the tensors
without a shard into checkpoint-coordinate patches for a loader (vLLM's
``load_checkpoint_weight_patches``): one dense patch per tensor sent whole, one sparse patch
(flat indices and values) per tensor sent as element patches or rows.

Xor-coded patch values (``values="xor"``) of a tensor with a shard on the CPU stay xors
(``old ^ new``) and are applied at the commit, ``flat[idx] ^= xor`` in one compiled loop:
each old value is read once, there, not gathered at staging too (a scattered update's
staging on a server: ~25 ms less per 2.5 M changed elements). The others are decoded
against `old` as they are staged. Patch indices are held as int64 (what the commit's
``index_copy_`` and the loader take), as int32 where the compiled loop writes them on the
CPU: 6 bytes held per changed bf16 element, not 10.

Besides `delta_apply.checked`, a staged update is refused, naming the tensor, when a float
value is NaN or Inf (NaN marks "unchanged" in vLLM's sparse loader), or a tensor's pieces
(of any kind: `pack` may split rows into dense element ranges) do not come in increasing,
non-overlapping flat order. Xors kept as xors are not checked here (their new values exist
only at the commit): the sender checks the values it xor-codes (`RemoteGroup`).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

from hotweights.errors import DeltaError
from hotweights.remote import delta_apply, jit
from hotweights.remote.codec import XOR
from hotweights.remote.delta import DENSE, PATCH, _row_index
from hotweights.remote.packing import Round
from hotweights.remote.shards import Shard

__all__ = ["Patch", "Staged"]

logger = logging.getLogger(__name__)


class Patch(NamedTuple):
    """One tensor's update in checkpoint coordinates (the fields of vLLM's
    ``CheckpointWeightPatch``): dense when `indices` is None, else flat indices."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None


class Staged:
    """The rounds of one update, checked against `specs` and held (see the module doc).

    Args:
        specs: HF name -> a tensor of the model's dtype and shape (a meta tensor will do).
        old: HF name -> the tensor's current value (the live weights or views of them, any
            device), or the `Shard` of it that this worker holds:
            ``values="xor"`` patch pieces of a tensor without a CPU shard (or staged into
            pinned memory) are decoded against it when staged (the weights do not change
            until the commit), so the staged pieces hold new values. A round with such xor
            values for a tensor it lacks is refused.
        shards: HF name -> what this worker holds of it and where (`remote.shards.of`);
            only those parts are kept, and `apply_in_place` writes them. A tensor without
            one (or with one of another shape or dtype than its spec) is kept whole, for
            `patches`.
        pin: keep the staged data in pinned host memory (a CUDA worker's).
    Attributes:
        nbytes: bytes of staged data held.
        peak: the most bytes held since the last `clear`, counting the buffer of the round
            being staged (the channel's) on top.
        rounds: rounds staged so far.
    """

    def __init__(self, specs: Mapping[str, torch.Tensor], *,
                 old: Mapping[str, torch.Tensor] | None = None,
                 shards: Mapping[str, Shard] | None = None, pin: bool = False):
        self.specs, self.old, self.pin = specs, old, pin
        # written in place only where the slabs hold the spec's dtype (a remote engine's
        # specs follow the slabs vLLM keeps in a wider float: `delta_apply.widens`); the
        # loader casts into any other
        self.shards = {name: s for name, s in (shards or {}).items()
                       if name in specs and s.shape == tuple(specs[name].shape)
                       and s.dtype in (None, specs[name].dtype)}
        # the tensors whose xor values stay xors until the commit applies them in place;
        # not two names of one slab (tied weights sent under both): a second xor would undo
        # the first, while values written twice are the same values
        slabs = Counter(_storages(s) for s in self.shards.values())
        self._bare = frozenset(name for name, s in self.shards.items() if not pin and (
            not s.runs or s.dests[0][0].device.type == "cpu" and slabs[_storages(s)] == 1)
        ) if jit.enabled() else ()
        self.nbytes = self.peak = self.rounds = 0
        self._pieces: dict[str, list[tuple]] = {}  # name -> [(entry, host tensors)]
        self._writes: dict[str, list] = {}  # name -> its pieces' writes, made ready
        # (`delta_apply.writer`) for a tensor whose shard writes straight into one slab
        self._next: dict[str, int] = {}  # per tensor: the first flat element not yet staged

    def __call__(self, r: Round) -> None:
        # the channel reuses its buffer for the next round: what is kept is copied
        held, pieces = 0, []
        for e, t, views in delta_apply.checked(r, self.specs, old=self.old, bare=self._bare):
            name, kind = e["name"], e["kind"]
            decoded = "sections" in e  # a compact patch: fresh tensors, not buffer views
            bare = decoded and e["values"] == XOR and name in self._bare
            start, stop = self._span(e, t, views, decoded)
            if start < stop:  # (an empty piece writes nothing: it may come anywhere)
                if start < self._next.get(name, 0):
                    raise DeltaError(f"`{name}`: a {kind} piece starts at element {start}, "
                                     "before the end of the pieces staged before it; refused")
                self._next[name] = stop
            # the indices as the commit takes them, made here while the server still serves,
            # not while it is paused: int32 where the compiled loop writes them (half the
            # memory held), else int64 (index_copy_, the loader)
            narrow = kind == PATCH and delta_apply.narrow(name, t, self._bare)
            if kind == PATCH and not narrow:
                views = (views[0].to(torch.int64), views[1])
            shard = self.shards.get(name)
            for ce, cv in shard.cut(e, views) if shard is not None else [(e, views)]:
                if narrow:
                    cv = (cv[0].to(torch.int32), cv[1])
                # checked once cut: a TP worker decodes xor values it does not hold
                # against 0 (`Shard.gather`), whatever they make
                if bare:
                    ce = {**ce, "xor": True}  # applied to the old values by the commit
                elif kind != DENSE and t.dtype.is_floating_point and \
                        not delta_apply.finite(cv[-1]):
                    raise DeltaError(f"`{name}`: the {kind} values hold NaN or Inf; refused")
                kept = cv if decoded and not self.pin else tuple(self._keep(v) for v in cv)
                held += sum(v.nbytes for v in kept)
                pieces.append((name, shard, (ce, kept)))
        for name, shard, (e, views) in pieces:  # the round is all checked: kept
            if (target := shard.target if shard is not None else None) is not None:
                self._writes.setdefault(name, []).append(delta_apply.writer(e, target, views))
            else:
                self._pieces.setdefault(name, []).append((e, views))
        self.nbytes += held
        self.peak = max(self.peak, self.nbytes + r.buffer.nbytes)
        self.rounds += 1

    def _keep(self, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(v.shape, dtype=v.dtype, pin_memory=self.pin)
        return out.copy_(v)

    @staticmethod
    def _span(e: dict, t: torch.Tensor, views: tuple, decoded: bool) -> tuple[int, int]:
        """The flat elements [first, last + 1) a piece writes; (0, 0) if none. Indices and
        row ranges must increase within a piece (`decoded` ones do by construction)."""
        if e["kind"] == DENSE:
            return e["start"], e["stop"]
        index = delta_apply.host(views[0])
        if not len(index):
            return 0, 0
        if e["kind"] == PATCH:
            ok, first, last = decoded or bool((index[1:] > index[:-1]).all()), index[0], \
                index[-1]
        else:
            ok = bool((index[1:, 0] >= index[:-1, 1]).all())
            row = math.prod(t.shape[1:])
            first, last = index[0, 0] * row, index[-1, 1] * row - 1
        if not ok:
            raise DeltaError(f"`{e['name']}`: the {e['kind']} "
                             f"{'indices' if e['kind'] == PATCH else 'ranges'} do not "
                             "increase; refused")
        return int(first), int(last) + 1

    def apply_in_place(self) -> set[str]:
        """Write every staged tensor with a shard into the parameter slabs that hold it,
        tensor by tensor: O(what changed). Returns the names written."""
        done = self._writes.keys() | (self._pieces.keys() & self.shards.keys())
        for name in done:  # each tensor's staged data freed once written
            for write in self._writes.pop(name, ()):
                write()
            if name in self._pieces:
                self.shards[name].write(self._pieces.pop(name))
        return done

    def patches(self) -> Iterator[Patch]:
        """One patch per staged tensor without a shard, each taken out of the staging as it
        is made (its pieces go once the caller lets go of the patch: one tensor's index
        arrays at a time): dense where a tensor came whole (the held values if in one
        piece), else flat indices and values; on the host."""
        for name in [n for n in self._pieces if n not in self.shards]:
            pieces = self._pieces.pop(name)
            spec = self.specs[name]
            shape, row = tuple(spec.shape), spec[0].numel() if spec.dim() else 1
            if all(e["kind"] == DENSE for e, _ in pieces) and \
                    sum(v.numel() for _, (v,) in pieces) == spec.numel():
                yield Patch(name, shape, spec.dtype, _cat([v for _, (v,) in pieces]))
                continue
            idx, vals = [], []
            for e, views in pieces:
                dev = views[0].device
                if e["kind"] == DENSE:
                    idx.append(torch.arange(e["start"], e["stop"], device=dev))
                elif e["kind"] == PATCH:
                    idx.append(views[0].to(torch.int64))
                else:
                    cols = torch.arange(row, dtype=torch.int64, device=dev)
                    idx.append((_row_index(views[0])[:, None] * row + cols).view(-1))
                vals.append(views[-1].reshape(-1))
            del pieces
            yield Patch(name, shape, spec.dtype, _cat(vals), _cat(idx))

    def clear(self) -> None:
        self.__init__(self.specs, old=self.old, shards=self.shards, pin=self.pin)

    def fresh(self) -> Staged:
        """An empty staging of the same specs: another object."""
        return Staged(self.specs, old=self.old, shards=self.shards, pin=self.pin)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _storages(shard: Shard) -> frozenset[tuple[str, int, int]]:
    """Where `shard`'s slabs lie: (device, address, bytes) of each (one shared file holds
    every weight of a server: its storage tells none apart)."""
    return frozenset((str(t.device), t.data_ptr(), t.nbytes)
                     for dests in shard.dests for t in dests)
