"""Endpoint plugin: the /hotweights/* routes of the vLLM API server.

Every route needs `Authorization: Bearer <token>` (the token comes from the
HOTWEIGHTS_TOKEN environment variable that `hotweights serve` sets; it is never logged).
The routes are a thin HTTP layer over `hotweights.server.transaction.Transaction`: `begin`
pauses generation and takes a lease, the trainer writes the shared weights in place,
`commit` runs the workers' post-update hook, resets the caches, serves a new version and
resumes. A `--remote` server's trainer begins with `stage`: the lease only, while the
update's rounds are received (on a thread of each worker's own) and generation goes on;
its commit pauses, applies, resets the caches and resumes. Bodies are parsed into the
transaction's frozen request types (400 naming the field); refusals carry the HTTP status
the transaction gives them.

The plugin is inert (no routes, nothing touched) in a vLLM server that `hotweights serve`
did not start: it acts only when HOTWEIGHTS_SERVER_ID is set.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hmac
import json
import logging
import os
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from hotweights.checkpoint.digest import digest, stats
from hotweights.checkpoint.hub import local_dir
from hotweights.errors import ConfigError, ServerError
from hotweights.protocol.tokens import remove_token
from hotweights.remote.rendezvous import PROTOCOL, channel_id
from hotweights.server.bodies import (
    MAX_LEASE_S,
    Abort,
    Begin,
    Body,
    Commit,
    Receive,
    Refused,
    Renew,
)
from hotweights.server.env import CHECKPOINT_STATS, REMOTE, REMOTE_ENGINE, SERVER_ID
from hotweights.server.launch import free_port
from hotweights.server.transaction import NothingApplied, Transaction
from hotweights.vllm_plugin.gate import Gate, GateMiddleware

logger = logging.getLogger(__name__)

_CHECKSUM_WAIT_S = 60.0  # how long /hotweights/checksum waits for an update to end

_METRICS: dict = {}


def _metrics() -> dict:
    """Prometheus metrics on vLLM's /metrics (the default registry), made once."""
    if not _METRICS:
        from prometheus_client import Gauge, Histogram

        _METRICS.update(
            version=Gauge("hotweights_weight_version", "Weight version being served (N of "
                          "N@SERVER)"),
            dirty=Gauge("hotweights_weights_dirty", "1 if no commit vouched for the weights "
                        "being served"),
            update=Histogram("hotweights_update_seconds", "From begin (pause) to the end "
                             "of commit (resume)"),
            commit=Histogram("hotweights_commit_seconds", "Commit: hook, cache reset, "
                             "version bump, resume"),
        )
    return _METRICS


