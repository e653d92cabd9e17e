"""`sync`: write the live weights into a safetensors directory, only what changed.

`sync` runs five stages, each taking what the one before returns (2 to 4 per shard: a
shard is planned and staged as soon as its changes are found, while the next one is
hashed):

1. resolve (`_resolve`): the live names onto the shards' (`checkpoint.names`), every live
   tensor checked against its shard's header (dtype, shape: nothing is written if one
   disagrees), grouped per shard;
2. what changed (`checkpoint.changed`): each shard's changed blocks from its sidecar
   fingerprints (`checkpoint.sidecar`), a `WriteWatch`'s written pages or the `changed=`
   names; where a sidecar cannot be trusted, every page is compared with the file;
3. plan (`_Stager.add`): how each changed shard is written (below); a shard patched has
   its changed blocks narrowed to the 4 KiB pages that differ from the file (only those
   blocks are read);
4. write (`_Stager`, `_journal`, `_commit`): staged or journaled, all committed by one
   journal for the whole directory (`checkpoint.journal`);
5. record (`_record`): each shard's sidecar, once the commit is durable; where shards
   are reflinked, the spare clones of those written, for the next sync (`spare.keep`).

A changed shard is written one of three ways:

- `reflink`: the shard is cloned (no data copied), the changed pages are cloned into the
  clone from a scratch file (`stage.patched`), and the clone replaces the shard at commit:
  a reader sees one whole shard;
- whole: the shard is written anew, sequentially, and replaces the old one at commit
  (mode `copy`; `auto` without reflinks, or where most of a shard changed);
- `journal` (asked for only): the changed blocks go through the redo journal and are
  applied in place: crash-safe, but a reader during the apply can see a torn shard, and
  a process that mapped the file (safetensors does) sees its bytes change. A shard that
  is a symlink or has other hard links is rewritten whole instead: a write in place would
  change the other names too.

`auto` (the default) never writes into a file a reader may hold: reflink where the
filesystem clones files, else whole rewrites. A directory with no safetensors gets a
first full save (`checkpoint.first_save`).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hotweights.changes import blocks, writewatch
from hotweights.changes.spans import merge_spans
from hotweights.changes.streams import settle
from hotweights.changes.writewatch import WriteWatch
from hotweights.checkpoint import MODES, clone, journal, lock, sidecar, spare, stage, threads
from hotweights.checkpoint.changed import (
    Ranges,
    ShardChanges,
    ShardTensors,
    find_changes,
    ranges_bytes,
    to_pages,
)
from hotweights.checkpoint.dtypes import TORCH
from hotweights.checkpoint.fileid import FileId
from hotweights.checkpoint.names import matching, to_disk, unpack
from hotweights.checkpoint.result import Progress, SyncResult, check_dir_arg, mib
from hotweights.checkpoint.shards import Shard, TensorInfo, read_dir
from hotweights.checkpoint.writable import shared_file
from hotweights.checkpoint.writes import syncfs
from hotweights.errors import CheckpointError, LiveTensorError

logger = logging.getLogger(__name__)

WHOLE_FRACTION = 0.5  # auto: a shard with more of its bytes changed is rewritten whole
# A shard cloned and patched again and again lies in ever more extents (each patched page
# splits one), and a clone costs time per extent of its source (~25 us on XFS): one in
# more extents than one per FRAGMENT_BYTES (and FRAGMENTS_MIN) is rewritten whole instead,
# which leaves it in a few long extents again.
FRAGMENT_BYTES = 64 << 10
FRAGMENTS_MIN = 1024
UNREADABLE = ("A sync reads every shard's header and the index before it writes anything: "
              "fix what is named (or restore it from a copy), or sync into an empty "
              "directory to save the whole model anew")


def check_mode(mode: str) -> None:
    """Raise a CheckpointError naming `mode` unless it is one of `MODES`."""
    if mode not in MODES:
        raise CheckpointError(f"mode {mode!r}: choose one of {', '.join(MODES)}")


def write_mode(model_dir: str | os.PathLike, mode: str = "auto") -> tuple[str, str]:
    """How `sync` patches the shards of `model_dir` in `mode`: ("reflink" | "journal" |
    "copy", why)."""
    check_mode(mode)
    if mode in ("journal", "copy"):
        return mode, "asked for"
    ok, why = clone.supports_reflink(model_dir)
    if mode == "reflink" and not ok:
        raise CheckpointError(f"{model_dir}: mode 'reflink' asked for, but {why}; use "
                              "mode 'auto', 'journal' or 'copy'")
    return ("reflink", why) if ok else ("copy", f"{why}: changed shards are rewritten")


def sync(model_dir: str | os.PathLike, live: Mapping[str, torch.Tensor] | torch.nn.Module, *,
         mode: str = "auto", version: str | None = None, config: object = None,
         block_size: int = blocks.DEFAULT_BLOCK_SIZE, convert_dtype: bool = False,
         max_shard_size: int | str = "50GB", progress: Progress | None = None,
         after_read: Callable[[], None] | None = None,
         changed: Iterable[str] | None = None, watch: WriteWatch | bool = False) -> SyncResult:
    """Make the safetensors in `model_dir` hold the `live` tensors, writing what changed.

    Args:
        model_dir: a directory with `model.safetensors` or a sharded index; one with no
            safetensors (or none yet) gets a first full save.
        live: HF-named tensors (e.g. `bridge.model().state_dict()`), any device, or a
            transformers model (then its own conversions name fused MoE experts as the
            checkpoint does; else those of `config.model_type`).
        mode: "auto", "reflink", "journal" or "copy" (see the module docstring).
        version: the weight version the live tensors are (recorded in the sidecars).
        config: the model's config (a `PretrainedConfig` or a dict): its `model_type`
            picks the name conversions; a first save writes it as `config.json`.
        block_size: bytes per fingerprinted block.
        convert_dtype: cast a live tensor to the file's dtype instead of refusing it.
        max_shard_size: for a first save, as in `save_pretrained`.
        progress: called with (phase, bytes done, bytes total) as hashing and writing go.
        after_read: called once every live byte the sync needs has been read (staged or
            journaled) and the sync is committed, before the files are replaced: the
            weights may change again from then on. If it raises, the sync still completes
            (the files hold the live tensors) and its error is raised after.
        changed: the live names or `fnmatch` patterns (e.g. ``"model.layers.*.mlp.*"``;
            as in `live`, a wrapped model's with or without the wrappers' parts) of the
            only tensors that may differ from what the directory holds, e.g. the
            parameters your optimizer steps. Each must match a live name. Every other
            tensor is taken as unchanged, not hashed, where its shard has a fresh sidecar
            and its bytes share none with a named tensor's (a tied alias, a view). Only
            pass what you know: a change this leaves out is not written (a later sync
            without `changed` finds it). None: every tensor is hashed.
        watch: opt-in, for weights only this process's CPU code writes: the kernel
            tracks the writes to the live tensors (this process's own CPU memory, Linux
            6.7+) and only the blocks written since the last sync are hashed (see
            `hotweights.changes.writewatch`). True: the process's own `WriteWatch`, unless
            the environment sets HOTWEIGHTS_WRITE_WATCH=0; or a `WriteWatch` of yours.
            Writes that bypass the page tables (DMA into memory pinned by another
            library, RDMA, io_uring fixed buffers) are not seen: a change they make in a
            block it saw no write in is not written (a later sync without the watch finds
            it). False (default): every tensor is hashed. The tensors it cannot watch
            (pinned, shared, off the CPU) are hashed; `changed` rules over it for the
            tensors it names.
    Returns:
        A `SyncResult`.
    Raises:
        CheckpointError: a live tensor whose dtype or shape differs from the file's (named,
            with the shard), a name or pattern of `changed` that matches no live name, too
            little free space, an unwritable directory, a corrupt shard: nothing is
            written. An argument it cannot take (`live` not names to tensors, a meta
            tensor, `mode`, `version`, `max_shard_size`, `config`), before anything is
            made or locked.
        FingerprintError: `block_size` not a positive multiple of 8.
    """
    started = time.perf_counter()
    check_dir_arg(model_dir, "sync")
    check_mode(mode)
    block_size = blocks.check_block_size(block_size, "sync")
    if not isinstance(watch, bool | WriteWatch):
        raise CheckpointError(f"sync: field 'watch' must be True, False or a WriteWatch, "
                              f"found {watch!r}")
    if not isinstance(convert_dtype, bool):
        raise CheckpointError(f"sync: field 'convert_dtype' must be True or False, found "
                              f"{convert_dtype!r}")
    for field, f in (("progress", progress), ("after_read", after_read)):
        if f is not None and not callable(f):
            raise CheckpointError(f"sync: field {field!r} must be a callable or None, found "
                                  f"{f!r}")
    if version is not None and not isinstance(version, str):
        raise CheckpointError(f"sync: field 'version' must be a str (e.g. the server's "
                              f"'3@ab12cd34') or None, found {version!r}")
    from hotweights.checkpoint import first_save
    max_shard_size = first_save.check_options(max_shard_size, config)
    model_dir = Path(os.path.abspath(model_dir))  # its finisher thread may run after a chdir
    watch = writewatch.default() if watch is True else watch or None
    live, model, model_type = unpack(live, config)
    if not live:
        raise CheckpointError(f"{model_dir}: live holds no tensors to sync (an empty state "
                              "dict?); nothing was written")
    if changed is not None:
        changed = _check_changed(live, changed)
    progress = progress or (lambda phase, done, total: None)
    made = _existing(model_dir)
    with lock.locked(model_dir), _removed_on_failure(made):
        journal.recover(model_dir, lock=False)  # an interrupted sync is finished or dropped
        settle(live)
        disk = read_to_sync(model_dir)
        if disk is None:
            result = first_save.save(
                model_dir, live, mode=mode, version=version, config=config, model=model,
                model_type=model_type, block_size=block_size, max_shard_size=max_shard_size,
                progress=progress, after_read=after_read, started=started)
            spare.keep(())  # the spares of shards gone or changed since, closed (as `_record`)
            return result
        patch_mode, reason = write_mode(model_dir, mode)  # under the lock: the directory a
        # writer that held it before may have made (then its shards are patched here)
        # 1. resolve: the live tensors by disk name, per shard
        resolved = _resolve(model_dir, live, disk, changed, model=model, model_type=model_type,
                            convert_dtype=convert_dtype)
        written = {} if watch is None else watch.written(resolved.own)  # before any hash
        hashes = {}
        try:
            with stage.staging(model_dir, "stage the changed shards") as area, \
                    _Stager(model_dir, area, mode, patch_mode, progress) as stager:
                # 2. what changed, per shard; 3. each changed shard planned and 4. staged
                # as soon as it is found, while the next one is hashed
                found = find_changes(resolved.shards, block_size=block_size,
                                     trusted=resolved.trusted, watch=watch, written=written,
                                     progress=progress, then=stager.add)
                writes, bytes_written = stager.wait()
                order = {s.shard.path: i for i, s in enumerate(resolved.shards)}
                writes.sort(key=lambda w: order[w.shard.path])  # staged as found: the
                # shards changed last time first (`changed._order`)
                _journal(model_dir, writes, version, stager.step)
            # 4. one commit; 5. record the sidecars once the commit is durable
            _commit(model_dir, writes, after_read, functools.partial(
                _record, found.shards, {w.shard.path for w in writes}, version,
                patch_mode == "reflink"))
            hashes = found.hashes()
        finally:  # what the watch tells next time counts from the hashes just taken
            if watch is not None:
                watch.record(hashes)
    return SyncResult(
        mode=mode, version=version, tensors_synced=sum(len(s.tensors) for s in resolved.shards),
        tensors_changed=len({n for w in writes for n, _, _ in w.ranges}),
        shards_changed=tuple(w.name for w in writes), bytes_hashed=found.bytes_hashed,
        bytes_compared=found.bytes_compared, bytes_written=bytes_written,
        bytes_trusted=found.bytes_trusted, missing_on_disk=resolved.only_live,
        missing_live=resolved.only_disk, seconds=time.perf_counter() - started,
        writes={w.name: w.how for w in writes}, tied=resolved.tied, reason=reason,
        write_mode=patch_mode)


def read_to_sync(model_dir: Path) -> dict[str, tuple[Shard, TensorInfo]] | None:
    """`read_dir` (strict: a tensor two shards hold is refused), its errors about a file's
    contents ending with what to do."""
    try:
        return read_dir(model_dir, strict=True)
    except CheckpointError as e:
        if isinstance(e.__cause__, OSError):  # cannot read it (permissions, I/O): as is
            raise
        raise CheckpointError(f"{e}. {UNREADABLE}") from None


def _existing(model_dir: Path) -> list[Path]:
    """Make `model_dir` with its missing parents (each one's entry fsync'd: a power loss
    after the save cannot take the directory away); the directories made, deepest first."""
    if os.path.lexists(model_dir) and not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    made, path = [], model_dir
    while not os.path.lexists(path) and path != path.parent:
        made.append(path)
        path = path.parent
    try:
        model_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{model_dir}: cannot create the directory: {e.strerror}") from e
    try:
        for path in reversed(made):
            journal.fsync_dir(path.parent)
    except OSError as e:
        raise CheckpointError(f"{model_dir}: created, but its entry in {path.parent} cannot "
                              f"be made durable: {e.strerror}") from e
    return made


@contextlib.contextmanager
def _removed_on_failure(made: list[Path]) -> Iterator[None]:
    """The directories a sync made (deepest first) removed again if it fails while they
    are empty: a failed first save leaves nothing behind."""
    try:
        yield
    except BaseException:
        for path in made:
            with contextlib.suppress(OSError):  # not empty: kept, with what it holds
                path.rmdir()
        raise


def _check_changed(live: Mapping[str, torch.Tensor], changed: Iterable[str]
                   ) -> frozenset[str]:
    if isinstance(changed, str) or not isinstance(changed, Iterable):
        raise CheckpointError(f"changed={changed!r}: pass a collection of live tensor names "
                              "or patterns"
                              + (", not one string" if isinstance(changed, str) else ""))
    changed = list(changed)  # a generator is read once, here
    if bad := [c for c in changed if not isinstance(c, str)]:
        raise CheckpointError(f"changed: {bad[:3]} are not names (str); nothing was written")
    return frozenset(matching(live, changed))


# -- 1. resolve: the live tensors by disk name, per shard ---------------------------------

@dataclass(frozen=True)
class _Resolved:
    shards: list[ShardTensors]
    own: dict[str, torch.Tensor]  # those that are live bytes, not a conversion's or a
    # cast's copy: what a watch can follow
    trusted: frozenset[str] | None  # the disk names `changed=` rules out; None: no hint
    tied: tuple[str, ...]  # live aliases of a tensor stored once, under another name
    only_live: tuple[str, ...]  # live names with no place on disk
    only_disk: tuple[str, ...]  # disk names no live tensor fills


def _resolve(model_dir: Path, live: Mapping[str, torch.Tensor],
             disk: Mapping[str, tuple[Shard, TensorInfo]], changed: frozenset[str] | None, *,
             model: torch.nn.Module | None, model_type: str | None,
             convert_dtype: bool) -> _Resolved:
    names = to_disk(live, disk.keys(), model=model, model_type=model_type)
    names.check_placed(model_dir)
    if lost := names.only_live:  # a few: a module the trainer added, say
        logger.warning("%s: %d live tensor(s) have no place in the checkpoint and are not "
                       "written (result.missing_on_disk): %s", model_dir, len(lost),
                       ", ".join(lost[:5]) + (", ..." if len(lost) > 5 else ""))
    tensors = {n: _check(n, t, *disk[n], convert_dtype) for n, t in names.tensors.items()}
    per_shard: dict[str, ShardTensors] = {}
    for name, t in tensors.items():
        shard = disk[name][0]
        per_shard.setdefault(shard.path, ShardTensors(shard, {})).tensors[name] = t
    storages = {(t.device, t.untyped_storage().data_ptr()) for t in live.values()}
    own = {n: t for n, t in tensors.items()  # the bytes a sync reads: not a copy's to be
           if t.is_contiguous() and t.dtype == TORCH[disk[n][1].dtype]  # (`ready`)
           and (t.device, t.untyped_storage().data_ptr()) in storages}
    return _Resolved(list(per_shard.values()), own,
                     None if changed is None else _unchanged(live, changed, own),
                     tuple(sorted(names.tied)), names.only_live, names.only_disk)


def _check(name: str, t: torch.Tensor, shard: Shard, info: TensorInfo,
           convert: bool) -> torch.Tensor:
    where = f"{name} in {shard.path}"
    want = TORCH.get(info.dtype)
    if want is None:  # first: F4's torch form packs two values an element, another shape
        raise CheckpointError(f"{where}: the file holds {info.dtype}, which has no torch "
                              "dtype: hotweights cannot sync it; nothing was written")
    if tuple(t.shape) != info.shape:
        raise LiveTensorError(f"{where}: the file holds shape {list(info.shape)}, the live "
                              f"tensor {list(t.shape)}; nothing was written")
    floats = castable(want, t.dtype)
    if want != t.dtype and not (convert and floats):
        raise LiveTensorError(f"{where}: the file holds {info.dtype}, the live tensor is "
                              f"{str(t.dtype).removeprefix('torch.')}; nothing was written" + (
                                  " (convert_dtype=True, or --convert-dtype, casts it)"
                                  if floats else ": only floats of 16 bits or more are cast "
                                  "(integer, FP8 or other quantized values would not keep "
                                  "their meaning)"))
    return t.detach()  # cast and made contiguous shard by shard (`ShardTensors.ready`)


def castable(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether `convert_dtype` casts between `a` and `b`: floats of 16 bits or more (an
    FP8 tensor's values mean something only with its scales)."""
    return all(d.is_floating_point and d.itemsize > 1 for d in (a, b))


