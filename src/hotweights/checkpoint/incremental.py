"""`sync`: write the live weights into a safetensors directory, only what changed.

Every live tensor is checked against the shard headers first (dtype, shape: nothing is
written if one disagrees). The changed blocks are found from each shard's sidecar
fingerprints (`checkpoint.sidecar`), then narrowed to the 4 KiB pages that differ from the
file (only those blocks are read); where a sidecar cannot be trusted, every page is
compared with the file. Each changed shard is then written one of three ways, all
committed by one journal for the whole directory (`checkpoint.journal`):

- `reflink`: the shard is cloned (no data copied), the changed blocks are written into the
  clone, and the clone replaces the shard at commit: a reader sees one whole shard;
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
import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from hotweights.changes import blocks, writewatch
from hotweights.changes.writewatch import WriteWatch
from hotweights.checkpoint import MODES, clone, journal, sidecar, stage
from hotweights.checkpoint.dtypes import TORCH
from hotweights.checkpoint.mapped import mapped
from hotweights.checkpoint.names import to_disk, unpack
from hotweights.checkpoint.result import SyncResult
from hotweights.checkpoint.shards import Shard, TensorInfo, read_dir
from hotweights.errors import CheckpointError

logger = logging.getLogger(__name__)

WHOLE_FRACTION = 0.5  # auto: a shard with more of its bytes changed is rewritten whole
PAGE = 4096  # a changed block is patched page by page: only the pages that differ
Progress = Callable[[str, int, int], None]  # (phase "hash" | "write", bytes done, total)


def write_mode(model_dir: str | os.PathLike, mode: str = "auto") -> tuple[str, str]:
    """How `sync` patches the shards of `model_dir` in `mode`: ("reflink" | "journal" |
    "copy", why)."""
    if mode not in MODES:
        raise CheckpointError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
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
            journaled), before the commit: the weights may change again from then on.
        changed: the live names (as in `live`) of the only tensors that may differ from
            what the directory holds, e.g. the parameters your optimizer steps. Every other
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
            library, RDMA, io_uring fixed buffers) are not seen: a change they make is not
            written. False (default): every tensor is hashed. The tensors it cannot watch
            (pinned, shared, off the CPU) are hashed; `changed` rules over it for the
            tensors it names.
    Returns:
        A `SyncResult`.
    Raises:
        CheckpointError: a live tensor whose dtype or shape differs from the file's (named,
            with the shard), a name in `changed` that `live` lacks, too little free space,
            an unwritable directory, a corrupt shard: nothing is written.
    """
    started = time.perf_counter()
    model_dir = Path(model_dir)
    watch = writewatch.default() if watch is True else watch or None
    live, model, model_type = unpack(live, config)
    if changed is not None:
        changed = _check_changed(live, changed)
    patch_mode, reason = write_mode(model_dir, mode) if model_dir.is_dir() else (mode, "")
    progress = progress or (lambda phase, done, total: None)
    with journal.locked(_existing(model_dir)):
        journal.recover(model_dir, lock=False)  # an interrupted sync is finished or dropped
        disk = read_dir(model_dir)
        if disk is None:
            from hotweights.checkpoint import first_save
            return first_save.save(model_dir, live, mode=mode, version=version, config=config,
                                   model=model, model_type=model_type,
                                   block_size=block_size, max_shard_size=max_shard_size,
                                   progress=progress, after_read=after_read, started=started)
        names = to_disk(live, disk.keys(), model=model, model_type=model_type)
        names.check_placed(model_dir)
        matched, tied = dict(names.tensors), names.tied
        for name in list(matched):
            matched[name] = _check(name, matched[name], *disk[name], convert_dtype)
        own = _own(live, matched)
        trusted = None if changed is None else _unchanged(live, changed, matched, own)
        seen = {} if watch is None else watch.written({n: matched[n] for n in own})
        hashes = {}
        try:
            plans, hashed, compared, trusted_bytes = _plan(matched, disk, block_size,
                                                           progress, trusted, seen, watch)
            for p in plans:
                if p.ranges:
                    p.how = _how(p, mode, patch_mode)
                    if p.how != "whole" and not p.exact:  # what the watch saw is exact
                        p.ranges = _compare_file(p, [r for r in p.ranges if r[0] not in
                                                     p.known]) + [r for r in p.ranges
                                                                  if r[0] in p.known]
            writing = [p for p in plans if p.ranges]
            _check_space(model_dir, writing)
            record = functools.partial(_record, plans, version)
            written = _write(model_dir, writing, version, progress, after_read, record)
            hashes = {n: p.fresh.tensors[n][1] for p in plans for n in p.hashed}
        finally:  # what the watch tells next time counts from the hashes just taken
            if watch is not None:
                watch.record(hashes)
    return SyncResult(
        mode=mode, version=version, tensors_synced=len(matched),
        tensors_changed=len({n for p in writing for n, _, _ in p.ranges}),
        shards_changed=tuple(p.name for p in writing), bytes_hashed=hashed,
        bytes_compared=compared, bytes_written=written, bytes_trusted=trusted_bytes,
        missing_on_disk=names.only_live, missing_live=names.only_disk,
        seconds=time.perf_counter() - started, writes={p.name: p.how for p in writing},
        tied=tuple(sorted(tied)), reason=reason)