class VllmEngine:
    """`transaction.Engine` over vLLM's engine client and the request gate."""

    def __init__(self, client, gate: Gate, *, remote: bool = False):
        self.client, self.gate, self.remote = client, gate, remote
        self.receiving: asyncio.Task | None = None  # remote: the workers' receive in flight
        self.next_update = ""  # remote: the commit's `next_update`, for the workers to arm
        self.armed = ""  # remote: the update the workers wait for since the last commit
        self.broken = False  # remote: a worker's channel broke (the status names none)
        self._resumes = 0  # resumes sent: a pause whose wait outlived one is not sent
        self._pausing: asyncio.Task | None = None  # the scheduler's pause call in flight

    async def _received(self) -> BaseException | None:
        """Wait for the receive's start in flight, if any; what it raised."""
        task, self.receiving = self.receiving, None
        if task is None:
            return None
        await asyncio.wait([task])
        return task.exception() if not task.cancelled() else asyncio.CancelledError()

    def hold(self) -> None:
        self.gate.open.clear()

    def release(self) -> None:
        self.gate.open.set()

    async def pause(self, mode: str) -> None:
        resumes = self._resumes
        if mode == "wait":  # finish what already has a version header
            await self.gate.idle.wait()
        elif mode == "abort":  # streams it ends get a finish reason
            self.gate.mark_aborted()
        if self._resumes != resumes:  # an abort resumed meanwhile, in the loop's turn that
            # woke this wait (its task not cancelled yet): a pause now would outlast it
            raise asyncio.CancelledError
        self._pausing = asyncio.ensure_future(self._pause_scheduler(mode))
        await self._pausing
        if mode == "abort":
            await self._abort_past_the_gate()

    async def _pause_scheduler(self, mode: str) -> None:
        # vLLM's `pause_generation` (0.32) sleeps 20 ms once the scheduler paused, "not
        # required for correctness" (so that the last outputs are out first): every commit
        # paid it. The version headers do not need it: a response's header is set as it
        # starts, and a request drained or frozen by the pause was computed before it.
        core = getattr(self.client, "engine_core", None)
        if callable(getattr(core, "pause_scheduler_async", None)):
            await core.pause_scheduler_async(mode=mode, clear_cache=False)
        else:  # another vLLM
            await self.client.pause_generation(mode=mode, clear_cache=False)

    async def _abort_past_the_gate(self) -> None:
        """Abort every request that has a version header, including those that reached
        the engine after the pause (vLLM would queue them and run them on the new
        weights), until none is left: each response was computed with its version."""
        while not self.gate.idle.is_set():
            states = getattr(getattr(self.client, "output_processor", None),
                             "request_states", {})
            if ids := list(states):
                await self.client.abort(ids, internal=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.gate.idle.wait(), 0.01)

    async def resume(self) -> None:
        self._resumes += 1
        if self._pausing is not None and not self._pausing.done():  # sent, maybe: the
            await asyncio.wait([self._pausing])  # resume goes after it, never before
        await self.client.resume_generation()

    def busy(self) -> bool:
        return not self.gate.idle.is_set()

    async def after_update(self) -> None:
        # remote: the staged update is applied first, then the hook (one round trip)
        if not self.remote:
            await self.client.collective_rpc("hotweights_after_update")
            return
        next_update, self.next_update, armed, self.armed = self.next_update, "", self.armed, ""
        if (failed := await self._received()) is not None:  # the workers' staging freed
            await self.client.collective_rpc("hotweights_remote_discard")
            raise NothingApplied(f"the update's receive failed: {failed!r}")
        if armed:  # no receive claimed the update the workers wait for: the apply would
            await self.client.collective_rpc("hotweights_remote_discard")  # join that wait
            raise NothingApplied("no receive of the update before its commit (POST "
                                 "/hotweights/remote/receive)")
        applied = await self.client.collective_rpc("hotweights_remote_apply",
                                                   args=(next_update or None,))
        if not any(a.get("applied", True) for a in applied):  # each worker's receive failed
            raise NothingApplied(f"the workers' receive failed: {applied[0]['error']}")
        if failed := [a["error"] for a in applied if not a.get("applied", True)]:
            raise ServerError(f"some workers applied the update, others not: {failed[0]}")
        self.armed = next_update if next_update and all(a["armed"] for a in applied) else ""
        self.broken = any(a["broken"] for a in applied)

    async def discard(self) -> None:
        if self.remote:
            self.armed = ""
            await self._received()
            dropped = await self.client.collective_rpc("hotweights_remote_discard")
            self.broken = self.broken or any((d or {}).get("broken") for d in dropped)

    async def reset_caches(self) -> None:
        # Cached KV (frozen `keep` requests' too: they recompute it on resume; a KV
        # connector's, e.g. an offloading tier, as vLLM's own weight updates clear it) and
        # encoder outputs were computed with the old weights.
        # both at once: the engine core serves them in order, at the cost of one round trip
        reset, _ = await asyncio.gather(self.client.reset_prefix_cache(
            reset_running_requests=True, reset_connector=True),
            self.client.reset_encoder_cache())
        if not reset:
            raise ServerError("vLLM did not reset its prefix cache")

    async def set_version(self, label: str) -> None:
        await self.client.update_weight_version(label)