def _unchanged(live: Mapping[str, torch.Tensor], changed: Collection[str],
               own: Mapping[str, torch.Tensor]) -> frozenset[str]:
    """The disk names `changed` rules out: tensors of `own` whose bytes share none with
    a tensor named in it."""
    spans: dict[torch.device, list[tuple[int, int]]] = {}
    for n in changed:
        t = live[n]
        if t.numel():
            lo = t.data_ptr()
            spans.setdefault(t.device, []).append(
                (lo, lo + t.element_size() * (1 + sum((s - 1) * st for s, st in
                                                      zip(t.shape, t.stride(), strict=True)))))
    merged = {}  # per device: disjoint sorted spans (starts, ends)
    for device, ss in spans.items():
        union = merge_spans(ss)
        merged[device] = [lo for lo, _ in union], [hi for _, hi in union]

    def touches(t: torch.Tensor) -> bool:
        starts, ends = merged.get(t.device, ((), ()))
        lo, i = t.data_ptr(), bisect.bisect_right(starts, t.data_ptr()) - 1
        return (i >= 0 and ends[i] > lo) or (i + 1 < len(starts)
                                             and starts[i + 1] < lo + t.nbytes)
    return frozenset(n for n, t in own.items() if not touches(t))


# -- 2. what changed: `checkpoint.changed.find_changes` -----------------------------------


