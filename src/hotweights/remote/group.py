"""Trainer side of remote servers: `RemoteGroup` sends each update, only what changed, to every
`hotweights serve --remote`, as one transaction.

One update: begin on every server (it takes the lease and goes on serving the old version);
every server's workers receive the rounds into staging while this process broadcasts them
on a `Channel` (checked there, nothing applied; the lease renewed meanwhile); commit on
every server with one version number N, which pauses generation only to apply the staged
update, reset the caches and resume. What the design guarantees:

- a server that does not answer at the start of an update, or dies during the send, is
  dropped from it (`result["dropped"]` and a warning name it; a send it broke is made again
  to the others) and the others commit; with ``require="all"`` it fails the update on
  every server instead, within the timeout and by name, the others aborting with nothing
  applied: **all stay at the old version**. A server that stalls or refuses (bad input)
  fails the update everywhere;
- once every server has staged the whole update, each is committed; a server that dies
  between staging and its commit is named while the others serve version N (an error
  with ``require="all"``): **the survivors all serve the new version**. The one that failed
  (or restarted, or missed an update) is caught up at the next update (from the
  checkpoint it loaded, or whole), and then gets the deltas again.

The old values the deltas are computed against are a host copy of what the servers hold
(`reference.tensors`: one copy of the tensors that can change, `trainable`), or the checkpoint
itself (`reference="checkpoint"`). A server that holds exactly
the checkpoint it started from (it reports the checkpoint's digest until its first commit)
is synced from it instead, when the group is given the same checkpoint: only what differs
from it is sent, not the whole model. Servers that hold different old values (one
restarted, or dropped from an update) are sent each their own encode on a channel of their
own, one after the other under the same transaction: the up-to-date servers still receive
only the delta (`result["bytes"]` per server).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hotweights.changes.streams import settle
from hotweights.checkpoint.names import reverted
from hotweights.errors import DeltaError, HotweightsError, RemoteError
from hotweights.layout.plan import model_weights
from hotweights.protocol.http import request
from hotweights.protocol.renewer import MAX_LEASE_S, Renewer, unanswered
from hotweights.protocol.tokens import find_token
from hotweights.protocol.urls import is_loopback
from hotweights.remote import delta, delta_apply, packing, prefilter, served
from hotweights.remote.hosts import channel_backend, route_address, server_urls
from hotweights.remote.links import Link, Links, named, outcome
from hotweights.remote.loaded import LoadedCheckpoint
from hotweights.remote.reference import Reference
from hotweights.remote.rendezvous import PROTOCOL

__all__ = ["Pending", "RemoteGroup"]

logger = logging.getLogger(__name__)

ROUND_BYTES = 64 << 20  # staging budget per round, on both sides
_CUTS = 16  # an update with 1 MiB of changes in every sixteenth of the weights goes in
# about this many rounds at least: the servers stage each while the trainer encodes the next ...
_MIN_CUT = 1 << 20  # ... each covering this many bytes of weights at least (a round's fixed
# costs, its collectives and its 4 KiB first message, stay small beside what it covers) ...
_CUT_PAYLOAD = 4 << 20  # ... and holding this many bytes, unless open for _CUT_WAIT s: each
_CUT_WAIT = 0.5  # round costs a hand-off to every server's receiving thread, which waits for
# the CPU where an engine steps beside it (a 1 % rows update on the benchmark's two busy
# servers: 16 rounds ~0.07 s more than 5, 5 ~0.035 s more than 2), while a round's wait stays
# bounded
_AHEAD_BYTES = 2 << 20  # a last round up to this size (uncompressed) is staged in about an
# engine step: the servers start their commit's pause as it goes out (a larger one would
# keep them paused while they stage it: a 1 % scattered update, 2.6 MB in one round, paused
# the benchmark's busy servers 70-170 ms so, 65-90 ms without)
_HINT_S = 5.0  # how long that hint may take (the update waits for its answers)
_MAX_TIMEOUT = MAX_LEASE_S / 4  # the lease is 4x the timeout
REQUIRE = ("any", "all")
REFERENCES = ("copy", "checkpoint")


@dataclass(frozen=True)
class Pending:
    """An update staged on every server (`RemoteGroup.prepare`), not yet committed."""

    status: dict  # url -> the server's status when the update began
    new: dict  # name -> the new tensor
    deltas: list | None  # taken against `reference.tensors`; None: it is copied whole
    full: tuple[str, ...]  # servers sent the whole model
    from_checkpoint: tuple[str, ...]  # servers sent what differs from the checkpoint
    prints: prefilter.Prints | None  # of `new` (if taken): then of what the servers hold
    sent: int  # bytes that left this process
    carried: dict  # url -> the bytes it received
    started: float
    floor: int  # the version number to commit must be above this
    frozen: prefilter.Prints  # of the tensors that cannot change, once the servers hold them
    dropped: dict  # url -> why: servers down at the start or dead during the send
    lease_s: float  # the servers' lease: their commit may wait this long for its pause
    written: dict  # name -> (the trainer's tensor, its version counter when it was read)


class _Encoded(list):
    """A plan's deltas, kept as the send reads them from the encode (for after the send:
    without the old values a patch carries for the send's xor, until the commit on the
    trainer's device); `failed`: what the encode raised (bad input, named), if it did."""

    failed: BaseException | None = None

    def read(self, deltas: Iterator[delta.Delta]) -> Iterator[delta.Delta]:
        try:
            for d in deltas:
                self.append(d if d.old_values is None else replace(d, old_values=None))
                yield d
        except Exception as e:
            self.failed = e
            raise


