"""The token handshake of a channel's rendezvous, over its `TCPStore`, before any group exists.

The sender (rank 0, which hosts the store) publishes the world size and a fresh random
nonce; each receiver claims its rank once and publishes an HMAC-SHA256 of the nonce with the
shared token; the sender checks every proof and answers with its own proof, or a refusal
that names the ranks at fault. The token never goes on the wire. A peer with a wrong token,
or a stranger on the port, fails every side with a `RemoteError` before anything is sent.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import Store

from hotweights.errors import RemoteError

__all__ = ["NS", "PROTOCOL", "prove"]

NS = "hotweights/channel"  # store keys of the rendezvous
PROTOCOL = 5  # what goes over a channel, as one number: `channel`'s framing and the rounds'
# format (`packing.FORMAT`), and the requests' fields (5: `seq`); bumped with any change to
# them. A server reports it in its status and the group names a server of another one
# before any join; a server refuses a join of another one by name (mixed versions would
# otherwise fail mid-update)


def _proof(token: str, nonce: str, who: str) -> str:
    return hmac.new(token.encode(), f"{nonce}:{who}".encode(), hashlib.sha256).hexdigest()


def prove(store: Store, *, rank: int, world_size: int, token: str, timeout: float,
          where: str, hint: str = "") -> str:
    """Prove the token both ways; every rank calls it once, right after joining the store.

    Args:
        store: the channel's store (rank 0 hosts it).
        rank, world_size: this side's place; 0 is the sender.
        token: the shared secret.
        timeout: seconds the sender waits for every receiver's proof.
        where: names this side in errors (address, port, rank).
        hint: added to the error when a receiver does not join (`interface_hint`).
    Returns:
        The nonce: fresh for this channel, so its keys never meet another's.
    Raises:
        RemoteError: a receiver missing or unproven (named by rank), a rank claimed twice, a
            world size that differs, or a sender that does not prove the token.
    """
    if rank == 0:
        return _sender(store, world_size, token, timeout, where, hint)
    return _receiver(store, rank, world_size, token, where)


def interface_hint(addr: str) -> str:
    """What to check when peers do not meet at `addr` (the sender's address)."""
    return (f"; can every server reach {addr} (RemoteGroup(master_addr=...))? On hosts with "
            "several network interfaces, set GLOO_SOCKET_IFNAME (CPU) or NCCL_SOCKET_IFNAME "
            "(GPU) on every side to the interface the servers reach")


def _sender(s: Store, world_size: int, token: str, timeout: float, where: str,
            hint: str) -> str:
    nonce = secrets.token_hex(16)
    s.set(f"{NS}/world", str(world_size))
    s.set(f"{NS}/nonce", nonce)
    keys = [f"{NS}/proof/{r}" for r in range(1, world_size)]
    try:
        s.wait(keys, timedelta(seconds=timeout))
    except dist.DistError as e:
        missing = [r for r, k in enumerate(keys, 1) if not s.check([k])]
        _refuse(s, f"missing {missing}", len(keys) - len(missing), timeout)
        raise RemoteError(f"{where}: receiver rank(s) {missing} did not join within {timeout} s"
                          f"{hint}") from e
    if (now := s.get(f"{NS}/nonce").decode()) != nonce:  # the proofs answer another nonce
        _refuse(s, "the store was written by someone else (nonce)", len(keys), timeout)
        raise RemoteError(f"{where}: the store was written by someone else: the channel's "
                          f"nonce is {now[:40]!r}, not the sender's (someone on the network "
                          "reached the store's port); nothing sent")
    bad = [r for r, k in enumerate(keys, 1)
           if not hmac.compare_digest(s.get(k).decode(), _proof(token, nonce, str(r)))]
    if bad:
        _refuse(s, f"token of rank(s) {bad}", len(keys), timeout)
        raise RemoteError(f"{where}: receiver rank(s) {bad} did not prove the channel's token "
                          "(wrong token, or a stranger on the port); nothing sent")
    s.set(f"{NS}/verdict", "ok:" + _proof(token, nonce, "sender"))
    return nonce


def _refuse(s: Store, why: str, joined: int, timeout: float) -> None:
    # The store dies with the sender: give the receivers that joined a moment to read why.
    s.set(f"{NS}/verdict", f"refused:{why}")
    end = time.monotonic() + min(3.0, timeout)
    while s.add(f"{NS}/seen", 0) < joined and time.monotonic() < end:
        time.sleep(0.02)


def _receiver(s: Store, rank: int, world_size: int, token: str, where: str) -> str:
    me = secrets.token_hex(8)
    if s.compare_set(f"{NS}/claim/{rank}", "", me).decode() != me:
        raise RemoteError(f"{where}: rank {rank} is already taken by another receiver; give "
                          "each receiver its own rank")
    if (world := int(s.get(f"{NS}/world"))) != world_size:
        raise RemoteError(f"{where}: field 'world_size' is {world_size}, the sender's is "
                          f"{world}")
    nonce = s.get(f"{NS}/nonce").decode()
    s.set(f"{NS}/proof/{rank}", _proof(token, nonce, str(rank)))
    verdict = s.get(f"{NS}/verdict").decode()
    s.add(f"{NS}/seen", 1)
    if verdict.startswith("refused:"):
        raise RemoteError(f"{where}: the sender refused the channel: "
                          f"{verdict.removeprefix('refused:')}; nothing received")
    if not hmac.compare_digest(verdict.removeprefix("ok:"), _proof(token, nonce, "sender")):
        raise RemoteError(f"{where}: the sender did not prove the channel's token (wrong "
                          "token, or the store was written by someone else?); nothing received")
    return nonce


def channel_id(addr: str, port: int, token: str) -> str:
    """Names a trainer's channel (in a server's status) without giving its token away."""
    return f"{addr}:{port}#{hashlib.sha256(token.encode()).hexdigest()[:12]}"
