"""Announced updates: the sender's word on an update, passed through a channel's store.

The receivers of an announced update (`Channel.receive(update=...)`) each write a ready key
and wait, up to a wait of their own, for the sender's word (``go`` or ``cancel``) instead
of waiting in a collective, which times out after the channel's timeout; so they can be
ready while the sender is still working out what to send. The sender wakes each receiver
through a key of its own, which `interrupt` sets too, so no wait polls. The keys of the
update before last are deleted as the sender announces a new one.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import TCPStore

from hotweights.errors import RemoteError

__all__ = ["Announcements"]

logger = logging.getLogger(__name__)

_WAIT_SLICE_S = 2.0  # a wait for an announced update waits this long at once: an
# `interrupt` whose wake cannot be set (its own connection refused) ends it within one, not
# at the wait's end (the worker's main thread waits for it). A store whose host vanished
# without a reset still holds a slice's end up to the store's timeout: torch cancels a
# wait with a round trip of its own


class Announcements:
    """One rank's side of the announced updates of a channel.

    Args:
        store: the channel's store connection.
        ns: the channel's namespace in it.
        rank, world_size: this side's place in the channel (0: the sender).
        addr, port: the store's (`interrupt` opens a connection of its own).
        timeout: the channel's: how long the sender waits for the receivers to be ready.
        where: how messages name this side.
    """

    def __init__(self, store, ns: str, *, rank: int, world_size: int, addr: str, port: int,
                 timeout: float, where: str):
        self.store, self.ns, self.rank, self.world_size = store, ns, rank, world_size
        self.addr, self.port, self.timeout, self.where = addr, port, timeout, where
        self._told: list[str] = []  # the last two updates the sender announced
        self._interrupted: set[str] = set()  # announced updates this receiver stops awaiting

    def key(self, what: str, update: str, rank: int | None = None) -> str:
        return f"{self.ns}/{what}/{update}" + ("" if rank is None else f"/{rank}")

    # --- the sender ---------------------------------------------------------------------

    def await_ready(self, update: str, check: Callable[[], None] = lambda: None) -> None:
        """Wait until every receiver waits for `update`, calling `check` meanwhile."""
        keys = {r: self.key("ready", update, r) for r in range(1, self.world_size)}
        deadline = time.monotonic() + self.timeout
        while not self.store.check(list(keys.values())):
            check()
            if time.monotonic() > deadline:
                late = ", ".join(f"rank {r} (receiver)" for r, k in keys.items()  # each as
                                 if not self.store.check([k]))  # `Link.named` reads it
                raise RemoteError(f"{self.where}: {late} did not start receiving the update "
                                  f"within {self.timeout} s")
            time.sleep(0.002)

    def word(self, update: str, word: bytes) -> None:
        """Say `word` (``go``, ``cancel``) on `update`, and wake every receiver."""
        receivers = range(1, self.world_size)
        for old in self._told[:-1]:  # the update before last is over everywhere
            for r in receivers:
                self.store.delete_key(self.key("ready", old, r))
                self.store.delete_key(self.key("wake", old, r))
            self.store.delete_key(self.key("word", old))
        self._told = [*self._told[-1:], update]
        if (got := self.store.compare_set(self.key("word", update), "", word)) != word and \
                word == b"go":
            raise RemoteError(f"{self.where}: the store was written by someone else: the "
                              f"word for update {update} is {got[:40]!r}, not the sender's")
        self.store.multi_set([self.key("wake", update, r) for r in receivers],
                             [word] * len(receivers))  # each receiver waits on its own

    # --- a receiver ---------------------------------------------------------------------

    def await_word(self, update: str, wait: float) -> None:
        """Say this rank is ready for `update`, then wait up to `wait` s for the sender's
        word; raise unless it is ``go``."""
        ready = self.key("ready", update, self.rank)
        self.store.set(ready, "1")
        try:
            if self._word_for(update, wait) != b"go":
                raise RemoteError(f"{self.where}: the sender cancelled the update before "
                                  "sending it; nothing of it is applied")
        except RemoteError:
            # no longer waiting: a `start` of this id (the sender may reuse it for the
            # next update) must wait for this rank's next receive, not pass on this key
            with contextlib.suppress(RuntimeError):
                self.store.delete_key(ready)
            raise

    def _word_for(self, update: str, wait: float) -> bytes:
        key, wake = self.key("word", update), self.key("wake", update, self.rank)
        deadline = time.monotonic() + wait
        while True:
            # the sender writes its word and `interrupt` its mark before either sets the
            # wake: checked first, so a wake deleted below as stale hides neither
            if update in self._interrupted:
                self._interrupted.discard(update)
                raise RemoteError(f"{self.where}: stopped waiting for update {update} "
                                  "(dropped by this side); nothing of it is applied")
            if self.store.check([key]):
                word = self.store.get(key)
                break
            try:
                self.store.wait([wake], timedelta(seconds=max(0.001, min(
                    _WAIT_SLICE_S, deadline - time.monotonic()))))
            except dist.DistStoreError as e:
                if update in self._interrupted or time.monotonic() < deadline:
                    continue  # interrupted (its wake may not have reached the store: not
                    # touched again), or a slice of a longer wait
                raise RemoteError(f"{self.where}: the sender did not start the update "
                                  f"within {wait} s; nothing of it is applied") from e
            except RuntimeError as e:  # the store lives in the sender
                raise RemoteError(f"{self.where}: the sender (rank 0) at {self.addr}:"
                                  f"{self.port} is gone ({e}); nothing of the update is "
                                  "applied") from e
            self.store.delete_key(wake)  # whose it was: the checks above say
        return word

    def interrupt(self, update: str) -> None:
        """End this receiver's wait for `update` (on another thread): it raises, naming
        the update dropped."""
        self._interrupted.add(update)
        try:  # a connection of its own: the waiting thread's holds the store's lock
            socket.create_connection((self.addr, self.port), timeout=1.0).close()
            TCPStore(self.addr, self.port, None, False, timeout=timedelta(
                seconds=min(self.timeout, 5.0))).set(self.key("wake", update, self.rank),
                                                     "stop")
        except (OSError, RuntimeError) as e:  # the sender is gone (a TCPStore would retry
            # until its timeout): the wait ends by itself
            logger.info("%s: could not interrupt the wait for update %s: %s", self.where,
                        update, e)
