"""A broadcast channel for packed delta rounds: one sender (rank 0), N receivers, a private group.

The group is *stateless* (`remote.process_group`): it lives beside any default group of the
process (vLLM's own) and never touches global state.

Before any weight moves, every side proves it holds the shared token (`rendezvous.prove`):
a peer without it, or a stranger on the port, fails every side with a `RemoteError`. Rank 0's
store listens on `master_addr` only, not on every interface.

Each round goes as two broadcasts from rank 0, whatever its number of tensors: a fixed
4 KiB message, the int64 meta (header length, buffer length, round index, rounds total: 0
until the last round, as rounds are sent while later ones are still being encoded; and the
round's keyed digest, `signing`) followed by the JSON header (a longer header's rest goes in
a broadcast of its own), then the buffer. A receiver refuses a
round over its budget (`max_round_bytes`) before allocating it, and one whose digest does not
match before anything sees it; what the ranks tell each other through the store is signed
with the same key. An update may be announced: its receivers then wait in the store,
up to a wait of their own, for the sender's word (`start` or `cancel`) instead of waiting in
a collective, which times out after `timeout`; so they can be ready while the sender is
still working out what to send (`remote.announce`). Every rank runs a heartbeat thread (its
own store connection), so when a collective fails or times out the channel names the peer
that stopped (`remote.peers`).

A receiver may relay (`receive(relay=...)`): it hands each round on, as rank 0 of a channel
of its own, to receivers behind it (a server's other workers), and acknowledges only once
they have staged it; so the sender's channel has one rank per server.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from hotweights.errors import RemoteError
from hotweights.remote import process_group, rendezvous, signing
from hotweights.remote.announce import Announcements
from hotweights.remote.packing import Round
from hotweights.remote.peers import Peers

__all__ = ["BACKENDS", "Channel"]

logger = logging.getLogger(__name__)

BACKENDS = process_group.BACKENDS
_FIELDS = 4  # int64s: header length, buffer length, round index, rounds total (or 0)
_META = _FIELDS + signing.DIGEST_BYTES // 8  # then the round's digest
_FIRST = 4096  # bytes of a round's first broadcast: its meta, then its header's first bytes
# (zero-padded; a longer header's rest follows in a broadcast of its own)
_INLINE = _FIRST - _META * 8
_MAX_HEADER = 1 << 26  # a header longer than this is a broken or hostile sender
_ABORT = -1  # a meta header length telling the receivers the sender gave up the update


class _Relay:
    """One update as a relaying receiver sends it on, as rank 0 of the relay channel: its
    receivers wait for the word (``announced``), then read each round as it is forwarded
    (``open``) until the acknowledgement, a cancel or an abort (``None``)."""

    def __init__(self, channel: Channel | None, update: str | None):
        self.channel, self.update, self.rounds = channel, update, 0
        self.state = None if channel is None else "announced" if update else "open"

    def ready(self) -> RemoteError | None:
        """Wait until every relay receiver waits for the announced update; None if they do."""
        if self.state != "announced":
            return None
        try:
            self.channel.announced.await_ready(self.update)
        except RemoteError as e:
            return e
        return None

    def go(self) -> None:
        if self.state == "announced":
            self.channel.announced.word(self.update, b"go")
            self.state = "open"

    def send(self, meta: torch.Tensor, head: torch.Tensor, buf: torch.Tensor, what: str,
             hashes: list[bytes]) -> None:
        """Send a round on (`hashes`: `signing.round_hashes` of it, taken to verify it)."""
        if self.state == "open":
            self.channel.bytes_sent += self.channel._send_parts(meta, head, buf, what, hashes)
            self.rounds += 1

    def ack(self, rounds: int) -> RemoteError | None:
        """The relay receivers' acknowledgement: None, or their refusal or failure."""
        if self.state != "open":
            return None
        self.state = None
        try:
            self.channel._ack(f"acknowledgement of {rounds} rounds")
        except RemoteError as e:
            return e
        return None

    def fail(self, why: BaseException) -> None:
        """Tell the relay receivers the update will not come (idempotent)."""
        state, self.state = self.state, None
        try:
            if state == "announced":
                self.channel.cancel(self.update)
            elif state == "open" and not self.channel.broken:
                self.channel._abort(self.rounds, why)
        except (RemoteError, RuntimeError) as e:  # they learn it from their timeout
            logger.warning("%s: could not tell the relay's receivers: %s",
                           self.channel._where(), e)