# -- 3. plan: how each changed shard is written -------------------------------------------

@dataclass(frozen=True)
class _ShardWrite:
    shard: Shard
    tensors: dict[str, torch.Tensor]
    ranges: Ranges  # the bytes that differ (a whole rewrite writes every byte)
    how: str  # "whole" | "reflink" | "journal"

    @property
    def name(self) -> str:
        return Path(self.shard.path).name

    @property
    def changed_bytes(self) -> int:
        return ranges_bytes(self.ranges)


def _how(shard: Shard, changed_bytes: int, mode: str, patch_mode: str) -> str:
    if patch_mode == "copy" or (mode == "auto" and
                                changed_bytes > WHOLE_FRACTION * shard.size):
        return "whole"
    if patch_mode == "journal" and (why := shared_file(shard.path)):
        logger.info("%s: %s; rewritten whole, not patched in place", shard.path, why)
        return "whole"
    if patch_mode == "reflink" and not _clonable(shard):
        logger.info("%s: a link to %s, on another filesystem: rewritten whole, not cloned",
                    shard.path, os.path.realpath(shard.path))
        return "whole"
    if patch_mode == "reflink" and (n := _extents(shard.path)) > max(
            FRAGMENTS_MIN, shard.size // FRAGMENT_BYTES):
        logger.info("%s lies in %d extents (its earlier patches split them): rewritten "
                    "whole, not cloned", shard.path, n)
        return "whole"
    return patch_mode


def _need(c: ShardChanges, how: str) -> int:
    """The bytes writing `c` `how` takes until the commit (a patch's at most: its changed
    blocks, and a record per range)."""
    return c.shard.size if how == "whole" else ranges_bytes(c.ranges) + 64 * len(c.ranges)


def _clonable(shard: Shard) -> bool:
    """Whether the shard lies on its directory's filesystem (a link to another cannot be
    cloned into it)."""
    return shard.file.dev == os.stat(os.path.dirname(shard.path)).st_dev


def _extents(path: str) -> int:
    """How many extents the shard at `path` lies in: as its spare clone was when taken
    (behind the last sync), else counted now; 0 where the filesystem does not say."""
    n = spare.extents(path)
    return (clone.extents(path) if n is None else n) or 0


# -- 4. write: staged or journaled, one commit --------------------------------------------

class _Stager:
    """Plans each changed shard (`add`) and stages it in a worker thread: narrowed to the
    pages that differ from the file where it is patched, then cloned and patched, or
    written whole, and fsync'd. Two workers: one shard's fsync overlaps the next one's
    writes, and both overlap the hashing of the shards after them."""

    def __init__(self, model_dir: Path, area: Path, mode: str, patch_mode: str,
                 progress: Progress):
        self.model_dir, self.area, self.mode, self.patch_mode = model_dir, area, mode, patch_mode
        self.progress, self.free, self.need = progress, shutil.disk_usage(model_dir).free, 0
        self.journaled = self.total = self.done = 0
        self.staged = 0  # bytes of the shards staged (counted in `free` once re-measured)
        self.short = 0  # bytes of the changes that did not fit, once one did not
        self.counted = threading.Lock()
        self.pool = threads.pool(2)
        self.jobs: list[Future[tuple[_ShardWrite | None, int]]] = []

    def __enter__(self) -> _Stager:
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(cancel_futures=True)  # waits for the running jobs: the stage
        # area is removed after them

    def add(self, c: ShardChanges) -> None:
        if not c.ranges:
            return
        how = _how(c.shard, ranges_bytes(c.ranges), self.mode, self.patch_mode)
        if not self._fits(c, how):
            fits = False
            if how != "whole" or self.patch_mode == "reflink" and _clonable(c.shard):
                # near a full disk: the need once narrowed to the pages that differ (the
                # changed blocks counted whole overstate it), patched where the whole
                # rewrite was chosen for speed only
                how = "journal" if how == "journal" else "reflink"
                c = replace(c, ranges=to_pages(c), compared=True)
                if not c.ranges:
                    return
                fits = self._fits(c, how)
            if not fits:  # not staged: counted for what `wait` says is missing
                self.short += _need(c, how)
                return
        need = _need(c, how)
        if how != "journal":
            self.staged += need
            self.area.mkdir(exist_ok=True)
        elif spare.drop([c.shard.path]):  # its blocks shared with a spare: each page the
            # apply writes in place would take a new block (copy on write), not counted
            syncfs(self.model_dir)  # the spare's blocks let go (XFS: in the background)
        if c.copied:  # its copies are held until it is staged: the hashing waits while
            # two shards wait for the stager, not every shard's copies pile up behind it
            futures.wait([j for j in self.jobs if not j.done()][:-1])
        self.jobs.append(self.pool.submit(self._stage, c, how))

    def _fits(self, c: ShardChanges, how: str) -> bool:
        """Whether `c` written `how` fits, counted if so (never once one did not)."""
        return not self.short and self._room(_need(c, how), how == "journal")

    def _room(self, need: int, journaled: bool) -> bool:
        """Count `need` more bytes for this sync (`journaled`: in the journal, written at
        the end) if they fit (else False). Where the free space measured first says no,
        it is measured again once the shards before are staged and the filesystem's
        deferred frees are done (XFS frees a deleted file's blocks in the background: the
        shards the last sync replaced may still count as used)."""
        if self.need + need > self.free:
            for job in self.jobs:  # staged: their bytes are used now, not to come
                job.result()
            syncfs(self.model_dir)
            self.free, self.need = shutil.disk_usage(self.model_dir).free, self.journaled
            if self.need + need > self.free:
                return False
        self.need += need
        self.journaled += need if journaled else 0
        return True

    def _stage(self, c: ShardChanges, how: str) -> tuple[_ShardWrite | None, int]:
        """The shard's write (None: no page differs from the file) and the bytes it writes
        into the shard."""
        ranges = c.ranges if how == "whole" else to_pages(c)
        if not ranges:
            return None, 0
        w = _ShardWrite(c.shard, c.tensors, ranges, how)
        with self.counted:
            self.total += w.shard.size if how == "whole" else w.changed_bytes
        dst = self.area / w.name
        if how == "journal":  # journaled by `_journal`, from the tensors that changed (the
            return replace(w, tensors={n: w.tensors[n] for n, _, _ in w.ranges}), \
                w.changed_bytes  # others' copies go now)
        if how == "whole":  # the tensors `changed=` left out keep the file's bytes, which
            hashed = {n: w.tensors[n] for n in c.hashed}  # their sidecar describes
            n = stage.whole(w.shard, hashed, dst, self.step)
        else:
            n = stage.patched(w.shard, w.tensors, w.ranges, dst, self.step)
        return replace(w, tensors={}), n  # staged: the copies made for it go

    def step(self, n: int) -> None:
        with self.counted:
            self.done += n
            self.progress("write", self.done, self.total)

    def wait(self) -> tuple[list[_ShardWrite], int]:
        """The shards to write (staged, or to journal) and the bytes they write, once
        every staging job is done."""
        done = [f.result() for f in self.jobs]
        if self.short:  # every shard hashed: the whole need known
            need, free = self.staged + self.need + self.short, self.free + self.staged
            raise CheckpointError(
                f"{self.model_dir}: not enough free space: this sync needs {mib(need)} "
                f"({need} bytes) for its journal and staged shards, {mib(free)} are free: "
                f"free {mib(need - free, up=True)} more; nothing was written. (A shard rewritten "
                "whole takes its whole size until the commit; one patched by reflink, only "
                "its changed pages)")
        writes = [w for w, _ in done if w is not None]
        if self.area.exists() and all(w.how == "journal" for w in writes):
            self.area.rmdir()  # each shard it was made for matched its file after all
        return writes, sum(n for _, n in done)


def _journal(model_dir: Path, writes: list[_ShardWrite], version: str | None,
             step: Callable[[int], None]) -> None:
    """The commit's journal: the staged shards' moves, the journaled shards' patches; none
    if a shard to write is no longer the file this sync read (its bytes were staged from,
    or its patches placed by, the header read then), before the journal is written or
    while it is."""
    def unchanged() -> None:
        for w in writes:
            try:
                now = os.stat(w.shard.path)
            except FileNotFoundError:
                now = None
            w.shard.check(now)
    unchanged()
    if writes:
        journal.write_journal(model_dir, _patches(writes, step),
                              moves=[w.name for w in writes if w.how != "journal"],
                              meta={"version": version}, check=unchanged)


def _commit(model_dir: Path, writes: list[_ShardWrite], after_read: Callable[[], None] | None,
            record: Callable[..., None]) -> None:
    """Apply the journal; `record` runs once the commit is durable (given the files as
    the commit placed them: `journal.apply`'s `then`), or at once if nothing changed (given
    nothing), in the finisher thread (`finisher.finish`)."""
    if writes:
        stage.commit(model_dir, after_read, record)
        return
    try:
        if after_read:
            after_read()
    finally:  # the files hold the live tensors: their sidecars are true either way
        lock.later(model_dir, record)


def _patches(writes: list[_ShardWrite], step: Callable[[int], None]
             ) -> Iterator[tuple[str, int, memoryview]]:
    for w in writes:
        if w.how != "journal":
            continue
        for name, lo, chunk in stage.range_chunks(w.tensors, w.ranges):
            yield w.name, w.shard.tensors[name].begin + lo, chunk
            step(chunk.nbytes)


# -- 5. record: the sidecars --------------------------------------------------------------

def _record(shards: list[ShardChanges], rewritten: Collection[str],
            version: str | None, spares: bool, placed: dict[str, FileId] | None = None
            ) -> None:
    """Write every shard's sidecar, after its data (a stale sidecar is only ever
    distrusted); a sidecar that cannot be written only costs the next sync a compare.
    `rewritten`: the paths of the shards just written, `placed` (name -> file) as the
    commit left them; with `spares`, each is cloned for the next sync (`spare.keep`,
    which closes the spares of shards gone or changed in any case)."""
    for c in shards:
        with sidecar.best_effort(c.shard.path):
            shard = c.shard
            if shard.path in rewritten:  # the same header (names, offsets) in a new file
                # or with a new mtime, unless another program wrote into it since
                now = sidecar.as_placed(shard.path, (placed or {}).get(
                    os.path.basename(shard.path)))
                if now is None:
                    continue
                shard = replace(shard, file=now)
            sidecar.write(shard, c.fresh, version)
    spare.keep(sorted(rewritten) if spares else ())
