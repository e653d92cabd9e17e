"""Endpoint plugin: the /hotweights/* routes of the vLLM API server.

Every route needs `Authorization: Bearer <token>` (the token comes from the
HOTWEIGHTS_TOKEN environment variable that `hotweights serve` sets; it is never logged).
An update is a transaction: `begin` pauses generation and takes a lease, the trainer
writes the shared weights in place, `commit` runs the workers' post-update hook, resets
the prefix cache, bumps the weight version and resumes. A lease that expires (the
trainer died) resumes the server by itself and marks the weights dirty.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from hotweights.vllm_plugin.gate import Gate, GateMiddleware

logger = logging.getLogger(__name__)

MODES = ("wait", "abort", "keep")
MAX_LEASE_S = 24 * 3600.0


_METRICS: dict = {}


def _metrics() -> dict:
    """Prometheus metrics on vLLM's /metrics (the default registry), made once."""
    if not _METRICS:
        from prometheus_client import Gauge, Histogram

        _METRICS.update(
            version=Gauge("hotweights_weight_version", "Weight version being served"),
            dirty=Gauge("hotweights_weights_dirty", "1 if the weights may hold a "
                        "half-written update"),
            update=Histogram("hotweights_update_seconds", "From begin (pause) to the end "
                             "of commit (resume)"),
            commit=Histogram("hotweights_commit_seconds", "Commit: hook, cache reset, "
                             "version bump, resume"),
        )
    return _METRICS


@dataclass
class UpdateState:
    """What `status` reports; one per API server."""

    version: int = 0
    paused: bool = False
    holder: str | None = None  # who holds the update lease
    mode: str | None = None
    lease_expires: float | None = None  # time.time()
    dirty: bool = False  # weights may hold a half-written update
    updates: int = 0
    last_pause_s: float | None = None
    last_commit_s: float | None = None
    manifests: list[dict] = field(default_factory=list)

    def public(self) -> dict:
        out = asdict(self)
        out.pop("manifests")
        return out


