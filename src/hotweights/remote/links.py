"""The trainer's channels to its remote servers (`RemoteGroup`): one per set of servers that
hold the same old values, each server on one channel at a time, (re)built when one of its
servers joined, restarted or is on another channel."""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hotweights.errors import RemoteError, ServerError
from hotweights.remote.channel import Channel
from hotweights.remote.hosts import free_port
from hotweights.remote.rendezvous import PROTOCOL, channel_id

__all__ = ["Link", "Links", "named", "outcome"]

logger = logging.getLogger(__name__)


@dataclass
class Link:
    """A channel and the servers on it."""

    channel: Channel
    members: tuple  # ((url, server id), ...)
    id: str  # `rendezvous.channel_id`, as each member's status reports it
    ranks: dict[str, range]  # url -> its ranks on the channel
    xor: bool  # every member decodes xor-coded values
    next: str = ""  # the next update's id, sent with the last commit: servers wait for it

    def named(self, msg: str) -> str:
        """`msg` with each receiver rank of this channel it names followed by the server's
        URL (not the ranks of a server's own relay, which its part of `msg` names)."""
        ours, relay, theirs = msg.partition("relay ")
        return re.sub(r"\brank ([1-9]\d*)( \(receiver\))?", lambda m: f"{m.group(0)} = "
                      + next((u for u, r in self.ranks.items() if int(m.group(1)) in r), "?"),
                      ours) + relay + theirs


class Links:
    """The channels of one trainer, by their members.

    Args:
        master_addr, master_port: where the channels listen (`RemoteGroup`'s).
        timeout, max_round_bytes: the channels' (`RemoteGroup`'s).
        post: ``post(url, status, route, **body)``: a request to a server (its answer).
    """

    def __init__(self, *, master_addr: str, master_port: int, timeout: float,
                 max_round_bytes: int, post: Callable[..., dict]):
        self.master_addr, self.master_port = master_addr, master_port
        self.timeout, self.max_round_bytes, self.post = timeout, max_round_bytes, post
        self._by_members: dict[tuple, Link] = {}

    def __iter__(self) -> Iterator[Link]:
        return iter(list(self._by_members.values()))

    def __len__(self) -> int:
        return len(self._by_members)

    def connect(self, status: dict, backend: str, device: torch.device | None = None) -> Link:
        """The channel of the servers of `status`: (re)built when one of them joined,
        restarted or is on another channel (a channel whose send failed is dropped). Its
        buffers on `device` (NCCL: the trainer's weights' GPU; None: the channel's
        default)."""
        members = tuple((u, st["server_id"]) for u, st in status.items())
        link = self._by_members.get(members)
        if link is not None and all(st.get("channel") == link.id for st in status.values()):
            return link  # nobody restarted, and nobody joined another channel since
        for old in self:
            if {u for u, _ in old.members} & set(status):
                self.drop(old)  # a server is on one channel at a time
        offset, ranks = 1, {}
        for u, st in status.items():
            ranks[u] = range(offset, offset + st["channel_ranks"])  # its leader: 1
            offset = ranks[u].stop
        port = self.port()
        token = secrets.token_hex(16)
        with ThreadPoolExecutor(len(status)) as pool:
            joins = {u: pool.submit(self.post, u, status[u], "/hotweights/remote/join",
                                    master_addr=self.master_addr, master_port=port,
                                    rank_offset=ranks[u].start, world_size=offset,
                                    token=token, timeout=self.timeout,
                                    max_round_bytes=self.max_round_bytes,
                                    protocol=PROTOCOL) for u in status}
            channel = error = None
            try:
                channel = Channel(master_addr=self.master_addr, master_port=port, rank=0,
                                  world_size=offset, token=token, timeout=self.timeout,
                                  backend=backend, device=device)
            except RemoteError as e:  # a server that refused to join says why (below)
                error = e
            finally:
                outs = {u: outcome(f) for u, f in joins.items()}
        if failed := {u: e for u, e in outs.items() if isinstance(e, Exception)}:
            if channel is not None:
                channel.close()
            raise RemoteError(f"joining the channel failed on {named(failed)}") from error
        if error is not None:
            raise error
        # values as few bits as flipped, where every server's workers hold each tensor (or
        # their run of it) in one slab
        link = Link(channel, members, channel_id(self.master_addr, port, token), ranks,
                    all(out.get("xor") for out in outs.values()))
        self._by_members[members] = link
        logger.info("hotweights: channel %s:%d with %s", self.master_addr, port,
                    {u: f"ranks {r.start}..{r.stop - 1}" for u, r in ranks.items()})
        return link

    def port(self) -> int:
        """A port for a new channel: `master_port`, else the first free one above it that
        no channel here holds; any free one if not given."""
        if not self.master_port:
            if port := free_port(self.master_addr):
                return port
            raise RemoteError(f"no free port on {self.master_addr} for a channel: is it an "
                              "address of this host? (RemoteGroup(master_addr=))")
        held = {link.channel.port for link in self}
        ports = range(self.master_port, min(self.master_port + 64, 65536))
        for port in ports:
            if port not in held and free_port(self.master_addr, port):
                return port
        raise RemoteError(f"no free port in {ports.start}..{ports.stop - 1} on "
                          f"{self.master_addr} for a channel (master_port=)")

    def drop(self, link: Link) -> None:
        """Leave `link`'s channel (the servers waiting for its next update let go)."""
        if link.next:  # its servers' workers wait for it: let them go now
            with contextlib.suppress(RemoteError, RuntimeError):
                link.channel.cancel(link.next)
        link.channel.close()
        self._by_members.pop(link.members, None)

    def drop_gone(self, urls) -> None:
        """Leave the channels none of whose servers is among `urls`."""
        for link in self:
            if not {u for u, _ in link.members} & set(urls):
                self.drop(link)

    def close(self) -> None:
        for link in self:
            self.drop(link)


def outcome(future) -> Any:
    """A request's answer, or the `ServerError` it raised."""
    try:
        return future.result()
    except ServerError as e:
        return e


def named(failed: dict[str, Exception]) -> str:
    """``url: error; ...``."""
    return "; ".join(f"{u}: {e}" for u, e in failed.items())