@dataclass(frozen=True)
class Join(Body):
    """Where the trainer's channel is, and this server's place in it."""

    master_addr: str = ""
    master_port: int = 0
    rank_offset: int = 0
    world_size: int = 0
    token: str = ""
    timeout: float = 60.0
    max_round_bytes: int = 64 << 20  # the trainer's budget per round (RemoteGroup's default)
    protocol: int = 0  # the trainer's `rendezvous.PROTOCOL` (0: one from before the check)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("master_addr", "master_port", "rank_offset", "world_size", "token"):
            if not getattr(self, name):
                raise Refused(400, f"field {name!r} is required")
        if self.max_round_bytes < 64:  # packing.MIN_ROUND_BYTES
            raise Refused(400, f"field 'max_round_bytes' must be >= 64, got "
                          f"{self.max_round_bytes}")
        if not 0 < self.timeout <= MAX_LEASE_S:  # also refuses nan and inf
            raise Refused(400, f"field 'timeout' must be in (0, {MAX_LEASE_S:.0f}] seconds, "
                          f"got {self.timeout!r}")
        if not 0 < self.master_port <= 65535:
            raise Refused(400, f"field 'master_port' must be a port, got {self.master_port}")
        if not 0 < self.rank_offset < self.world_size:  # rank 0: the trainer
            raise Refused(400, f"field 'rank_offset' must be in [1, world_size="
                          f"{self.world_size}), got {self.rank_offset}")


def _loaded(model: str, revision: str | None = None, cache_dir: str | None = None
            ) -> str | None:
    """The digest of the checkpoint vLLM loaded from `model` (a directory, or a hub id at
    `revision` found in the local cache, `cache_dir`), if its shards are those `hotweights
    serve` saw before the load (none written since); else None."""
    before = os.environ.get(CHECKPOINT_STATS)
    if not before or not (model := local_dir(model, revision, cache_dir)):
        return None
    found = digest(model)
    if stats(model) != json.loads(before):
        logger.warning("hotweights: %s changed since this server loaded it; a trainer's "
                       "first update to it sends the whole model", model)
        return None
    return found


def _dtypes(workers: list[dict[str, str]]) -> dict:
    """What a status says of the dtypes the workers hold tensors in (`served.narrowed_to`
    reads it): the most common one, and the tensors held in another."""
    counts = Counter(v for worker in workers for v in worker.values())
    default = counts.most_common(1)[0][0] if counts else None
    others: dict[str, str] = {}  # each worker names every tensor: one holding it in
    for worker in workers:  # another dtype (a float32 slab) says so, whatever the order
        for k, v in worker.items():
            if v != default:
                others[k] = min(others.get(k, v), v)
    return {"default": default, "others": others}


def _server_info(model_config, remote: bool) -> dict:
    """The served model's settings, shaped like vLLM's `/server_info` (a `VllmConfig` tree,
    only what a trainer reads); the weight-transfer engine is hotweights' own on a
    `--remote` server, none otherwise (the trainer writes the served tensors)."""
    return {"model_config": {
        "model": str(model_config.model),
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "max_model_len": model_config.max_model_len,
        "max_logprobs": model_config.max_logprobs,
        "logprobs_mode": str(model_config.logprobs_mode),
        "vocab_size": model_config.get_vocab_size(),  # the rows a trainer's config must have
    }, "weight_transfer_config": {"backend": REMOTE_ENGINE} if remote else None}


def _refuse_split_servers(args) -> None:
    for flag in ("api_server_count", "data_parallel_size"):
        if (getattr(args, flag, 1) or 1) > 1:
            raise ConfigError(f"hotweights: --{flag.replace('_', '-')} > 1 is not supported: "
                              "one server must own the one copy of the weights, its update "
                              "lease and its version")