class HotweightsRoutes:
    """`vllm.endpoint_plugins` entry point (name `hotweights`)."""

    name = "hotweights"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.state = UpdateState()
        self.metrics = _metrics()
        self.began: float | None = None
        self.token = os.environ.get("HOTWEIGHTS_TOKEN", "")
        self.engine = None
        self.lock = asyncio.Lock()
        self.watchdog: asyncio.Task | None = None
        self.gate = Gate()
        self.expired: tuple[str, float] | None = None  # (holder, time) of the last expiry

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter(prefix="/hotweights")
        router.add_api_route("/manifest", self.manifest, methods=["GET"])
        router.add_api_route("/status", self.status, methods=["GET"])
        router.add_api_route("/begin", self.begin, methods=["POST"])
        router.add_api_route("/renew", self.renew, methods=["POST"])
        router.add_api_route("/commit", self.commit, methods=["POST"])
        router.add_api_route("/abort", self.abort, methods=["POST"])
        app.include_router(router)

        app.add_middleware(GateMiddleware, gate=self.gate, version=lambda: self.state.version)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            return
        if not self.token:
            raise RuntimeError("hotweights: HOTWEIGHTS_TOKEN is not set; start the server "
                               "with `hotweights serve`, which sets it")
        for flag in ("api_server_count", "data_parallel_size"):
            if (getattr(args, flag, 1) or 1) > 1:
                raise RuntimeError(f"hotweights: --{flag.replace('_', '-')} > 1 is not "
                                   "supported: one server must own the one copy of the "
                                   "weights, its update lease and its version")
        self.engine = engine_client
        await engine_client.update_weight_version(str(self.state.version))  # not "default"
        server_id = os.environ.get("HOTWEIGHTS_SERVER_ID")
        self.state.manifests = list(
            await engine_client.collective_rpc("hotweights_share", args=(server_id,))
        )
        logger.info("hotweights: weights shared by %d worker(s)", len(self.state.manifests))

    # -- helpers ---------------------------------------------------------------------

    def _refuse(self, request: Request) -> JSONResponse | None:
        auth = request.headers.get("authorization", "")
        given = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        return None

    async def _body(self, request: Request) -> dict:
        try:
            data = await request.json()
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def _not_holder(self, holder: str | None) -> JSONResponse | None:
        if self.state.holder is None:
            if self.expired is not None and self.expired[0] == holder:
                return JSONResponse({"error": f"the lease of {holder} expired at "
                                     f"{self.expired[1]:.0f} (unix time); the server resumed "
                                     "and marked the weights dirty"}, status_code=409)
            return JSONResponse({"error": "no update in progress"}, status_code=409)
        if holder != self.state.holder:
            return JSONResponse({"error": f"update lease held by {self.state.holder}",
                                 "holder": self.state.holder}, status_code=409)
        return None

    @staticmethod
    def _lease(body: dict) -> float | JSONResponse:
        try:
            lease_s = float(body.get("lease_s", 60.0))
        except (TypeError, ValueError):
            lease_s = math.nan
        if not 0 < lease_s <= MAX_LEASE_S:  # also refuses nan and inf
            return JSONResponse({"error": f"lease_s must be in (0, {MAX_LEASE_S:.0f}] "
                                 f"seconds, got {body.get('lease_s')!r}"}, status_code=400)
        return lease_s

    def _arm(self, lease_s: float) -> None:
        self.state.lease_expires = time.time() + lease_s
        if self.watchdog is not None:
            self.watchdog.cancel()
        self.watchdog = asyncio.create_task(self._expire(lease_s, self.state.holder))

    async def _expire(self, delay: float, holder: str | None) -> None:
        await asyncio.sleep(delay)
        async with self.lock:
            if self.state.holder != holder:
                return
            logger.warning("hotweights: lease of %s expired; resuming, weights marked dirty",
                           holder)
            self.state.dirty = True
            self.expired = (holder, time.time())
            await self._release()

    async def _release(self) -> None:
        """End the update: drop the lease, resume generation, open the gate."""
        if self.watchdog is not None and self.watchdog is not asyncio.current_task():
            self.watchdog.cancel()
        self.watchdog = None
        self.metrics["dirty"].set(int(self.state.dirty))
        self.state.holder = self.state.mode = self.state.lease_expires = None
        try:
            if self.state.paused:
                await self.engine.resume_generation()
                self.state.paused = False
        finally:
            self.gate.open.set()

    async def _reset_caches(self) -> bool:
        """Drop cached KV, frozen (`keep`) requests' too: they recompute it on resume."""
        try:
            return bool(await self.engine.reset_prefix_cache(reset_running_requests=True))
        except Exception:  # vLLM raises when the scheduler cannot reset
            logger.exception("hotweights: prefix cache not reset; weights marked dirty")
            return False

    async def _abort_past_the_gate(self) -> None:
        """Abort every request that has a version header, including those that reached
        the engine after the pause (vLLM would queue them and run them on the new
        weights), until none is left: each response was computed with its version."""
        while not self.gate.idle.is_set():
            states = getattr(getattr(self.engine, "output_processor", None),
                             "request_states", {})
            if ids := list(states):
                await self.engine.abort(ids, internal=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.gate.idle.wait(), 0.01)

    # -- routes ----------------------------------------------------------------------

    async def manifest(self, request: Request):
        if refused := self._refuse(request):
            return refused
        return {"manifests": self.state.manifests, "version": self.state.version}

    async def status(self, request: Request):
        if refused := self._refuse(request):
            return refused
        return self.state.public()

    async def begin(self, request: Request):
        if refused := self._refuse(request):
            return refused
        body = await self._body(request)
        holder, mode = str(body.get("holder") or "trainer"), body.get("mode", "wait")
        if mode not in MODES:
            return JSONResponse({"error": f"mode must be one of {MODES}, got {mode!r}"},
                                status_code=400)
        lease_s = self._lease(body)
        if isinstance(lease_s, JSONResponse):
            return lease_s
        async with self.lock:
            if self.state.holder is not None:
                return JSONResponse({"error": f"update lease held by {self.state.holder}",
                                     "holder": self.state.holder}, status_code=409)
            self.state.holder, self.state.mode = holder, mode
            self.gate.open.clear()
            started = self.began = time.perf_counter()
            try:
                if mode == "wait":  # finish what already has a version header
                    await asyncio.wait_for(self.gate.idle.wait(), timeout=lease_s)
                elif mode == "abort":  # streams it ends get a finish reason
                    self.gate.mark_aborted()
                self.state.paused = True  # _release resumes, even if the pause times out
                await asyncio.wait_for(
                    self.engine.pause_generation(mode=mode, clear_cache=False), lease_s)
                if mode == "abort":
                    await asyncio.wait_for(self._abort_past_the_gate(), lease_s)
            except TimeoutError:
                await self._release()
                return JSONResponse({"error": f"in-flight requests did not finish within "
                                     f"lease_s={lease_s} s; generation resumed, try again "
                                     "or use mode=abort"}, status_code=503)
            except BaseException:
                await self._release()
                raise
            self.state.last_pause_s = time.perf_counter() - started
            self._arm(lease_s)
        return {"version": self.state.version, "lease_expires": self.state.lease_expires}

    async def renew(self, request: Request):
        if refused := self._refuse(request):
            return refused
        body = await self._body(request)
        lease_s = self._lease(body)
        if isinstance(lease_s, JSONResponse):
            return lease_s
        async with self.lock:
            if refused := self._not_holder(body.get("holder")):
                return refused
            self._arm(lease_s)
        return {"lease_expires": self.state.lease_expires}

    async def commit(self, request: Request):
        if refused := self._refuse(request):
            return refused
        body = await self._body(request)
        async with self.lock:
            if refused := self._not_holder(body.get("holder")):
                return refused
            started = time.perf_counter()
            try:
                await self.engine.collective_rpc("hotweights_after_update")
                hooked = True
            except Exception:
                logger.exception("hotweights: post-update hook failed; weights marked dirty")
                hooked = False
            reset = await self._reset_caches()
            self.state.version += 1  # the trainer wrote them: a new version either way
            self.state.dirty = not (hooked and reset)
            self.state.updates += 1
            await self.engine.update_weight_version(str(self.state.version))
            await self._release()
            self.state.last_commit_s = time.perf_counter() - started
            self.metrics["commit"].observe(self.state.last_commit_s)
            self.metrics["update"].observe(time.perf_counter() - self.began)
            self.metrics["version"].set(self.state.version)
        if self.state.dirty:
            return JSONResponse({"error": "commit incomplete (see the server log): the "
                                 "weights are served as version "
                                 f"{self.state.version} and marked dirty",
                                 "version": self.state.version, "dirty": True},
                                status_code=500)
        return {"version": self.state.version}

    async def abort(self, request: Request):
        if refused := self._refuse(request):
            return refused
        body = await self._body(request)
        async with self.lock:
            if refused := self._not_holder(body.get("holder")):
                return refused
            if body.get("dirty", True):  # the trainer may have written part of an update
                self.state.dirty = True
                await self._reset_caches()
            await self._release()
        return {"version": self.state.version, "dirty": self.state.dirty}
