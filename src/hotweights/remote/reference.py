"""What a trainer knows the servers hold (`RemoteGroup`'s default ``reference="copy"``): a
host copy of the tensors an update may change, fingerprints of the others.

The deltas are taken against `Reference.tensors`; after each commit `remember` writes into
it only what changed. A tensor that "cannot change" (frozen: `trainable`, or
``requires_grad=False``) costs its fingerprints only; if it changes anyway it is sent whole
(a warning names it) and copied from then on.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from hotweights.checkpoint.names import reverted
from hotweights.errors import RemoteError
from hotweights.layout.plan import model_weights
from hotweights.remote import delta, prefilter

__all__ = ["Reference"]

logger = logging.getLogger(__name__)


class Reference:
    """The old values the servers that are up to date hold.

    Args:
        trainable: names or `fnmatch` patterns of the only tensors an update may change
            (default: a model's parameters that require grad, else every tensor).
    """

    def __init__(self, trainable: str | Iterable[str] | None = None):
        self.trainable = None if trainable is None else (
            (trainable,) if isinstance(trainable, str) else tuple(trainable))
        self.tensors: dict[str, torch.Tensor] | None = None  # None: nothing sent yet
        self.frozen_prints: prefilter.Prints = {}  # of the frozen tensors, not copied

    def frozen(self, weights: torch.nn.Module | Mapping[str, torch.Tensor],
               new: dict[str, torch.Tensor]) -> set[str]:
        """The names of `new` (checkpoint names of `weights`) an update cannot change."""
        if self.trainable is not None:
            if bad := [p for p in self.trainable if not fnmatch.filter(new, p)]:
                raise RemoteError(f"field 'trainable': {bad} match(es) no tensor of the "
                                  f"weights (e.g. {sorted(new)[:3]})")
            return {k for k in new if not any(fnmatch.fnmatchcase(k, p)
                                               for p in self.trainable)}
        if isinstance(weights, torch.nn.Module):  # buffers too (none requires grad)
            if fixed := {n: t.to("meta") for n, t in model_weights(weights).items()
                         if not t.requires_grad}:  # names only (meta: no conversion copies)
                return set(reverted(fixed, model=weights)) & set(new)
        return set()

    def kept(self, new: dict[str, torch.Tensor], frozen: set[str], held: bool
             ) -> tuple[set[str], prefilter.Prints]:
        """(the tensors that cannot change left out of the deltas to the servers holding
        `tensors`: their fingerprints say they did not change, the fingerprints of the
        tensors that cannot change, once the servers hold them). `held`: a server holds
        `tensors`. A tensor that cannot change and did is sent whole (named)."""
        frozen = frozen - set(self.tensors or ())  # copied already: as any other
        frozen_prints = prefilter.fingerprints({k: new[k] for k in frozen})
        if not held:
            return set(), frozen_prints
        kept = frozen - _changed(self.frozen_prints, frozen_prints,
                                 "sent whole, and copied from now on")
        return kept, {k: frozen_prints[k] for k in kept}

    def remember(self, new: dict[str, torch.Tensor], deltas: list[delta.Delta] | None,
                 frozen: prefilter.Prints) -> None:
        """Make `tensors` (and the fingerprints of the tensors not copied, `frozen`) what
        the servers now hold: only what changed is written (`deltas`, taken against it;
        None: copied whole)."""
        self.frozen_prints = frozen
        if deltas is None or self.tensors is None:
            old, self.tensors = self.tensors or {}, {}  # the old copies are reused or let
            for k, t in new.items():  # go as the new ones are made: never two at once
                if k not in frozen:
                    self.tensors[k] = _host_copy(t, old.pop(k, None))
            return
        for d in deltas:
            if d.name in frozen:
                continue
            if d.name not in self.tensors:  # could not change, did: copied from now on
                self.tensors[d.name] = _host_copy(new[d.name])
                continue
            ref = self.tensors[d.name]
            if d.kind == delta.PATCH:
                delta.index_copy(ref.view(-1), d.indices.to(ref.device, torch.int64),
                                 d.values.to(ref.device))
            elif d.kind == delta.ROWS:
                for a, b in d.ranges.tolist():
                    ref[a:b].copy_(d.tensor[a:b])
            elif d.kind == delta.DENSE:
                ref.copy_(d.tensor)

    def restore(self, weights: torch.nn.Module | Mapping[str, torch.Tensor],
                new: Mapping[str, torch.Tensor]) -> bool:
        """Write `tensors` back into `weights`, in place: undoes a trainer's step that the
        servers did not take. False if it cannot: nothing sent yet, a name the weights do
        not hold as a tensor of their own, or a tensor that cannot change did (`new`: the
        checkpoint names of `weights`; no copy of its old values to write back)."""
        if self.tensors is None or any(k not in new for k in self.frozen_prints):
            return False
        if _changed(self.frozen_prints,
                    prefilter.fingerprints({k: new[k] for k in self.frozen_prints}),
                    "they cannot be written back"):
            return False
        live = model_weights(weights) if isinstance(weights, torch.nn.Module) \
            else dict(weights)
        held = {t.untyped_storage().data_ptr() for t in live.values()}
        into = {k: live[k] if k in live else new[k] for k in self.tensors if k in live or (
            k in new and new[k].untyped_storage().data_ptr() in held)}  # a view of them
        if off := [k for k, r in self.tensors.items() if k not in into
                   or into[k].shape != r.shape]:
            logger.warning("hotweights: the step cannot be undone: %s (of %d) is no tensor of "
                           "the model under its checkpoint name, nor a view of one (e.g. %s: "
                           "a wrapped model, experts transformers keeps in another layout)",
                           len(off), len(self.tensors), off[0])
            return False
        with torch.no_grad():
            for k, r in self.tensors.items():
                into[k].copy_(r)
        return True


def _host_copy(t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A host copy of `t`, into `into` where it fits (its shape, dtype, pinning); pinned
    when `t` is on a GPU (deltas and restores copy faster)."""
    if into is None or into.shape != t.shape or into.dtype != t.dtype or \
            into.is_pinned() != t.is_cuda:
        into = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
    return into.copy_(t.detach())


def _changed(before: prefilter.Prints, now: prefilter.Prints, then: str) -> set[str]:
    """The tensors of `now` (that cannot change) whose fingerprints are not those of
    `before`, named in a warning that ends with `then`."""
    if moved := {k for k, p in now.items() if not _same(before.get(k), p)}:
        logger.warning("hotweights: %d tensor(s) that cannot change (trainable=) changed: "
                       "%s; %s", len(moved), sorted(moved)[:5], then)
    return moved


def _same(a: tuple | None, b: tuple) -> bool:
    """Two `prefilter` fingerprints of one tensor say it holds the same bytes."""
    return a is not None and a[:2] == b[:2] and np.array_equal(a[2], b[2])
