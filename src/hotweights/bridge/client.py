"""Trainer side: attach to a running `hotweights serve`, train its weights in place."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hotweights.bridge import loaded
from hotweights.changes.streams import settle
from hotweights.errors import (
    CheckpointError,
    HotweightsError,
    LayoutError,
    RemoteError,
    ServerError,
)
from hotweights.layout.plan import text_config
from hotweights.layout.views import ViewReport, build_hf_model, outside_served
from hotweights.protocol import process, shm
from hotweights.protocol.http import request, server_status
from hotweights.protocol.renewer import Renewer
from hotweights.protocol.tokens import find_token
from hotweights.protocol.urls import server_url

if TYPE_CHECKING:
    from hotweights.checkpoint.result import SyncResult

logger = logging.getLogger(__name__)


_NEW = {"process", "read"}  # begin fields an older server refuses (dropped there, as is
# the number `_post` adds to every request)
# What a first save copies from the served model's directory (`Bridge._saved`)
_SERVING_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                  "merges.txt", "chat_template*", "generation_config.json")


class Bridge:
    """A connection to one hotweights server on this machine.

    Example:
        bridge = Bridge.connect("http://127.0.0.1:8000")  # token: see connect
        model = bridge.model(trainable=r"layers\\.")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        with bridge.update():
            optimizer.step()   # writes vLLM's weights; served from the commit on
    """

    def __init__(self, url: str, token: str, manifests: list[shm.Manifest], version: str, *,
                 cafile: str | os.PathLike | None = None):
        self.url, self._token, self.cafile = server_url(url), token, cafile
        self.manifests = manifests
        self.server_id = manifests[0].server_id  # every update names the server we mapped
        self.version = version  # "N@SERVER", as in every response's x-hotweights-version
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.tensors = shm.attach(manifests[0])
        self._model: torch.nn.Module | None = None
        self.report: ViewReport | None = None  # of the model `model()` built
        self._versions: dict[str, int] = {}  # its parameters' version counters when built
        # or when the last update ended (`_written_outside`)
        self.remote = None  # a RemoteGroup updated with this server (add_remote)
        self.remote_result: dict | None = None  # its last update's (`RemoteGroup.update`)
        self._leased = threading.Lock()  # held by this bridge's update or exclusive read
        self._seq = 0  # the number of its update in progress (or last), in every request
        # of it: the server refuses one of an earlier update that arrives late (`Body.seq`)
        self._numbered = True  # False: an older server, which knows no number
        self.closed = False  # `close` let go of the mapping

    @classmethod
    def connect(cls, url: str, *, token: str | None = None,
                cafile: str | os.PathLike | None = None) -> Bridge:
        """Fetch the server's manifest and map its shared weights (same machine).

        Args:
            url: the server, e.g. "http://127.0.0.1:8000", or "https://localhost:8000"
                for one started with --ssl-keyfile/--ssl-certfile.
            token: its access token (default: the HOTWEIGHTS_TOKEN environment variable,
                else the token file `hotweights serve` wrote for that port).
            cafile: for https, the CA bundle (PEM) that signed the server's certificate
                (default: HOTWEIGHTS_CA_FILE, else the system's trust store).
        """
        url = server_url(url)
        token = find_token(url, token)
        data = request(url, "GET", "/hotweights/manifest", token, cafile=cafile)
        for key, kind in (("manifests", list), ("version", str)):
            if not isinstance(data, dict) or not isinstance(data.get(key), kind):
                raise ServerError(f"{url}/hotweights/manifest: field {key!r} must be a "
                                  f"{kind.__name__}, found "
                                  f"{data.get(key) if isinstance(data, dict) else data!r}: is it "
                                  "a `hotweights serve` of this hotweights version?")
        manifests = [shm.Manifest.from_dict(m, source=f"{url}/hotweights/manifest")
                     for m in data["manifests"]]
        if not manifests and data.get("remote"):
            raise ServerError(f"{url} is a `hotweights serve --remote`: it shares no memory, "
                              "and a bridge (so `sync` or `diagnose --server`) maps a server's "
                              "weights on this machine; update it with RemoteGroup, or "
                              "bridge.add_remote(...) from the bridge of a server on the "
                              "trainer's machine, and checkpoint from that server")
        if len(manifests) != 1:
            raise ServerError(f"{url}: {len(manifests)} workers; the bridge maps tp=1 servers")
        if manifests[0].server_id != data.get("server_id"):
            raise ServerError(f"{url}: manifest of server {manifests[0].server_id}, but the "
                              f"server says it is {data.get('server_id')!r}")
        return cls(url, token, manifests, str(data["version"]), cafile=cafile)

    def model(self, config: Any = None, *, check_loaded: bool = True,
              **kwargs: Any) -> torch.nn.Module:
        """The HF model whose parameters are views into the server's weights.

        Args:
            config: a transformers config or a model directory of this machine (default:
                the directory the server loaded, which must be a local directory: the
                server's word alone never makes this process read a hub or run code
                from a directory others can write).
            check_loaded: while the server serves what it loaded (version 0, idle) from a
                directory of this machine, compare a few rows of every view with that
                checkpoint (`loaded.check_loaded`): a vLLM loader that reorders a tensor
                keeping its name and shape is refused, not trained. False skips it.
            kwargs: go to `build_hf_model` (`trainable=`, `allow_missing=`,
                `trust_remote_code=` for a model whose code ships with it, ...); its
                report is kept in `bridge.report`.
        """
        if self.closed:
            raise ServerError("model(): this bridge was closed; connect again (Bridge.connect)")
        self._same_server(before := self.status())
        source = self.manifests[0].model
        if config is None:
            config = _local_model_dir(source, kwargs.get("trust_remote_code", False))
        model, self.report = build_hf_model(config, self.tensors, **kwargs)
        _check_vocab(model.config, self.server_info())
        if check_loaded and os.path.isdir(source) and _as_loaded(before):
            try:
                loaded.check_loaded(model, source, self.report.mapped)
            except LayoutError:
                self._same_server(after := self.status())  # (a restart: the views are gone)
                if _as_loaded(after):
                    raise
                logger.warning("views not compared with %s: an update began meanwhile", source)
        self._model, self._versions = model, _versions(model)
        return model

    def _same_server(self, status: dict) -> None:
        if (now := status.get("server_id")) != self.server_id:
            raise ServerError(f"{self.url} is server {now} now, not {self.server_id}: it "
                              "restarted and the weights this bridge mapped are gone; "
                              "reconnect (Bridge.connect), rebuild the model, and drop this "
                              "bridge and what was built on it (bridge.close(): they keep "
                              "its memory)")

    def checkpoint(self, model_dir: str | os.PathLike, *, exclusive: bool = False,
                   **kwargs: Any):
        """Write the live weights into `model_dir`, only what changed (`checkpoint.sync`).

        The sidecars record the version the server serves. Call it between steps: the weights must
        not change while they are read. A process that is not the trainer passes
        `exclusive=True`: the update lease (mode "keep") then holds off every trainer
        while the live bytes are read, and the server resumes, at the same version, before
        the files are replaced (also, not dirty, if this process dies meanwhile: its lease
        only reads).

        A first save (a directory with no safetensors) also gets the served model's
        tokenizer and generation config, where its directory is on this machine: a
        directory `hotweights serve` can serve.

        Args:
            model_dir: the checkpoint directory (its safetensors name the tensors; one
                with none gets a first full save).
            exclusive: hold the update lease while reading (see above).
            kwargs: go to `checkpoint.sync` (`mode=`, `progress=`, `changed=` the names
                or `fnmatch` patterns of the only parameters that may have changed, e.g.
                those the optimizer steps: the rest is not hashed, see `checkpoint.sync`).

        Returns:
            The `checkpoint.SyncResult`.
        """
        from hotweights.checkpoint import recover, sync

        model = self._model or self.model(check_loaded=False)  # what it serves, as is
        if not self._leased.locked():  # (not from another thread inside an update's body)
            self._written_outside("checkpoint()")
        if missing := self.report.missing if self.report else ():
            raise CheckpointError(
                f"checkpoint(): {len(missing)} parameter(s) of the model no vLLM tensor holds "
                f"(allow_missing=; zeros here, e.g. {missing[0]}) would be written over the "
                "checkpoint's values; sync the served ones yourself "
                "(hotweights.checkpoint.sync with a state dict that leaves them out)")
        if not exclusive:  # the version the server serves (after a commit whose answer was
            status = self._refresh_version()  # lost, the bridge's own may be the one before)
            return self._saved(sync(model_dir, model, version=self.version,
                                    config=model.config, **kwargs), model_dir, status)
        if os.path.isdir(model_dir):  # another writer's sync first, and what a crashed one
            recover(model_dir)  # left finished: not while the server is paused
        with self._exclusive("checkpoint(exclusive=True)") as unlock:
            renewer, released = Renewer(self.renew, 60.0), False

            def release(read: bool = False) -> None:
                """Resume the server (at the same version: nothing written); `read`: the
                live bytes were read, which only a lease held to this end makes one
                version."""
                nonlocal released
                if released:
                    return
                released = True
                try:
                    renewer.__exit__()
                finally:  # (a Ctrl-C in the join): resumed all the same
                    try:  # (refused: the lease expired or was taken from it)
                        if (e := self._abort(dirty=False, quiet=read)) and read:
                            raise CheckpointError(  # (else the caller's error is the news)
                                f"checkpoint(exclusive=True): the update lease was lost while "
                                f"the weights were read ({e}): a trainer may have written "
                                f"them meanwhile, and {model_dir} may mix two versions; "
                                "checkpoint again") from e
                    finally:  # the files are written after: an update may go on
                        unlock()

            self._begin(mode="keep", lease_s=60.0, read=True)  # (nothing between begin
            # and try; read: however the lease ends, the version stays clean)
            try:
                renewer.start()
                status = self.status()
                return self._saved(sync(
                    model_dir, model, version=status["version"], config=model.config,
                    after_read=functools.partial(release, read=True), **kwargs), model_dir,
                    status)
            finally:
                release()

    def _saved(self, result: SyncResult, model_dir: str | os.PathLike,
               status: dict | None) -> SyncResult:
        """`result`, with why the version the server serves is dirty where it is (logged);
        after a first save, the served model's tokenizer and generation config copied
        beside the weights where it lies on this machine (a directory that serves)."""
        if result.first_save and os.path.isdir(source := self.manifests[0].model):
            for src in sorted({p for pattern in _SERVING_FILES
                               for p in Path(source).glob(pattern) if p.is_file()}):
                if not (dst := Path(model_dir) / src.name).exists():
                    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
                    try:
                        shutil.copyfile(src, tmp)  # whole or not at all
                        os.replace(tmp, dst)
                    except OSError as e:  # the weights are saved: say what is missing
                        tmp.unlink(missing_ok=True)
                        logger.warning("checkpoint(): %s not copied beside the weights (%s): "
                                       "copy it into %s before serving that directory",
                                       src, e, model_dir)
        if not status or not status.get("dirty"):
            return result
        why = str(status.get("dirty_reason") or "an update that raised after writing")
        logger.warning("checkpoint(): the server serves dirty version %s (%s): the weights "
                       "checkpointed may be half updated", status.get("version"), why)
        return dataclasses.replace(result, dirty=why)

    def close(self) -> None:
        """Let go of the server's memory (`tensors`, the model this bridge built: the
        mapping goes once nothing else holds a view of it, so drop the model and its
        optimizer too) and close the remote group, if any. The server serves on."""
        if self.remote is not None:
            self.remote.close()
        self.tensors, self._model, self.closed = {}, None, True

    def __enter__(self) -> Bridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_remote(self, servers, **kwargs: Any):
        """Update remote servers too: every `update()` then serves one version number on
        this server and them (see `update` for who commits when, with `require=`).

        Args:
            servers: a `RemoteGroup`, or what `RemoteGroup` takes (URLs, ``host:port``,
                SLURM node lists) with `kwargs` (``token=``, ``master_addr=``,
                ``timeout=``, ``checkpoint=``, ``require=``, ``cafile=``: default this
                bridge's, ...).
        Returns:
            The `RemoteGroup`. Its first update sends the whole model, unless it was given
            ``checkpoint=`` the directory the servers loaded: then only what differs from it.
        """
        from hotweights.remote.group import RemoteGroup

        kwargs.setdefault("cafile", self.cafile)
        self.remote = servers if isinstance(servers, RemoteGroup) else RemoteGroup(servers,
                                                                                   **kwargs)
        return self.remote

    @contextlib.contextmanager
    def update(self, mode: str = "wait", *, lease_s: float = 60.0) -> Iterator[None]:
        """Pause the server, let the body write the weights, then commit (or abort).

        While the body runs, the lease is renewed in the background every `lease_s / 3`
        seconds, so a step may take as long as it needs while a dead trainer still frees
        the server within `lease_s`.

        Args:
            mode: how the server treats in-flight requests while paused: "wait" (finish
                them first), "abort" (stop them) or "keep" (freeze them; resumed after).
            lease_s: the server resumes by itself, marking the weights dirty, if it hears
                nothing from this trainer for this many seconds. It also bounds the drain.

        With remote servers (`add_remote`), every server serves the new weights under one
        version number N. By default (``RemoteGroup(require="any")``) this server commits
        and resumes right after the body; then the remotes receive what changed (serving
        their old version meanwhile) and commit N. If they fail, this server serves N and
        they stay at their old version: the error (a `RemoteError`, `served` N) names them,
        and the next update catches them up. Where only some fail, the others commit N: a
        warning and ``remote_result["dropped"]`` (`RemoteGroup.update`'s result) name those
        left out.
        With ``require="all"``, every remote stages what changed first; only then does
        this server commit, and the remotes; if a remote fails before that, the body's
        writes are undone here (from the group's copy of the old weights), every server
        resumes at its old version, and the error names the remote; where the group
        holds no such copy (its first update, ``reference="checkpoint"``, a tensor outside
        ``trainable=`` written, fused MoE experts, remotes that hold a narrower float than
        this server), this server serves the new weights as a dirty version. Either way, if this
        server's commit fails, the remotes commit anyway (this server's weights are the new
        ones, written in place) and its error is raised.

        Raises:
            ServerError: the server refused (it restarted since `connect`; another
                holder, e.g. an exclusive checkpoint reading the weights, kept the lease
                longer than the `lease_s` + 30 s the update waits for it) or failed; an
                exception of the body is re-raised after the update was aborted.
            RemoteError: a remote server failed (named; see above).
        """
        with self._exclusive("update()"):
            self._written_outside("update()")
            try:
                yield from self._update(mode, lease_s)
            finally:  # the body's writes are this update's, committed or aborted
                self._versions = _versions(self._model)

    def _written_outside(self, what: str) -> None:
        """Warn where parameters of the model `model()` built were written in place since
        it was built or the last update ended: outside an update, the server computed with
        each write as it landed, under the version it served (no new number, its prefix
        cache not reset), and the sidecars of a checkpoint name that version. Seen by the
        tensors' version counters: an in-place op and a foreach or for-loop optimizer's
        step count; a write through `.data` or by another process, and a fused
        optimizer's step (`AdamW(fused=True)`, transformers' default), do not."""
        now = _versions(self._model)
        if written := [n for n, v in now.items() if self._versions.get(n, v) != v]:
            logger.warning(
                "%s: the model `model()` built was written outside `bridge.update()` since "
                "it was built or the last update (%s or a view of the same vLLM tensor): "
                "the server computed with the writes as they landed, as version %s, with "
                "no new version and its prefix cache not reset; write the weights inside "
                "`with bridge.update():` (the optimizer's step, a load)", what, written[0],
                self.version)
        self._versions = now

    def _check_views(self, what: str) -> None:
        """Refuse where the model this bridge built has trainable parameters that are no
        longer views of the server's weights: training them would not reach the server."""
        if not isinstance(self._model, torch.nn.Module):
            return
        if outside := outside_served(self._model, self.tensors,
                                     self.report.missing if self.report else ()):
            raise LayoutError(
                f"{what}: {len(outside)} trainable parameter(s) of the model `model()` built "
                f"are copies, no longer the server's weights (e.g. {outside[0]}): a "
                "`.float()`, `.to(...)` or `.half()` of the model copies them, and a step on "
                "them would not reach the server; train the model as built, in the served "
                "dtype and on the server's device (bf16: see docs/training.md)")

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[Callable[[], None]]:
        """One update or exclusive read of this bridge at a time: a second one's begin
        would be refused, and its abort, in this bridge's name, would end the first.
        Yields the unlock, for a holder done with the lease before the block ends."""
        if self.closed:
            raise ServerError(f"{what}: this bridge was closed; connect again "
                              "(Bridge.connect)")
        if not self._leased.acquire(blocking=False):
            raise ServerError(f"{what}: this bridge is updating or reading the server already "
                              "(a nested update or checkpoint(exclusive=True) in `with "
                              "bridge.update()`, or another thread's): one at a time")
        held = [True]

        def unlock() -> None:
            if held:
                held.clear()
                self._leased.release()
        try:
            yield unlock
        finally:
            unlock()

    def _update(self, mode: str, lease_s: float) -> Iterator[None]:
        self._check_views("update()")
        model = None if self.remote is None else self._model or self.model(
            check_loaded=False)  # what it serves, as is: before the pause
        floor = None
        if self.remote is not None and self.remote.require == "any":
            try:  # read before the pause: the remotes' versions, which N must be above
                floor = self.remote.floor()
            except RemoteError:  # no remote answers: this server commits all the same (the
                floor = self.remote.n  # remotes' error follows, naming them)
        # the server bounds the drain by lease_s; a client that gives up aborts
        renewer = Renewer(self.renew, lease_s)  # (made first: nothing between begin and try)
        began = self._begin(timeout=lease_s + 30, mode=mode, lease_s=lease_s)
        try:
            with renewer:
                try:
                    yield
                except BaseException:  # what the body queued lands before the server
                    with contextlib.suppress(Exception):  # resumes (its error is the news)
                        settle(self.tensors)
                    raise
                settle(self.tensors)
        except BaseException:
            self._abort(dirty=True)
            raise
        if self.remote is None:
            self._commit()
            return
        if floor is not None:
            n = max(floor, began["n"]) + 1
            try:
                self._commit(n=n)
            except Exception as e:  # the weights here are the new ones whatever became of
                with _noted(e, n):  # the commit
                    self._update_remotes(model, n, mode, lease_s)
                raise
            self._update_remotes(model, n, mode, lease_s)
            return
        try:  # this server stays paused while the remotes stage: its lease is renewed
            with Renewer(self.renew, lease_s):
                pending = self.remote.prepare(model, mode=mode, lease_s=lease_s,
                                              pause_ahead=True)  # the commits follow
        except BaseException as e:
            restored = False
            try:
                restored = self.remote.restore(model)  # restored: the old version
            except Exception as failed:  # the remote's error stays the news
                e.add_note(f"the step could not be undone here: {failed!r}")
            if not restored:
                e.add_note(f"{self.url} serves the step's weights as a new, dirty version "
                           "(the group holds no copy of the old ones here); the remote "
                           "servers serve the old ones")
            self._abort(dirty=not restored)
            raise
        n = max(pending.floor, began["n"]) + 1
        try:
            self._commit(n=n)
        except Exception as e:  # the weights here are the new ones whatever became of the
            with _noted(e, n):  # commit (served, dirty, or at the lease's expiry): so are
                self.remote.commit(pending, n)  # the remotes'
            raise
        except BaseException:
            self.remote.abort(pending)
            raise
        with self._served_here(n, "not every remote server took it"):
            self.remote_result = self.remote.commit(pending, n)

    def _update_remotes(self, model, n: int, mode: str, lease_s: float) -> None:
        with self._served_here(n, "the remote servers did not take it"):
            self.remote_result = self.remote.update(model, mode=mode, lease_s=lease_s, n=n)

    @contextlib.contextmanager
    def _served_here(self, n: int, what: str) -> Iterator[None]:
        """A failure of the remote servers' update (`what` it left), said to leave this
        server at `n`."""
        try:
            yield
        except Exception as e:  # refused or failed (named), here or there; or an error of
            # the encode (out of memory, say): this server serves n all the same
            raise RemoteError(f"{self.url} serves version {n}; {what} (the next update "
                              f"catches them up): {_said(e)}", served=n) from e

    def renew(self, lease_s: float = 60.0) -> None:
        """Extend the lease of the current update (`update()` does it by itself). A renewal
        waits for its answer a third of the lease at most (`Renewer` then tries again at
        once), so that one stuck on a dead connection cannot outlast the lease."""
        self._post("/hotweights/renew", timeout=max(1.0, lease_s / 3), lease_s=lease_s)

    def _begin(self, *, timeout: float = 120, **body: Any) -> dict:
        """Begin an update, waiting up to `timeout` for the lease while another holds it
        (an exclusive checkpoint reading the weights, another trainer's step), a begin sent
        then given its drain's time all the same (`lease_s` + 10 s); if the begin
        fails or is interrupted (a timeout, a Ctrl-C), it is aborted, so that no server
        stays paused for a trainer that gave up: clean (nothing was written), or dirty where
        the refusal names this bridge's own update still open (its commit and abort lost:
        its weights were written)."""
        deadline, waited, warn_at, dirty = time.monotonic() + timeout, None, None, False
        self._seq += 1
        drain = body.get("lease_s", 60.0) + 10  # the server bounds a begin's drain by lease_s
        if ident := process.identity():  # the server ends the lease once we exit
            body["process"] = ident
        try:
            while True:
                try:
                    return self._post("/hotweights/begin", timeout=timeout, **body)
                except ServerError as e:
                    new = body.keys() & _NEW | ({"seq"} if self._numbered else set())
                    if e.status == 400 and "unknown field" in str(e) and new:
                        logger.info("hotweights: an older server (%s): begun without %s", e,
                                    sorted(new))
                        body = {k: v for k, v in body.items() if k not in _NEW}
                        self._numbered = False
                        continue
                    other = e.detail.get("holder") if e.status == 409 else None
                    # this bridge's last update still open (its commit and abort lost): the
                    dirty = other == self.holder  # weights were written
                    if other is None or dirty or time.monotonic() >= deadline:
                        raise
                    if other != waited:
                        logger.info("hotweights: waiting for the update lease %s holds", other)
                        waited, warn_at = other, time.monotonic() + 5
                    elif warn_at is not None and time.monotonic() > warn_at:  # (said once
                        logger.warning("hotweights: still waiting for the update lease %s "
                                       "holds (at most %.0f s more)", other,  # where seen)
                                       deadline - time.monotonic())
                        warn_at = None
                    time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
                    timeout = max(drain, deadline - time.monotonic())
        except BaseException:
            self._abort(dirty=dirty, quiet=True)
            raise

    def _commit(self, **body: Any) -> None:
        """Commit; if that fails, the update is aborted (dirty: the weights were written;
        refused where the commit did land and only its answer was lost), so that the
        server does not stay paused for the rest of the lease, and `version` is what the
        server serves."""
        try:
            self.version = self._post("/hotweights/commit", **body)["version"]
        except Exception:
            self._abort(dirty=True, quiet=True)
            raise
        except BaseException:  # a Ctrl-C during the round trip: committed or not, the
            self._abort(dirty=True, quiet=True)  # server does not stay paused (if it was
            raise  # committed, the abort is refused)

    def _abort(self, *, dirty: bool, quiet: bool = False) -> ServerError | None:
        """Abort the update; the server's refusal or failure, logged (`quiet`: at debug
        level) and returned, not raised, else None."""
        try:  # its answer: the version served now (a new, dirty one where weights changed)
            self.version = self._post("/hotweights/abort", dirty=dirty)["version"]
        except ServerError as e:  # keep the caller's exception; the lease will expire
            (logger.debug if quiet else logger.warning)("hotweights: abort failed: %s", e)
            self._refresh_version()  # (it may have expired: a dirty version served)
            return e
        return None

    def _refresh_version(self) -> dict | None:
        """The server's status (None: no answer), its version taken as the bridge's."""
        with contextlib.suppress(HotweightsError):  # (the caller's error is the news; the
            status = self.status(timeout=10)  # remotes' commit may follow)
            if status.get("server_id") == self.server_id:  # not a restarted server's
                self.version = status["version"]
            return status
        return None

    def status(self, *, timeout: float = 120) -> dict:
        return server_status(self.url, self._token, cafile=self.cafile, timeout=timeout)

    def server_info(self) -> dict:
        """The served model's settings (`model_config`: model, dtype, max_model_len,
        max_logprobs, logprobs_mode, vocab_size), shaped like vLLM's dev-mode `/server_info`."""
        return request(self.url, "GET", "/hotweights/server_info", self._token,
                       cafile=self.cafile)

    def _post(self, route: str, *, timeout: float = 120, **body: Any) -> dict:
        body = dict(holder=self.holder, server_id=self.server_id, **body)
        if self._numbered:
            body["seq"] = self._seq
        return request(self.url, "POST", route, self._token, body, timeout=timeout,
                       cafile=self.cafile)


def _check_vocab(config: Any, info: dict) -> None:
    """The model's vocabulary is the server's: one that differs inside vLLM's padding of the
    rows maps all the same, and would leave tokens out of the trainer's softmax."""
    served = (info.get("model_config") or {}).get("vocab_size")  # None: an older server
    text = text_config(config)
    mine = getattr(text, "vocab_size", None)
    if isinstance(served, int) and isinstance(mine, int) and served != mine:
        raise LayoutError(f"vocab_size: the config says {mine}, the server loaded {served}: "
                          "build the model from the config the server loaded")


def _as_loaded(status: dict) -> bool:
    """Whether the server serves what it loaded: no update ever began (an aborted one made
    a version too), none under way."""
    return status.get("n") == 0 and status.get("state") == "idle"


@contextlib.contextmanager
def _noted(error: BaseException, n: int) -> Iterator[None]:
    """Run what follows a failed commit of version `n` here; its own failure is noted on
    `error` (which the caller raises), not raised in its place."""
    try:
        yield
    except Exception as e:
        error.add_note(f"the remote servers did not take version {n} either: "
                       f"{_said(e.__cause__ or e)}")


def _said(e: BaseException) -> str:
    """An error for a message: ours by its words, another with its kind."""
    return str(e) if isinstance(e, HotweightsError) else repr(e)


def _local_model_dir(path: str, trust_remote_code: bool) -> str:
    """The server's model directory, if this process may read it on the server's word."""
    if not path or not os.path.isdir(path):
        raise ServerError(f"the server loaded {path!r}, which is not a directory on this "
                          "machine; pass the model's config or directory: "
                          "bridge.model(config=...)")
    if trust_remote_code:  # its code runs here: only from files others cannot write
        for code in [path, *sorted(glob.glob(os.path.join(glob.escape(path), "*.py")))]:
            try:
                st = os.stat(code)
            except FileNotFoundError:  # a dangling link (a download cut short): no code
                continue
            if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022:
                raise ServerError(f"{code}: trust_remote_code would run code from a "
                                  f"{'directory' if code == path else 'file'} that another "
                                  "user owns or can write; pass bridge.model(config=DIR) "
                                  "for a directory you trust")
    return path


def _versions(model: Any) -> dict[str, int]:
    """Each parameter's version counter (torch bumps it at every in-place write through
    the tensor or a view sharing its counter, here every view of one vLLM tensor); an
    inference tensor has none."""
    if not isinstance(model, torch.nn.Module):
        return {}
    return {n: p._version for n, p in model.named_parameters() if not p.is_inference()}
