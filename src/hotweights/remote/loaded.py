"""The checkpoint the remote servers were started from, as the old values an update is
encoded against (`RemoteGroup(checkpoint=...)`): memory-mapped, trusted only where a
server's digest of what it loaded matches, and, with ``reference="checkpoint"``, synced
after every commit so that it stays what the servers hold."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from hotweights.checkpoint.digest import digest, stats
from hotweights.checkpoint.source import open_dir
from hotweights.errors import RemoteError
from hotweights.remote.delta_apply import widens
from hotweights.remote.served import Cast

__all__ = ["LoadedCheckpoint"]

logger = logging.getLogger(__name__)


class LoadedCheckpoint:
    """A checkpoint directory (`path`) as old values.

    Attributes:
        synced_at: the version number it holds, once `sync` wrote one (None: unknown).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self.synced_at: int | None = None
        self._synced: dict | None = None  # its files' `stats` as that sync left them
        self._loaded: tuple[dict, str | None, dict] | None = None  # (stats, digest, tensors)
        self._cast: Cast | None = None  # its tensors as the servers rounded them

    def tensors(self, now: dict | None = None) -> dict:
        """Its tensors, memory-mapped (opened again when its files changed; `now`: their
        `stats`, where the caller just took them)."""
        now = now or stats(self.path)
        if self._loaded is None or self._loaded[0] != now:
            self._loaded = (now, None, open_dir(self.path))  # its digest: when needed
        return self._loaded[2]

    def held_at(self, n: int) -> dict | None:
        """Its tensors, where they are what the servers hold at version `n`: it was synced
        to `n`, and nothing wrote into it since (another program, the trainer's own sync)."""
        if self.synced_at != n:
            return None
        if (now := stats(self.path)) != self._synced:
            logger.info("hotweights: %s was written since this group synced it: the servers "
                        "are synced whole", self.path)
            self.synced_at = None
            return None
        return self.tensors(now)

    def written(self) -> bool:
        """Its files changed since their tensors were mapped (`tensors`, `held_by`)."""
        return stats(self.path) != self._loaded[0]

    def check_dtypes(self, new: dict) -> None:
        """reference="checkpoint": refuse weights it cannot hold bit for bit."""
        tensors = self.tensors()
        if bad := _unlike(tensors, new):
            held = "nothing by that name" if bad not in tensors else \
                f"{tensors[bad].dtype} {tuple(tensors[bad].shape)}"
            raise RemoteError(f"reference='checkpoint': `{bad}` is {new[bad].dtype} "
                              f"{tuple(new[bad].shape)}, the checkpoint {self.path} "
                              f"holds {held}; it must hold every tensor in the weights' own "
                              "dtype and shape")

    def sync(self, new: dict, n: int) -> None:
        """Make it `new`, as version `n` (what the servers now hold); a failure is logged
        and leaves `synced_at` None (the next update is then a full sync)."""
        from hotweights.checkpoint import sync

        self.synced_at = None
        try:
            sync(self.path, new, version=str(n))
            self._synced = stats(self.path)
        except Exception:
            logger.exception("hotweights: syncing %s failed; the next update is a full sync",
                             self.path)
            return
        self.synced_at = n

    def held_by(self, stale: list[dict], new: dict) -> Mapping[str, torch.Tensor] | None:
        """Its tensors (memory-mapped) when every server of `stale` (their statuses) holds
        exactly this checkpoint and it matches the new weights' names, dtypes and shapes;
        a tensor it holds in a wider float than the new weights' (a float32 checkpoint,
        served in bf16: `served`) is read rounded to theirs, as the servers loaded it."""
        if any(st.get("checkpoint") is None for st in stale):
            return None
        now = stats(self.path)
        if self._loaded is None or self._loaded[0] != now or self._loaded[1] is None:
            found = digest(self.path)  # None: no safetensors there (hashed again only
            # when changed)
            tensors = {} if found is None else self._loaded[2] if self._loaded is not None \
                and self._loaded[0] == now else open_dir(self.path)  # one map: `tensors`
            if stats(self.path) != now:
                logger.info("hotweights: %s is being written: a full sync", self.path)
                return None
            self._loaded = (now, found, tensors)
        _, found, tensors = self._loaded
        if any(st["checkpoint"] != found for st in stale):
            logger.info("hotweights: %s differs from what the servers loaded: a full sync",
                        self.path)
            return None
        if bad := _unlike(tensors, new, rounded=True):
            logger.info("hotweights: %s: %s differs from the checkpoint's (dtype, shape or "
                        "missing): a full sync", self.path, bad)
            return None
        casts = {k: t.dtype for k, t in new.items() if tensors[k].dtype != t.dtype}
        if not casts:
            return tensors
        if self._cast is None or self._cast.tensors is not tensors or self._cast.casts != casts:
            self._cast = Cast(tensors, casts)  # one for every stale server: one channel
        return self._cast


def _unlike(held: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
            rounded: bool = False) -> str | None:
    """The first name of `new` that `held` lacks or holds in another dtype (`rounded`: in
    one that neither is nor `widens` the new one's) or shape."""
    return next((k for k, t in new.items() if k not in held or held[k].shape != t.shape
                 or held[k].dtype != t.dtype and not (rounded and widens(t.dtype,
                                                                         held[k].dtype))),
                None)
