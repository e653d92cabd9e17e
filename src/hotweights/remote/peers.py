"""What the ranks of a channel tell each other through its store, and who is at fault when
a collective fails.

Every rank bumps a heartbeat counter on a thread and connection of its own; receivers
record each step they enter (a round, the acknowledgement). When a collective fails or
times out, the rank that saw it first names the peer that stopped (its heartbeat stood
still) or fell behind (its steps lag) and tells the others under a signed key; the others
take that message instead of finding out again. Messages are signed with the channel's key
(`signing`): one that is not is ignored and logged, since then someone else writes to the
store.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import TCPStore

from hotweights.errors import RemoteError
from hotweights.remote import signing

__all__ = ["Peers"]

logger = logging.getLogger(__name__)


class _Heartbeat(threading.Thread):
    """Bumps this rank's counter in the store every `interval` s, on its own connection."""

    def __init__(self, addr: str, port: int, key: str, interval: float, timeout: float):
        super().__init__(name=f"hotweights-heartbeat-{key}", daemon=True)
        self.store = TCPStore(addr, port, None, False, timeout=timedelta(seconds=timeout))
        self.key, self.interval, self.stop = key, interval, threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            try:
                self.store.set(self.key, str(n := n + 1))
            except RuntimeError:  # the store (the sender) is gone: the channel reports it
                return
            self.stop.wait(self.interval)


class Peers:
    """One rank's view of the others, through the channel's store; starts its heartbeat.

    Args:
        store: the channel's store connection.
        ns: the channel's namespace in it.
        mac: the channel's key (`signing.channel_key`).
        rank, world_size: this side's place in the channel (0: the sender).
        addr, port: the store's (the heartbeat connects on its own).
        timeout: the channel's.
        where: how messages name this side.
    """

    def __init__(self, store, ns: str, mac: bytes, *, rank: int, world_size: int, addr: str,
                 port: int, timeout: float, where: str):
        self.store, self.ns, self.mac, self.rank, self.world_size = store, ns, mac, rank, \
            world_size
        self.addr, self.port, self.timeout, self.where = addr, port, timeout, where
        self.interval = min(1.0, timeout / 8)
        self._steps = 0
        self._heartbeat = _Heartbeat(addr, port, f"{ns}/hb/{rank}", self.interval, timeout)
        self._heartbeat.start()

    def close(self) -> None:
        """Stop the heartbeat and wait for its thread (a store call bounds the wait): a
        daemon thread still inside a store call when the interpreter exits is ended there,
        through C++ frames that cannot unwind (SIGABRT)."""
        self._heartbeat.stop.set()
        self._heartbeat.join(self.timeout + 1.0)

    @property
    def told_within(self) -> float:
        """How long a peer's failure takes to be told (a receiver waits this long for it)."""
        return 2.5 * self.interval + 1.0

    def say(self, key: str, msg: str) -> None:
        """Write `msg` under `key`, signed."""
        self.store.set(key, signing.sign(self.mac, key, msg))

    def opened(self, key: str) -> str | None:
        """The signed message under `key`; None if there is none, or a forged one (logged:
        someone else writes to the store, so every rank finds out for itself)."""
        if not self.store.check([key]):
            return None
        if (msg := signing.opened(self.mac, key, self.store.get(key))) is None:
            logger.warning("%s: ignored %s: not signed by a member of the channel (someone "
                           "else writes to its store)", self.where, key)
        return msg

    def awaited(self, key: str) -> str | None:
        """The signed message under `key`, waiting for it up to `told_within`; None as soon
        as a failure is told instead, or if the store is gone."""
        failed, deadline = f"{self.ns}/failed", time.monotonic() + self.told_within
        try:
            while not self.store.check([key]):
                if self.store.check([failed]) or time.monotonic() > deadline:
                    return None
                time.sleep(0.01)
        except RuntimeError:
            return None
        return self.opened(key)

    def step(self) -> None:
        """Record a step this receiver enters (a round, the ack): a stalled one lags."""
        self._steps += 1
        self.store.set(f"{self.ns}/progress/{self.rank}", str(self._steps))

    def tell(self, msg: str) -> None:
        """Tell the others what failed (the first to tell is kept)."""
        key = f"{self.ns}/failed"
        with contextlib.suppress(RuntimeError):
            self.store.compare_set(key, "", signing.sign(self.mac, key, msg))

    def blame(self, what: str, exc: BaseException) -> RemoteError:
        """The error naming the peer that stopped; told to the others through the store."""
        try:
            if (msg := self._told()) is not None:
                return RemoteError(f"{self.where}: {what} failed: {msg}")
            before = self._beats()
            time.sleep(min(2.5 * self.interval, self.timeout))
            after = self._beats()
            dead = [r for r in before if before[r] == after[r]]
            behind = [] if dead else self._behind()
        except RuntimeError:  # the store lives in the sender: it is gone
            return RemoteError(f"{self.where}: {what} failed: the sender (rank 0) at "
                               f"{self.addr}:{self.port} is gone ({exc})")
        if dead:
            who = (", ".join(f"rank {r} ({'sender' if r == 0 else 'receiver'})" for r in dead)
                   + f" stopped (no heartbeat for {2.5 * self.interval:.1f} s)")
        elif behind:
            who = ", ".join(f"rank {r} (receiver)" for r in behind) + " stalled behind the others"
        else:
            who = "no peer stopped or fell behind; a peer is slow or unreachable"
        msg = f"{who}; reported by rank {self.rank} ({exc})"
        self.tell(msg)
        return RemoteError(f"{self.where}: {what} failed: {msg}")

    def _told(self) -> str | None:
        # What another rank found: a receiver waits a little for the sender's verdict.
        key = f"{self.ns}/failed"
        if self.rank != 0:
            try:
                self.store.wait([key], timedelta(seconds=self.told_within))
            except dist.DistStoreError:  # nothing said yet: find out ourselves
                return None
        return self.opened(key)

    def _beats(self) -> dict[int, bytes | None]:
        out = {}
        for r in range(self.world_size):
            if r != self.rank:
                k = f"{self.ns}/hb/{r}"
                out[r] = self.store.get(k) if self.store.check([k]) else None
        return out

    def _behind(self) -> list[int]:
        got = {}
        for r in range(1, self.world_size):
            k = f"{self.ns}/progress/{r}"
            got[r] = int(self.store.get(k)) if self.store.check([k]) else -1
        low = min(got.values())
        return [r for r, v in got.items() if v == low and low < max(got.values())]