class HotweightsRoutes:
    """`vllm.endpoint_plugins` entry point (name `hotweights`)."""

    name = "hotweights"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.server_id = os.environ.get(SERVER_ID, "")
        self.token = os.environ.get("HOTWEIGHTS_TOKEN", "")
        self.metrics = _metrics()
        self.gate = Gate()
        self.remote = os.environ.get(REMOTE) == "1"
        self.tx: Transaction | None = None
        self.manifests: list[dict] = []
        self.workers = 0
        self.channel: str | None = None  # the trainer channel joined (remote servers)
        self.device: str | None = None  # where the workers hold the weights (cuda, cpu)
        self.loaded: str | None = None  # remote: digest of the checkpoint vLLM loaded
        self.dtypes: dict | None = None  # remote: the dtypes its workers hold tensors in
        self.info: dict = {}  # what /server_info answers (the served model's settings)

    def attach_router(self, app: FastAPI) -> None:
        if not self.server_id:
            logger.warning("hotweights: endpoint plugin loaded in a server that `hotweights "
                           "serve` did not start (no HOTWEIGHTS_SERVER_ID); no routes added")
            return
        router = APIRouter(prefix="/hotweights")
        router.add_api_route("/manifest", self.manifest, methods=["GET"])
        router.add_api_route("/status", self.status, methods=["GET"])
        for name in ("begin", "renew", "commit", "abort"):
            router.add_api_route(f"/{name}", getattr(self, name), methods=["POST"])
        router.add_api_route("/checksum", self.checksum, methods=["GET"])
        router.add_api_route("/server_info", self.server_info, methods=["GET"])
        if self.remote:
            router.add_api_route("/remote/join", self.join, methods=["POST"])
            router.add_api_route("/remote/receive", self.receive, methods=["POST"])
            router.add_api_route("/remote/received", self.received, methods=["GET"])
        app.include_router(router)
        app.add_middleware(GateMiddleware, gate=self.gate, version=lambda: self.tx.version)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None or not self.server_id:
            return
        if not self.token:
            raise ConfigError("hotweights: HOTWEIGHTS_TOKEN is not set; start the server with "
                              "`hotweights serve`, which sets it")
        _refuse_split_servers(args)
        if token_file := os.environ.get("HOTWEIGHTS_TOKEN_FILE"):  # written by the runner
            atexit.register(remove_token, Path(token_file), self.token)
        self.tx = Transaction(VllmEngine(engine_client, self.gate, remote=self.remote),
                              self.server_id)
        await engine_client.update_weight_version(self.tx.version)  # not "default"
        self.info = _server_info(engine_client.model_config, self.remote)
        self.device = engine_client.vllm_config.device_config.device_type  # cuda, cpu, ...
        self.metrics["version"].set_function(lambda: self.tx.n)
        self.metrics["dirty"].set_function(lambda: int(self.tx.dirty))
        if self.remote:  # updates come over the transfer engine: nothing to share
            self.workers = len(await engine_client.collective_rpc("hotweights_check_in_place"))
            self.loaded = await asyncio.to_thread(_loaded, str(getattr(args, "model", "")),
                                                  getattr(args, "revision", None),
                                                  getattr(args, "download_dir", None))
            self.dtypes = _dtypes(await engine_client.collective_rpc(
                "hotweights_remote_dtypes"))
            logger.info("hotweights: server %s, %d worker(s) receive updates from a "
                        "trainer (--remote)", self.server_id, self.workers)
            return
        self.manifests = list(
            await engine_client.collective_rpc("hotweights_share", args=(self.server_id,)))
        self.workers = len(self.manifests)
        logger.info("hotweights: server %s, weights shared by %d worker(s)", self.server_id,
                    self.workers)

    # -- helpers ---------------------------------------------------------------------

    def _refuse(self, request: Request) -> JSONResponse | None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given = given.strip() if scheme.lower() == "bearer" else ""
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        return None

    async def _call(self, request: Request, kind, method) -> dict | JSONResponse:
        if refused := self._refuse(request):
            return refused
        try:
            try:
                body = await request.json()
            except ValueError:
                raise Refused(400, "the request body is not JSON") from None
            return await method(kind.from_json(body))
        except Refused as e:
            return JSONResponse(e.to_dict(), status_code=e.status)
        except Exception as e:  # the engine's (it died, say): named, in JSON, not a bare 500
            logger.exception("hotweights: %s failed", request.url.path)
            return JSONResponse({"error": f"{request.url.path} failed on the server: {e!r}"},
                                status_code=500)

    # -- routes ----------------------------------------------------------------------

    async def manifest(self, request: Request):
        if refused := self._refuse(request):
            return refused
        return {"manifests": self.manifests, "version": self.tx.version,
                "server_id": self.server_id, "remote": self.remote}

    async def status(self, request: Request):
        if refused := self._refuse(request):
            return refused
        untouched = self.tx.n == 0 and not self.tx.dirty  # still the weights it loaded
        return {**self.tx.status(), "remote": self.remote, "workers": self.workers,
                "channel_ranks": int(self.remote),
                "channel": None if self.tx.engine.broken else self.channel,
                "protocol": PROTOCOL,
                "armed": bool(self.remote and self.tx.engine.armed), "device": self.device,
                "checkpoint": self.loaded if untouched else None, "dtypes": self.dtypes}

    async def server_info(self, request: Request):
        """The served model's settings a trainer checks (TRL reads `logprobs_mode`): what
        vLLM's `/server_info` says in its dev mode, which `hotweights serve` never needs."""
        if refused := self._refuse(request):
            return refused
        return self.info

    async def checksum(self, request: Request):
        """The version served and one xxh3-64 per worker over its weights (hashes them all)."""
        if refused := self._refuse(request):
            return refused
        settled = ("idle", "expired", "staging")  # (a staged update has not touched them)
        deadline = time.monotonic() + _CHECKSUM_WAIT_S
        while True:
            while self.tx.state.value not in settled:  # not hashed while an update writes
                if time.monotonic() > deadline:
                    return JSONResponse({"error": f"an update has been in progress for "
                                         f"{_CHECKSUM_WAIT_S:.0f} s; ask again once it "
                                         "ends"}, status_code=503)
                await asyncio.sleep(0.05)
            version = self.tx.version
            sums = await self.tx.engine.client.collective_rpc("hotweights_checksum")
            if version == self.tx.version and self.tx.state.value in settled:
                return {"version": version, "checksum": list(sums)}
            if time.monotonic() > deadline:  # each hash stalls generation: not forever
                return JSONResponse({"error": f"updates kept landing during the hash for "
                                     f"{_CHECKSUM_WAIT_S:.0f} s; ask again between updates"},
                                    status_code=503)
            # an update ran meanwhile: hashed again once it has ended

    async def join(self, request: Request):
        """Join a trainer's channel (`hotweights.RemoteGroup`); returns once every rank has.

        The server takes one rank of it (`channel_ranks`), its first worker's: with more than
        one worker, that one hands each round on to the others over a relay of their own on
        127.0.0.1 (a fresh port and token each join), so the server receives each byte once.
        """
        return await self._call(request, Join, self._join)

    async def _join(self, req: Join) -> dict:
        self.tx.check_server(req.server_id)
        if req.protocol != PROTOCOL:
            raise Refused(400, f"the trainer speaks channel protocol {req.protocol or '< 3'}, "
                          f"this server {PROTOCOL}: run the same hotweights version on the "
                          "trainer and every server")
        if self.tx.state.value not in ("idle", "expired"):
            raise Refused(409, f"an update is {self.tx.state.value}; join between updates",
                          holder=self.tx.holder)
        info = {k: getattr(req, k) for k in ("master_addr", "master_port", "rank_offset",
                                             "world_size", "token", "timeout",
                                             "max_round_bytes")}
        if self.workers > 1:
            info |= {"relay_port": free_port(), "relay_token": secrets.token_hex(16)}
        # a new channel drops an armed wait
        self.channel, self.tx.engine.armed, self.tx.engine.broken = None, "", False
        await self._rpc("init_weight_transfer_engine", info)
        xor = all(await self._rpc("hotweights_remote_decodes_xor"))
        self.channel = channel_id(req.master_addr, req.master_port, req.token)
        logger.info("hotweights: %s joined channel %s:%d as rank %d of %d (%d worker(s))",
                    self.server_id, req.master_addr, req.master_port, req.rank_offset,
                    req.world_size, self.workers)
        return {"workers": self.workers, "channel_ranks": 1, "version": self.tx.version,
                "xor": xor}

    async def received(self, request: Request):
        """Bytes each worker received since the server joined, in worker order: from the
        trainer (`trainer_bytes`: the first worker's) and from the relay (`relay_bytes`);
        and of the last update it received: the bytes it staged (`staged_bytes`: its TP
        shard's) and their high-water mark (`peak_staging_bytes`, with one round's buffer)."""
        if refused := self._refuse(request):
            return refused
        try:
            counts = await self._rpc("hotweights_remote_received")
        except Refused as e:
            return JSONResponse(e.to_dict(), status_code=e.status)
        return {f"{key}_bytes": [c[key] for c in counts]
                for key in ("trainer", "relay", "staged", "peak_staging")}

    async def receive(self, request: Request):
        """Start receiving one update into staging (under the holder's lease), on a thread
        of each worker's own; the commit waits for it and applies it."""
        return await self._call(request, Receive, self._receive)

    async def _receive(self, req: Receive) -> dict:
        async with self.tx.leased(req, "receive"):  # not beside an abort's or expiry's
            # discard, which would leave this receive behind
            if req.update and req.update == self.tx.engine.armed:  # the workers wait for it
                self.tx.engine.armed = ""
                return {"receiving": True, "armed": True, "workers": self.workers}
            self.tx.engine.armed = ""  # the workers drop that wait for this one
            task = asyncio.ensure_future(self._rpc("hotweights_remote_receive",
                                                   req.update or None, req.wait_s or None))
            self.tx.engine.receiving = task  # a commit or abort waits for it
        (first, *_) = await asyncio.shield(task)
        return {**first, "workers": self.workers}

    async def _rpc(self, method: str, *args) -> list:
        try:
            return await self.tx.engine.client.collective_rpc(method, args=args)
        except Exception as e:  # the worker's error (a RemoteError, a refusal) by name
            raise Refused(502, f"{method} failed on a worker: {e}") from e

    async def begin(self, request: Request):
        return await self._call(request, Begin, self._begin)

    async def _begin(self, req: Begin) -> dict:
        if req.stage and not self.remote:
            raise Refused(400, "field 'stage' needs a `hotweights serve --remote` server: here "
                          "the trainer writes the served weights, which generation must not "
                          "read meanwhile")
        return await self.tx.begin(req)

    async def renew(self, request: Request):
        return await self._call(request, Renew, self.tx.renew)

    async def abort(self, request: Request):
        return await self._call(request, Abort, self.tx.abort)

    async def _commit(self, req: Commit) -> dict:
        if req.next_update and not self.remote:
            raise Refused(400, "field 'next_update' needs a `hotweights serve --remote` server")
        async with self.tx.leased(req, "commit"):  # not another trainer's commit's
            self.tx.engine.next_update = req.next_update
        return await self.tx.commit(req)

    async def commit(self, request: Request):
        out = await self._call(request, Commit, self._commit)
        if isinstance(out, JSONResponse):
            return out
        self.metrics["commit"].observe(self.tx.last_commit_s)
        self.metrics["update"].observe(self.tx.last_update_s)
        if out["dirty"]:
            return JSONResponse({"error": f"commit incomplete ({out['dirty_reason']}; see the "
                                 f"server log): the weights are served as version "
                                 f"{out['version']} and marked dirty", **out}, status_code=500)
        return out