def _existing(model_dir: Path) -> Path:
    try:
        model_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{model_dir}: cannot create the directory: {e.strerror}") from e
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    return model_dir


def _check(name: str, t: torch.Tensor, shard: Shard, info: TensorInfo,
           convert: bool) -> torch.Tensor:
    where = f"{name} in {os.path.basename(shard.path)}"  # no Path per tensor
    if tuple(t.shape) != info.shape:
        raise CheckpointError(f"{where}: the file holds shape {list(info.shape)}, the live "
                              f"tensor {list(t.shape)}; nothing was written")
    want = TORCH.get(info.dtype)
    if want is None:
        raise CheckpointError(f"{where}: the file holds {info.dtype}, which has no torch "
                              "dtype: hotweights cannot sync it; nothing was written")
    if want != t.dtype:
        if convert:
            return t.detach().to(want).contiguous()
        raise CheckpointError(f"{where}: the file holds {info.dtype}, the live tensor is "
                              f"{str(t.dtype).removeprefix('torch.')}; nothing was written "
                              "(convert_dtype=True, or --convert-dtype, casts it)")
    return t.detach().contiguous()


@dataclass
class _Plan:
    shard: Shard
    tensors: dict[str, torch.Tensor]
    fresh: blocks.Fingerprints
    ranges: list[tuple[str, int, int]]  # (tensor, byte range within it) that changed
    how: str = ""
    exact: bool = False  # ranges are the pages that differ (else: whole changed blocks)
    hashed: tuple[str, ...] = ()  # the tensors whose fresh block hashes were taken now
    known: frozenset[str] = frozenset()  # the tensors whose ranges are the pages written

    @property
    def name(self) -> str:
        return Path(self.shard.path).name

    @property
    def changed_bytes(self) -> int:
        return sum(hi - lo for _, lo, hi in self.ranges)


def _plan(matched, disk, block_size: int, progress: Progress, trusted: set[str] | None,
          written: Mapping[str, list[tuple[int, int]]], watch: WriteWatch | None
          ) -> tuple[list[_Plan], int, int, int]:
    """Per shard, its changed ranges and fresh fingerprints; the bytes hashed, compared with
    the file and not hashed. `trusted`: the names `changed=` rules out (None: no hint; then
    xxh3 shards are hashed coarse first, `blocks.refresh`). `written`: what `watch` saw
    written, used where the sidecar holds the hashes it recorded."""
    by_shard: dict[str, _Plan] = {}
    for name, t in matched.items():
        shard = disk[name][0]
        by_shard.setdefault(shard.path, _Plan(shard, {}, None, [])).tensors[name] = t
    total = sum(t.nbytes for t in matched.values())
    done = hashed = compared = 0
    for p in by_shard.values():
        nbytes = sum(t.nbytes for t in p.tensors.values())
        kind = blocks.kind_of(p.tensors.values())
        old = sidecar.load(p.shard, block_size, kind)
        if old is not None and set(old.tensors) >= set(p.tensors):
            todo = {n: t for n, t in p.tensors.items() if n not in (trusted or ())}
            if trusted is None and kind == blocks.XXH3:
                seen = {n: r for n, r in written.items()
                        if n in todo and _same(watch.recorded(n), old.tensors[n][1])}
                new = blocks.refresh(old, todo, written=seen)
            else:  # named tensors are likely changed: straight to per-block hashes
                seen, new = {}, blocks.fingerprint(todo, block_size=block_size, kind=kind)
            diff = blocks.changed(_subset(old, todo), new)
            if len(todo) < len(p.tensors):
                kept = {n: new if n in todo else old for n in p.tensors}
                new = blocks.Fingerprints(kind, block_size, {
                    n: fp.tensors[n] for n, fp in kept.items()}, {
                    n: fp.coarse[n] for n, fp in kept.items() if n in fp.coarse})
            p.fresh, p.hashed, p.known = new, tuple(todo), frozenset(seen)
            p.ranges = [(n, int(lo), int(hi)) for n, c in diff.tensors.items() for lo, hi in
                        (_within(c.ranges.tolist(), seen[n]) if n in seen else c.ranges)]
            hashed += sum(t.nbytes for n, t in todo.items() if n not in seen) + sum(
                _block_bytes(r, block_size, todo[n].nbytes) for n, r in seen.items())
        else:
            p.fresh = blocks.fingerprint(p.tensors, block_size=block_size, kind=kind,
                                         coarse=True)  # for `refresh` next time
            p.hashed = tuple(p.tensors)
            whole = [(n, 0, t.nbytes) for n, t in p.tensors.items()]
            p.ranges, p.exact = _compare_file(p, whole), True
            compared += nbytes
            hashed += nbytes
        done += nbytes
        progress("hash", done, total)
    return list(by_shard.values()), hashed, compared, total - hashed