@dataclass
class _Plan:
    """Servers that hold the same old values: sent one encode, on a channel of their own."""

    urls: list[str]
    reference: dict | None  # the old values they hold; None: the whole model is sent
    held: bool  # it is the group's `reference.tensors`, what it sent last (`prefilter`)


class RemoteGroup:
    """The remote servers a trainer updates (see the module doc for the guarantees).

    Example:
        group = RemoteGroup("gpu[01-04]:8000", token=token)  # or ["http://a:8000", ...]
        for batch in data:
            train_step(model, batch)
            group.update(model)      # every server serves the new weights, same version

    Args:
        servers: base URLs, ``host[:port]`` items or SLURM node lists (see
            `hosts.server_urls`), as a comma-separated string or a list.
        token: the servers' bearer token, or a mapping URL -> token (default: as for
            `Bridge.connect`: HOTWEIGHTS_TOKEN, else the token file of a local server).
        master_addr: the address the servers reach this process at for the channel
            (default: 127.0.0.1 when every server is local, else this host's address on the
            route to the first server on another host, `route_address`).
        master_port: the channel's port on this process (default: a free one). Servers that
            hold different old values get channels of their own (see the module doc): those
            take the next free ports above it.
        timeout: seconds any peer may be silent in a collective before it is named (the
            servers wait for each round in one: a round's encode, that of a sixteenth of the
            weights (1 MiB at least) or of 0.5 s where that is longer, plus one tensor's,
            must take less; they wait for the first round up to the lease).
        max_round_bytes: the staging budget per round, on both sides (this side packs the
            rounds into two such buffers in turn: one is sent while the next is packed).
        checkpoint: a directory holding the checkpoint the servers were started from (the
            same files). A server that reports it still holds exactly that checkpoint (it
            just started, or restarted) is sent only what differs from it instead of the
            whole model; its digest is checked, so a different one costs a full sync, never
            a wrong weight.
        reference: where the old values the deltas are taken against live: ``"copy"``
            (default), a host copy of what the servers hold (`reference`, 100 % of the
            trainable tensors' bytes); ``"checkpoint"``, the `checkpoint` directory itself,
            memory-mapped: no copy, but every committed update is synced into it
            (`hotweights.checkpoint.sync`, beside the commits) so that it stays exactly what
            the servers hold; a sync that fails costs a full sync at the next update.
        trainable: names or `fnmatch` patterns of the only tensors (checkpoint names) an
            update may change; default: for a model, its parameters that require grad,
            else every tensor. The group keeps a host copy (`reference`) of those only, and
            of the rest fingerprints, checked at every update: a tensor that changed anyway
            is sent whole (a warning names it) and copied from then on.
        compress: None (default), or ``"zstd"``: every round compressed (the ``zstd``
            extra), for slow links; costs encode and apply time (see docs/remote.md).
        require: ``"any"`` (default): a server down at the start of an update or dead
            during it is dropped from it (named) and the others commit; with a local server
            (`Bridge.add_remote`) the local server commits and resumes first, then the
            remotes receive and commit (if they fail, the local server serves the new
            version and they stay at the old one, named, until the next update catches them
            up). ``"all"``: one server failing fails the update on every server, and the
            local server waits until every remote has staged the update: if one fails the
            trainer's step is undone and every server stays at the old version (not with
            ``reference="checkpoint"`` nor at the first update, which keep no copy of the
            old weights, nor for a model whose parameters are not the checkpoint's tensors,
            e.g. fused MoE experts: the local server then serves the new ones, dirty).
        cafile: the CA bundle that checks https servers' certificates (default:
            HOTWEIGHTS_CA_FILE, else the system's trust store; see docs/remote.md, TLS).
    """

    def __init__(self, servers: str | Iterable[str], *, token: str | Mapping[str, str] | None =
                 None, master_addr: str | None = None, master_port: int = 0,
                 timeout: float = 60.0, max_round_bytes: int = ROUND_BYTES,
                 checkpoint: str | os.PathLike | None = None, reference: str = "copy",
                 trainable: Iterable[str] | None = None, compress: str | None = None,
                 require: str = "any", cafile: str | os.PathLike | None = None):
        trainable = _check_args(timeout=timeout, master_addr=master_addr,
                                master_port=master_port, checkpoint=checkpoint,
                                trainable=trainable, max_round_bytes=max_round_bytes,
                                require=require, compress=compress, reference=reference)
        self.urls = server_urls(servers)
        self.cafile = cafile
        given = {u: token.get(u) if isinstance(token, Mapping) else token for u in self.urls}
        self._tokens = {u: find_token(u, given[u]) for u in self.urls}
        # the loopback servers whose token is their token file's: read again at each update
        # (a server restarted since wrote a new one)
        self._token_files = [] if os.environ.get("HOTWEIGHTS_TOKEN") else \
            [u for u in self.urls if not given[u]]
        remote = [u for u in self.urls if not is_loopback(urllib.parse.urlsplit(u).hostname)]
        self.master_addr = master_addr or (route_address(remote[0]) if remote else
                                           "127.0.0.1")
        self.timeout = timeout
        self.max_round_bytes, self.require, self.compress = max_round_bytes, require, compress
        self.reference_mode = reference
        self._staging: tuple[torch.Tensor, ...] | None = None  # see _round_buffers
        self.checkpoint = None if checkpoint is None else LoadedCheckpoint(checkpoint)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.n = 0  # the version number every server served at the last update
        self.reference = Reference(trainable)  # what the servers hold ("copy")
        self._prefilter = prefilter.Prefilter()  # fingerprints of `reference.tensors`
        self.bytes_sent = 0
        self._held: dict[str, tuple[str, int]] = {}  # url -> (server id, n) of `reference.tensors`
        self.links = Links(master_addr=self.master_addr, master_port=master_port,
                           timeout=timeout, max_round_bytes=max_round_bytes, post=self._post)
        self._leased: dict = {}  # url -> status, of the servers an update in progress began
        self._lease_lost = ""  # require="all": the servers that refused a renewal meanwhile
        self._lost = 0  # bytes that left this process in the update's sends that failed
        self._seq = 0  # the number of the try of an update in progress (or the last one)
        self._casts: dict[str, torch.dtype] = {}  # name -> the servers' narrower float
        self._warm: threading.Thread | None = None  # compiles the encode's loops ahead

    # -- the update ------------------------------------------------------------------------

    def update(self, weights: torch.nn.Module | Mapping[str, torch.Tensor], *,
               mode: str = "wait", lease_s: float | None = None, n: int | None = None) -> dict:
        """Send the new weights to every server, as one transaction; return what happened.

        Args:
            weights: a transformers model (its parameters under the checkpoint's names, tied
                ones once) or a mapping of checkpoint names to tensors.
            mode: how servers treat in-flight requests while paused ("wait", "abort",
                "keep"), as for `Bridge.update`.
            lease_s: how long a server waits for this trainer before it drops the update by
                itself (default: four times the timeout, at least 60 s).
            n: the version number to serve (default: one above every server's, `floor`).
        Returns:
            ``{"version": N, "servers": {url: "N@SERVER"}, "full": [url, ...],
            "from_checkpoint": [url, ...], "bytes_sent": int, "bytes": {url: int},
            "seconds": float, "paused_ms": {url: ms}, "dropped": {url: why}}``: ``full``
            the servers sent the whole model, ``from_checkpoint`` those sent what differs
            from the checkpoint they loaded; ``bytes_sent`` what left this process (a
            broadcast sends some copies: `Channel.copies`), ``bytes`` what each server
            received (``bytes_sent`` also counts a send that failed and was made again to
            the others; `bytes_sent` of the group, the sum over its updates, also those
            that failed); ``paused_ms`` how long each server's
            generation stayed paused (pause to resume), by its own clock; ``dropped``
            the servers left out of it (down at its start, dead during the send or
            before their commit; with ``require="any"``), each caught up at the next
            update it reaches.
        Raises:
            RemoteError: naming the server that failed (see the module doc for the state
                every server is left in).
            DeltaError: bad input, naming the tensor (NaN or Inf in a patch, a dtype the
                channel cannot carry): every server at its old version.
        """
        return self.commit(self.prepare(weights, mode=mode, lease_s=lease_s,
                                        pause_ahead=True), n)

    def floor(self) -> int:
        """The highest version number a server serves or this group committed: an update's
        number must be above it."""
        return self._floor(self._status(self.urls, {})[0])

    def _floor(self, status: dict) -> int:
        return max(self.n, *(st["n"] for st in status.values()))

    def prepare(self, weights: torch.nn.Module | Mapping[str, torch.Tensor], *,
                mode: str = "wait", lease_s: float | None = None,
                pause_ahead: bool = False) -> Pending:
        """The first half of `update`: every server holding the whole update staged, still
        serving its old version.

        Follow with `commit` (or `abort`) within the lease (`renew` extends it). On failure
        every server is at its old version with nothing applied, and the error names the
        server that failed. `pause_ahead`: the commit follows at once (as in `update`), so
        the servers may begin its pause as the last round travels; else they serve until
        the commit, however late.
        """
        started, self._lost = time.perf_counter(), 0
        new = _weights(weights)
        settle(new)  # a step still running on a side stream lands before anything reads it
        written = {k: (t, t._version) for k, t in new.items()}  # before the encode reads them
        status, dropped = self._status(self.urls, {})
        self._abort_left(status)
        self._casts = served.narrowed_to(status, new)  # a float32 trainer, bf16 servers
        if self._casts and self.reference_mode == "checkpoint":
            name, dtype = next(iter(self._casts.items()))
            raise RemoteError(f"reference='checkpoint': the servers hold `{name}` (and "
                              f"{len(self._casts) - 1} more) in {dtype}, narrower than the "
                              f"trainer's {new[name].dtype}, and the checkpoint would have to "
                              "hold their rounded values, not the trainer's: use "
                              "reference='copy' (the default), or train in the served dtype")
        new = dict(served.Cast(new, self._casts))  # (the rounded copies made here, once)
        if self._warm is None:  # while the first update (a full sync) travels, not at the
            # second (not a daemon: numba must not be cut off at exit)
            self._warm = threading.Thread(target=packing.warm, name="hotweights-jit-warm",
                                          args=({t.dtype for t in new.values()},))
            self._warm.start()
        try:
            while True:
                try:
                    return self._prepare(weights, new, status, mode, lease_s, started,
                                         dropped, pause_ahead, written)
                except RemoteError as e:
                    if self.require == "all":
                        raise
                    before = len(dropped)
                    status, dropped = self._status(list(status), dropped)  # who is gone?
                    if len(dropped) == before:
                        raise  # every server answers: not one that died (bad input, a stall)
                    logger.warning("hotweights: %s; updating the others again", e)
        except BaseException:
            self.bytes_sent += self._lost
            raise

    def _status(self, urls: list[str], dropped: dict) -> tuple[dict, dict]:
        """(url -> status of each of `urls` that answers, `dropped` plus url -> why for each
        that does not: dropped from this update, or, with require="all", the update fails).
        A server that answers with an error (a wrong token or URL) fails it whatever
        `require`."""
        for u in self._token_files:
            try:
                self._tokens[u] = find_token(u)
            except HotweightsError:  # no file (yet): the request names what is wrong
                pass
        outs = self._each(lambda u: request(u, "GET", "/hotweights/status", self._tokens[u],
                                            timeout=min(self.timeout, 30.0),
                                            cafile=self.cafile),
                          errors=True, urls=urls)
        if refused := {u: e for u, e in outs.items()
                       if isinstance(e, Exception) and not unanswered(e)}:
            raise RemoteError(named(refused))  # it answers: a wrong token or URL, not down
        down = {u: str(e) for u, e in outs.items() if isinstance(e, Exception)}
        if down and (self.require == "all" or len(down) == len(urls)):
            raise RemoteError(f"no answer from {named(down)}")
        if down:
            logger.warning("hotweights: %s dropped from this update (the next one catches "
                           "them up): %s", sorted(down), named(down))
        status = {u: st for u, st in outs.items() if u not in down}
        for u, st in status.items():
            if not st.get("remote"):
                raise RemoteError(f"{u}: not started with `hotweights serve --remote`; a "
                                  "local server is updated in place through Bridge")
        if other := {u: st.get("protocol", "< 3") for u, st in status.items()
                     if st.get("protocol") != PROTOCOL}:
            raise RemoteError(f"channel protocol {other} on those servers, {PROTOCOL} on this "
                              "trainer: run the same hotweights version on the trainer and "
                              "every server")
        return status, {**dropped, **down}

    def _prepare(self, weights, new: dict, status: dict, mode: str, lease_s: float | None,
                 started: float, dropped: dict, pause_ahead: bool, written: dict) -> Pending:
        """`prepare` on the servers of `status`: who holds which old values (`_plans`), the
        encode and the send for each set of them."""
        lease_s = lease_s or self._lease_s()
        plans = self._plans(status, new)
        if self.reference_mode == "checkpoint":  # at every update: servers that loaded a
            # wider float checkpoint take deltas against its rounded values, but its sync
            # after the commit would be refused
            self.checkpoint.check_dtypes(new)
            frozen = set()  # no copies to spare
        else:
            frozen = self.reference.frozen(weights, new)
        kept, frozen_prints = self.reference.kept(new, frozen, any(
            p.held and p.reference is self.reference.tensors for p in plans))
        found = []  # (rows, prints) of the fingerprints, taken while the begins travel

        def fingerprint() -> None:
            found.append(self._prefilter.rows({k: t for k, t in new.items() if k not in kept},
                                              use=plans[0].held))  # kept: `frozen_prints`
        backend = channel_backend(status)  # one kind of device for the whole group
        self.links.drop_gone(status)
        device = channel_device(backend, new.values())
        links = [self.links.connect({u: status[u] for u in p.urls}, backend, device)
                 for p in plans]
        sends = self._send(status, list(zip(plans, links, strict=True)),
                           lambda p: self._encode(p, new, kept, found[0][0]),
                           max(_MIN_CUT, -(-sum(t.nbytes for t in new.values()) // _CUTS)),
                           mode, lease_s, meanwhile=fingerprint, pause_ahead=pause_ahead)
        done, prints = list(zip(plans, sends, strict=True)), found[0][1]
        return Pending(status, new,
                       next((d for p, (d, _, _) in done if p.held and p.reference is
                             self.reference.tensors), None),
                       tuple(u for p in plans if p.reference is None for u in p.urls),
                       tuple(u for p in plans if p.reference is not None for u in p.urls
                             if self._stale(u, status[u])),
                       prints, self._lost + sum(left for _, _, left in sends),
                       {u: sent for p, (_, sent, _) in done for u in p.urls}, started,
                       self._floor(status), frozen_prints, dropped, lease_s, written)

    def _stale(self, url: str, status: dict) -> bool:
        """The server at `url` may not hold what this group last sent it."""
        return self._held.get(url) != (status["server_id"], status["n"])

    def _plans(self, status: dict, new: dict) -> list[_Plan]:
        """The servers of `status` by the old values they hold, those holding what this
        group sent last first: the up-to-date servers are sent only the delta, each stale
        one (restarted, dropped from an update) what differs from the checkpoint it loaded
        (`checkpoint`), else the whole model, each set on its own channel."""
        held = self.reference.tensors if self.reference_mode == "copy" else \
            self.checkpoint.held_at(self.n)
        plans: dict[int, _Plan] = {}
        for u, st in status.items():
            ref = held if held is not None and not self._stale(u, st) else \
                self._checkpoint_for([st], new)  # `held` itself, where the checkpoint is it
            plans.setdefault(id(ref), _Plan([], ref, ref is not None and ref is held)
                             ).urls.append(u)
        return sorted(plans.values(), key=lambda p: (not p.held, p.reference is None))

    def commit(self, pending: Pending, n: int | None = None) -> dict:
        """Commit a prepared update on every server with version number `n` (default: one
        above every server's); see `update` for what it returns and raises."""
        n = n or pending.floor + 1
        if n <= pending.floor:
            self.abort(pending)  # staged, maybe paused ahead: not left so until the lease ends
            raise RemoteError(f"version number {n} must be above {pending.floor}; the update "
                              "was aborted on every server")
        status, self._leased = pending.status, {}
        committed, failed = {}, {}
        nexts = {}  # url -> the id of its channel's next update: it waits for it from now
        for link in self.links:
            link.next = uuid.uuid4().hex
            nexts |= {u: link.next for u, _ in link.members}
        # the reference changes now: until the commits are known, no server holds it (if
        # what follows raises, the next update syncs every server again whole)
        self._held = {}
        with ThreadPoolExecutor(1) as pool:  # while the servers commit
            remembered = pool.submit(self.checkpoint.sync, pending.new, n) \
                if self.reference_mode == "checkpoint" else \
                pool.submit(self.reference.remember, pending.new, pending.deltas,
                            pending.frozen)
            outs = self._each(lambda u: self._post(
                u, status[u], "/hotweights/commit", n=n, next_update=nexts.get(u, ""),
                http_timeout=pending.lease_s + self.timeout + 60),  # the server's pause
                errors=True, urls=list(status))  # may take the lease, then it applies
        try:
            remembered.result()
            kept = True
        except Exception:  # (a pinned host copy that cannot be had, say): the servers
            # committed all the same; with no copy of what they hold, the next update syncs
            logger.exception("hotweights: version %d: the copy of what the servers now hold "
                             "could not be kept; the next update syncs them whole", n)
            kept = False  # them whole
        for u, out in outs.items():
            (failed if isinstance(out, Exception) else committed)[u] = out
        if failed:  # a commit lost on its way: not left staged (maybe paused ahead) until
            # its lease ends (one made refuses the abort; one not answered, the next
            # update's `_abort_left` tries again)
            self._abort(status, list(failed), http_timeout=min(self.timeout, 30.0))
        self._prefilter.prints = pending.prints
        self.n = n
        self._held = {u: (status[u]["server_id"], n) for u in committed} if kept else {}
        if changed := _changed_since(pending):  # the copy kept is not what the servers got
            logger.warning("hotweights: %s changed between prepare and commit (e.g. %s): the "
                           "servers hold the values prepare read; the next update syncs "
                           "them again whole", f"{len(changed)} tensor(s)", changed[0])
            self._held = {}
        self.bytes_sent += pending.sent
        result = {"version": n, "full": list(pending.full),
                  "from_checkpoint": list(pending.from_checkpoint),
                  "bytes_sent": pending.sent, "bytes": dict(pending.carried),
                  "seconds": time.perf_counter() - pending.started,
                  "servers": {u: out["version"] for u, out in committed.items()},
                  "paused_ms": {u: None if out.get("paused_s") is None else
                                round(out["paused_s"] * 1e3, 3)
                                for u, out in committed.items()},
                  "dropped": pending.dropped}
        if failed and (self.require == "all" or not committed):
            raise RemoteError(f"version {n} is served by {sorted(committed) or 'no server'}; "
                              f"the commit failed on {named(failed)}; that server is "
                              "caught up at the next update")
        if failed:
            logger.warning("hotweights: version %d: the commit failed on %s; caught up at the "
                           "next update", n, named(failed))
            result["dropped"] = {**pending.dropped, **{u: str(e) for u, e in failed.items()}}
        logger.info("hotweights: version %d on %d servers, %d bytes sent%s in %.2f s", n,
                    len(committed), pending.sent, f" (the whole model to {list(pending.full)})"
                    if pending.full else "", result["seconds"])
        return result

    def abort(self, pending: Pending) -> None:
        """Drop a prepared update everywhere: every server goes on at its old version."""
        self._leased = {}
        self.bytes_sent += pending.sent  # sent all the same
        self._abort(pending.status, list(pending.status))

    def _abort(self, status: dict, urls: list[str], *, http_timeout: float | None = None
               ) -> dict[str, Exception]:
        """Abort the update this group staged on `urls` (nothing written: the version
        stays); return the servers that did not answer, named in a warning: each drops it
        by itself when its lease ends, and this group's next update aborts it first. A
        refusal says there is none (committed, expired, or never begun)."""
        outs = self._each(lambda u: self._post(u, status[u], "/hotweights/abort", dirty=False,
                                               http_timeout=http_timeout),
                          errors=True, urls=urls)
        if silent := {u: e for u, e in outs.items() if isinstance(e, Exception)
                      and unanswered(e)}:
            logger.warning("hotweights: no answer to the abort from %s: it drops the update "
                           "when its lease ends, or at this group's next update",
                           named(silent))
        return silent

    def _abort_left(self, status: dict) -> None:
        """Abort the updates this group left staged on servers of `status` (its commit or
        abort lost on the way): else such a server refuses every update until its lease
        ends (a channel's join waits for no update staged)."""
        if left := [u for u, st in status.items() if st.get("holder") == self.holder
                    and st.get("state") in ("staging", "draining", "paused")]:
            logger.warning("hotweights: %s still staged this group's last update (its "
                           "commit or abort was lost): aborted first", left)
            self._abort(status, left)

    def renew(self, lease_s: float | None = None) -> None:
        """Extend the lease of the update in progress on every server that began it (the
        update does it by itself during its encode and send; call it between `prepare`
        and a late `commit`). With ``require="any"``, a server that refuses or does not
        answer is named in a warning and the others are renewed all the same (its commit
        fails, and the next update catches it up).

        Raises:
            RemoteError: naming each server that refused or did not answer, with
                ``require="all"`` or when none renewed.
        """
        leased, lease_s = self._leased, lease_s or self._lease_s()
        outs = self._each(lambda u: self._post(  # an answer within a third of the lease:
            u, leased[u], "/hotweights/renew", lease_s=lease_s,  # a server that hangs
            http_timeout=max(1.0, min(self.timeout, lease_s / 3))),  # holds no one else's
            errors=True, urls=list(leased))  # renewal past its lease
        if failed := {u: e for u, e in outs.items() if isinstance(e, Exception)}:
            refused = {u: e for u, e in failed.items() if not unanswered(e)}
            if refused and self.require == "all":
                self._lease_lost = named(refused)  # the send then fails (`_send`)
            for u in refused if self.require == "any" else ():  # its lease is gone (its
                leased.pop(u, None)  # commit fails): the others' renewals go on
            if self.require == "all" or len(failed) == len(outs):
                raise RemoteError(named(failed), no_answer=not refused or (
                    self.require == "any" and len(refused) < len(failed)))
            logger.warning("hotweights: lease renewal failed on %s (the others go on)",
                           named(failed))

    def _lease_s(self) -> float:
        return max(60.0, 4 * self.timeout)

    def restore(self, weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> bool:
        """Write what the servers hold back into `weights`, in place: undoes a trainer's
        step that the servers did not take (`Reference.restore`; False if it cannot)."""
        if self._casts:
            logger.warning("hotweights: the step cannot be undone: the servers hold %d "
                           "tensor(s) in a narrower float than the trainer's (e.g. %s), and "
                           "their values would round the trainer's", len(self._casts),
                           next(iter(self._casts)))
            return False
        if self.reference.tensors is not None and not self._held:
            logger.warning("hotweights: the step cannot be undone: no server holds what this "
                           "group keeps as their values (the last commit failed, or the "
                           "weights changed between its prepare and commit); the next update "
                           "syncs the servers whole")
            return False
        return self.reference.restore(weights, _weights(weights))

    def _encode(self, plan: _Plan, new: dict, kept: set[str], rows: dict | None
                ) -> Iterator[delta.Delta]:
        """The deltas for the servers of `plan`, one tensor at a time: against what they
        hold, the blocks whose fingerprint did not change since the last update left
        uncompared where they hold what this group sent (`rows`), the tensors in `kept`
        left out. Patch values that hold NaN or Inf are refused here: the servers check
        everything else they stage, but xor-coded values only become values in their
        commit."""
        if plan.held:
            new = {k: t for k, t in new.items() if k not in kept}
        for d in delta.encode_each(plan.reference, new, rows=rows if plan.held else None):
            if d.kind == delta.PATCH and d.dtype.is_floating_point and \
                    not delta_apply.finite(d.values):
                raise DeltaError(f"`{d.name}`: the patch values hold NaN or Inf; refused")
            yield d
        if plan.reference is not None and plan.reference is not self.reference.tensors and \
                self.checkpoint.written():
            # in place (journal mode): the memory-mapped old values may have moved under us
            raise RemoteError(f"{self.checkpoint.path} was written during the update; the update "
                              "was given up on every server: update again")

    def _checkpoint_for(self, stale: list[dict], new: dict) -> dict | None:
        """The checkpoint's tensors, where every server of `stale` holds it (`held_by`)."""
        return None if self.checkpoint is None else self.checkpoint.held_by(stale, new)

    def _send(self, status: dict, plans: list[tuple[_Plan, Link]],
              encode: Callable[[_Plan], Iterator[delta.Delta]], cut_bytes: int, mode: str,
              lease_s: float, meanwhile: Callable[[], None] = lambda: None,
              pause_ahead: bool = False) -> list[tuple]:
        """Begin everywhere, then for each plan encode and broadcast on its channel while
        its servers receive; on failure abort all. Returns (the deltas, bytes each of its
        servers received, bytes that left this process) for each plan once every server's
        workers have staged the whole update.

        A begin takes the lease without pausing (`stage`): each server goes on serving the
        old version while this process encodes and sends, and pauses only in its commit.
        A plan's servers' workers are asked to receive the update (on threads of their own:
        they wait for its start on the channel up to the lease), then the encode runs as the
        rounds are sent: a round goes once it is full or its deltas cover `cut_bytes` of the
        weights and it holds `_CUT_PAYLOAD` bytes (or was opened `_CUT_WAIT` s ago), and the
        servers stage it while the next one is encoded. Once the last plan's last round is
        on its way, if it is small (`_AHEAD_BYTES`) and `pause_ahead` (the commit follows at
        once), every server is told to start its commit's pause (a renew with `pause`): the
        engine step in flight ends while that round travels and is staged, not in the
        commit. The lease is renewed
        every `lease_s / 3` until the sends end, however long they take. `meanwhile` runs on
        a thread while the begins travel, the lease renewed from theirs on until it ends."""
        self._seq += 1  # every request of this try of the update carries it (`_post`,
        # bound now: also one a starved thread sends late): the servers refuse one of an
        # earlier try or update that arrives late
        post = functools.partial(self._post, seq=self._seq)
        pool = ThreadPoolExecutor(2 * len(status) + 1)
        begins, out, on, hints, meantime = {}, [], None, [], []  # on: (link, update) sent
        received: list[Future] = []  # each server's receive request
        counted = [(link.channel, link.channel.bytes_sent) for _, link in plans]
        deltas, started = _Encoded(), False
        try:
            begins = {u: pool.submit(post, u, status[u], "/hotweights/begin", mode=mode,
                                     lease_s=lease_s, stage=True) for u in status}
            meantime.append(pool.submit(meanwhile))
            _raise_failed(begins, "begin")
            self._leased, self._lease_lost = dict(status), ""

            def hint_pause(last: packing.Round) -> None:  # a server that does not answer it
                # (in _HINT_S) pauses in its commit
                if last.header.get("raw_nbytes", last.header["nbytes"]) <= _AHEAD_BYTES:
                    hints.extend(pool.submit(post, u, status[u], "/hotweights/renew",
                                             http_timeout=_HINT_S, lease_s=lease_s,
                                             pause=True) for u in status)

            with Renewer(self.renew, lease_s):
                meantime[0].result()  # the lease renewed while it ends
                for i, (plan, link) in enumerate(plans):
                    on, link.next, started = (link, link.next or uuid.uuid4().hex), "", False
                    receipts = self._receive(pool, post, {u: status[u] for u in plan.urls},
                                             on[1], lease_s)
                    received.extend(receipts.values())
                    deltas = _Encoded()
                    rounds = packing.pack(
                        deltas.read(encode(plan)), max_bytes=self.max_round_bytes,
                        staging=self._round_buffers(link.channel.device),
                        values="xor" if link.xor else "raw", compress=self.compress,
                        cut_bytes=cut_bytes, cut_payload=_CUT_PAYLOAD, cut_wait=_CUT_WAIT)
                    rounds = self._while_leased(rounds)  # a renewal refused: stop
                    if i == len(plans) - 1 and pause_ahead:
                        rounds = _then_last(rounds, hint_pause)
                    first = next(rounds)  # the receivers wait for the start in the store,
                    # up to the lease, while it is encoded (in the collective: the timeout)
                    try:
                        link.channel.start(on[1], check=lambda r=receipts: _raise_failed(
                            r, "receive", wait=False))
                        started = True
                        sent = link.channel.send(itertools.chain([first], rounds), ahead=True)
                    except RemoteError as e:  # it names the rank: no need to wait for receipts
                        if e is deltas.failed:
                            raise
                        raise RemoteError(link.named(str(e))) from e
                    out.append((deltas, sent, sent * link.channel.copies))
                    on = None
                # every worker has staged it all (the channel's acknowledgement), maybe
                # before its server had the receive (workers armed by the last commit take
                # the update without it; a loaded machine may send that request late): the
                # commit goes once each receive has answered (a server's refusal, or one
                # still unanswered, then reaches its commit), the lease renewed meanwhile
                if late := futures.wait(received, timeout=self.timeout).not_done:
                    logger.warning("hotweights: %d receive request(s) unanswered after %.0f "
                                   "s: their servers refuse the commit", len(late),
                                   self.timeout)
            self._check_leased()  # (the last round's renewals)
            futures.wait(hints)  # a late pause must not reach the server's next update
            pool.shutdown(wait=False)
            return out
        except BaseException as e:
            self._leased = {}
            self._lost += sum((c.bytes_sent - before) * c.copies for c, before in counted)
            futures.wait([*begins.values(), *hints, *meantime])  # a begin still travelling
            # (`meanwhile` failed), a pause that must not reach the server's next update
            pool.shutdown(wait=False, cancel_futures=True)  # a receive request still
            # travelling carries this update's number: the server refuses it under the next
            if on is not None and e is deltas.failed:  # the encode's (bad input, named): the
                # receivers learn it from the send (an abort) or from a cancel, before it
                if not started:
                    on[0].channel.cancel(on[1])
                on = None  # the channel stands
            if on is not None:  # receivers still waiting for it give up; then the channel is
                # left: the survivors' receive fails at once (not at their timeout) and a
                # server whose own relay broke joins afresh at the next update
                on[0].channel.cancel(on[1])
                self.links.drop(on[0])
            began = [u for u, f in begins.items() if not f.cancelled() and f.done()
                     and f.exception() is None]
            sent = [u for u, f in begins.items() if not f.cancelled()]  # a begin whose answer
            # was lost may have taken the lease: aborted too (where none did, it is refused)
            silent = self._abort(status, sent, http_timeout=self.timeout + 30)
            if isinstance(e, HotweightsError) and on is not None:  # else: bad input, named
                left = [u for u in began if u not in silent]
                raise RemoteError(f"update not applied anywhere: {e}; servers at their "
                                  f"old version: {left}" + (
                                      f"; no answer to the abort from {sorted(silent)} (each "
                                      "drops it when its lease ends)" if silent else "")) from e
            raise

    def _while_leased(self, rounds: Iterator[packing.Round]) -> Iterator[packing.Round]:
        for r in rounds:
            self._check_leased()
            yield r

    def _check_leased(self) -> None:
        if self._lease_lost:  # require="all": its commit would fail after the others'
            raise RemoteError(f"the lease of this update was lost during its send on "
                              f"{self._lease_lost}: aborted everywhere, every server at its "
                              "old version")

    def _round_buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The two buffers the rounds are packed into in turn (one is broadcast while the
        next round is packed into the other), reused: their pages are touched only as far as
        the biggest round (fresh pages for every round cost a full sync ~0.3 s per GB)."""
        size = self.max_round_bytes // 8 * 8
        if self._staging is None or self._staging[0].numel() < size or \
                self._staging[0].device != device:
            self._staging = tuple(torch.empty(size, dtype=torch.uint8, device=device)
                                  for _ in range(2))
        return self._staging

    def _receive(self, pool: ThreadPoolExecutor, post: Callable[..., dict], status: dict,
                 update: str, lease_s: float) -> dict:
        """Ask every server to receive `update` (its workers wait for its start on the
        channel, on threads of their own); return those requests' futures."""
        return {u: pool.submit(post, u, status[u], "/hotweights/remote/receive",
                               update=update, wait_s=lease_s,
                               http_timeout=lease_s + self.timeout + 60) for u in status}

    def close(self) -> None:
        """Leave the channels (the servers keep serving; the next update rebuilds them)."""
        self.links.close()

    def __enter__(self) -> RemoteGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- HTTP ------------------------------------------------------------------------------

    def _post(self, url: str, status: dict, route: str, *, http_timeout: float | None = None,
              seq: int | None = None, **body: Any) -> dict:
        """`seq`: the number of the update the request belongs to (else the one in
        progress)."""
        body = dict(holder=self.holder, server_id=status["server_id"],
                    seq=self._seq if seq is None else seq, **body)
        return request(url, "POST", route, self._tokens[url], body,
                       timeout=http_timeout or self.timeout + 60, cafile=self.cafile)

    def _each(self, fn: Callable[[str], Any], *, errors: bool = False,
              urls: list[str] | None = None) -> dict[str, Any]:
        """fn(url) for every server at once; with `errors`, a failure is returned, not
        raised."""
        urls = self.urls if urls is None else urls
        if not urls:
            return {}
        with ThreadPoolExecutor(len(urls)) as pool:
            futures = {u: pool.submit(fn, u) for u in urls}
            outs = {u: outcome(f) for u, f in futures.items()}
        if not errors and (failed := {u: e for u, e in outs.items()
                                      if isinstance(e, Exception)}):
            raise RemoteError(named(failed))
        return outs


def _check_args(*, timeout, master_addr, master_port, checkpoint, trainable, max_round_bytes,
                require, compress, reference) -> str | tuple[str, ...] | None:
    """`trainable` (an iterable read once, into a tuple), once `RemoteGroup` can take its
    arguments; else a RemoteError naming the first it cannot (before any server is asked,
    or a route looked up)."""
    if type(max_round_bytes) is not int or max_round_bytes < packing.MIN_ROUND_BYTES:
        raise RemoteError(f"field 'max_round_bytes' must be an int >= "
                          f"{packing.MIN_ROUND_BYTES}, found {max_round_bytes!r}")
    if require not in REQUIRE:
        raise RemoteError(f"field 'require' must be one of {REQUIRE}, found {require!r}")
    if compress not in packing.COMPRESS:
        raise RemoteError(f"field 'compress' must be one of {list(packing.COMPRESS)}, found "
                          f"{compress!r}")
    if reference not in REFERENCES or reference == "checkpoint" and checkpoint is None:
        raise RemoteError(f"field 'reference' must be one of {REFERENCES}, 'checkpoint' "
                          f"with checkpoint=DIR; found {reference!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or \
            not 0 < timeout <= _MAX_TIMEOUT:
        raise RemoteError(f"field 'timeout' must be a number of seconds in (0, "
                          f"{_MAX_TIMEOUT:.0f}], found {timeout!r}")
    if master_addr is not None and not isinstance(master_addr, str):
        raise RemoteError(f"field 'master_addr' must be an address (a str), found "
                          f"{master_addr!r}")
    if type(master_port) is not int or not 0 <= master_port <= 65535:
        raise RemoteError(f"field 'master_port' must be a port (0: any free one), found "
                          f"{master_port!r}")
    if checkpoint is not None and not Path(checkpoint).is_dir():
        raise RemoteError(f"field 'checkpoint': {checkpoint} is not a directory")
    if trainable is None or isinstance(trainable, str):
        return trainable
    if isinstance(trainable, Iterable):
        trainable = tuple(trainable)
        if all(isinstance(t, str) for t in trainable):
            return trainable
    raise RemoteError(f"field 'trainable' must be names or patterns (a str or strs), found "
                      f"{trainable!r}")


def _then_last(items: Iterator, then: Callable[[Any], None]) -> Iterator:
    """`items`, then `then(the last item)` once they are exhausted (if there was one)."""
    last = none = object()
    for last in items:
        yield last
    if last is not none:
        then(last)


def channel_device(backend: str, tensors: Iterable[torch.Tensor]) -> torch.device | None:
    """Where a channel's buffers go: NCCL's on the weights' GPU (not the current one,
    maybe another server's); gloo's on the CPU (its default), beside CUDA weights too."""
    if backend != "nccl":
        return None
    return next((t.device for t in tensors if t.device.type == "cuda"), None)


def _raise_failed(futures: dict, what: str, *, wait: bool = True) -> None:
    """RemoteError naming every server whose request (`futures`: url -> future) for `what`
    failed. Without `wait`, only the requests done count."""
    outs = {u: outcome(f) for u, f in futures.items() if wait or f.done()}
    if failed := {u: e for u, e in outs.items() if isinstance(e, Exception)}:
        raise RemoteError(f"{what} failed on {named(failed)}")


def _changed_since(pending: Pending) -> list[str]:
    """The tensors of `pending` written in place since `prepare` read them (their version
    counters moved): the servers received the values read then, not these."""
    return [k for k, (t, version) in pending.written.items() if t._version != version]


def _weights(weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(weights, torch.nn.Module):  # a tied weight once, under the checkpoint's
        # names: transformers' fused MoE experts split back, per expert, as views of them
        weights = reverted(model_weights(weights), model=weights, views=True)
    return {k: t.detach() if t.is_contiguous() else t.detach().contiguous()
            for k, t in weights.items()}