class Channel:
    """One sender (rank 0) and ``world_size - 1`` receivers over a private process group.

    Example:
        sender: ``Channel(master_addr=a, master_port=p, rank=0, world_size=3, token=t)
        .send(packing.pack(deltas, max_bytes=m))``; each receiver:
        ``Channel(..., rank=i, ...).receive(stage)``, where ``stage(round)`` checks a round
        and keeps a copy; apply the copies once `receive` returns.

    Attributes:
        rank, world_size: this side's place in the group.
        bytes_sent: bytes broadcast by this rank (meta, headers and buffers, once per round,
            whatever the number of receivers: what each receiver receives; `copies` of them
            leave this rank), the rounds of a send that failed included; 0 on receivers.
        bytes_received: the same, counted on a receiver.
    """

    def __init__(self, *, master_addr: str, master_port: int, rank: int, world_size: int,
                 token: str, timeout: float = 60.0, backend: str = "gloo",
                 device: torch.device | str | None = None, name: str = "channel",
                 max_round_bytes: int = 1 << 30):
        """Rendezvous, prove the token both ways, then build the group.

        Args:
            master_addr: the sender's address; rank 0 listens on it.
            master_port: the store's port (rank 0 binds it).
            rank: 0 for the sender, 1 .. world_size - 1 for the receivers.
            world_size: the sender and every receiver.
            token: the shared secret; never sent, only HMACs of a fresh nonce with it.
            timeout: seconds any rendezvous step or collective may wait for a peer.
            backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
            device: where the meta, header and staging tensors live; default CPU for gloo,
                the current CUDA device for nccl.
            name: what its messages call it (``relay``: a server's own workers).
            max_round_bytes: a receiver refuses a round whose buffer is bigger, before
                allocating it (`RemoteGroup` tells the servers its own at join).
        Raises:
            RemoteError: a bad argument, a peer missing or late, a rank claimed twice, a
                token proof that does not match (each names the rank).
        """
        self._validate(rank, world_size, token, timeout, backend)
        if type(max_round_bytes) is not int or max_round_bytes < 1:
            raise RemoteError(f"channel: field 'max_round_bytes' must be an int >= 1, found "
                              f"{max_round_bytes!r}")
        self.max_round_bytes = max_round_bytes
        self.rank, self.world_size, self.backend, self.name = rank, world_size, backend, name
        self.addr, self.port, self.timeout = master_addr, master_port, timeout
        self.device = torch.device(device if device is not None else "cpu" if backend ==
                                   "gloo" else f"cuda:{torch.cuda.current_device()}")
        self.bytes_sent = self.bytes_received = self._updates = 0
        self._verdict: int | None = None  # the update whose verdict the store holds (rank 0)
        self._staging: torch.Tensor | None = None
        self._pg = self._peers = None
        self.announced: Announcements | None = None  # (after the rendezvous)
        self._broken: str | None = None
        td = timedelta(seconds=timeout)
        self._store = self._ns = None
        try:
            self._store = process_group.listening_store(
                master_addr, master_port, td, self._where()) if rank == 0 else TCPStore(
                master_addr, master_port, None, False, timeout=td)
            nonce = rendezvous.prove(self._store, rank=rank, world_size=world_size, token=token,
                                     timeout=timeout, where=self._where(),
                                     hint=rendezvous.interface_hint(master_addr))
            self._ns = f"{rendezvous.NS}/{nonce}"
            self._mac = signing.channel_key(token, nonce)
            at = {"rank": rank, "world_size": world_size, "addr": master_addr,
                  "port": master_port, "timeout": timeout, "where": self._where()}
            self.announced = Announcements(self._store, self._ns, **at)
            self._peers = Peers(self._store, self._ns, self._mac, **at)
            self._pg = self._group(PrefixStore(f"{self._ns}/pg", self._store))
        except RuntimeError as e:  # torch.distributed's errors: the store's, Gloo's
            self.close()
            raise RemoteError(f"{self._where()}: rendezvous failed within {timeout} s: "
                              f"{self._peer_hint()} ({e})") from e
        except RemoteError:
            self.close()
            raise
        logger.info("%s: channel ready (%s, %d ranks)", self._where(), backend, world_size)

    @staticmethod
    def _validate(rank: int, world_size: int, token: str, timeout: float, backend: str) -> None:
        if type(world_size) is not int or world_size < 2:
            raise RemoteError(f"channel: field 'world_size' must be an int >= 2 (the sender and "
                              f"a receiver), found {world_size!r}")
        if type(rank) is not int or not 0 <= rank < world_size:
            raise RemoteError(f"channel: field 'rank' must be an int in [0, {world_size}), "
                              f"found {rank!r}")
        if not isinstance(token, str) or len(token) < 8:
            raise RemoteError("channel: field 'token' must be a string of 8 characters or more")
        if not timeout > 0:
            raise RemoteError(f"channel: field 'timeout' must be > 0 seconds, found {timeout!r}")
        if backend not in BACKENDS:
            raise RemoteError(f"channel: field 'backend' must be one of {list(BACKENDS)}, "
                              f"found {backend!r}")

    @property
    def copies(self) -> int:
        """Copies of each broadcast byte that leave the sender: Gloo broadcasts along a
        binomial tree (gloo/broadcast.cc: the root sends to ranks 1, 2, 4, ..., i.e.
        ceil(log2(world_size)) of them, which pass it on), NCCL along a ring (one)."""
        return (self.world_size - 1).bit_length() if self.backend == "gloo" else 1

    @property
    def broken(self) -> bool:
        """A collective failed: the group is unusable; close it and open a new one."""
        return self._broken is not None

    def give_up(self, why: str) -> None:
        """Take the channel as broken (see `broken`) for `why`."""
        self._broken = self._broken or why

    def _where(self) -> str:
        return f"{self.name} {self.addr}:{self.port} rank {self.rank}"

    def _peer_hint(self) -> str:
        return ("a receiver did not join" if self.rank == 0 else
                f"the sender (rank 0) at {self.addr}:{self.port} did not answer") + \
            rendezvous.interface_hint(self.addr)

    def _group(self, store: PrefixStore):
        return process_group.build(store, rank=self.rank, world_size=self.world_size,
                                   backend=self.backend, timeout=self.timeout,
                                   where=self._where(), peer_hint=self._peer_hint)

    # --- failures ---------------------------------------------------------------------------

    def _broadcast(self, t: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._collective(lambda: self._pg.broadcast([t], opts).wait(), what)

    def _ack(self, what: str, refused: bool = False) -> None:
        """Every receiver has read and staged every round; any rank returns only then.

        Each rank adds 1 if it refused the update: a non-zero sum fails it on every rank,
        naming the receivers that refused and why.

        The sender's sum is the verdict: once its allreduce has ended, every rank has
        added its part, yet a receiver may still be exchanging with another one when that
        one dies. So the sender writes the sum to the store (`_verdict_key`), and a
        receiver whose allreduce fails takes it from there if it is written (the channel
        is then broken): the update it staged is applied as everywhere else, not lost
        because a peer died after the sender's acknowledgement.
        """
        t = torch.tensor([int(refused)], dtype=torch.int64, device=self.device)
        key = self._verdict_key(self._updates)

        def verdict(exc: RuntimeError) -> bool:
            if self.rank == 0 or (total := self._peers.awaited(key)) is None:
                return False
            t.fill_(int(total))
            self._broken = f"{what} failed after the sender's had ended ({exc})"
            logger.warning("%s: %s; the update stands (the sender's verdict), the channel "
                           "is broken", self._where(), self._broken)
            return True
        self._collective(lambda: self._pg.allreduce([t]).wait(), what, verdict)
        if self.rank == 0:
            with contextlib.suppress(RuntimeError):  # (a receiver then fails by itself)
                self._peers.say(key, str(int(t.item())))
                if self._verdict is not None:  # the last one written (not an abort's number)
                    self._store.delete_key(self._verdict_key(self._verdict))
                self._verdict = self._updates
        keys = [(r, self._refusal_key(r)) for r in range(1, self.world_size)]
        self._updates += 1
        if int(t.item()) and not refused:
            reasons = [f"rank {r}: {why}" for r, k in keys if (why := self._peers.opened(k))]
            raise RemoteError(f"{self._where()}: receiver(s) refused the update, so no receiver "
                              f"applies it: {'; '.join(reasons)}")

    def _verdict_key(self, update: int) -> str:
        return f"{self._ns}/acked/{update}"

    def _check_open(self) -> None:
        if self._broken is not None:
            raise RemoteError(f"{self._where()}: the channel is broken ({self._broken}); "
                              "close it and open a new one")

    def _collective(self, op, what: str,
                    recover: Callable[[RuntimeError], bool] = lambda e: False) -> None:
        """Run `op`; if it fails, mark the channel broken and raise the error naming the
        peer at fault, unless `recover(error)` says the failure changes nothing."""
        self._check_open()
        try:
            op()
        except RuntimeError as e:
            if recover(e):
                return
            err = self._peers.blame(what, e)
            self._broken = str(err)
            logger.error("%s", err)
            raise err from e

    # --- rounds -----------------------------------------------------------------------------

    def send(self, rounds: Iterable[Round], *, ahead: bool = False) -> int:
        """Broadcast one update's rounds to every receiver (rank 0 only).

        Args:
            rounds: from `hotweights.remote.packing.pack`, in order; their buffers on this channel's
                device. If reading them raises, the receivers are told the update is aborted
                and the error is raised again.
            ahead: read (encode) the next round while this one is broadcast, on a thread of
                its own: the receivers' pace then does not hold up the encode. A round's
                buffer must then stay as it is until the round after the next is read (`pack`
                with two staging buffers, or none).
        Returns:
            The bytes this update put on the wire (also added to `bytes_sent`, as each
            round goes: a send that fails adds the rounds it broadcast).
        Raises:
            RemoteError: a receiver died, stalled or left (named), within the timeout (the
                channel is then broken), or refused the update (named, with its reason; the
                channel stays usable).
        """
        if self.rank != 0:
            raise RemoteError(f"{self._where()}: only rank 0 sends; call receive()")
        sent, i, it = 0, 0, iter(rounds)
        pool = ThreadPoolExecutor(1, thread_name_prefix="hotweights-send") if ahead else None
        pending: Future | None = None  # the round being broadcast (ahead)
        try:
            while True:
                try:
                    r = next(it, None)
                except Exception as e:
                    if pending is not None:
                        sent += pending.result()  # in order: that round, then the abort
                    self._abort(i, e)
                    raise
                if pending is not None:
                    sent += pending.result()
                    pending = None
                if r is None:
                    break
                if pool is None:
                    sent += self._send_round(r)
                else:
                    pending = pool.submit(self._send_round, r)
                i += 1
        finally:
            if pool is not None:
                pool.shutdown(wait=False)
            self.bytes_sent += sent
        self._ack(f"acknowledgement of {i} rounds")
        logger.info("%s: sent %d rounds, %d bytes", self._where(), i, sent)
        return sent

    def start(self, update: str, check: Callable[[], None] = lambda: None) -> None:
        """Let the receivers of an announced update (`receive(update=...)`) go on to its
        rounds, once every one of them waits for it (rank 0 only); `send` them next.

        Args:
            update: the update's id, as the receivers were given it.
            check: called while a receiver is not ready yet; raise from it to stop waiting
                (the receiver's request failed, say). Then `cancel` the update.
        Raises:
            RemoteError: a receiver not ready within the timeout (named by rank).
        """
        self.announced.await_ready(update, check)
        self.announced.word(update, b"go")

    def cancel(self, update: str) -> None:
        """Tell the receivers waiting for an announced update that it will not come (rank 0;
        nothing happens if it was started)."""
        if self._store is not None and self._broken is None:
            self.announced.word(update, b"cancel")

    def interrupt(self, update: str) -> None:
        """End this receiver's wait for the announced `update` (`receive` on another
        thread): that receive raises, naming it dropped. Once the update started, nothing
        happens. Receivers only."""
        self.announced.interrupt(update)

    def _send_round(self, r: Round) -> int:
        head = r.header_bytes()
        buf = r.buffer
        if buf.device != self.device:
            buf = buf.to(self.device)
        meta = torch.tensor([len(head), buf.numel(), r.header["round"], r.header["rounds"]],
                            dtype=torch.int64)
        head = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        return self._send_parts(meta, head, buf, f"round {r.header['round'] + 1}")

    def _send_parts(self, meta: torch.Tensor, head: torch.Tensor, buf: torch.Tensor,
                    what: str, hashes: list[bytes] | None = None) -> int:
        """Broadcast a round, its meta fields (`meta[:_FIELDS]`) signed with this channel's
        key: a relay signs again what it verified with the sender's, from the `hashes` it
        took then (`signing.round_hashes`)."""
        meta = torch.cat([meta[:_FIELDS].cpu(), self._digest(
            signing.round_hashes((meta[:_FIELDS], head, buf)) if hashes is None else hashes)])
        first = torch.zeros(_FIRST, dtype=torch.uint8)
        first[:_META * 8] = meta.view(torch.uint8)
        inline = min(head.numel(), _INLINE)
        first[_META * 8:_META * 8 + inline] = head[:inline].cpu()
        self._broadcast(first.to(self.device), what)
        if head.numel() > _INLINE:
            self._broadcast(head[_INLINE:].to(self.device), what)
        if buf.numel():
            self._broadcast(buf, what)
        return _FIRST + max(0, head.numel() - _INLINE) + buf.numel()

    def _abort(self, i: int, why: BaseException) -> None:
        """Tell the receivers, waiting for round `i`'s meta, that the update is given up."""
        key = f"{self._ns}/aborted"
        self._peers.say(key, f"{type(why).__name__}: {why}")
        first = torch.zeros(_FIRST, dtype=torch.uint8)
        first[:_FIELDS * 8] = torch.tensor([_ABORT, 0, i, 0]).view(torch.uint8)
        self._broadcast(first.to(self.device), f"abort at round {i + 1}")
        self._updates += 1  # as every receiver counts it: the next update's rounds are
        # signed anew, this one's cannot be replayed into it

    def receive(self, stage: Callable[[Round], None], *, update: str | None = None,
                wait: float | None = None, relay: Channel | None = None) -> int:
        """Receive one update, handing each round to `stage` as it arrives (receivers only).

        `stage` checks a round and keeps what it needs: the round's buffer is a view of one
        staging buffer, grown only when a round is bigger than any before, and overwritten
        by the next round. Apply nothing before this returns: it returns only when every
        receiver has staged every round (all or nothing). If `stage` raises, the rest of the
        update is read and dropped, and at the acknowledgement every rank learns that this
        one refused; the channel stays usable.

        With a `relay` (a two-level group: one rank per server on this channel, the server's
        other workers behind it), each round goes on to the relay's receivers as it arrives,
        and this rank acknowledges only once they have all staged it: a refusal or failure
        of theirs is this rank's refusal (named). If this rank fails or refuses, or the
        sender cancels or aborts, the relay's receivers are told at once.

        Args:
            stage: see above.
            update: the id of an announced update: first wait, up to `wait` seconds (default
                the timeout), for the sender to `start` it. The relay's receivers wait for it
                under the same id.
            wait: see `update`; ``math.inf``: no bound (an update announced ahead, which
                this side may drop with `interrupt`).
            relay: a channel of which this side is rank 0.
        Returns:
            The number of rounds received.
        Raises:
            RemoteError: the sender died, stalled, aborted or cancelled, sent a malformed
                round, or another receiver refused the update (each named).
            Exception: what `stage` raised, on the receiver that refused.
        """
        if self.rank == 0:
            raise RemoteError(f"{self._where()}: rank 0 sends; call send()")
        if relay is not None and relay.rank != 0:
            raise RemoteError(f"{self._where()}: a relay is sent on as its rank 0, found "
                              f"rank {relay.rank}")
        self._check_open()  # before its ready key: the sender must not wait for it
        fwd = _Relay(relay, update)
        try:
            return self._receive(stage, update, self.timeout if wait is None else wait, fwd)
        except BaseException as e:
            fwd.fail(e)
            raise

    def _receive(self, stage: Callable[[Round], None], update: str | None, wait: float,
                 fwd: _Relay) -> int:
        refused = None

        def refuse(e: Exception) -> None:  # read the rest, then tell everyone at the ack
            nonlocal refused
            refused = e
            key = self._refusal_key(self.rank)
            self._peers.say(key, f"{type(e).__name__}: {e}")
            fwd.fail(e)

        if update is not None:
            if (late := fwd.ready()) is not None:
                refuse(late)
            self.announced.await_word(update, wait)
            fwd.go()
        i, total = 0, 0  # total: known from the last round (0 on the rounds before it)
        while not total:
            first = torch.zeros(_FIRST, dtype=torch.uint8, device=self.device)
            self._peers.step()
            self._broadcast(first, f"round {i + 1}")
            meta = first[:_META * 8].view(torch.int64)
            hlen, blen, idx, total = meta[:_FIELDS].tolist()
            if hlen == _ABORT:
                self._updates += 1  # as the sender counts it (`_abort`)
                why = self._peers.opened(f"{self._ns}/aborted") or "no reason given"
                raise RemoteError(f"{self._where()}: the sender aborted the update at round "
                                  f"{i + 1} ({why}); nothing of it is applied")
            self._check_meta(hlen, blen, idx, total, i)
            what = f"round {i + 1}"
            head = first[_META * 8:_META * 8 + min(hlen, _INLINE)]
            if hlen > _INLINE:
                rest = torch.empty(hlen - _INLINE, dtype=torch.uint8, device=self.device)
                self._broadcast(rest, what)
                head = torch.cat([head, rest])
            buf = self._buffer(blen)
            if blen:
                self._broadcast(buf, what)
            self.bytes_received += _FIRST + max(0, hlen - _INLINE) + blen
            if refused is None:
                try:
                    hashes = self._verify(meta, head, buf, what)
                    r = Round(self._header(head, blen, i), buf)
                    fwd.send(meta, head, buf, what, hashes)
                    stage(r)
                except Exception as e:
                    refuse(e)
            i += 1
        if refused is None and (theirs := fwd.ack(total)) is not None:
            refuse(theirs)
        self._peers.step()
        self._ack(f"acknowledgement of {total} rounds", refused is not None)
        if refused is not None:
            raise refused
        logger.info("%s: received %d rounds", self._where(), total)
        return total

    def _digest(self, hashes: list[bytes]) -> torch.Tensor:
        # bound to the update: `_updates` counts the updates acknowledged or aborted, the
        # same everywhere
        d = signing.round_digest(self._mac, self._updates, hashes=hashes)
        return torch.frombuffer(bytearray(d), dtype=torch.int64)

    def _verify(self, meta: torch.Tensor, head: torch.Tensor, buf: torch.Tensor,
                what: str) -> list[bytes]:
        """The round's `signing.round_hashes`, once its digest is the channel's."""
        hashes = signing.round_hashes((meta[:_FIELDS], head, buf))
        if not torch.equal(meta[_FIELDS:].cpu(), self._digest(hashes)):
            raise RemoteError(f"{self._where()}: {what} is not from the "
                              f"{'trainer' if self.name == 'channel' else self.name + ' sender'}"
                              " (altered on the way?): its digest does not match the "
                              "channel's key; nothing of the update is staged")
        return hashes

    def _refusal_key(self, rank: int) -> str:
        return f"{self._ns}/refused/{self._updates}/{rank}"

    def _check_meta(self, hlen: int, blen: int, idx: int, n: int, i: int) -> None:
        if blen > self.max_round_bytes or hlen > _MAX_HEADER:  # before allocating it
            self._broken = f"round {i + 1} over the budget"
            msg = (f"round {i + 1}: the sender's round of {blen} buffer bytes and {hlen} "
                   f"header bytes is over the budget agreed at join ({self.max_round_bytes} "
                   f"buffer bytes, max_round_bytes; {_MAX_HEADER} header bytes); nothing of "
                   "the update is staged")
            self._peers.tell(f"rank {self.rank} refused {msg}")
            raise RemoteError(f"{self._where()}: {msg}")
        if not (0 < hlen <= _MAX_HEADER and blen >= 0 and idx == i and n in (0, i + 1)):
            self._broken = f"malformed round meta {[hlen, blen, idx, n]}"
            raise RemoteError(f"{self._where()}: round {i + 1}: the sender's meta "
                              f"[header length, buffer length, round, rounds] is "
                              f"{[hlen, blen, idx, n]}, expected round {i} and rounds 0 "
                              f"(more follow) or {i + 1} (the last)")

    def _header(self, head: torch.Tensor, blen: int, i: int) -> dict:
        try:
            header = json.loads(bytes(head.cpu().numpy()))
        except ValueError as e:
            raise RemoteError(f"{self._where()}: round {i + 1}: header is not JSON ({e})") from e
        if not isinstance(header, dict) or header.get("nbytes") != blen or header.get(
                "round") != i:
            raise RemoteError(f"{self._where()}: round {i + 1}: header fields 'nbytes', "
                              f"'round' do not match the meta ({blen}, {i})")
        return header

    def _buffer(self, n: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(n, dtype=torch.uint8, device=self.device)
        return self._staging[:n]

    def close(self) -> None:
        """Stop the heartbeat and destroy the group and the store connection (idempotent)."""
        if self._peers is not None:
            self._peers.close()
            self._peers = None
        if self.announced is not None:  # (the last reference to the store: rank 0's
            self.announced.store = None  # listens until it goes)
        if self._pg is not None:
            try:
                self._pg.shutdown()
            except RuntimeError as e:  # a broken group may refuse a clean shutdown
                logger.debug("%s: group shutdown: %s", self._where(), e)
            self._pg = None
        self._store = None
        self._staging = None

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