def _check_changed(live: Mapping[str, torch.Tensor], changed: Iterable[str]
                   ) -> frozenset[str]:
    if isinstance(changed, str):
        raise CheckpointError(f"changed={changed!r}: pass a collection of live tensor names, "
                              "not one string")
    changed = frozenset(changed)  # a generator is read once, here
    if unknown := sorted(n for n in changed if n not in live):
        raise CheckpointError(f"changed names {len(unknown)} tensor(s) the live weights do not "
                              f"hold, e.g. {unknown[:3]}; nothing was written")
    return changed


def _within(blocks_changed: list[list[int]], pages: list[tuple[int, int]]
            ) -> list[tuple[int, int]]:
    """The parts of the changed blocks in the pages written (both sorted, disjoint): the
    pages of a changed block not written since the last sync still hold the file's bytes."""
    out, j = [], 0
    for lo, hi in blocks_changed:
        while j < len(pages) and pages[j][1] <= lo:
            j += 1
        k = j
        while k < len(pages) and pages[k][0] < hi:
            out.append((max(lo, pages[k][0]), min(hi, pages[k][1])))
            k += 1
    return out


def _same(a: np.ndarray | None, b: np.ndarray) -> bool:
    return a is b or np.array_equal(a, b)  # the sidecar this process wrote: the same array


