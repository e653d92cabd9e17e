"""The update transaction of one server: named states, the allowed transitions, versions.

    idle/expired --begin--> draining --paused--> paused --commit--> committing --> idle
                               |                   |--abort------------------------> idle
                               |                   '--lease expires----------------> expired
                               '--abort, drain timeout, failure------------------> idle

    idle/expired --begin(stage)--> staging --commit: pause, apply--> committing --> idle
                                      '--abort, lease expires------------------------> idle

`staging` (remote servers, whose weights the trainer never writes): the holder has the
lease while generation runs on, the update's rounds arrive into staging; only the commit
pauses (in the begin's mode), applies, resets the caches and resumes. A renew with `pause`
(the trainer's "the last round is on its way") starts that pause early while requests are
in flight, so that the wait for the engine step in flight overlaps the end of the transfer
instead of the commit. Nothing was written when a staged update is aborted or its lease
runs out: the version stays, not dirty.

A version is `N@SERVER` (e.g. `7@3f9a1c2b`): N counts the weight states one server has
served, SERVER is random per server start, so two weight states never share a version,
across restarts too. Any resume that may follow a write gets a new N: a commit, an abort
that says the trainer may have written, a lease that expired. A holder that began to read
only (`read`, an exclusive checkpoint) writes nothing: its lease ends at the same version.
A lease whose holder's process runs beside the server (`process`) also ends, as if it ran
out, once that process exits (`_watch`): a killed trainer freezes generation for a poll,
not for the rest of its lease. `dirty` says that no commit
vouched for the weights being served (an abort, an expiry, a failed post-update hook or
cache reset); the next clean commit clears it. `dirty_versions` keeps which versions were
served dirty.

Pure: no HTTP, no vLLM. The server plugs vLLM in through `Engine`; tests use a stub.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from hotweights.protocol import process
from hotweights.server.bodies import (
    DEFAULT_LEASE_S,
    Abort,
    Begin,
    Body,
    Commit,
    Refused,
    Renew,
)

logger = logging.getLogger(__name__)

_AHEAD = {"abort": "keep"}  # a pause begun ahead of a staged commit (a renew's hint) in
# abort mode freezes the requests in flight: the commit ends them, an update that fails
# before it does not
_KEPT_DIRTY = 100  # dirty versions remembered
_KEPT_ENDED = 1000  # holders whose last numbered lease's number is remembered


class State(enum.Enum):
    IDLE = "idle"  # serving; no update
    DRAINING = "draining"  # begin: new requests held, in-flight ones finishing or aborted
    PAUSED = "paused"  # leased: the holder writes the weights
    STAGING = "staging"  # leased, still serving: a remote server receives the update
    COMMITTING = "committing"  # hook, cache reset, version bump, resume
    EXPIRED = "expired"  # serving again after a lease expired; weights dirty


class NothingApplied(Exception):
    """`Engine.after_update` wrote nothing (a remote server whose receive failed): the
    weights are the old ones, and the version stays."""


class Engine(Protocol):
    """What the transaction needs from the server (vLLM in production, a stub in tests)."""

    def hold(self) -> None:
        """Hold new generation requests at the door."""

    def release(self) -> None:
        """Let held and new requests through."""

    async def pause(self, mode: str) -> None:
        """Pause generation (mode wait/abort/keep); return once the weights are idle."""

    async def resume(self) -> None: ...

    def busy(self) -> bool:
        """Whether requests are in flight (a pause then waits for the engine step)."""

    async def after_update(self) -> None:
        """Apply what was staged (remote servers), then the workers' post-update hook;
        raises on failure (`NothingApplied` where no weight was written)."""

    async def discard(self) -> None:
        """Drop a staged update (remote servers); the weights stay as they are."""

    async def reset_caches(self) -> None:
        """Drop every cache that holds weights-derived state; raises on failure."""

    async def set_version(self, label: str) -> None: ...


def version_label(n: int, server_id: str) -> str:
    return f"{n}@{server_id}"


# -- what the transaction keeps: versions, the lease ----------------------------------------


@dataclass
class Versions:
    """Which weight state one server serves: its number `n`, whether no commit vouched for it
    (`dirty`, and why), and the numbers of the last versions served dirty."""

    server_id: str
    n: int = 0
    dirty: bool = False
    dirty_reason: str | None = None
    dirty_numbers: list[int] = field(default_factory=list)  # the last _KEPT_DIRTY

    @property
    def label(self) -> str:
        return version_label(self.n, self.server_id)

    def advance(self, dirty_reason: str | None, n: int = 0) -> None:
        """Serve version `n` (0: the next one), dirty unless `dirty_reason` is None."""
        self.n = n or self.n + 1
        self.dirty, self.dirty_reason = dirty_reason is not None, dirty_reason
        if self.dirty:
            self.dirty_numbers = [*self.dirty_numbers, self.n][-_KEPT_DIRTY:]

    def dirty_labels(self) -> list[str]:
        return [version_label(n, self.server_id) for n in self.dirty_numbers]


class Lease:
    """The update lease's deadline and the timer that ends it.

    Args:
        clock: wall-clock time for the deadline.
        on_expiry: awaited with the holder when a lease runs out.
    """

    def __init__(self, clock: Callable[[], float],
                 on_expiry: Callable[[str | None], Awaitable[None]]):
        self.clock, self._on_expiry = clock, on_expiry
        self.expires: float | None = None  # unix time; while draining, the drain's deadline
        self._timer: asyncio.Task | None = None

    def arm(self, holder: str | None, lease_s: float) -> None:
        """(Re)start the timer: `on_expiry(holder)` in `lease_s` seconds."""
        self.disarm()
        self.expires = self.clock() + lease_s
        self._timer = asyncio.ensure_future(self._expire_after(lease_s, holder))

    def disarm(self) -> None:
        """Stop the timer, keep the deadline; an expiry in progress runs to its end."""
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()
        self._timer = None

    def end(self) -> None:
        self.disarm()
        self.expires = None

    async def _expire_after(self, delay: float, holder: str | None) -> None:
        await asyncio.sleep(delay)
        await self._on_expiry(holder)


# -- the transaction --------------------------------------------------------------------------


class Transaction:
    """One server's update state machine. Every method runs on the server's event loop.

    Args:
        engine: the server's generation control (see `Engine`).
        server_id: this server start's id; every update request must name it.
        clock: wall-clock time for lease deadlines (tests may pass their own).
        watch: a begin's `process` -> a probe that says whether it exited, or None where
            it cannot be watched (`process.watch`).
        poll_s: how often a holder's process is looked at.
    """

    def __init__(self, engine: Engine, server_id: str, *, clock=time.time,
                 watch: Callable[[str], Callable[[], bool] | None] = process.watch,
                 poll_s: float = 0.5):
        self.engine, self.server_id, self.clock = engine, server_id, clock
        self.watch, self.poll_s = watch, poll_s
        self._read = False  # the holder only reads the weights (`Begin.read`)
        self._process = ""  # the holder's (`Begin.process`)
        self._watcher: asyncio.Task | None = None  # its exit (`_watch`)
        self.state = State.IDLE
        self.versions = Versions(server_id)
        self.lease = Lease(clock, self.expire)
        self.holder: str | None = None
        self.seq = 0  # the holder's update the lease is of (`Body.seq`; 0: unnumbered)
        self._ended: dict[str, int] = {}  # holder -> the number of its last lease that
        # ended (the latest `_KEPT_ENDED` holders'): a begin of it or before is refused
        self.mode: str | None = None
        self.expired: dict | None = None  # holder, at, version of the last expired lease
        self._expiry_news: str | None = None  # its holder, until a lease is taken again
        self.updates = 0
        self.last_pause_s: float | None = None
        self.last_paused_s: float | None = None  # generation paused: pause to resume
        self._held_at: float | None = None  # new requests held since
        self._paused_at: float | None = None  # generation paused since
        self._drain_s = DEFAULT_LEASE_S  # a staged update's drain bound: its begin's lease
        self.last_commit_s: float | None = None
        self.last_update_s: float | None = None  # begin to the end of commit
        self._began = 0.0
        self._pausing: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # transitions; never held while draining

    @property
    def version(self) -> str:
        return self.versions.label

    @property
    def n(self) -> int:
        return self.versions.n

    @property
    def dirty(self) -> bool:
        return self.versions.dirty

    def status(self) -> dict:
        return dict(
            server_id=self.server_id, version=self.version, n=self.n, state=self.state.value,
            paused=self._held_at is not None,
            holder=self.holder, mode=self.mode, lease_expires=self.lease.expires,
            lease_left_s=None if self.lease.expires is None else max(
                0.0, self.lease.expires - self.clock()),  # by this server's clock
            dirty=self.dirty, dirty_reason=self.versions.dirty_reason,
            dirty_versions=self.versions.dirty_labels(),
            expired=self.expired and dict(self.expired, ago_s=max(  # (by this server's
                0.0, self.clock() - self.expired["at"])),  # clock, as lease_left_s)
            updates=self.updates, last_pause_s=self.last_pause_s,
            last_paused_s=self.last_paused_s, last_commit_s=self.last_commit_s,
            last_update_s=self.last_update_s,
        )

    # -- requests ------------------------------------------------------------------------

    async def begin(self, req: Begin) -> dict:
        """Hold new requests, drain or abort in-flight ones, pause, and lease the weights.

        The whole drain is bounded by `lease_s`; a drain that times out, fails or is
        cancelled resumes generation. The holder's retry of a begin joins the first one.
        With `stage`, only the lease is taken: generation goes on (see the module doc).
        """
        async with self._lock:
            self.check_server(req.server_id)
            # (a commit holds the lock to its end: never COMMITTING here)
            if self.state in (State.DRAINING, State.PAUSED, State.STAGING):
                if req.holder != self.holder:
                    raise self._held()
                self._check_seq(req, "begin", later=True)  # a later update of the holder's
                # takes over the lease its last left (an abort that got no answer)
                if req.process != self._process:  # (the same holder name, another
                    raise Refused(409, f"{req.holder} already began an update from "  # process)
                                  f"another process ({self._process or 'unnamed'})",
                                  holder=self.holder)
                if req.mode != self.mode or req.stage != (self.state is State.STAGING) \
                        or req.read != self._read:
                    raise Refused(409, f"{req.holder} already began an update in mode "
                                  f"{self.mode!r} ({self.state.value}{', read' * self._read}),"
                                  f" not {req.mode!r}{' staged' if req.stage else ''}"
                                  f"{' read' if req.read else ''}", holder=self.holder)
                self.seq = max(self.seq, req.seq)
                if self.state is not State.DRAINING:  # a retry: the lease runs from now
                    self.lease.arm(self.holder, req.lease_s)
                    return self._granted()
                pausing = self._pausing
            elif req.seq and req.seq <= (ended := self._ended.get(req.holder, 0)):
                raise Refused(409, f"begin of {req.holder}'s update {req.seq}, but its update "
                              f"{ended} ended: a request that arrived late, refused (a "
                              "holder numbers its updates rising)")
            elif req.stage:
                self.state, self.holder, self.mode = State.STAGING, req.holder, req.mode
                self.seq = req.seq
                self._read, self._expiry_news = req.read, None  # (a lease since: old news)
                self._watch(req)
                self._began, self._drain_s = time.perf_counter(), req.lease_s
                self.lease.arm(self.holder, req.lease_s)
                return self._granted()
            else:
                self.state, self.holder, self.mode = State.DRAINING, req.holder, req.mode
                self.seq = req.seq
                self._read, self._expiry_news = req.read, None  # (a lease since: old news)
                self._watch(req)
                self.lease.expires = self.clock() + req.lease_s  # the drain's deadline
                self._began = time.perf_counter()
                self._hold()
                pausing = self._pausing = asyncio.ensure_future(self._pause(req))
        await asyncio.shield(pausing)  # a cancelled caller leaves the drain to its owner
        return self._granted()

    def _watch(self, req: Begin) -> None:
        """Watch the process of `req`'s holder where it runs beside this server (same
        machine, same pid namespace): once it exits (a trainer killed, crashed or out of
        memory), its lease ends as if it ran out, without the wait; in its drain, as an
        abort (its begin never returned: nothing was written)."""
        if self._watcher is not None:  # (the last holder's: over, or about to notice)
            self._watcher.cancel()
        self._process, self._watcher = req.process, None
        if req.process and (exited := self.watch(req.process)) is not None:
            self._watcher = asyncio.ensure_future(self._watch_exit(req.holder, exited))

    async def _watch_exit(self, holder: str, exited: Callable[[], bool]) -> None:
        while self.holder == holder:
            await asyncio.sleep(self.poll_s)
            if self.holder != holder or self.state is State.COMMITTING or not exited():
                continue
            why = f"the process of {holder} (pid {self._process.rsplit(':', 2)[1]}) exited"
            if self.state is State.DRAINING:  # (dead then: it never got the answer)
                logger.warning("hotweights: %s in its begin; resuming", why)
                with contextlib.suppress(Refused):  # (another lease meanwhile)
                    await self.abort(Abort(holder, self.server_id, dirty=False))
            else:
                await self.expire(holder, why)
            return

    def _hold(self) -> None:
        self._held_at = time.perf_counter()
        self.engine.hold()

    async def _paused(self, mode: str, timeout: float) -> None:
        """Pause generation (in-flight requests drained, aborted or frozen first)."""
        await asyncio.wait_for(self.engine.pause(mode), timeout)
        self._paused_at = time.perf_counter()

    async def _pause(self, req: Begin) -> None:
        """The drain of `req` (this task: `_pausing`). An abort ends it (`_pausing` then
        None), and the same holder's next begin may start another before this one unwinds:
        it is told apart by its task, not by its holder."""
        ours = asyncio.current_task()
        try:
            await self._paused(req.mode, req.lease_s)
        except BaseException as e:
            async with self._lock:
                if self._pausing is ours and self.state is State.DRAINING:
                    await self._resume("drain failed")
            if isinstance(e, TimeoutError):
                raise Refused(503, f"in-flight requests did not finish within lease_s="
                              f"{req.lease_s} s; generation resumed; {_retry(req.mode)}") \
                    from None
            if isinstance(e, asyncio.CancelledError):
                raise Refused(409, f"{req.holder} aborted its begin") from None
            raise
        async with self._lock:
            if self.state is not State.DRAINING or self._pausing is not ours:  # an abort
                raise Refused(409, f"{req.holder} aborted its begin")  # came first: resumed
            self.state = State.PAUSED
            self.last_pause_s = time.perf_counter() - self._began
            self.lease.arm(self.holder, req.lease_s)

    async def _pause_for_commit(self, mode: str) -> Exception | None:
        """Pause for a staged update's commit, in `mode` and bounded by its lease; what
        failed, for the commit to report."""
        self._hold()
        try:
            await self._paused(mode, self._drain_s)
        except Exception as e:
            return e
        return None

    async def _pause_staged(self) -> None:
        """Pause for a staged update's commit (or finish the pause a renew started); if that
        fails, the update is dropped and generation resumes at the old version."""
        ahead = self._pausing is not None
        pausing = self._pausing or asyncio.ensure_future(self._pause_for_commit(self.mode))
        if (e := await pausing) is None and ahead and self.mode in _AHEAD:
            try:  # the requests frozen ahead end now (still paused: `_paused_at` stays)
                await asyncio.wait_for(self.engine.pause(self.mode), self._drain_s)
            except Exception as err:
                e = err
        if e is not None:
            mode = self.mode  # (the resume forgets it)
            await self._discard_quietly()
            await self._resume("commit's pause failed")
            why, then = (f"in-flight requests did not finish within lease_s={self._drain_s} "
                         f"s", _retry(mode)) if isinstance(e, TimeoutError) else (
                f"pausing failed ({e!r})", "update again")
            raise Refused(503, f"{why}; the staged update was dropped, the server serves "
                          f"{self.version}; {then}") from None
        self.last_pause_s = self._paused_at - self._held_at

    async def renew(self, req: Renew) -> dict:
        async with self._lock:
            self.check_lease(req, "renew")
            self.lease.arm(self.holder, req.lease_s)
            if req.pause and self.state is State.STAGING and self._pausing is None \
                    and self.engine.busy():  # idle, the commit's pause takes no wait
                self._pausing = asyncio.ensure_future(self._pause_for_commit(
                    _AHEAD.get(self.mode, self.mode)))
            return self._granted()

    async def commit(self, req: Commit) -> dict:
        """Post-update hook, cache reset, a new version, resume; `dirty` if a step failed.
        A staged update pauses first (a drain that fails: resumed, the update dropped)."""
        async with self._lock:
            self.check_lease(req, "commit")
            if self._read:
                raise Refused(409, f"{req.holder} began to read the weights (read=true), "
                              "not to update them: abort, or begin again without read")
            if req.n and req.n <= self.n:
                raise Refused(409, f"field 'n' ({req.n}) must be above the version number "
                              f"served ({self.n})", n=self.n)
            staged, self.state = self.state is State.STAGING, State.COMMITTING
            self.lease.disarm()
            started = time.perf_counter()
            if staged:
                try:
                    await self._pause_staged()
                except Refused:  # the pause failed: dropped and resumed already
                    raise
                except BaseException:  # cancelled (a server shutting down): not left paused
                    await self._discard_quietly()
                    await self._resume("commit cancelled")
                    raise
            failed, kept = ["the commit (cut short)"], None  # until both steps answered
            try:  # both at once, each while paused: the engine serves them in order, at
                # the cost of one round trip
                steps = (self.engine.after_update, self.engine.reset_caches)
                outs = await asyncio.gather(*(step() for step in steps),
                                            return_exceptions=True)
                if isinstance(outs[0], NothingApplied):  # the weights, and so the caches,
                    # are the old ones: the version stays, whatever the cache reset did
                    kept = outs[0]
                    outs = (None, None if isinstance(outs[1], Exception) else outs[1])
                failed = [step.__name__ for step, out in zip(steps, outs, strict=True)
                          if isinstance(out, BaseException)]
                for step, out in zip(steps, outs, strict=True):
                    if isinstance(out, Exception):
                        logger.error("hotweights: %s failed; weights marked dirty",
                                     step.__name__, exc_info=out)
                    elif isinstance(out, BaseException):
                        raise out
            finally:  # whatever happened, the trainer wrote: a new version, and resume
                # our version (status, headers) is set before resume lets requests in;
                # vLLM's own label goes beside the resume
                if kept is not None and not failed:  # it did not: the version stays
                    await self._resume("nothing applied")
                else:
                    self.updates += 1
                    await asyncio.gather(self._new_version(
                        f"commit by {req.holder}: {', '.join(failed)} failed" if failed
                        else None, req.n), self._resume("committed"))
            if kept is not None and not failed:
                logger.warning("hotweights: the update of %s was not applied (%s); still "
                               "serving %s", req.holder, kept, self.version)
                raise Refused(503, f"the update was not applied ({kept}); the server serves "
                              f"{self.version}, unchanged; update again", n=self.n)
            self.last_commit_s = time.perf_counter() - started
            self.last_update_s = time.perf_counter() - self._began
            return {"version": self.version, "n": self.n, "dirty": self.dirty,
                    "dirty_reason": self.versions.dirty_reason,
                    "paused_s": self.last_paused_s}

    async def abort(self, req: Abort) -> dict:
        """Resume. With `dirty` (the default: the trainer may have written) the weights get
        a new version marked dirty; without, the version stays. A staged update wrote
        nothing: its version stays."""
        async with self._lock:
            self._check_holder(req)
            self._check_seq(req, "abort", later=True)  # (one of a later update: the
            # holder clears the lease its last update left)
            if self._pausing is not None:  # a drain, or a staged update's early pause
                self._pausing.cancel()
            if self.state is not State.DRAINING:
                self.lease.disarm()
            await self._discard_quietly()
            if req.dirty and self.state not in (State.STAGING, State.DRAINING) \
                    and not self._read:  # in those the trainer wrote nothing: its begin
                # has not returned, it only stages, or it only reads
                await self._reset_quietly()
                await self._new_version(f"update aborted by {req.holder}")
            await self._resume("aborted")
            return {"version": self.version, "n": self.n, "dirty": self.dirty}

    async def expire(self, holder: str, why: str | None = None) -> None:
        """The lease of `holder` ran out (or its process exited: `why`): resume on weights
        it may have half-written."""
        why = why or f"lease of {holder} expired"
        async with self._lock:
            if self.holder != holder or self.state not in (State.PAUSED, State.STAGING):
                return
            staged = self.state is State.STAGING
            if staged or self._read:  # nothing written: the version stays
                logger.warning("hotweights: %s; %s", why, "its staged update dropped"
                               if staged else "resuming (it only read the weights)")
                if self._pausing is not None:
                    self._pausing.cancel()
                await self._discard_quietly()
                self.expired = dict(holder=holder, at=self.clock(), version=self.version,
                                    staged=staged, dirty=False, why=why)
                self._expiry_news = holder
                await self._resume("expired")
                return
            logger.warning("hotweights: %s; resuming, weights marked dirty", why)
            await self._discard_quietly()
            await self._reset_quietly()
            await self._new_version(why)
            self.expired = dict(holder=holder, at=self.clock(), version=self.version,
                                staged=False, dirty=True, why=why)
            self._expiry_news = holder
            try:
                await self._resume("expired")
            finally:  # also if the engine's resume failed (logged by the timer's task)
                self.state = State.EXPIRED

    # -- helpers ----------------------------------------------------------------------------

    def _granted(self) -> dict:
        return {"version": self.version, "n": self.n, "lease_expires": self.lease.expires,
                "server_id": self.server_id}

    def check_server(self, server_id: str) -> None:
        if server_id != self.server_id:
            raise Refused(409, f"this is server {self.server_id}, not {server_id}: the server "
                          "restarted and the weights you mapped are gone; reconnect "
                          "(Bridge.connect) and rebuild the model; the old bridge, model and "
                          "optimizer hold the old weights' memory until dropped (bridge.close())",
                          server_id=self.server_id)

    def _held(self) -> Refused:
        return Refused(409, f"update lease held by {self.holder} ({self.state.value})",
                       holder=self.holder)

    def _check_holder(self, req: Body) -> None:
        self.check_server(req.server_id)
        if self.holder is not None:
            if req.holder != self.holder:
                raise self._held()
        elif self.expired and self._expiry_news == req.holder:
            raise Refused(409, f"the lease of {req.holder} expired at "
                          f"{self.expired['at']:.0f} (unix time); the server "
                          f"{'dropped the staged update' if self.expired['staged'] else 'resumed'}"
                          f" and serves version {self.expired['version']}"
                          f"{', marked dirty' if self.expired['dirty'] else ''}",
                          expired=self.expired)
        else:
            raise Refused(409, f"no update in progress for {req.holder}")

    @contextlib.asynccontextmanager
    async def leased(self, req: Body, what: str) -> AsyncIterator[None]:
        """Run the block under the transaction's lock once `req`'s holder is found to hold
        the lease (`check_lease`): no abort, expiry or commit runs meanwhile."""
        async with self._lock:
            self.check_lease(req, what)
            yield

    def check_lease(self, req: Body, what: str) -> None:
        """Refuse (409) `what` unless `req`'s holder holds the paused (or staging)
        weights."""
        self._check_holder(req)
        self._check_seq(req, what)
        if self.state not in (State.PAUSED, State.STAGING):
            raise Refused(409, f"{req.holder}'s update is {self.state.value}, not paused; "
                          f"{what} after begin returned")

    def _check_seq(self, req: Body, what: str, later: bool = False) -> None:
        """Refuse (409) `what` of another of the holder's updates than the lease's (with
        `later`, only of an earlier one): a request that arrived late, after the holder's
        next update began. Unnumbered requests and leases are not checked."""
        if req.seq and self.seq and (req.seq < self.seq or req.seq != self.seq and not later):
            raise Refused(409, f"{what} of {req.holder}'s update {req.seq}, but the lease is "
                          f"of its update {self.seq}: a request that arrived late, refused",
                          holder=self.holder)

    async def _discard_quietly(self) -> None:
        try:
            await self.engine.discard()
        except Exception:
            logger.exception("hotweights: could not drop the staged update")

    async def _reset_quietly(self) -> None:
        try:  # dirty anyway; the log says why
            await self.engine.reset_caches()
        except Exception:
            logger.exception("hotweights: could not reset the caches")

    async def _new_version(self, dirty_reason: str | None, n: int = 0) -> None:
        self.versions.advance(dirty_reason, n)
        try:  # vLLM's own label; ours (status, headers) is already right
            await self.engine.set_version(self.version)
        except Exception:
            logger.exception("hotweights: could not label the engine's weights %s",
                             self.version)

    async def _resume(self, why: str) -> None:
        """End the update: idle, resume generation, let requests in (even if resume fails)."""
        self.lease.end()
        if self.seq:
            self._ended.pop(self.holder, None)  # (the newest last)
            self._ended[self.holder] = self.seq
            if len(self._ended) > _KEPT_ENDED:
                del self._ended[next(iter(self._ended))]
        self.state, self.holder, self.mode, self.seq = State.IDLE, None, None, 0
        self._pausing, self._read = None, False
        if self._held_at is None:  # a staged update that never paused
            logger.info("hotweights: %s; serving version %s", why, self.version)
            return
        try:  # also after a drain that failed half way: resuming an idle engine is a no-op
            await self.engine.resume()
        finally:
            self.engine.release()
            if self._paused_at is not None:
                self.last_paused_s = time.perf_counter() - self._paused_at
            self._held_at = self._paused_at = None
            logger.info("hotweights: %s; serving version %s", why, self.version)


def _retry(mode: str) -> str:
    """What to try after a pause in `mode` timed out."""
    return "update again with a longer lease" + {
        "wait": ", or mode=abort (ends the requests in flight) or keep (freezes them)",
        "abort": ", or mode=keep (freezes the requests in flight instead of ending them)",
    }.get(mode, "")