def _block_bytes(ranges: list[tuple[int, int]], block_size: int, nbytes: int) -> int:
    """The bytes of the blocks that `ranges` touch."""
    blocks_touched = set()
    for lo, hi in ranges:
        blocks_touched.update(range(lo // block_size, -(-hi // block_size)))
    return min(nbytes, len(blocks_touched) * block_size)


def _own(live: Mapping[str, torch.Tensor], matched: Mapping[str, torch.Tensor]) -> set[str]:
    """The disk names whose tensors are a live tensor's own bytes, not a conversion's or
    a cast's copy."""
    own = {(t.device, t.untyped_storage().data_ptr()) for t in live.values()}
    return {n for n, t in matched.items() if (t.device, t.untyped_storage().data_ptr()) in own}


def _unchanged(live: Mapping[str, torch.Tensor], changed: Collection[str],
               matched: Mapping[str, torch.Tensor], own: set[str]) -> set[str]:
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
        starts, ends = [], []
        for lo, hi in sorted(ss):
            if ends and lo <= ends[-1]:
                ends[-1] = max(ends[-1], hi)
            else:
                starts.append(lo)
                ends.append(hi)
        merged[device] = starts, ends

    def touches(t: torch.Tensor) -> bool:
        starts, ends = merged.get(t.device, ((), ()))
        lo, i = t.data_ptr(), bisect.bisect_right(starts, t.data_ptr()) - 1
        return (i >= 0 and ends[i] > lo) or (i + 1 < len(starts)
                                             and starts[i + 1] < lo + t.nbytes)
    return {n for n in own if not touches(matched[n])}


def _how(p: _Plan, mode: str, patch_mode: str) -> str:
    if patch_mode == "copy" or (mode == "auto" and
                                p.changed_bytes > WHOLE_FRACTION * p.shard.size):
        return "whole"
    if patch_mode == "journal" and (why := _shared_file(p.shard.path)):
        logger.info("%s: %s; rewritten whole, not patched in place", p.shard.path, why)
        return "whole"
    return patch_mode


def _shared_file(path: str) -> str | None:
    """Why a write in place into `path` would reach another name too (a symlink, e.g. a
    Hugging Face cache snapshot onto its blob, or a file with other hard links)."""
    if os.path.islink(path):
        return f"a symlink to {os.path.realpath(path)}"
    if (links := os.stat(path).st_nlink) > 1:
        return f"{links - 1} other hard link(s)"
    return None


def _check_space(model_dir: Path, changed: list[_Plan]) -> None:
    need = sum(p.shard.size if p.how == "whole" else p.changed_bytes + 64 * len(p.ranges)
               for p in changed)
    free = shutil.disk_usage(model_dir).free
    if need > free:
        raise CheckpointError(f"{model_dir}: this sync needs {need} bytes for its journal "
                              f"and staged shards, only {free} are free; nothing was written")


def _record(plans: list[_Plan], version: str | None) -> None:
    """Write every shard's sidecar, after its data (a stale sidecar is only ever
    distrusted); a sidecar that cannot be written only costs the next sync a compare."""
    for p in plans:
        try:
            shard = p.shard
            if p.ranges:  # the same header (names, offsets) in a new file or a new mtime
                st = os.stat(shard.path)
                shard = replace(shard, size=st.st_size, mtime_ns=st.st_mtime_ns,
                                inode=st.st_ino)
            sidecar.write(shard, p.fresh, version)
        except (OSError, CheckpointError) as e:
            logger.warning("%s: sidecar not written (%s); the next sync compares the shard "
                           "with the live weights", p.shard.path, e)


def _write(model_dir: Path, changed: list[_Plan], version: str | None, progress: Progress,
           after_read: Callable[[], None] | None, record: Callable[[], None]) -> int:
    """Stage or journal every changed shard, then commit and apply them together; `record`
    runs once the commit is durable, or at once if nothing changed, in the finisher thread
    (`journal.finish`)."""
    total = sum(p.shard.size if p.how == "whole" else p.changed_bytes for p in changed)
    done, lock = 0, threading.Lock()

    def step(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            progress("write", done, total)

    staged = [p for p in changed if p.how != "journal"]
    with stage.staging(model_dir, "stage the changed shards") as area:
        if staged:
            area.mkdir()
        with ThreadPoolExecutor(2) as pool:  # one shard's fsync overlaps the next's writes
            written = sum(f.result() for f in [
                pool.submit(stage.whole, p.shard, p.tensors, area / p.name, step)
                if p.how == "whole" else
                pool.submit(stage.patched, p.shard, p.tensors, p.ranges, area / p.name, step)
                for p in staged])
        if changed:
            journal.write_journal(model_dir, _patches(changed, step),
                                  moves=[p.name for p in staged], meta={"version": version})
    if changed:
        stage.commit(model_dir, after_read, record)
    else:
        if after_read:
            after_read()
        journal.later(model_dir, record)
    return written + sum(p.changed_bytes for p in changed if p.how == "journal")


def _subset(fp: blocks.Fingerprints, names) -> blocks.Fingerprints:
    return blocks.Fingerprints(fp.kind, fp.block_size, {n: fp.tensors[n] for n in names})


def _compare_file(p: _Plan, ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The pages of `ranges` (tensor, byte range) whose bytes differ from the file's."""
    per: dict[str, list[tuple[int, int]]] = {}
    for name, lo, hi in ranges:  # from page starts: a block size under a page, or not a
        per.setdefault(name, []).append((lo - lo % PAGE, hi))  # multiple of it, is fine
    out = []
    with mapped(p.shard.path) as view:
        for name, spans in per.items():
            info = p.shard.tensors[name]
            change = blocks.compare_bytes(name, p.tensors[name], view[info.begin:info.end],
                                          block_size=PAGE, ranges=spans)
            out += [(name, int(a), int(b)) for a, b in change.ranges]
    return out


def _patches(changed: list[_Plan], step: Callable[[int], None]
             ) -> Iterator[tuple[str, int, memoryview]]:
    for p in changed:
        if p.how != "journal":
            continue
        shard, where = p.name, p.shard.tensors
        for name, lo, chunk in stage.range_chunks(p.tensors, p.ranges):
            yield shard, where[name].begin + lo, chunk
            step(chunk.nbytes)
